"""The service's shape, read from its imports (every `import` in a module, function bodies included):
the core and the pipeline know no protocol, no door reaches into another, and the supervisor and the
server no longer import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[1] / "service"
PROTOCOLS = ("grpc", "grpc_health", "grpc_reflection", "aiohttp", "asr", "google.protobuf")


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def modules(package: str) -> list[Path]:
    return sorted((SERVICE / package).glob("*.py"))


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package", ["core", "pipeline"])
def test_the_core_and_the_pipeline_import_no_protocol_no_door_and_no_process_plumbing(package: str) -> None:
    found = {
        f"{path.name}: {name}"
        for path in modules(package)
        for name in imports(path)
        if under(name, (*PROTOCOLS, "service.doors", "service.runtime"))
    }
    assert not found


def test_no_door_imports_another_door() -> None:
    # grpc_status (codes) and grpc_calls (a streaming call's life): what every gRPC door shares, not doors;
    # ws_deadline (bounded writes) likewise for the WebSocket doors, telephony_socket for the telephony ones
    shared = {"__init__", "grpc_status", "grpc_calls", "ws_deadline", "telephony_socket"}
    doors = {p.stem for p in modules("doors")} - shared
    found = {
        f"{path.name}: {name}"
        for path in modules("doors")
        for name in imports(path)
        if under(name, tuple(f"service.doors.{d}" for d in doors if d != path.stem))
    }
    assert not found


def test_the_server_does_not_import_the_supervisor_and_the_supervisor_imports_it_only_in_a_frontend() -> None:
    assert not under_any(imports(SERVICE / "runtime" / "server.py"), "service.runtime.supervisor")
    tree = ast.parse((SERVICE / "runtime" / "supervisor.py").read_text())
    top_level = {
        node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert not under_any(top_level, "service.runtime.server")
    importers = [
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef)
        and any(isinstance(n, ast.ImportFrom) and n.module == "service.runtime.server" for n in f.body)
    ]
    assert importers == ["_serve_frontend"]  # run in the frontend process, never in the supervisor


def under_any(names: set[str], module: str) -> bool:
    return any(under(name, (module,)) for name in names)

"""The service's shape where import-linter cannot see it. The layers, the doors' independence, the protocols
kept out of the lower layers, the engine's one door (engine/api.py) and the clients' separation are
contracts in pyproject.toml `[tool.importlinter]`, which scripts/test.sh checks with `lint-imports`; what is
left here is about *where* in a module an import is, and that the contracts are the ones the README
describes."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVICE = REPO / "service"


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def contracts() -> dict[str, dict]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_the_service_layers_are_in_the_issue_s_order_and_every_package_has_its_place() -> None:
    layers = contracts()["service-layers"]
    assert layers["containers"] == ["service"]
    assert layers["layers"] == ["runtime", "doors", "recognizer", "pipeline : config : metrics", "vocabulary"]
    assert layers["exhaustive"] is True  # a package added under service/ breaks the contract until placed


def test_the_engine_packages_are_layered_and_scheduling_and_process_import_no_torch() -> None:
    # the engine's paths show its torch boundary (issue 27): these contracts are what keep it there
    assert contracts()["engine-layers"]["layers"] == ["api", "core", "model", "decoding", "scheduling"]
    for source in ("scheduling", "process"):
        contract = contracts()[f"{source}-without-torch"]
        assert contract["source_modules"] == [f"engine.{source}"] and "torch" in contract["forbidden_modules"]
        assert not contract.get("allow_indirect_imports", False)  # torch through anything they import, too


def test_every_door_is_independent_of_the_others_and_only_shared_is_below_them() -> None:
    doors = contracts()["doors-independent"]
    assert doors["exhaustive"] is True and doors["layers"][1:] == ["shared"]
    listed = {d.strip() for d in doors["layers"][0].split("|")}
    present = {
        p.stem for p in (SERVICE / "doors").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert listed == present - {"__init__", "shared"}


def test_the_pipeline_reads_the_server_flags_only_through_session_settings() -> None:
    # issue 27: a stream's parts get the flags they use (SessionSettings.from_config), not all of ServerConfig
    importers = {
        p.name
        for p in (SERVICE / "pipeline").glob("*.py")
        if any(
            isinstance(n, ast.ImportFrom) and n.module == "service.config"
            for n in ast.walk(ast.parse(p.read_text()))
        )
    }
    assert importers == {"session_settings.py"}


def test_lint_imports_runs_in_the_test_command() -> None:
    # a line of its own, next to ruff and mypy: the contracts hold only if something runs them
    assert "lint-imports" in (REPO / "scripts" / "test.sh").read_text().splitlines()


def test_the_server_does_not_import_the_supervisor_and_the_supervisor_imports_it_only_in_a_frontend() -> None:
    # import-linter sees that the supervisor imports the server, not where: at module level the supervisor
    # process (which never serves) would load every door and the gRPC stack
    assert "server-without-supervisor" in contracts()
    tree = ast.parse((SERVICE / "runtime" / "supervisor.py").read_text())
    top_level = {
        node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert not any(under(name, ("service.runtime.server",)) for name in top_level)
    importers = [
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef)
        and any(isinstance(n, ast.ImportFrom) and n.module == "service.runtime.server" for n in f.body)
    ]
    assert importers == ["_serve_frontend"]  # run in the frontend process, never in the supervisor


def test_the_wheel_lists_every_package_of_the_tree() -> None:
    """pyproject lists its packages by hand (asr comes from proto/): a package missing there is missing
    from a non-editable install (the image, the GPU host's rehearsal) though every editable run finds it."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("engine", "service", "clients", "harness")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert found - listed == set()

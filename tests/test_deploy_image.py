"""The Dockerfile, checked without a Docker engine: hadolint is clean, every COPY source exists and is
not excluded by .dockerignore, the packages pyproject installs are all copied, the runtime runs as a
non-root user that matches the Kubernetes securityContext, and ENTRYPOINT/CMD are the console script
and flags the server accepts."""

from __future__ import annotations

import fnmatch
import functools
import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser

from service.config import parse_args
from tests.support.prom import DEPLOY, tool

REPO = DEPLOY.parent
DOCKERFILE = REPO / "Dockerfile"


@functools.cache
def instructions() -> list[dict[str, Any]]:
    parser = DockerfileParser(path=str(DOCKERFILE))
    return list(parser.structure)


def stages() -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for ins in instructions():
        if ins["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def dockerignored(path: str) -> bool:
    """Docker's .dockerignore semantics for the patterns used here: later lines win, '!' re-includes."""
    ignored = False
    for raw in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def json_array(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), f"exec form expected: {value}"
    return [str(v) for v in parsed]


def test_hadolint_is_clean() -> None:
    out = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_multi_stage_with_a_small_runtime_stage() -> None:
    build, runtime = stages()
    assert " AS build" in build[0]["value"] or build[0]["value"].endswith("AS build")
    runtime_runs = [i for i in runtime if i["instruction"] == "RUN"]
    # The runtime stage installs nothing: it copies the finished virtualenv from the build stage.
    assert all("pip install" not in i["value"] and "apt-get" not in i["value"] for i in runtime_runs)
    copies = [i["value"] for i in runtime if i["instruction"] == "COPY"]
    assert copies == ["--from=build /opt/asr /opt/asr"]


def test_torch_comes_from_a_configurable_cuda_index() -> None:
    args = {i["value"].split("=", 1)[0]: i["value"] for i in instructions() if i["instruction"] == "ARG"}
    assert "TORCH_INDEX_URL" in args and "TORCH_VERSION" in args
    assert re.search(r"TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    torch_pin = args["TORCH_VERSION"].split("=", 1)[1]
    requirement = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    minimum = re.search(r">=([\d.]+)", requirement)
    assert minimum is not None
    pin = tuple(int(x) for x in torch_pin.split("."))
    assert pin >= tuple(int(x) for x in minimum.group(1).split(".")), "pinned torch below pyproject's floor"
    assert any(
        '--index-url "${TORCH_INDEX_URL}"' in i["value"] for i in instructions() if i["instruction"] == "RUN"
    )


def test_every_copy_source_exists_and_is_in_the_build_context() -> None:
    copied = []
    for ins in instructions():
        if ins["instruction"] != "COPY" or ins["value"].startswith("--from="):
            continue
        *sources, _dest = ins["value"].split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: no such file in the repository"
            assert not dockerignored(src.rstrip("/")), f"COPY {src}: excluded by .dockerignore"
            copied.append(src.rstrip("/"))
    # Every package pyproject installs is copied (asr lives under proto/).
    package_dirs = pyproject()["tool"]["setuptools"]["package-dir"]
    for package in pyproject()["tool"]["setuptools"]["packages"]:
        top = package.split(".")[0]
        root = package_dirs.get(top, top).split("/")[0] or top
        assert root in copied, f"package {package} ({root}/) is not copied into the image"
    assert "pyproject.toml" in copied
    # Nothing heavy or secret rides along in the context.
    for path in (".venv", ".git", "tests", "deploy", "engine/__pycache__"):
        assert dockerignored(path), path


def test_runs_as_a_non_root_user_matching_the_pod_security_context() -> None:
    (_build, runtime) = stages()
    users = [i["value"] for i in runtime if i["instruction"] == "USER"]
    assert users, "the runtime stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, (
        "USER must be numeric (runAsNonRoot checks a numeric uid) and not 0"
    )
    deployment = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text(encoding="utf-8"))
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsUser"] == int(uid) and security["runAsGroup"] == int(gid)


def test_entrypoint_is_the_console_script_and_cmd_flags_are_accepted() -> None:
    (_build, runtime) = stages()
    entrypoint = json_array(next(i["value"] for i in runtime if i["instruction"] == "ENTRYPOINT"))
    scripts = pyproject()["project"]["scripts"]
    assert entrypoint == ["asr-server"] and "asr-server" in scripts
    cmd = json_array(next(i["value"] for i in runtime if i["instruction"] == "CMD"))
    config = parse_args(cmd)
    assert config.engine.model == "tiny.en"
    help_text = subprocess.run(
        [tool("asr-server"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (a for a in cmd if a.startswith("--")):
        assert flag in help_text, flag
    exposed = {int(p) for i in runtime if i["instruction"] == "EXPOSE" for p in i["value"].split()}
    # every port the server listens on with the image's flags: gRPC, the OpenAI-compatible HTTP door, metrics
    listening = {config.port, config.http_port, config.metrics_port} - {0}
    assert exposed == listening, f"EXPOSE {sorted(exposed)}, but the server listens on {sorted(listening)}"


def test_base_image_is_pinned_by_digest() -> None:
    """A tag moves with every Debian and Python patch release; the digest makes rebuilds repeatable."""
    args = {
        i["value"].split("=", 1)[0]: i["value"].split("=", 1)[1]
        for i in instructions()
        if i["instruction"] == "ARG" and "=" in i["value"]
    }
    froms = [i["value"].split()[0] for i in instructions() if i["instruction"] == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        resolved = args.get(image.strip("${}"), image) if image.startswith("$") else image
        assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", resolved), (
            f"FROM {image} = {resolved}: not pinned by digest"
        )


def test_the_build_asserts_torch_is_a_cuda_build() -> None:
    runs = [i["value"] for i in instructions() if i["instruction"] == "RUN"]
    torch_install = next(r for r in runs if '--index-url "${TORCH_INDEX_URL}"' in r)
    # The check runs in the same layer as the install, for every CUDA index (all but .../cpu).
    assert "assert torch.version.cuda," in torch_install
    assert "*/cpu)" in torch_install


def test_dependencies_are_installed_before_the_project_code_is_copied() -> None:
    """A code change must not invalidate the layer that installs the dependencies."""
    (build, _runtime) = stages()
    code_dirs = {"proto/", "engine/", "service/", "clients/"}
    first_code_copy = next(
        n for n, i in enumerate(build) if i["instruction"] == "COPY" and i["value"].split()[0] in code_dirs
    )
    before = build[:first_code_copy]
    deps = [n for n, i in enumerate(before) if i["instruction"] == "RUN" and "pip install -r" in i["value"]]
    assert deps, "no dependency install before the project code is copied"
    copied_before = [i["value"].split()[:-1] for i in before if i["instruction"] == "COPY"]
    assert all(set(srcs) <= {"pyproject.toml", "README.md"} for srcs in copied_before), copied_before
    after = [
        i["value"]
        for i in build[first_code_copy:]
        if i["instruction"] == "RUN" and "pip install" in i["value"]
    ]
    assert after and all("--no-deps" in r for r in after), (
        "the project install must not resolve dependencies again"
    )

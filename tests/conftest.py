"""Shared fixtures. Keep them small; heavier ones live next to the tests that use them."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, EngineConfig
from engine.hooks import EngineHooks
from service.config import ServerConfig
from tests.support import gpu_rehearsal
from tests.support.server import (
    AUDIOHOOK_API_KEY,
    AUDIOHOOK_CLIENT_SECRET,
    DOOR_TOKEN,
    TWILIO_AUTH_TOKEN,
    ServerProcess,
    ServerThread,
    free_port,
)

_rehearsal: gpu_rehearsal.Rehearsal | None = None


TESTS = Path(__file__).resolve().parent


def tier(item: pytest.Item) -> str:
    """The tier a test belongs to (pyproject.toml's markers): `engine` (tests/engine: the model and the
    scheduler), `doors` (tests/doors: each protocol through a real server), `server` (the other tests
    marked slow: real servers, processes, Prometheus), else `quick` (a few minutes: `pytest -m quick`)."""
    where = item.path.relative_to(TESTS).parts[0]
    if where in ("engine", "doors"):
        return where
    return "server" if item.get_closest_marker("slow") else "quick"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier(item))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The GPU rehearsal runs in the background from here, if its test is selected (see its module); under
    xdist the controller starts it (below), not every worker."""
    global _rehearsal
    if xdist_worker() or _rehearsal is not None:
        return
    if any(item.nodeid == gpu_rehearsal.NODE_ID for item in session.items):
        _rehearsal = gpu_rehearsal.start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: Sequence[str]) -> None:
    """xdist's controller collects nothing itself: it starts the rehearsal when a worker has collected its
    test, in the directory every worker of this run finds (gpu_rehearsal.shared_directory)."""
    global _rehearsal
    if _rehearsal is None and gpu_rehearsal.NODE_ID in ids:
        _rehearsal = gpu_rehearsal.start(gpu_rehearsal.shared_directory(node.workerinput["testrunuid"]))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _rehearsal is not None:
        _rehearsal.discard()


def xdist_worker() -> str | None:
    """This process's xdist worker id (gw0, gw1...), None when pytest runs without xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER")


@pytest.fixture(scope="session")
def background_gpu_rehearsal() -> gpu_rehearsal.Rehearsal:
    """The rehearsal started at collection (or now, when its test was not collected at the start)."""
    global _rehearsal
    if _rehearsal is None:
        shared = gpu_rehearsal.shared_directory(os.environ.get("PYTEST_XDIST_TESTRUNUID", ""))
        if xdist_worker() and shared.is_dir():
            # the controller's: it discards it at the end of the run (this worker may be over sooner)
            return gpu_rehearsal.Rehearsal(shared)
        _rehearsal = gpu_rehearsal.start()
    return _rehearsal


@pytest.fixture(scope="session")
def engine_hooks() -> EngineHooks:
    """The test seams of `service_engine` (engine/hooks.py): a test sets them for a block with
    `engine_hooks.installed(...)`, which refuses a seam another test still holds."""
    return EngineHooks()


@pytest.fixture(scope="session")
def service_engine(engine_hooks: EngineHooks) -> Iterator[Engine]:
    """The real bundled tiny.en, started and warmed, behind the in-process servers."""
    engine = Engine(EngineConfig(model="tiny.en", threads=2), hooks=engine_hooks)
    engine.start()
    engine.warmup()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def asr_server(service_engine: Engine) -> Iterator[ServerThread]:
    """One real gRPC server on 127.0.0.1 (free port) for the whole session; default limits
    except max_streams, kept small so that the limit can be reached in a test."""
    server = ServerThread(ServerConfig(max_streams=8), service_engine).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server_process() -> Iterator[ServerProcess]:
    """`asr-server` as a subprocess (own engine, one frontend process), SERVING; for tests that need a real
    process and leave it as they found it (a server booted costs 10-40 s on 2 cores, more under load)."""
    server = ServerProcess("--frontends", "1").wait_serving()
    yield server
    server.terminate()
    server.wait(60)
    server.stop()


@pytest.fixture(scope="session")
def two_frontend_siprec_port() -> int:
    """The SIPREC port of `two_frontend_process` (the supervisor reserves it, each frontend binds it)."""
    return free_port()


@pytest.fixture(scope="session")
def two_frontend_process(two_frontend_siprec_port: int) -> Iterator[ServerProcess]:
    """`asr-server --frontends 2` as a subprocess, SERVING, with the HTTP port and the SIPREC port on and
    the Twilio auth token from the environment (TWILIO_AUTH_TOKEN, as a Kubernetes Secret gives it): for
    the tests that check every frontend process serves a door, or that another server cannot take its
    ports, and leave the server as they found it. One
    boot of a two-frontend server costs ~15 s on 2 cores; a test that signals or drains starts its own."""
    server = ServerProcess(
        "--frontends", "2", "--siprec-port", str(two_frontend_siprec_port),
        http=True, env={"TWILIO_AUTH_TOKEN": TWILIO_AUTH_TOKEN},
    ).wait_serving()  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="session")
def door_tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--auth-tokens-file holding DOOR_TOKEN, the bearer token the protocol doors' tests send."""
    path = tmp_path_factory.mktemp("door-auth") / "tokens"
    path.write_text(f"{DOOR_TOKEN}\n")
    return path


@pytest.fixture(scope="session")
def twilio_auth_token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--twilio-auth-token-file holding TWILIO_AUTH_TOKEN, the token the Twilio door's tests sign with."""
    path = tmp_path_factory.mktemp("twilio") / "auth-token"
    path.write_text(f"{TWILIO_AUTH_TOKEN}\n")
    return path


@pytest.fixture(scope="session")
def audiohook_secret_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """--audiohook-api-key-file and --audiohook-client-secret-file: AUDIOHOOK_API_KEY, AUDIOHOOK_CLIENT_SECRET."""
    folder = tmp_path_factory.mktemp("audiohook")
    (folder / "api-key").write_text(AUDIOHOOK_API_KEY)
    (folder / "client-secret").write_text(AUDIOHOOK_CLIENT_SECRET)
    return folder / "api-key", folder / "client-secret"


@pytest.fixture(scope="session")
def door_server(
    service_engine: Engine,
    door_tokens_file: Path,
    twilio_auth_token_file: Path,
    audiohook_secret_files: tuple[Path, Path],
) -> Iterator[ServerThread]:
    """One server for the protocol doors' tests (Riva, Google, Deepgram, OpenAI Realtime, the telephony
    doors, SIPREC's SIP port among them): auth on, the HTTP port on (Deepgram, Realtime), an interim at most every 0.5 s so that a sentence of real speech
    has one. Tests that need limits of their own, or drain a server, start their own."""
    server = ServerThread(
        ServerConfig(
            auth_tokens_file=str(door_tokens_file),
            twilio_auth_token_file=str(twilio_auth_token_file),
            audiosocket_port=free_port(),
            siprec_port=free_port(),
            audiohook_api_key_file=str(audiohook_secret_files[0]),
            audiohook_client_secret_file=str(audiohook_secret_files[1]),
            interim_interval_s=0.5,
        ),
        service_engine,
        http=True,
    ).start()
    yield server
    server.stop()

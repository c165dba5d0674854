"""Real servers for tests, on loopback only.

- `ServerThread`: an AsrServer in a background thread with its own event loop (tests keep their own
  loops; one engine can back several servers with different limits).
- `ServerProcess`: `asr-server` as a subprocess, for what only a process shows (signals, exit codes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import Engine
from service.config import ServerConfig
from service.ports import free_port
from service.server import AsrServer

__all__ = ["HOST", "REPO", "ServerProcess", "ServerThread", "free_port", "sync_stream", "watch_health"]
T = TypeVar("T")
HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]


class ServerThread:
    """An in-process server on 127.0.0.1 (a free port), backed by an already started engine.
    The HTTP door is off unless `http` (then on a free port: parallel tests never meet on 8000)."""

    def __init__(self, config: ServerConfig, engine: Engine, *, http: bool = False) -> None:
        config.host, config.port, config.metrics_port = HOST, 0, 0
        config.http_port = free_port() if http else 0
        self.config = config
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.server = AsrServer(config, engine)
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)

    @property
    def target(self) -> str:
        return f"{HOST}:{self.server.port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.server.http_port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the server's loop (to start, stop, or look inside it)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self._thread.start()

        async def up() -> None:
            await self.server.start()
            await self.server.load()

        self.call(up())
        return self

    def stop(self) -> None:
        try:
            self.call(self.server.stop(0.5, stop_engine=False), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class ServerProcess:
    """`asr-server` in a subprocess with free ports; its log goes to a file (see `log()`). The HTTP door
    is off unless `http` (then on a free port: never the default 8000, which parallel tests would share).
    `ports_of` takes another server's ports (a restart); `own_process_group` puts it in a process group
    of its own, which a test may signal as a whole (systemd's KillMode=control-group, `kill -- -PGID`)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        http: bool = False,
        ports_of: ServerProcess | None = None,
        own_process_group: bool = False,
    ) -> None:
        if ports_of is not None:
            self.port, self.metrics_port, self.http_port = (
                ports_of.port,
                ports_of.metrics_port,
                ports_of.http_port,
            )
        else:
            self.port = free_port()
            self.metrics_port = free_port()
            self.http_port = free_port() if http else 0
        self._log = tempfile.NamedTemporaryFile(prefix="asr-server-", suffix=".log", delete=False)  # noqa: SIM115
        argv = [
            str(Path(sys.executable).with_name("asr-server")),
            *("--host", HOST, "--port", str(self.port), "--metrics-port", str(self.metrics_port)),
            *("--http-port", str(self.http_port)),
            *("--threads", "2", "--log-format", "json"),
            *args,
        ]
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            process_group=0 if own_process_group else None,
        )

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def health(self, service: str = "asr.v1.Recognizer") -> str:
        with grpc.insecure_channel(self.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_serving(self, timeout: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"asr-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.health() == "SERVING":
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"asr-server not SERVING after {timeout} s:\n{self.log()}")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.unlink(self._log.name)


def sync_stream(
    target: str, requests: Iterable[asr_pb2.StreamingRecognizeRequest], timeout: float = 120
) -> tuple[list[asr_pb2.StreamingRecognizeResponse], grpc.StatusCode, str]:
    """One StreamingRecognize call through the sync API: (responses, status code, details).

    For refusals that can arrive while the client is still writing: the sync API reports the server's
    status there, where grpc.aio may report INTERNAL instead (grpc/grpc#36066).
    """
    responses: list[asr_pb2.StreamingRecognizeResponse] = []
    with grpc.insecure_channel(target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(iter(requests), timeout=timeout)
        with contextlib.suppress(grpc.RpcError):  # the status is read from the call below
            responses.extend(call)
        return responses, call.code(), call.details() or ""


def watch_health(target: str) -> tuple[list[str], threading.Thread]:
    """Watch asr.v1.Recognizer's health from a background thread; returns the list the statuses are
    appended to as they arrive (the first is already there: the watch is live) and the thread, which
    ends when the server does."""
    statuses: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with contextlib.suppress(grpc.RpcError):
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service="asr.v1.Recognizer")):
                    statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                    watching.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(10), "no health status within 10 s"
    return statuses, watcher

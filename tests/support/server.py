"""Real servers for tests, on loopback only.

- `ServerThread`: an AsrServer in a background thread with its own event loop (tests keep their own
  loops; one engine can back several servers with different limits).
- `ServerProcess`: `asr-server` as a subprocess, for what only a process shows (signals, exit codes);
  the benchmark scripts' own (harness.server), so tests and benchmarks start servers one way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import grpc
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import Engine
from harness.server import HOST, REPO, ServerProcess, health_status
from service.config import ServerConfig
from service.runtime.ports import free_port
from service.runtime.server import AsrServer

__all__ = ["HOST", "REPO", "ServerProcess", "ServerThread", "free_port", "sync_stream", "watch_health"]
T = TypeVar("T")
DOOR_TOKEN = "door-test-token"  # what tests/conftest.py's door_server accepts
TWILIO_AUTH_TOKEN = "twilio-test-auth-token"  # the account auth token door_server checks signatures with
AUDIOHOOK_API_KEY = "audiohook-test-api-key"  # the Genesys integration door_server takes
AUDIOHOOK_CLIENT_SECRET = "VGhpcyBpcyBhIHRlc3QgY2xpZW50IHNlY3JldC4="  # base64, as Genesys shows it


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

    def health(self, service: str = "asr.v1.Recognizer") -> str:
        """The health service's answer for `service`, as ServerProcess.health asks it."""
        return health_status(self.target, service)

    def drain(self, grace: float | None = None) -> concurrent.futures.Future[None]:
        """Start what SIGTERM starts in a server process (AsrServer.drain: NOT_SERVING, open streams finish
        what they heard, then the ports close), leaving the shared engine running; done when the drain is.
        A door's drain is checked here without booting a process (15-40 s on 2 cores); the signal itself
        and the exit status are test_server_processes.py's."""
        return asyncio.run_coroutine_threadsafe(self.server.drain(grace, stop_engine=False), self.loop)

    def stop(self) -> None:
        try:
            self.call(self.server.stop(0.5, stop_engine=False), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


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

"""`EngineClient`: the engine in another process, behind the same narrow surface the service uses
from an in-process `Engine` (submit -> handle with a Future and cancel; cancel; info; validate;
alive; stats; stop).

One I/O thread owns the DEALER socket (ZeroMQ sockets are not thread-safe); `submit` and `cancel`
hand their frames to it through a `Mailbox` and return at once, so the caller's event loop never
waits on the engine process. A refusal (EngineOverloaded, EngineStopped, ValueError) therefore
arrives on the handle's future rather than from `submit` itself, except where the client already
knows: options this model cannot serve (checked here from ModelInfo, no round trip) and an engine
that is gone.

The engine process going away (crash, kill) closes its Unix socket; ZeroMQ's socket monitor reports
the disconnect, and every open utterance fails with EngineStopped at once, and `on_failure` is called.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine import ipc
from engine.api import EngineStopped, ModelInfo, UtteranceHandle
from engine.metrics import IPC_SECONDS
from engine.request import DecodeOptions, Transcript, validate_options

log = logging.getLogger("engine.client")


class EngineClient:
    """Connects to the engine process at `address` (ipc://...) and blocks until it answers HELLO."""

    def __init__(self, address: str, *, name: str | None = None, connect_timeout: float = 30.0) -> None:
        self.name = name or f"client-{os.getpid()}"
        self._ids = itertools.count()
        self._pending: dict[str, tuple[Future[Transcript], float]] = {}  # rid -> (future, sent)
        self._stats: dict[bytes, Future[dict[str, int]]] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closing = threading.Event()
        self.on_failure: Callable[[BaseException], None] | None = None
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.name.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self._outbox = ipc.Mailbox()
        self._hello: Future[tuple[ModelInfo, int]] = Future()
        self._thread = threading.Thread(target=self._run, name=f"engine-client-{self.name}", daemon=True)
        self._thread.start()
        self._outbox.put([ipc.HELLO])
        try:
            self._info, self.max_queue = self._hello.result(connect_timeout)
        except Exception:
            self.stop()
            raise

    # --- the Engine surface ---
    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closing.is_set()

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Register what to call (from the client's I/O thread) if the engine process goes away."""
        self.on_failure = on_failure

    def validate(self, options: DecodeOptions) -> None:
        validate_options(options, multilingual=self._info.multilingual, languages=self._info.languages)

    def submit(
        self,
        audio: np.ndarray,
        options: DecodeOptions | None = None,
        *,
        ready_time: float | None = None,
        request_id: str | None = None,
    ) -> UtteranceHandle:
        options = options or DecodeOptions()
        self.validate(options)
        if not self.alive:
            raise EngineStopped(self._dead or "the engine client is stopped")
        rid = request_id or f"{self.name}-u{next(self._ids)}"
        samples = np.ascontiguousarray(audio, dtype=np.float32)
        future: Future[Transcript] = Future()
        sent = time.monotonic()
        with self._lock:
            self._pending[rid] = (future, sent)
        header = ipc.dump((rid, options, sent if ready_time is None else ready_time))
        # the array itself is the frame: ZeroMQ sends from its memory without a copy
        self._outbox.put([ipc.SUBMIT, header, samples])
        return UtteranceHandle(id=rid, future=future, _engine=self)  # type: ignore[arg-type]

    def cancel(self, request_id: str) -> None:
        if self.alive:
            self._outbox.put([ipc.CANCEL, ipc.dump(request_id)])

    def stats(self, timeout: float = 5.0) -> dict[str, int]:
        """Snapshot from the engine process: waiting, active, slots_used, slots_free."""
        if not self.alive:
            raise EngineStopped(self._dead or "the engine client is stopped")
        token = os.urandom(8)
        future: Future[dict[str, int]] = Future()
        with self._lock:
            self._stats[token] = future
        self._outbox.put([ipc.STATS, token])
        return future.result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect (the engine process itself is stopped by whoever started it); whatever is still
        open fails with EngineStopped."""
        self._closing.set()
        self._outbox.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- the I/O thread ---
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._outbox.fd, zmq.POLLIN)
        connected = False
        try:
            while not self._closing.is_set():
                events = dict(poller.poll())
                if self._socket in events:
                    self._receive()
                if self._monitor in events:
                    event = recv_monitor_message(self._monitor)["event"]
                    if event == zmq.EVENT_CONNECTED:
                        connected = True
                    elif event == zmq.EVENT_DISCONNECTED and connected:
                        self._receive()  # whatever arrived before the socket closed
                        self._engine_gone("the engine process exited")
                        return
                for item in self._outbox.drain():
                    if item is not None:
                        self._socket.send_multipart(item, copy=False)
        except Exception as e:  # a bug here must not leave callers waiting for ever
            log.exception("engine client I/O thread failed")
            self._engine_gone(f"engine client failed: {e!r}")
        finally:
            self._fail_all(EngineStopped(self._dead or "the engine client is stopped"))
            self._socket.disable_monitor()
            self._monitor.close(0)
            self._socket.close(0)
            self._context.term()
            self._outbox.close()

    def _receive(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = frames[0]
            if kind in (ipc.DONE, ipc.FAILED):
                self._finish(kind, ipc.load(frames[1]))
            elif kind == ipc.STATS:
                with self._lock:
                    stats_future = self._stats.pop(frames[1], None)
                if stats_future is not None:
                    stats_future.set_result(ipc.load(frames[2]))
            elif kind == ipc.HELLO:
                with contextlib.suppress(InvalidStateError):
                    self._hello.set_result(ipc.load(frames[1]))

    def _finish(self, kind: bytes, header: tuple[Any, ...]) -> None:
        now = time.monotonic()
        rid, received, published = header[0], header[-2], header[-1]
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is None:
            return
        future, sent = entry
        # time on the wire both ways: frontend -> engine, engine's reply -> frontend
        IPC_SECONDS.observe(max(0.0, received - sent) + max(0.0, now - published))
        with contextlib.suppress(InvalidStateError):
            if kind == ipc.DONE:
                future.set_result(header[1])
            elif header[1] == ipc.CANCELLED:
                future.cancel()
            else:
                future.set_exception(ipc.failure_exception(header[1], header[2]))

    def _engine_gone(self, why: str) -> None:
        if self._dead is not None:
            return
        self._dead = why
        log.critical("engine process gone", extra={"fields": {"error": why, "client": self.name}})
        self._fail_all(EngineStopped(why))
        if self.on_failure is not None:
            self.on_failure(EngineStopped(why))

    def _fail_all(self, exc: EngineStopped) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            stats, self._stats = self._stats, {}
        for future, _ in pending.values():
            with contextlib.suppress(InvalidStateError):
                future.set_exception(exc)
        for stats_future in stats.values():
            with contextlib.suppress(InvalidStateError):
                stats_future.set_exception(exc)
        if not self._hello.done():
            with contextlib.suppress(InvalidStateError):
                self._hello.set_exception(exc)

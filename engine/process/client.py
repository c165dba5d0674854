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

The client opens a session with a nonce of its own (engine/process/ipc.py): a client made again under the same
name (a restarted frontend) is a new session, and the engine cancels what the old one left. `stop`
sends everything still queued (cancels included), then BYE, so the engine frees the rest at once. A
reply that never comes is found by CHECK (engine/process/ipc.py, "Lost replies"): that utterance fails with
ReplyLost. A malformed reply is counted and dropped, failing its utterance where its id can be read.
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.api import EngineStopped, ModelInfo, UtteranceHandle
from engine.metrics import IPC_MALFORMED, IPC_REPLIES_LOST, IPC_SECONDS
from engine.outputs import Transcript
from engine.parameters import DecodeOptions, validate_beam_size, validate_options
from engine.process import ipc

log = logging.getLogger("engine.client")

STOP_LINGER_MS = 2000  # stop(): at most this long for the last messages (cancels, BYE) to get out
CHECK_GIVE_UP_S = 10 * ipc.CHECK_INTERVAL_S  # a CHECK unanswered this long is asked again


@dataclass
class _Pending:
    """An utterance submitted and not yet answered."""

    future: Future[Transcript]
    sent: float  # submit() was called (asr_ipc_seconds counts from here)
    wired: float | None = None  # the I/O thread put it on the socket (CHECK asks only about these)


class EngineClient:
    """Connects to the engine process at `address` (ipc://...) and blocks until it answers HELLO."""

    def __init__(self, address: str, *, name: str | None = None, connect_timeout: float = 30.0) -> None:
        self.name = name or f"client-{os.getpid()}"
        self._ids = itertools.count()
        self._pending: dict[str, _Pending] = {}  # by request id
        self._stats: dict[bytes, Future[dict[str, int]]] = {}
        self._nonce = os.urandom(8)  # this session, whatever the name (engine/process/ipc.py)
        # the CHECK in flight (I/O thread only): its token and when it was sent
        self._check: tuple[bytes, float] | None = None
        self._last_check = 0.0
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
        self._outbox.put([ipc.HELLO, self._nonce])
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
        validate_beam_size(options.beam_size, *self._info.max_beam_size)

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
            self._pending[rid] = _Pending(future, sent)
        header = ipc.dump((options, sent if ready_time is None else ready_time))
        # the array itself is the frame: ZeroMQ sends from its memory without a copy
        self._outbox.put([ipc.SUBMIT, rid.encode(), header, samples])
        return UtteranceHandle(id=rid, future=future, _engine=self)  # type: ignore[arg-type]

    def cancel(self, request_id: str) -> None:
        if self.alive:
            self._outbox.put([ipc.CANCEL, request_id.encode()])

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
        """Send what is queued (cancels included), say BYE (the engine cancels what this client still
        has there) and disconnect; the engine process itself is stopped by whoever started it. Whatever
        is still open fails with EngineStopped."""
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
        linger_ms = 0
        try:
            while not self._closing.is_set():
                events = dict(poller.poll(round(ipc.CHECK_INTERVAL_S * 1000)))
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
                self._send_outbox()
                self._check_replies()
            # stopping: what callers queued (cancels above all) goes out, then BYE frees the rest
            self._send_outbox()
            self._socket.send_multipart([ipc.BYE])
            linger_ms = STOP_LINGER_MS
        except Exception as e:  # a bug here must not leave callers waiting for ever
            log.exception("engine client I/O thread failed")
            self._engine_gone(f"engine client failed: {e!r}")
        finally:
            self._fail_all(EngineStopped(self._dead or "the engine client is stopped"))
            self._socket.disable_monitor()
            self._monitor.close(0)
            self._socket.close(linger_ms)  # lets the last messages out, at most this long
            self._context.term()
            self._outbox.close()

    def _send_outbox(self) -> None:
        for item in self._outbox.drain():
            if item is None:
                continue
            self._socket.send_multipart(item, copy=False)
            if item[0] == ipc.SUBMIT:  # from now on the engine has it or lost it: CHECK may ask
                with self._lock:
                    entry = self._pending.get(item[1].decode())
                if entry is not None:
                    entry.wired = time.monotonic()

    def _check_replies(self) -> None:
        """Ask the engine about the utterances waited on for CHECK_INTERVAL_S or more (one CHECK at a
        time; one unanswered for long is given up and asked again)."""
        now = time.monotonic()
        if now - self._last_check < ipc.CHECK_INTERVAL_S:
            return
        if self._check is not None and now - self._check[1] < CHECK_GIVE_UP_S:
            return
        self._last_check = now
        with self._lock:
            due = [
                rid
                for rid, p in self._pending.items()
                if p.wired is not None and now - p.wired >= ipc.CHECK_INTERVAL_S
            ]
        if not due:
            return
        token = os.urandom(8)
        self._check = (token, now)
        self._socket.send_multipart([ipc.CHECK, token, *(rid.encode() for rid in due)])

    def _receive(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                try:
                    self._dispatch(frames)
                except ipc.Malformed as e:
                    self._malformed(e)
            except Exception:  # a bug in handling one reply (or in failing it) must not end the client
                log.exception("engine reply handling failed", extra={"fields": {"client": self.name}})
                IPC_MALFORMED.labels("frontend", "error").inc()

    def _malformed(self, e: ipc.Malformed) -> None:
        IPC_MALFORMED.labels("frontend", e.reason).inc()
        log.warning(
            "malformed reply from the engine process dropped",
            extra={"fields": {"client": self.name, "reason": e.reason, "error": str(e)}},
        )
        if e.rid is not None:
            with self._lock:
                entry = self._pending.pop(e.rid, None)
            if entry is not None:
                with contextlib.suppress(InvalidStateError):
                    entry.future.set_exception(ipc.RemoteEngineError("malformed reply", str(e)))

    def _dispatch(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind in (ipc.DONE, ipc.FAILED):
            if len(frames) < 2:
                raise ipc.Malformed("frames", f"{kind!r} with no request id")
            rid = ipc.request_id(frames[1])
            if len(frames) != 3:
                raise ipc.Malformed("frames", f"{kind!r} {rid} takes 3 frames, not {len(frames)}", rid)
            self._finish(kind, rid, ipc.reply_header(frames[2], kind, rid))
        elif kind == ipc.PING:
            pass  # the engine checking that this client is still connected
        elif kind == ipc.CHECK:
            if len(frames) < 2:
                raise ipc.Malformed("frames", "CHECK with no token")
            self._lost([ipc.request_id(f) for f in frames[2:]], frames[1])
        elif kind == ipc.STATS:
            if len(frames) != 3:
                raise ipc.Malformed("frames", f"STATS takes 3 frames, not {len(frames)}")
            stats = ipc.load_header(frames[2], "STATS")
            if not isinstance(stats, dict):
                raise ipc.Malformed("header", "STATS: not a dict")
            with self._lock:
                stats_future = self._stats.pop(frames[1], None)
            if stats_future is not None:
                stats_future.set_result(stats)
        elif kind == ipc.HELLO:
            if len(frames) != 2:
                raise ipc.Malformed("frames", f"HELLO takes 2 frames, not {len(frames)}")
            hello = ipc.load_header(frames[1], "HELLO")
            if not (
                isinstance(hello, tuple)
                and len(hello) == 2
                and isinstance(hello[0], ModelInfo)
                and isinstance(hello[1], int)
            ):
                raise ipc.Malformed("header", "HELLO: not (ModelInfo, max_queue)")
            with contextlib.suppress(InvalidStateError):
                self._hello.set_result(hello)
        else:
            raise ipc.Malformed("kind", f"unknown reply kind {kind[:8]!r}")

    def _lost(self, rids: list[str], token: bytes) -> None:
        """The CHECK's answer: the engine holds none of these and sent no reply before this answer."""
        if self._check is None or self._check[0] != token:
            return  # an answer given up on: a later CHECK asks again
        asked = self._check[1]
        self._check = None
        for rid in rids:
            with self._lock:
                entry = self._pending.get(rid)
                # the one asked about, not a later submission that reused its id
                if entry is None or entry.wired is None or entry.wired > asked:
                    continue
                del self._pending[rid]
            IPC_REPLIES_LOST.inc()
            log.error("engine reply lost", extra={"fields": {"client": self.name, "request_id": rid}})
            with contextlib.suppress(InvalidStateError):
                entry.future.set_exception(
                    ipc.ReplyLost(
                        f"utterance {rid}: no reply from the engine process, which no longer holds it "
                        "(the reply was lost)"
                    )
                )

    def _finish(self, kind: bytes, rid: str, header: tuple[Any, ...]) -> None:
        now = time.monotonic()
        received, published = header[-2], header[-1]
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is None:
            return
        future, sent = entry.future, entry.sent
        # time on the wire both ways: frontend -> engine, engine's reply -> frontend
        IPC_SECONDS.observe(max(0.0, received - sent) + max(0.0, now - published))
        with contextlib.suppress(InvalidStateError):
            if kind == ipc.DONE:
                future.set_result(header[0])
            elif header[0] == ipc.CANCELLED:
                future.cancel()
            else:
                future.set_exception(ipc.failure_exception(header[0], header[1]))

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
        for future in (p.future for p in pending.values()):
            with contextlib.suppress(InvalidStateError):
                future.set_exception(exc)
        for stats_future in stats.values():
            with contextlib.suppress(InvalidStateError):
                stats_future.set_exception(exc)
        if not self._hello.done():
            with contextlib.suppress(InvalidStateError):
                self._hello.set_exception(exc)

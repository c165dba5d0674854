"""The engine process: one `Engine` (its core loop, scheduler, model runner and KV cache; owns the
device) serving every frontend process over `engine.process.ipc`, through an `EngineRouter`.

The process's main thread does only socket I/O: the router turns messages into `Engine.submit`/`cancel`
calls and finished futures into replies, so the engine's loop thread (engine/core.py) keeps the device
busy and never touches a socket. Results reach the I/O thread through a `Mailbox` (futures complete on
the loop thread). vLLM's EngineCore process and SGLang's scheduler process split the same way.

Exit codes: 0 after the stop signal (SIGTERM; in asr-server the supervisor's own CONTROL_SIGNAL), 1 when
the engine's loop thread dies (every frontend sees the socket close and fails its open utterances), 2 when
the model cannot load.

Heartbeat: a process can hang without dying (a stuck device call, a deadlock in the engine's loop thread).
The I/O thread publishes, at least every HEARTBEAT_INTERVAL_S, into shared memory the supervisor
reads: when it published, the engine loop's iteration count (`Engine.progress`) and how many
utterances are in the engine with no reply yet. The supervisor (service/runtime/supervisor.py) ends an engine
whose loop makes no progress with work pending, or that stops publishing at all.

Sessions (engine/process/ipc.py): every utterance belongs to the session of the frontend that sent it; a session
ends, cancelling what it still holds, on BYE, on a new HELLO under its identity, or when a probe finds no
route to its frontend. Nothing a peer sends ends this process: a malformed message is counted and dropped.
"""

from __future__ import annotations

import functools
import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable, MutableSequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from engine import metrics as m
from engine.api import Engine, EngineStopped
from engine.config import EngineConfig
from engine.outputs import Transcript
from engine.process import ipc

log = logging.getLogger("engine.core_process")

EXIT_STOPPED, EXIT_SCHEDULER_DIED, EXIT_LOAD_FAILED = 0, 1, 2
HEARTBEAT_INTERVAL_S = 0.25
PROBE_INTERVAL_S = 0.25  # how often each session's route is tried (a frontend gone is found this fast)
# Slots of the shared heartbeat array (multiprocessing.Array("d", HEARTBEAT_SLOTS), written here only)
HEARTBEAT_PUBLISHED, HEARTBEAT_PROGRESS, HEARTBEAT_PENDING, HEARTBEAT_SLOTS = 0, 1, 2, 3


@dataclass
class Session:
    """One connected frontend (EngineClient): the nonce its HELLO named itself with and the utterances
    it has in the engine, by its own request ids."""

    number: int  # engine-wide: request ids of two sessions never meet in the scheduler
    nonce: bytes
    requests: dict[str, str] = field(default_factory=dict)  # the frontend's request id -> the engine's


class EngineRouter:
    """Routes messages between the ROUTER socket and an `Engine`, one session per frontend (engine/process/ipc.py):
    it decides nothing about the work, only whose it is and where its answer goes."""

    def __init__(
        self, engine: Engine, socket: zmq.Socket[Any], heartbeat: MutableSequence[float] | None = None
    ) -> None:
        self.engine = engine
        self.socket = socket
        self.outbox = ipc.Mailbox()
        self.failed = threading.Event()
        self.stopping = threading.Event()
        self.heartbeat = heartbeat
        # utterances accepted and not yet answered: the I/O thread adds, the loop thread's replies take
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        # owned by the I/O thread
        self.sessions: dict[bytes, Session] = {}
        self._session_numbers = itertools.count(1)
        self._probed = 0.0
        self._drop_replies = engine.config.debug_drop_replies  # test seam: replies not sent
        self._handlers: dict[bytes, Callable[[bytes, list[zmq.Frame]], None]] = {
            ipc.HELLO: self._hello,
            ipc.SUBMIT: self._submit,
            ipc.CANCEL: self._cancel,
            ipc.STATS: self._stats,
            ipc.CHECK: self._check,
            ipc.BYE: self._bye,
        }

    def publish_heartbeat(self) -> None:
        if self.heartbeat is None:
            return
        with self._in_flight_lock:
            pending = self._in_flight
        self.heartbeat[HEARTBEAT_PROGRESS] = float(self.engine.progress)
        self.heartbeat[HEARTBEAT_PENDING] = float(pending)
        self.heartbeat[HEARTBEAT_PUBLISHED] = time.monotonic()  # last: the others are current

    def on_scheduler_failure(self, exc: BaseException) -> None:
        # the engine's loop thread: the service's supervisor and tests look for this line
        log.critical("engine scheduler died; exiting", extra={"fields": {"error": repr(exc)}})
        self.failed.set()
        self.outbox.put(None)  # wake the I/O loop

    def request_stop(self) -> None:
        self.stopping.set()
        self.outbox.put(None)

    # --- the engine's loop thread ---
    def _reply(
        self, identity: bytes, session: int, rid: str, received: float, future: Future[Transcript]
    ) -> None:
        published = time.monotonic()
        with self._in_flight_lock:
            self._in_flight -= 1
        if future.cancelled():
            frames = [ipc.FAILED, rid.encode(), ipc.dump((ipc.CANCELLED, "", received, published))]
        elif (exc := future.exception()) is not None:
            kind, message = ipc.failure_kind(exc)
            frames = [ipc.FAILED, rid.encode(), ipc.dump((kind, message, received, published))]
        else:
            frames = [ipc.DONE, rid.encode(), ipc.dump((future.result(), received, published))]
        self.outbox.put((identity, session, rid, frames))

    # --- I/O thread: sending ---
    def _send(self, identity: bytes, frames: list[Any], *, reply: bool = True) -> None:
        """Send without blocking (ROUTER_MANDATORY): a frontend with no route is gone, and its session
        ends; one whose queue is full (it does not read) loses this reply, which its CHECK then finds."""
        try:
            self.socket.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self._end_session(identity, "disconnected")
            elif e.errno == zmq.EAGAIN:
                if reply:
                    m.IPC_REPLIES_DROPPED.labels("backlog").inc()
                    log.warning(
                        "reply dropped: the frontend's queue is full",
                        extra={"fields": {"peer": _peer(identity)}},
                    )
            else:
                raise

    def _flush(self) -> None:
        for item in self.outbox.drain():
            if item is None:
                continue
            identity, number, rid, frames = item
            session = self.sessions.get(identity)
            if session is None or session.number != number:
                continue  # that session ended and its work was cancelled: nobody waits for this
            session.requests.pop(rid, None)
            if self._drop_replies > 0:
                self._drop_replies -= 1
                m.IPC_REPLIES_DROPPED.labels("debug").inc()
                continue
            self._send(identity, frames)

    def _probe(self) -> None:
        """Find the sessions whose connection is gone: a frontend process that ended, however it ended,
        closed its Unix socket, and ROUTER_MANDATORY then finds no route to it."""
        now = time.monotonic()
        if now - self._probed < PROBE_INTERVAL_S:
            return
        self._probed = now
        for identity in list(self.sessions):
            self._send(identity, [ipc.PING], reply=False)

    def _end_session(self, identity: bytes, reason: str) -> None:
        """The frontend is gone (or is another one now): cancel what it still has in the engine."""
        session = self.sessions.pop(identity, None)
        if session is None:
            return
        for engine_id in session.requests.values():
            self.engine.cancel(engine_id)
        m.IPC_SESSIONS_ENDED.labels(reason).inc()
        m.IPC_ORPHANS_CANCELLED.inc(len(session.requests))
        log.info(
            "frontend session ended",
            extra={"fields": {"peer": _peer(identity), "reason": reason, "cancelled": len(session.requests)}},
        )

    # --- I/O thread: receiving ---
    def _handle(self, frames: list[zmq.Frame]) -> None:
        """One message; nothing a peer sends can end this process (engine/process/ipc.py)."""
        identity = frames[0].bytes
        try:
            try:
                if len(frames) < 2:
                    raise ipc.Malformed("frames", "a message with no kind frame")
                kind = frames[1].bytes
                handler = self._handlers.get(kind)
                if handler is None:
                    raise ipc.Malformed("kind", f"unknown message kind {kind[:8]!r}")
                handler(identity, frames[2:])
            except ipc.Malformed as e:
                self._malformed(identity, e)
        except Exception:  # a bug in handling one message (or in answering it) must not end the engine
            log.exception("IPC message handling failed", extra={"fields": {"peer": _peer(identity)}})
            m.IPC_MALFORMED.labels("engine", "error").inc()

    def _malformed(self, identity: bytes, e: ipc.Malformed) -> None:
        m.IPC_MALFORMED.labels("engine", e.reason).inc()
        log.warning(
            "malformed IPC message dropped",
            extra={"fields": {"peer": _peer(identity), "reason": e.reason, "error": str(e)}},
        )
        if e.rid is not None:
            now = time.monotonic()
            header = (e.kind, e.failed_message(), now, now)
            self._send(identity, [ipc.FAILED, e.rid.encode(), ipc.dump(header)])

    def _hello(self, identity: bytes, body: list[zmq.Frame]) -> None:
        if len(body) != 1:
            raise ipc.Malformed("frames", f"HELLO takes one frame (the nonce), not {len(body)}")
        nonce = body[0].bytes
        if not 0 < len(nonce) <= ipc.MAX_NONCE_BYTES:
            raise ipc.Malformed("header", f"HELLO's nonce must be 1-{ipc.MAX_NONCE_BYTES} bytes")
        session = self.sessions.get(identity)
        if session is not None and session.nonce != nonce:
            self._end_session(identity, "replaced")  # a restarted frontend under the same identity
            session = None
        if session is None:
            self.sessions[identity] = Session(number=next(self._session_numbers), nonce=nonce)
        self._send(identity, [ipc.HELLO, ipc.dump((self.engine.info, self.engine.config.max_queue))])

    def _submit(self, identity: bytes, body: list[zmq.Frame]) -> None:
        received = time.monotonic()
        if not body:
            raise ipc.Malformed("frames", "SUBMIT with no request id")
        rid = ipc.request_id(body[0].bytes)
        if len(body) != 3:
            raise ipc.Malformed(
                "frames", f"SUBMIT {rid} takes 3 frames (id, header, audio), not {len(body)}", rid
            )
        options, ready_time = ipc.submit_header(body[1].buffer, rid)
        # zero-copy: the array reads the frame's buffer (kept alive by the array's base)
        audio = ipc.audio_samples(body[2].buffer, rid)
        session = self.sessions.get(identity)
        if session is None:
            raise ipc.Malformed(
                "session", f"SUBMIT {rid}: no session (no HELLO, or it ended); reconnect", rid, ipc.STOPPED
            )
        if rid in session.requests:
            raise ipc.Malformed("duplicate", f"SUBMIT {rid}: request id already in use in this session", rid)
        try:
            handle = self.engine.submit(
                audio, options, ready_time=ready_time, request_id=f"{rid}#{session.number}"
            )
        except Exception as e:
            kind, message = ipc.failure_kind(e)
            self._send(
                identity, [ipc.FAILED, body[0].bytes, ipc.dump((kind, message, received, time.monotonic()))]
            )
            return
        session.requests[rid] = handle.id
        with self._in_flight_lock:
            self._in_flight += 1
        handle.future.add_done_callback(
            functools.partial(self._reply, identity, session.number, rid, received)
        )

    def _cancel(self, identity: bytes, body: list[zmq.Frame]) -> None:
        if len(body) != 1:
            raise ipc.Malformed("frames", f"CANCEL takes one frame (the request id), not {len(body)}")
        rid = ipc.request_id(body[0].bytes)
        session = self.sessions.get(identity)
        engine_id = session.requests.get(rid) if session is not None else None
        if engine_id is not None:  # else answered already, or its session ended (and cancelled it)
            self.engine.cancel(engine_id)

    def _stats(self, identity: bytes, body: list[zmq.Frame]) -> None:
        if len(body) != 1:
            raise ipc.Malformed("frames", f"STATS takes one frame (a token), not {len(body)}")
        self._send(identity, [ipc.STATS, body[0].bytes, ipc.dump(self.engine.stats())])

    def _check(self, identity: bytes, body: list[zmq.Frame]) -> None:
        """Name the utterances asked about that this session no longer holds: their replies were lost
        (any reply sent went out before this answer, on the same connection)."""
        if not body:
            raise ipc.Malformed("frames", "CHECK with no token")
        session = self.sessions.get(identity)
        held = session.requests if session is not None else {}
        lost = [f.bytes for f in body[1:] if f.bytes.decode(errors="replace") not in held]
        self._send(identity, [ipc.CHECK, body[0].bytes, *lost])

    def _bye(self, identity: bytes, body: list[zmq.Frame]) -> None:
        if body:
            raise ipc.Malformed("frames", f"BYE takes no frames, not {len(body)}")
        self._end_session(identity, "closed")

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.outbox.fd, zmq.POLLIN)
        while not (self.failed.is_set() or self.stopping.is_set()):
            self.publish_heartbeat()
            events = dict(poller.poll(round(HEARTBEAT_INTERVAL_S * 1000)))
            if self.socket in events:
                while True:
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._flush()
            self._probe()
        # Stop the engine (it fails whatever is still queued with EngineStopped), then send those
        # last replies before the socket closes.
        self.engine.stop()
        self._flush()
        return EXIT_SCHEDULER_DIED if self.failed.is_set() else EXIT_STOPPED


def _peer(identity: bytes) -> str:
    """A frontend's identity for logs: its name, or hex for ZeroMQ's random binary ones."""
    text = identity[:64].decode(errors="replace")
    return text if text.isprintable() else identity[:64].hex()


def serve(
    config: EngineConfig,
    address: str,
    ready: Connection,
    heartbeat: MutableSequence[float] | None = None,
    stop_signal: int = signal.SIGTERM,
) -> int:
    """The engine process's life: load and warm the model, report ready (or failed) on `ready`, then
    serve `address` until `stop_signal` (asr-server's supervisor sends its own: service/runtime/supervisor.py)
    or a scheduler failure, publishing into `heartbeat` (see the module docstring). Returns the
    process's exit code."""
    router: EngineRouter | None = None
    stop_early = threading.Event()

    def on_stop_signal(signum: int, frame: object) -> None:
        if router is not None:
            router.request_stop()
        else:
            stop_early.set()

    signal.signal(stop_signal, on_stop_signal)
    started = time.perf_counter()
    try:
        engine = Engine(config)
    except Exception as e:
        ready.send(("failed", f"{e}"))
        return EXIT_LOAD_FAILED
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 2000)  # last replies get out before the process ends
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting frontend takes its identity back
    # a send to a frontend with no route fails (EHOSTUNREACH) instead of vanishing: how the engine
    # learns that a frontend is gone (EngineRouter._probe)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # No ZMTP heartbeats (ZMQ_HEARTBEAT_IVL): with a peer's input stalled by backpressure they abort
    # libzmq 4.3.x on an assertion (zeromq/libzmq#3937, #4364; seen here as "!_io_error" in a test run).
    # A frontend that dies closes its Unix socket: the probe finds that without them.
    socket.bind(address)
    router = EngineRouter(engine, socket, heartbeat)
    engine.start(on_failure=router.on_scheduler_failure)
    try:
        if config.warmup:
            engine.warmup()
    except EngineStopped as e:
        ready.send(("failed", f"the engine died during warm-up: {e}"))
        engine.stop()
        socket.close()
        context.term()
        return EXIT_SCHEDULER_DIED
    if stop_early.is_set():
        engine.stop()
        socket.close()
        context.term()
        return EXIT_STOPPED
    router.publish_heartbeat()  # current before the supervisor starts watching it
    ready.send(("ready", engine.info, time.perf_counter() - started))
    try:
        return router.run()
    finally:
        socket.close()
        context.term()
        router.outbox.close()

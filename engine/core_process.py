"""The engine process: one `Engine` (model, scheduler, KV cache; owns the device) serving every
frontend process over `engine.ipc`.

The process's main thread does only socket I/O: it turns messages into `Engine.submit`/`cancel`
calls and finished futures into replies, so the scheduler thread keeps the device busy and never
touches a socket. Results reach the I/O thread through a `Mailbox` (futures complete on the
scheduler thread). vLLM's EngineCore process and SGLang's scheduler process split the same way.

Exit codes: 0 after the stop signal (SIGTERM; in asr-server the supervisor's own CONTROL_SIGNAL), 1 when
the scheduler thread dies (every frontend sees the socket close and fails its open utterances), 2 when
the model cannot load.

Heartbeat: a process can hang without dying (a stuck device call, a deadlock in the scheduler thread).
The I/O thread publishes, at least every HEARTBEAT_INTERVAL_S, into shared memory the supervisor
reads: when it published, the scheduler loop's iteration count (`Engine.progress`) and how many
utterances are in the engine with no reply yet. The supervisor (service/supervisor.py) ends an engine
whose loop makes no progress with work pending, or that stops publishing at all.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import MutableSequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq

from engine import ipc
from engine.api import Engine, EngineStopped
from engine.config import EngineConfig
from engine.request import DecodeOptions, Transcript

log = logging.getLogger("engine.core_process")

EXIT_STOPPED, EXIT_SCHEDULER_DIED, EXIT_LOAD_FAILED = 0, 1, 2
HEARTBEAT_INTERVAL_S = 0.25
# Slots of the shared heartbeat array (multiprocessing.Array("d", HEARTBEAT_SLOTS), written here only)
HEARTBEAT_PUBLISHED, HEARTBEAT_PROGRESS, HEARTBEAT_PENDING, HEARTBEAT_SLOTS = 0, 1, 2, 3


class EngineCore:
    """Routes messages between the ROUTER socket and an `Engine`."""

    def __init__(
        self, engine: Engine, socket: zmq.Socket[Any], heartbeat: MutableSequence[float] | None = None
    ) -> None:
        self.engine = engine
        self.socket = socket
        self.outbox = ipc.Mailbox()
        self.failed = threading.Event()
        self.stopping = threading.Event()
        self.heartbeat = heartbeat
        # utterances accepted and not yet answered: the I/O thread adds, the scheduler thread's replies take
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()

    def publish_heartbeat(self) -> None:
        if self.heartbeat is None:
            return
        with self._in_flight_lock:
            pending = self._in_flight
        self.heartbeat[HEARTBEAT_PROGRESS] = float(self.engine.progress)
        self.heartbeat[HEARTBEAT_PENDING] = float(pending)
        self.heartbeat[HEARTBEAT_PUBLISHED] = time.monotonic()  # last: the others are current

    def on_scheduler_failure(self, exc: BaseException) -> None:
        # scheduler thread: the service's supervisor and tests look for this line
        log.critical("engine scheduler died; exiting", extra={"fields": {"error": repr(exc)}})
        self.failed.set()
        self.outbox.put(None)  # wake the I/O loop

    def request_stop(self) -> None:
        self.stopping.set()
        self.outbox.put(None)

    def _reply(self, identity: bytes, rid: str, received: float, future: Future[Transcript]) -> None:
        published = time.monotonic()
        with self._in_flight_lock:
            self._in_flight -= 1
        if future.cancelled():
            header = (rid, ipc.CANCELLED, "", received, published)
            self.outbox.put([identity, ipc.FAILED, ipc.dump(header)])
            return
        exc = future.exception()
        if exc is not None:
            kind, message = ipc.failure_kind(exc)
            self.outbox.put([identity, ipc.FAILED, ipc.dump((rid, kind, message, received, published))])
        else:
            self.outbox.put([identity, ipc.DONE, ipc.dump((rid, future.result(), received, published))])

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, kind = frames[0].bytes, frames[1].bytes
        if kind == ipc.SUBMIT:
            received = time.monotonic()
            rid, options, ready_time = ipc.load(frames[2].buffer)
            assert isinstance(options, DecodeOptions)
            # zero-copy: the array reads the frame's buffer (kept alive by the array's base)
            audio = np.frombuffer(frames[3].buffer, dtype=np.float32)
            try:
                handle = self.engine.submit(audio, options, ready_time=ready_time, request_id=rid)
            except Exception as e:
                kind_, message = ipc.failure_kind(e)
                header = (rid, kind_, message, received, time.monotonic())
                self.socket.send_multipart([identity, ipc.FAILED, ipc.dump(header)])
                return
            with self._in_flight_lock:
                self._in_flight += 1
            handle.future.add_done_callback(functools.partial(self._reply, identity, rid, received))
        elif kind == ipc.CANCEL:
            self.engine.cancel(ipc.load(frames[2].buffer))
        elif kind == ipc.STATS:
            token = frames[2].bytes
            self.socket.send_multipart([identity, ipc.STATS, token, ipc.dump(self.engine.stats())])
        elif kind == ipc.HELLO:
            hello = (self.engine.info, self.engine.config.max_queue)
            self.socket.send_multipart([identity, ipc.HELLO, ipc.dump(hello)])
        else:
            log.error("unknown IPC message kind", extra={"fields": {"kind": repr(kind)}})

    def _flush(self) -> None:
        for item in self.outbox.drain():
            if item is not None:
                self.socket.send_multipart(item, copy=False)

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
        # Stop the scheduler (it fails whatever is still queued with EngineStopped), then send those
        # last replies before the socket closes.
        self.engine.stop()
        self._flush()
        return EXIT_SCHEDULER_DIED if self.failed.is_set() else EXIT_STOPPED


def serve(
    config: EngineConfig,
    address: str,
    ready: Connection,
    heartbeat: MutableSequence[float] | None = None,
    stop_signal: int = signal.SIGTERM,
) -> int:
    """The engine process's life: load and warm the model, report ready (or failed) on `ready`, then
    serve `address` until `stop_signal` (asr-server's supervisor sends its own: service/supervisor.py)
    or a scheduler failure, publishing into `heartbeat` (see the module docstring). Returns the
    process's exit code."""
    core: EngineCore | None = None
    stop_early = threading.Event()

    def on_stop_signal(signum: int, frame: object) -> None:
        if core is not None:
            core.request_stop()
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
    socket.bind(address)
    core = EngineCore(engine, socket, heartbeat)
    engine.start(on_failure=core.on_scheduler_failure)
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
    core.publish_heartbeat()  # current before the supervisor starts watching it
    ready.send(("ready", engine.info, time.perf_counter() - started))
    try:
        return core.run()
    finally:
        socket.close()
        context.term()
        core.outbox.close()

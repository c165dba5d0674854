"""The wire between frontend processes and the engine process (ZeroMQ over a Unix socket).

One ROUTER socket in the engine process; one DEALER per frontend (its identity names the frontend).
Every message is multipart: a one-byte kind, a small pickled header, and for a submission the audio
as a third frame of raw float32 samples, sent and received without a copy. Pickle is safe here
because both ends are processes of this same server, talking over a socket in a private (0700)
directory; it is never exposed on a network port.

frontend -> engine                        engine -> frontend
  HELLO                                     HELLO  (ModelInfo, max_queue)
  SUBMIT (rid, options, ready_time) audio   DONE   (rid, Transcript, received, published)
  CANCEL (rid)                              FAILED (rid, kind, message, received, published)
  STATS  (token)                            STATS  (token, stats)

Times are `time.monotonic()`, one clock for every process on the machine (CLOCK_MONOTONIC), so the
frontend can tell its IPC time from the engine's time.

Exceptions cross as (kind, message) and are raised again on the frontend as the same types.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
from typing import Any

from engine.api import EngineOverloaded, EngineStopped

HELLO, SUBMIT, CANCEL, STATS, DONE, FAILED = b"H", b"S", b"C", b"T", b"D", b"F"

# FAILED kinds
OVERLOADED, STOPPED, INVALID, CANCELLED, ERROR = "overloaded", "stopped", "invalid", "cancelled", "error"


class RemoteEngineError(RuntimeError):
    """An utterance failed inside the engine process with an exception of no engine-specific type
    (the frontend answers INTERNAL, as for an in-process failure). `remote_type` names the original."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type


def dump(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def load(data: bytes | memoryview) -> Any:
    return pickle.loads(data)


def failure_kind(exc: BaseException) -> tuple[str, str]:
    """(kind, message) for an exception raised by the engine, to cross the process boundary."""
    if isinstance(exc, EngineOverloaded):
        return OVERLOADED, str(exc)
    if isinstance(exc, EngineStopped):
        return STOPPED, str(exc)
    if isinstance(exc, ValueError):
        return INVALID, str(exc)
    return ERROR, f"{type(exc).__name__}|{exc}"


def failure_exception(kind: str, message: str) -> BaseException:
    """The exception the frontend raises for a (kind, message) from the engine process."""
    if kind == OVERLOADED:
        return EngineOverloaded(message)
    if kind == STOPPED:
        return EngineStopped(message)
    if kind == INVALID:
        return ValueError(message)
    remote_type, _, text = message.partition("|")
    return RemoteEngineError(remote_type, text)


class Mailbox:
    """Hands messages from any thread to the one thread that owns a ZeroMQ socket (sockets are not
    thread-safe). The owner polls `fd` alongside its socket; `put` writes a byte to wake it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    @property
    def fd(self) -> int:
        return self._read

    def put(self, item: Any) -> None:
        self._queue.put(item)
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the owner will drain the queue anyway
        except OSError:
            pass  # closed: the owner is gone

    def drain(self) -> list[Any]:
        try:
            while os.read(self._read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)

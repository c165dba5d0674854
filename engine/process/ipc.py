"""The wire between frontend processes and the engine process (ZeroMQ over a Unix socket).

One ROUTER socket in the engine process; one DEALER per frontend (its identity names the frontend).
Every message is multipart: a one-byte kind, then raw frames (request ids as UTF-8, tokens) and small
pickled headers; a submission carries the audio as a last frame of raw float32 samples, sent and
received without a copy. The request id travels in its own frame, so that a message whose header
cannot be read is still answered FAILED for its request.

frontend -> engine                           engine -> frontend
  HELLO  nonce                                 HELLO  (ModelInfo, max_queue)
  SUBMIT rid (options, ready_time) audio       DONE   rid (Transcript, received, published)
  CANCEL rid                                   FAILED rid (kind, message, received, published)
  STATS  token                                 STATS  token stats
  CHECK  token rid...                          CHECK  token rid...  (those asked about it does not hold)
  BYE                                          PING   (is this frontend still connected?)

Sessions. A HELLO opens a session for the sender's identity, named by the nonce the client drew for
itself; every utterance belongs to the session that submitted it. The engine ends a session, and
cancels what it still holds (waiting or in a KV slot), when its frontend says BYE, when its
connection is gone (a PING to it finds no route: its process ended, closing its socket), or when a HELLO with another nonce arrives under the same identity (a restart).

Neither end trusts the other's messages: a message with frames missing or extra, an unknown kind, an
unreadable request id or header, audio that is not whole finite float32 samples, a request id already
in use, or work from a peer with no session is counted (asr_ipc_malformed_total{receiver,reason}),
logged and dropped, and answered FAILED where its request id can be read. Headers are unpickled by
`load`, which builds only the engine's own data classes (engine.parameters, engine.outputs,
engine.errors): a crafted pickle cannot call anything. The socket sits in a private (0700) directory,
never on a network port.

Lost replies. A frontend asks (CHECK), every CHECK_INTERVAL_S, about the utterances it has been waiting
on for at least that long; the engine names those it no longer holds. Replies and the CHECK answer
travel in order on one connection, so an utterance named there and still unanswered lost its reply:
it fails (ReplyLost) within about two intervals of being lost. An utterance the engine still holds is
the engine's to finish however long it waits (recorded work may wait behind live calls); an engine
that stops making progress is the supervisor's to end (--engine-heartbeat-timeout).

Times are `time.monotonic()`, one clock for every process on the machine (CLOCK_MONOTONIC), so the
frontend can tell its IPC time from the engine's time.

Exceptions cross as (kind, message) and are raised again on the frontend as the same types.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import math
import os
import pickle
import queue
from typing import Any

import numpy as np

from engine.api import EngineOverloaded, EngineStopped
from engine.outputs import Transcript
from engine.parameters import DecodeOptions

HELLO, SUBMIT, CANCEL, STATS, CHECK, BYE = b"H", b"S", b"C", b"T", b"K", b"B"
DONE, FAILED, PING = b"D", b"F", b"P"

# FAILED kinds
OVERLOADED, STOPPED, INVALID, CANCELLED, ERROR = "overloaded", "stopped", "invalid", "cancelled", "error"

CHECK_INTERVAL_S = 1.0  # how often a frontend asks about replies it has waited on this long
MAX_REQUEST_ID_BYTES = 256
MAX_NONCE_BYTES = 64
# Modules whose data classes headers may hold: the only globals `load` resolves.
_HEADER_MODULES = ("engine.parameters", "engine.outputs", "engine.errors")


class RemoteEngineError(RuntimeError):
    """An utterance failed inside the engine process with an exception of no engine-specific type
    (the frontend answers INTERNAL, as for an in-process failure). `remote_type` names the original."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type


class ReplyLost(RuntimeError):
    """The engine process holds no such utterance and sent no reply for it (see "Lost replies")."""


class Malformed(Exception):
    """A message that breaks the protocol. `reason` labels asr_ipc_malformed_total (one of
    engine.metrics.IPC_MALFORMED_REASONS); `rid` is its request id where one could be read: it is then
    answered FAILED with `kind`, by default ERROR (the frontend raises RemoteEngineError("malformed"):
    INTERNAL, for the server broke the protocol, not the gRPC client)."""

    def __init__(self, reason: str, message: str, rid: str | None = None, kind: str = ERROR) -> None:
        super().__init__(message)
        self.reason, self.rid, self.kind = reason, rid, kind

    def failed_message(self) -> str:
        """The FAILED header's message for this `kind` (failure_exception reads it back)."""
        return f"malformed|{self}" if self.kind == ERROR else str(self)


# Classes beyond the data classes and enums that a header may carry: their __setstate__ takes plain
# values only (ModelInfo.prompts, so that a frontend counts prompt tokens with the engine's tokenizer).
_CARRIED_CLASSES = frozenset({("engine.decoding.prompt", "PromptEncoder")})


class _HeaderUnpickler(pickle.Unpickler):
    """Resolves only the data classes and enums of engine.parameters, engine.outputs and engine.errors, and
    _CARRIED_CLASSES: a pickle naming anything else (a function to call, another module's class) is
    refused before it can run."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CARRIED_CLASSES:
            return getattr(importlib.import_module(module), name)
        if module in _HEADER_MODULES and name.isidentifier():
            obj = getattr(importlib.import_module(module), name, None)
            if (
                isinstance(obj, type)
                and obj.__module__ == module
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
            ):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not a type the IPC carries")


def dump(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def load(data: bytes | memoryview) -> Any:
    """Unpickle a header built by `dump` from the engine's own types only (see _HeaderUnpickler)."""
    return _HeaderUnpickler(io.BytesIO(data)).load()


def load_header(data: bytes | memoryview, what: str, rid: str | None = None) -> Any:
    """`load`, any failure raised as Malformed("header") naming `what`."""
    try:
        return load(data)
    except Exception as e:
        raise Malformed("header", f"{what}: unreadable header ({type(e).__name__}: {e})", rid) from e


def request_id(frame: bytes) -> str:
    """A request id frame: 1-MAX_REQUEST_ID_BYTES bytes of UTF-8."""
    try:
        rid = frame.decode()
    except UnicodeDecodeError:
        rid = ""
    if not rid or len(frame) > MAX_REQUEST_ID_BYTES:
        raise Malformed(
            "request_id", f"request id must be 1-{MAX_REQUEST_ID_BYTES} bytes of UTF-8 (got {frame[:32]!r})"
        )
    return rid


def _is_time(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)


def submit_header(data: bytes | memoryview, rid: str) -> tuple[DecodeOptions, float]:
    """A SUBMIT's (options, ready_time)."""
    header = load_header(data, f"SUBMIT {rid}", rid)
    if (
        not isinstance(header, tuple)
        or len(header) != 2
        or not isinstance(header[0], DecodeOptions)
        or not _is_time(header[1])
    ):
        raise Malformed("header", f"SUBMIT {rid}: the header must be (DecodeOptions, ready_time)", rid)
    return header[0], float(header[1])


def audio_samples(buffer: memoryview, rid: str) -> np.ndarray:
    """A SUBMIT's audio frame as float32 samples, read in place (no copy)."""
    if buffer.nbytes % 4:
        raise Malformed(
            "audio",
            f"SUBMIT {rid}: the audio frame holds {buffer.nbytes} bytes, not whole float32 samples "
            "(a multiple of 4 bytes)",
            rid,
        )
    samples = np.frombuffer(buffer, dtype=np.float32)
    if not np.isfinite(samples).all():  # NaN would poison the utterance's every log-mel frame
        raise Malformed("audio", f"SUBMIT {rid}: the audio holds samples that are NaN or infinite", rid)
    return samples


def reply_header(data: bytes | memoryview, kind: bytes, rid: str) -> tuple[Any, ...]:
    """A DONE's (Transcript, received, published) or a FAILED's (kind, message, received, published)."""
    header = load_header(data, f"{kind.decode(errors='replace')} {rid}", rid)
    if kind == DONE:
        shape_ok = isinstance(header, tuple) and len(header) == 3 and isinstance(header[0], Transcript)
    else:
        shape_ok = (
            isinstance(header, tuple)
            and len(header) == 4
            and isinstance(header[0], str)
            and isinstance(header[1], str)
        )
    if not shape_ok or not all(_is_time(t) for t in header[-2:]):
        raise Malformed("header", f"{kind.decode(errors='replace')} {rid}: not a reply header", rid)
    return tuple(header)


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

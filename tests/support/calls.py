"""StreamingRecognize calls for tests that must see the server's own status, whatever the timing.

A request iterator handed to grpc.aio turns the server's status into INTERNAL "Internal error from
Core" when a write races the server ending the call (grpc/grpc#36066): a refusal would look like a
crash. Here each request is written through the call's core object, a failed write just stops the
writing, and the status comes from the call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

Request = asr_pb2.StreamingRecognizeRequest
Response = asr_pb2.StreamingRecognizeResponse
_CORE_ERROR: type[Exception] = importlib.import_module("grpc._cython.cygrpc").InternalError
# The status of a call whose write failed can take a moment to arrive; never wait forever for it.
STATUS_WAIT_S = 30.0


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[Response] = field(default_factory=list)
    sent_all: bool = False
    ended_at: float = 0.0  # time.monotonic() when the status arrived

    @property
    def finals(self) -> list[asr_pb2.StreamingRecognitionResult]:
        return [r for x in self.responses for r in x.results if r.is_final]

    @property
    def text(self) -> str:
        return " ".join(r.alternatives[0].transcript for r in self.finals if r.alternatives)

    def events(self, kind: int) -> int:
        return sum(1 for x in self.responses if x.speech_event_type == kind)


def config_request(
    encoding: int = asr_pb2.LINEAR16, sample_rate_hertz: int = 16000, **config: Any
) -> Request:
    return Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(
                encoding=encoding,  # type: ignore[arg-type]
                sample_rate_hertz=sample_rate_hertz,
                **config,
            )
        )
    )


def audio_requests(data: bytes, chunk_bytes: int = 640) -> list[Request]:
    return [Request(audio_content=data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


async def _write(call: Any, request: Request) -> bool:
    """False once the call has ended (its status then tells why)."""
    if call.done():
        return False
    core = getattr(call, "_cython_call", None)
    try:
        if core is not None and hasattr(core, "send_serialized_message"):
            await core.send_serialized_message(request.SerializeToString())
        else:
            await call.write(request)
    except (_CORE_ERROR, asyncio.InvalidStateError):
        return False
    return True


async def run_stream(
    channel: aio.Channel,
    requests: Iterable[Request] | AsyncIterable[Request],
    *,
    metadata: tuple[tuple[str, str], ...] = (),
    deadline_s: float | None = 120.0,
    half_close: bool = True,
) -> Outcome:
    """Send `requests` (then half-close), read every response; the server's status, never an exception."""
    call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(metadata=metadata, timeout=deadline_s)
    out = Outcome(grpc.StatusCode.UNKNOWN, "")

    async def read() -> None:
        async for response in call:
            out.responses.append(response)

    reader = asyncio.create_task(read())
    try:
        sent_all = True
        if isinstance(requests, AsyncIterable):
            async for request in requests:
                if not await _write(call, request):
                    sent_all = False
                    break
        else:
            for request in requests:
                if not await _write(call, request):
                    sent_all = False
                    break
        out.sent_all = sent_all
        if sent_all and half_close:
            with contextlib.suppress(asyncio.InvalidStateError, _CORE_ERROR):
                await call.done_writing()
        try:
            await asyncio.wait_for(reader, STATUS_WAIT_S)
        except aio.AioRpcError:
            pass  # the status is read below
        except TimeoutError:
            call.cancel()  # a call that never ends shows as CANCELLED rather than a hung test
    except BaseException:
        call.cancel()
        raise
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, aio.AioRpcError):
                await reader
    out.code = await call.code()
    out.details = await call.details() or ""
    out.ended_at = time.monotonic()
    return out

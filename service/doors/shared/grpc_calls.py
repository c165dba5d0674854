"""What every gRPC door's streaming call does the same way: wait for its first request (the config) only
so long, read the later requests into its core stream, end that stream and its request reader when the
RPC ends, and turn however the door's handler ends into a status and the code the core counts.

A door keeps only its protocol's own mapping: which request carries what, its responses, and how a
refusal is worded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
from grpc import aio

from service.doors.shared.grpc_status import core_code, grpc_code
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError

log = logging.getLogger("service.doors.grpc_calls")

FIRST_REQUEST_TIMEOUT_S = 10.0  # a stream that sends no config is not kept waiting for it
# What asr.v1, Google and Riva all answer to a config after the first request.
SECOND_CONFIG = "streaming_config may only be sent in the first request; later requests carry audio_content"

R = TypeVar("R")
T = TypeVar("T")


async def first_request(requests: AsyncIterator[R], recognizer: Recognizer, door: str) -> R | None:
    """A stream's first request (None: the client half-closed at once), or INVALID_ARGUMENT, counted
    under `door`, once FIRST_REQUEST_TIMEOUT_S passed without one. Refusals come after it is read, never
    before: a grpc.aio client whose first write races a status reports INTERNAL instead of it
    (grpc/grpc#36066). The config is the first thing any client sends, so this is still at once."""
    try:
        async with asyncio.timeout(FIRST_REQUEST_TIMEOUT_S):
            return await anext(aiter(requests), None)
    except TimeoutError:
        error = RecognitionError(
            Code.INVALID_ARGUMENT,
            f"first request must carry streaming_config; none came within {FIRST_REQUEST_TIMEOUT_S:g} s",
        )
        recognizer.refused(door, error)
        raise error from None


class StreamCall:
    """Ties a core stream, and the task that reads the call's requests into it, to the RPC's life.

    A cancel or deadline that lands while the door's response generator is parked at `yield` (gRPC sending
    a response) ends the RPC without resuming the generator: its `finally` would run only when it is
    garbage-collected, and until then the stream would hold its place and its engine work. The RPC's
    done callback frees them at once."""

    def __init__(self, context: aio.ServicerContext) -> None:
        self._context = context
        self.stream: Stream | None = None
        self.reader: asyncio.Task[None] | None = None

    def attach(self, stream: Stream) -> Stream:
        """The core stream the door opened (once admitted), from now on tied to the RPC."""
        self.stream = stream
        self._context.add_done_callback(self._rpc_done)  # type: ignore[arg-type]
        return stream

    def read(self, reading: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs the door's reader (requests -> stream) as a task, cancelled when the RPC ends."""
        self.reader = asyncio.create_task(reading)
        return self.reader

    async def close(self, code: Code) -> None:
        """The handler's end, however it ended: the reader stops, the stream closes with `code` (how the call
        ended, for the core's metrics)."""
        if self.reader is not None:
            self.reader.cancel()
        if self.stream is not None:
            await self.stream.close(code)

    def _rpc_done(self, context: aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        if self.reader is not None:
            self.reader.cancel()
        if self.stream is not None:
            self.stream.cancel(Code.DEADLINE_EXCEEDED if expired else Code.CANCELLED)


async def serve_stream(
    context: aio.ServicerContext,
    respond: Callable[[StreamCall], AsyncGenerator[T, None]],
    refuse: Callable[[RecognitionError], Awaitable[None]],
) -> AsyncIterator[T]:
    """A streaming RPC's responses: `respond` (the door's: open the stream, attach it to the call, start its
    reader, yield the door's responses), with the same ending for every door. A refusal becomes the door's
    status (`refuse` aborts the call in its protocol's words); the core's stream closes with how the call
    ended (a drain's abort, sent by `respond`, counts as OK)."""
    code = grpc.StatusCode.OK
    call = StreamCall(context)
    try:
        async with contextlib.aclosing(respond(call)) as responses:
            async for response in responses:
                yield response
    except RecognitionError as e:
        code = grpc_code(e.code)
        await refuse(e)
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except aio.AbortError:  # the status is already sent, and `code` says what it meant
        raise
    except Exception:
        code = grpc.StatusCode.UNKNOWN
        raise
    finally:
        await call.close(core_code(code))


async def read_requests(
    stream: Stream, requests: AsyncIterable[R], take: Callable[[R], Awaitable[None]]
) -> None:
    """The requests after the config into the stream (`take`: one request's audio, the door's own), the
    half-close as its end. A RecognitionError from `take` fails this stream with it; a bug of ours fails
    this stream only, loudly."""
    try:
        async for request in requests:
            await take(request)
        stream.finish()  # the client half-closed
    except RecognitionError as e:  # also a request refused before it was parsed (runtime/message_limit.py)
        stream.fail(e)
    except aio.AbortError:
        pass  # the call was already ended with its status: nothing is left to read
    except Exception as e:
        log.exception("stream reader failed", extra={"fields": {"stream_id": stream.id}})
        stream.fail(RecognitionError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}"))

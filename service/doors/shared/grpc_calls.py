"""What every gRPC door's streaming call does the same way: wait for its first request (the config) only
so long, end its core stream and its request reader when the RPC ends, and close them however the door's
handler ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from grpc import aio

from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError

FIRST_REQUEST_TIMEOUT_S = 10.0  # a stream that sends no config is not kept waiting for it

R = TypeVar("R")


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

    def __init__(self, context: aio.ServicerContext, stream: Stream) -> None:
        self.stream = stream
        self.reader: asyncio.Task[None] | None = None
        context.add_done_callback(self._rpc_done)  # type: ignore[arg-type]

    def read(self, reading: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs the door's reader (requests -> stream) as a task, cancelled when the RPC ends."""
        self.reader = asyncio.create_task(reading)
        return self.reader

    async def close(self, code: Code) -> None:
        """The handler's end, however it ended: the reader stops, the stream closes with `code` (how the call
        ended, for the core's metrics)."""
        if self.reader is not None:
            self.reader.cancel()
        await self.stream.close(code)

    def _rpc_done(self, context: aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        if self.reader is not None:
            self.reader.cancel()
        self.stream.cancel(Code.DEADLINE_EXCEEDED if expired else Code.CANCELLED)

"""What every gRPC door's streaming call does the same way: end its core stream and its request reader
when the RPC ends, and close them however the door's handler ends."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from grpc import aio

from service.core.errors import Code
from service.core.recognizer import Stream


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

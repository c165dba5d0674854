"""A live stream's events on their way to its door: queued in order, bounded in bytes, and the status the
stream ends with.

The writer (`events()`, iterated by the door) hands over whatever is queued, at the client's pace. A client
that does not read cannot grow the queue past --max-response-backlog-bytes (event_size): past it the
stream is shed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from service import metrics
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import CallEvent, CallMetricsReport, Result


def event_size(event: CallEvent) -> int:
    """About the bytes an event takes on any door's wire: its text, and 8 bytes per number it carries
    (what --max-response-backlog-bytes counts)."""
    if isinstance(event, CallMetricsReport):
        return 32 + 40 * len(event.metrics.channels)
    if not isinstance(event, Result):
        return 16
    words = sum(len(w.text.encode()) + 24 for w in event.words)
    segments = sum(len(s.text.encode()) + 16 for s in event.segments)
    return 48 + len(event.transcript.encode()) + len(event.language) + words + segments


@dataclass
class _Out:
    """A queued event, its size (event_size), and what to record once the door has sent it."""

    event: CallEvent
    on_sent: Callable[[], None] | None = None
    size: int = 0


class Outbox:
    def __init__(self, max_backlog_bytes: int, shed: Callable[[], None]) -> None:
        """`max_backlog_bytes`: --max-response-backlog-bytes; `shed`: stops the stream's work at once
        (the session's abandon) when the client has fallen that far behind."""
        self._max_backlog_bytes = max_backlog_bytes
        self._stop = shed
        # None tells the writer to end the stream, with end_status (None: OK)
        self._queue: asyncio.Queue[_Out | None] = asyncio.Queue()
        self._backlog = 0  # serialized bytes of the responses queued
        self._closed = False
        self.end_status: RecognitionError | None = None

    async def events(self) -> AsyncIterator[CallEvent]:
        """Yields events until the stream is over; raises RecognitionError to end it with that code."""
        while True:
            item = await self._queue.get()
            if item is None:
                if self.end_status is not None:
                    raise self.end_status
                return
            self._count_backlog(-item.size)
            yield item.event
            if item.on_sent is not None:
                item.on_sent()

    @property
    def backlog_bytes(self) -> int:
        """Bytes (event_size) of the events queued for the client and not yet taken by the door."""
        return self._backlog

    def put(self, event: CallEvent, on_sent: Callable[[], None] | None = None) -> None:
        if self._closed:
            return  # the call is over (or was shed for its backlog): nothing more goes out
        item = _Out(event, on_sent, event_size(event))
        self._queue.put_nowait(item)
        self._count_backlog(item.size)
        if self._backlog > self._max_backlog_bytes:
            metrics.refused("max_response_backlog_bytes")
            self._shed()

    def keep_first_status(self, error: RecognitionError) -> None:
        """The stream will end with `error`, unless a status is already set."""
        if self.end_status is None:
            self.end_status = error

    def end(self) -> None:
        """The writer ends the stream, with end_status, once it has handed over what is queued."""
        self._queue.put_nowait(None)

    def close(self) -> None:
        """The call is over: what is queued is never sent, and nothing more is queued."""
        self._closed = True
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                self._count_backlog(-item.size)

    def _count_backlog(self, change: int) -> None:
        self._backlog += change
        metrics.RESPONSE_BACKLOG_BYTES.inc(change)

    def _shed(self) -> None:
        """The client has fallen --max-response-backlog-bytes behind reading: stop its work at once (engine
        requests, tasks), drop what is queued, and end the stream RESOURCE_EXHAUSTED. The status reaches the
        client after what HTTP/2 already carries, once it reads again."""
        self.end_status = RecognitionError(
            Code.RESOURCE_EXHAUSTED,
            f"the client is {self._backlog} bytes of responses behind reading, over the limit of "
            f"{self._max_backlog_bytes} bytes (max_response_backlog_bytes); read responses as they come",
        )
        self._stop()
        self.end()  # the writer ends the call with the error once the door takes it

"""The life of one stream, as one enum instead of a set of flags."""

from __future__ import annotations

import enum


class StreamState(enum.Enum):
    """Where a stream is. Only forward moves are allowed (see `StreamState.can_become`)."""

    OPEN = "open"  # audio is read, endpointed and submitted
    # No more audio is processed (half-close, drain, single utterance, a limit, an engine refusal): the
    # utterances already admitted get their finals, then the stream ends with its end status.
    FINISHING = "finishing"
    ENDED = "ended"  # every final is queued; the writer ends the stream with the end status
    FAILED = "failed"  # ends now with an error status, after what is already queued
    CLOSED = "closed"  # the call is over: its engine slots are freed and its tasks stopped

    @property
    def takes_audio(self) -> bool:
        return self is StreamState.OPEN

    @property
    def ending(self) -> bool:
        """The writer has been told to stop (or the call is gone): nothing more may be queued to end it."""
        return self in (StreamState.ENDED, StreamState.FAILED, StreamState.CLOSED)

    def can_become(self, new: StreamState) -> bool:
        return new in _NEXT[self]


_NEXT: dict[StreamState, frozenset[StreamState]] = {
    StreamState.OPEN: frozenset({StreamState.FINISHING, StreamState.FAILED, StreamState.CLOSED}),
    StreamState.FINISHING: frozenset({StreamState.ENDED, StreamState.FAILED, StreamState.CLOSED}),
    StreamState.ENDED: frozenset({StreamState.CLOSED}),
    StreamState.FAILED: frozenset({StreamState.CLOSED}),
    StreamState.CLOSED: frozenset(),
}

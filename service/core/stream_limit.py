"""--max-streams: the server's limit on open streams (every door's), one count for all its processes.

In-process (tests, embedding) the count is a plain integer. asr-server's frontends share one count
through shared memory the supervisor creates (`SharedStreamCounts`): each frontend keeps the number of
streams it holds in its own slot, and a stream is admitted when the sum over every slot is below the
limit, checked and counted under an exclusive flock(2) on a file beside it, so two frontends can never
both take the last place. Why these parts: the kernel releases a dead process's flock (a lock in shared
memory held by a frontend that dies would stay taken for good), and a dead frontend's streams are one
slot the supervisor zeroes before it starts the frontend's successor, so its places come back at once
and exactly, whenever it died.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, MutableSequence
from dataclasses import dataclass


class StreamLimit:
    """Open streams of this process against `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open = 0

    def try_acquire(self) -> bool:
        """Take a place; False (nothing taken) when the limit is reached."""
        if self._open >= self.limit:
            return False
        self._open += 1
        return True

    def release(self) -> None:
        self._open -= 1


@dataclass
class SharedStreamCounts:
    """What the supervisor hands every frontend: one slot per frontend in shared memory (a
    multiprocessing Array of C ints) and the lock file that orders admissions."""

    slots: MutableSequence[int]
    lock_path: str

    def clear(self, index: int) -> None:
        """The frontend in `index` is dead (the supervisor has reaped it): its streams are gone."""
        self.slots[index] = 0


class SharedStreamLimit(StreamLimit):
    """One frontend's view of the server's count (see the module docstring)."""

    def __init__(self, limit: int, counts: SharedStreamCounts, index: int) -> None:
        super().__init__(limit)
        self._slots = counts.slots
        self._index = index
        self._lock_fd = os.open(counts.lock_path, os.O_RDWR | os.O_CLOEXEC)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held for a few microseconds by whoever has it
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def try_acquire(self) -> bool:
        with self._locked():
            if sum(self._slots) >= self.limit:
                return False
            self._slots[self._index] += 1
            return True

    def release(self) -> None:
        # under the lock as well: it orders this write before the next admission reads the slots
        with self._locked():
            self._slots[self._index] -= 1

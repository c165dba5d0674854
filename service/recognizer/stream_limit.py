"""--max-streams: the server's limit on open streams (every door's), one count for all its processes; and
--max-streams-per-token: each caller's share of it (a caller is a token's fingerprint, Identity.principal).

In-process (tests, embedding) the count is a plain integer. asr-server's frontends share one count
through shared memory the supervisor creates (`SharedStreamCounts`): each frontend keeps the number of
streams it holds in its own slot, and a stream is admitted when the sum over every slot is below the
limit, checked and counted under an exclusive flock(2) on a file beside it, so two frontends can never
both take the last place. The per-caller counts live beside them: a table of buckets keyed by a hash of
the caller, each bucket one count per frontend, found by linear probing under the same lock (a bucket
whose counts are all zero is free again). Why these parts: the kernel releases a dead process's flock (a lock in shared
memory held by a frontend that dies would stay taken for good), and a dead frontend's streams are one
slot the supervisor zeroes before it starts the frontend's successor, so its places come back at once
and exactly, whenever it died.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator, MutableSequence
from dataclasses import dataclass

MAX_STREAMS = "max_streams"
MAX_STREAMS_PER_TOKEN = "max_streams_per_token"


class StreamLimit:
    """Open streams of this process against `limit`, and each caller's against `per_caller` (0: none)."""

    def __init__(self, limit: int, per_caller: int = 0) -> None:
        self.limit = limit
        self.per_caller = per_caller
        self._open = 0
        self._by_caller: dict[str, int] = {}

    def take(self, caller: str = "") -> str | None:
        """Take a place: None when taken, else (nothing taken) the flag of the limit that is reached. An anonymous
        caller ("") counts against the server's limit only."""
        if self._open >= self.limit:
            return MAX_STREAMS
        if self.per_caller and caller:
            if self._by_caller.get(caller, 0) >= self.per_caller:
                return MAX_STREAMS_PER_TOKEN
            self._by_caller[caller] = self._by_caller.get(caller, 0) + 1
        self._open += 1
        return None

    def release(self, caller: str = "") -> None:
        self._open -= 1
        if self.per_caller and caller:
            left = self._by_caller.pop(caller, 1) - 1
            if left:
                self._by_caller[caller] = left


@dataclass
class SharedStreamCounts:
    """What the supervisor hands every frontend: one slot per frontend in shared memory (a
    multiprocessing Array of C ints), the per-caller table (`caller_keys`: a bucket's caller hash, 0 never
    used; `caller_counts`: frontends x buckets) and the lock file that orders admissions."""

    slots: MutableSequence[int]
    lock_path: str
    caller_keys: MutableSequence[int]
    caller_counts: MutableSequence[int]

    def clear(self, index: int) -> None:
        """The frontend in `index` is dead (the supervisor has reaped it): its streams are gone."""
        self.slots[index] = 0
        buckets = len(self.caller_keys)
        for b in range(buckets):
            self.caller_counts[index * buckets + b] = 0


def caller_buckets(max_streams: int) -> int:
    """Buckets enough for every caller holding a stream at once (each holds at least one), twice over."""
    return max(64, 2 * max_streams)


class SharedStreamLimit(StreamLimit):
    """One frontend's view of the server's count (see the module docstring)."""

    def __init__(self, limit: int, counts: SharedStreamCounts, index: int, per_caller: int = 0) -> None:
        super().__init__(limit, per_caller)
        self._slots = counts.slots
        self._keys = counts.caller_keys
        self._counts = counts.caller_counts
        self._frontends = len(counts.slots)
        self._index = index
        self._lock_fd = os.open(counts.lock_path, os.O_RDWR | os.O_CLOEXEC)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held for a few microseconds by whoever has it
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _held(self, bucket: int) -> int:
        n = len(self._keys)
        return sum(self._counts[f * n + bucket] for f in range(self._frontends))

    def _bucket(self, caller: str) -> int:
        """The caller's bucket (under the lock): its own, else the first free one on its probe path."""
        key = int.from_bytes(hashlib.sha256(caller.encode()).digest()[:8], "little", signed=True) or 1
        n = len(self._keys)
        free = -1
        for i in range(n):
            b = (key + i) % n
            if self._keys[b] == key:
                return b
            if free < 0 and (self._keys[b] == 0 or self._held(b) == 0):
                free = b
            if self._keys[b] == 0:
                break
        assert free >= 0, "more callers hold streams than there are streams"
        self._keys[free] = key
        return free

    def take(self, caller: str = "") -> str | None:
        with self._locked():
            if sum(self._slots) >= self.limit:
                return MAX_STREAMS
            if self.per_caller and caller:
                b = self._bucket(caller)
                if self._held(b) >= self.per_caller:
                    return MAX_STREAMS_PER_TOKEN
                self._counts[self._index * len(self._keys) + b] += 1
            self._slots[self._index] += 1
            return None

    def release(self, caller: str = "") -> None:
        # under the lock as well: it orders this write before the next admission reads the slots
        with self._locked():
            self._slots[self._index] -= 1
            if self.per_caller and caller:
                self._counts[self._index * len(self._keys) + self._bucket(caller)] -= 1

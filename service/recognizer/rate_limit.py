"""A token bucket: the per-stream bound on how often a client may ask for costly work (keyterm updates,
control messages), so that one stream's flood costs only that stream."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """`rate` actions per second on average, `burst` at once; rate 0 means no limit."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self) -> bool:
        """One action now: True if the bucket allows it (and counts it), False past the limit."""
        if self.rate <= 0:
            return True
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

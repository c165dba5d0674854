"""Waiting on a condition in a test with a deadline, so that a test whose condition never comes fails
at once naming it, instead of spinning until the suite's global timeout."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], within_s: float, what: str, poll_s: float = 0.001) -> None:
    """Poll `predicate` (from this thread) until it is true; fail after `within_s` seconds naming `what`."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within_s:g} s: {what}"
        time.sleep(poll_s)

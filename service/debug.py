"""Test-only fault injection, reachable from the command line so that a subprocess server can be broken
from outside. Off by default; never set in a deployment.

--debug-crash-scheduler-after N: the engine's scheduler thread dies (a BaseException, which its loop
does not survive) at the encoder pass of utterance N+1, the warm-up utterance counting as the first.
It proves that a dead scheduler turns health NOT_SERVING and ends the process non-zero.
"""

from __future__ import annotations

import itertools
import logging

from engine import Engine
from engine.request import Request

log = logging.getLogger("service.debug")


class InjectedSchedulerCrash(BaseException):
    """Raised on the scheduler thread by --debug-crash-scheduler-after (a BaseException, so that the
    per-utterance `except Exception` paths do not catch it: it stands for a crash, not a bad input)."""


def crash_scheduler_after(engine: Engine, n: int) -> None:
    counter = itertools.count(1)

    def hook(req: Request) -> None:
        if next(counter) > n:
            raise InjectedSchedulerCrash(f"--debug-crash-scheduler-after {n}: utterance {req.id}")

    # The scheduler's own test seam (engine/scheduler.py), called per request at its encoder pass.
    engine._scheduler.fault_hook = hook
    log.warning("TEST ONLY: the scheduler will crash", extra={"fields": {"after_utterances": n}})

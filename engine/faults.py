"""Test-only fault injection inside the engine, reachable from the command line (EngineConfig's hidden
`debug_crash_scheduler_after`) so that a subprocess server can be broken from outside. Off by default;
never set in a deployment. Applied where the engine runs: with asr-server's engine process, there.

--debug-crash-scheduler-after N: the scheduler thread dies (a BaseException, which its loop does not
survive) at the encoder pass of utterance N+1, the warm-up utterance counting as the first. It proves
that a dead scheduler turns health NOT_SERVING and ends the server non-zero.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler import Scheduler

log = logging.getLogger("engine.faults")


class InjectedSchedulerCrash(BaseException):
    """Raised on the scheduler thread by --debug-crash-scheduler-after (a BaseException, so that the
    per-utterance `except Exception` paths do not catch it: it stands for a crash, not a bad input)."""


def crash_scheduler_after(scheduler: Scheduler, n: int) -> None:
    counter = itertools.count(1)

    def hook(req: Request) -> None:
        if next(counter) > n:
            raise InjectedSchedulerCrash(f"--debug-crash-scheduler-after {n}: utterance {req.id}")

    # The scheduler's own test seam, called per request at its encoder pass.
    scheduler.fault_hook = hook
    log.warning("TEST ONLY: the scheduler will crash", extra={"fields": {"after_utterances": n}})

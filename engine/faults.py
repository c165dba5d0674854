"""Test-only fault injection inside the engine, reachable from the command line (EngineConfig's hidden
`debug_crash_scheduler_after`) so that a subprocess server can be broken from outside. Off by default;
never set in a deployment. Applied where the engine runs: with asr-server's engine process, there.

--debug-crash-scheduler-after N: the scheduler thread dies (a BaseException, which its loop does not
survive) at the encoder pass of utterance N+1, the warm-up utterance counting as the first. It proves
that a dead scheduler turns health NOT_SERVING and ends the server non-zero.

--debug-hang-scheduler-after N: the scheduler thread blocks for ever at the encoder pass of utterance
N+1 (a stuck device call, a deadlock): the process lives on and its I/O thread still answers. It
proves that the supervisor's heartbeat watch (--engine-heartbeat-timeout) ends a hung engine.

--debug-slow-encoder-s S: every encoder pass takes S seconds longer (a slow but live engine, such as a
large batch on a CPU): it proves that the heartbeat watch does not take slowness for a hang.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
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


def hang_scheduler_after(scheduler: Scheduler, n: int) -> None:
    counter = itertools.count(1)
    never = threading.Event()

    def hook(req: Request) -> None:
        if next(counter) > n:
            log.warning("TEST ONLY: the scheduler hangs", extra={"fields": {"utterance": req.id}})
            never.wait()

    scheduler.fault_hook = hook
    log.warning("TEST ONLY: the scheduler will hang", extra={"fields": {"after_utterances": n}})


def slow_encoder(scheduler: Scheduler, seconds: float) -> None:
    def hook(stage: str, reqs: list[Request]) -> None:
        if stage == "encoder":  # once per encoder pass, whatever its batch
            time.sleep(seconds)

    # The scheduler's per-stage test seam.
    scheduler.stage_hook = hook
    log.warning("TEST ONLY: every encoder pass is slowed", extra={"fields": {"seconds": seconds}})

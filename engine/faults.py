"""Test-only fault injection inside the engine, reachable from the command line (EngineConfig's hidden
`debug_crash_scheduler_after`) so that a subprocess server can be broken from outside. Off by default;
never set in a deployment. Applied where the engine runs (with asr-server's engine process, there),
through the engine's own test seams (engine/hooks.py), which `install` fills from the config.

--debug-crash-scheduler-after N: the engine's loop thread dies (a BaseException, which its loop does not
survive) at the encoder pass of utterance N+1, the warm-up utterance counting as the first. It proves
that a dead scheduler turns health NOT_SERVING and ends the server non-zero.

--debug-hang-scheduler-after N: the engine's loop thread blocks for ever at the encoder pass of utterance
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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from engine.config import EngineConfig
from engine.hooks import EngineHooks

if TYPE_CHECKING:
    from engine.scheduling.request import Request

log = logging.getLogger("engine.faults")
T = TypeVar("T")


class InjectedSchedulerCrash(BaseException):
    """Raised on the engine's loop thread by --debug-crash-scheduler-after (a BaseException, so that the
    per-utterance `except Exception` paths do not catch it: it stands for a crash, not a bad input)."""


def install(config: EngineConfig, hooks: EngineHooks) -> None:
    """Set the hooks the config's --debug-* faults ask for (none by default). A fault takes a seam of its
    own: one a test already holds is refused (engine/hooks.py)."""
    if config.debug_crash_scheduler_after:
        hooks.fault = _taken(hooks.fault, crash_after(config.debug_crash_scheduler_after))
    if config.debug_hang_scheduler_after:
        hooks.fault = _taken(hooks.fault, hang_after(config.debug_hang_scheduler_after))
    if config.debug_slow_encoder_s:
        hooks.stage = _taken(hooks.stage, slow_encoder(config.debug_slow_encoder_s))


def _taken(current: object, fault: T) -> T:
    if current is not None:
        raise RuntimeError("a --debug-* fault and a test hook both want the same engine seam")
    return fault


def crash_after(n: int) -> Callable[[Request], None]:
    """The loop thread dies at the encoder pass of utterance n+1 (the engine's fault seam, per request)."""
    counter = itertools.count(1)

    def hook(req: Request) -> None:
        if next(counter) > n:
            raise InjectedSchedulerCrash(f"--debug-crash-scheduler-after {n}: utterance {req.id}")

    log.warning("TEST ONLY: the scheduler will crash", extra={"fields": {"after_utterances": n}})
    return hook


def hang_after(n: int) -> Callable[[Request], None]:
    """The loop thread blocks for ever at the encoder pass of utterance n+1."""
    counter = itertools.count(1)
    never = threading.Event()

    def hook(req: Request) -> None:
        if next(counter) > n:
            log.warning("TEST ONLY: the scheduler hangs", extra={"fields": {"utterance": req.id}})
            never.wait()

    log.warning("TEST ONLY: the scheduler will hang", extra={"fields": {"after_utterances": n}})
    return hook


def slow_encoder(seconds: float) -> Callable[[str, Sequence[object]], None]:
    """Every encoder pass takes `seconds` longer (the engine's stage seam, once per pass)."""

    def hook(stage: str, reqs: Sequence[object]) -> None:
        if stage == "encoder":  # once per encoder pass, whatever its batch
            time.sleep(seconds)

    log.warning("TEST ONLY: every encoder pass is slowed", extra={"fields": {"seconds": seconds}})
    return hook

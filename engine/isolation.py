"""Per-stage failure isolation: an error in one stage fails the requests it belongs to, and the engine
goes on.

`Stages.run(stage, batch, fn)` runs `fn` over the whole batch. On an ordinary exception it runs `fn`
over each request alone, from the same inputs, to find the culprit(s): only they fail (each counted in
`asr_engine_failures_total{stage}`), the others keep the result of their run alone. An error that
leaves the engine unknown (`leaves_engine_unknown`) is never caught: it stops the engine.

The stages of a step (engine/core.py), in order, with the `stage` label each counts under:
  encoder      the encoder pass and the cross-attention K/V (with encoder batching off, each alone)
  prompt       a window's prompt tokens (each request alone)
  prefill      the prompts through the decoder
  rules        the first-token rules (no-speech, language) and the choice of the next token
  decode_step  one decode step of every decoding sequence (a step runs rows 0..n-1 together: a failed
               step fails every sequence in it)
  loop_check   whether a finished window looped (each alone)
  result       the transcript a finished request becomes (each alone)

No torch here (it is looked up only if it is already loaded): the helper is tested without a model.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from engine import metrics as m
from engine.hooks import EngineHooks

log = logging.getLogger("engine.isolation")


def leaves_engine_unknown(exc: BaseException) -> bool:
    """An error after which the engine's state cannot be trusted: not an ordinary Exception (a
    crash, an interrupt), or the accelerator itself failing (a lost device, an illegal memory
    access, a device-side assert), after which every tensor on it is suspect. Anything else stays
    with the requests that raised it."""
    if not isinstance(exc, Exception):
        return True
    torch = sys.modules.get("torch")  # an accelerator error can only come from a loaded torch
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)


class Identified(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T", bound=Identified)
R = TypeVar("R")


class Stages(Generic[T]):
    """Runs the stages of the engine's steps with failure isolation; `fail(item, error)` takes each
    request found at fault (it must not move KV-cache rows: callers index by position until the stage's
    results are used)."""

    def __init__(self, hooks: EngineHooks, fail: Callable[[T, BaseException], None]) -> None:
        self.hooks = hooks
        self.fail = fail

    def run(
        self,
        stage: str,
        batch: Sequence[T],
        fn: Callable[[list[T]], R],
        *,
        together: bool = True,
        alone: bool = True,
    ) -> list[tuple[list[T], R]]:
        """`fn` over `batch` (together: in one call; else one call per request). A failed call over several
        requests is run again for each alone (alone=True), or fails them all (alone=False: a stage that
        cannot run one request alone). Returns each successful call's requests and result, in order."""
        if not batch:
            return []
        if together:
            items = list(batch)
            try:
                return [(items, self._call(stage, items, fn))]
            except Exception as exc:
                if leaves_engine_unknown(exc):
                    raise
                if not alone or len(items) == 1:
                    for item in items:
                        self.failed(stage, item, exc)
                    return []
                log.warning(
                    "stage %s failed for a batch of %d; running each request alone to find the culprit",
                    stage,
                    len(items),
                    exc_info=exc,
                )
        done: list[tuple[list[T], R]] = []
        for item in batch:
            try:
                done.append(([item], self._call(stage, [item], fn)))
            except Exception as exc:
                if leaves_engine_unknown(exc):
                    raise
                self.failed(stage, item, exc)
        return done

    def failed(self, stage: str, item: T, exc: BaseException) -> None:
        """Fail one request for an error in `stage` (found by `run`, or reported by the stage itself);
        re-raise an error that leaves the engine unknown."""
        if leaves_engine_unknown(exc):
            raise exc
        log.error("utterance %s failed in stage %s", item.id, stage, exc_info=exc)
        m.ENGINE_FAILURES.labels(stage).inc()
        self.fail(item, exc)

    def _call(self, stage: str, items: list[T], fn: Callable[[list[T]], R]) -> R:
        if self.hooks.stage is not None:
            self.hooks.stage(stage, items)
        return fn(items)

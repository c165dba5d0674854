"""Test seams, given to the engine as one object: `Engine(config, hooks=EngineHooks(...))`.

Production engines get none (every callback None: one attribute read per seam). A test that needs the
engine to hold still, fail at a chosen place or record what it ran sets these callbacks, all called on
the engine's loop thread except `enqueue`:

  fault(request)          each request as its encoder pass begins, after `stage("encoder", ...)`
                          (raise an Exception to fail it there; block to hold the loop still; a
                          BaseException stands for a crash, which stops the engine)
  stage(name, requests)   as each stage of a step begins, for the requests it runs on (see
                          engine/isolation.py for the stages); raise to inject a fault into that stage
  enqueue(request)        in submit(), on the caller's thread, once the request is admitted and just
                          before it enters the loop's inbox
  closing()               on the loop thread as it stops, before it fails what is left

Nothing here imports torch: a scheduler test builds hooks without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.scheduling.request import Request

FaultHook = Callable[["Request"], None]
StageHook = Callable[[str, Sequence[Any]], None]
EnqueueHook = Callable[["Request"], None]
ClosingHook = Callable[[], None]


@dataclass
class EngineHooks:
    fault: FaultHook | None = None
    stage: StageHook | None = None
    enqueue: EnqueueHook | None = None
    closing: ClosingHook | None = None

    @contextmanager
    def installed(
        self,
        *,
        fault: FaultHook | None = None,
        stage: StageHook | None = None,
        enqueue: EnqueueHook | None = None,
        closing: ClosingHook | None = None,
    ) -> Iterator[EngineHooks]:
        """Set the given callbacks for the block, and clear them after. Refuses to replace one that is
        set: two tests sharing an engine never silently take each other's seam."""
        wanted = {"fault": fault, "stage": stage, "enqueue": enqueue, "closing": closing}
        given = {name: hook for name, hook in wanted.items() if hook is not None}
        taken = [name for name in given if getattr(self, name) is not None]
        if taken:
            raise RuntimeError(f"engine hooks already installed: {', '.join(taken)}")
        for name, hook in given.items():
            setattr(self, name, hook)
        try:
            yield self
        finally:
            for name in given:
                setattr(self, name, None)

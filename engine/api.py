"""The engine's whole public surface: load, start, submit audio, get a future, cancel, stop.

Thread-safe: `submit` and `cancel` may be called from any thread (the gRPC event loop);
the model runs only on the scheduler thread. Results come back as
`concurrent.futures.Future`s; asyncio callers wrap them with `asyncio.wrap_future`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig
from engine.constants import SAMPLE_RATE
from engine.errors import EngineOverloaded, EngineStopped, ModelInfo
from engine.request import DecodeOptions, Request, Transcript

__all__ = ["Engine", "EngineOverloaded", "EngineStopped", "ModelInfo", "UtteranceHandle"]


@dataclass
class UtteranceHandle:
    id: str
    future: Future[Transcript]
    _engine: Engine

    def cancel(self) -> None:
        """Drop the utterance wherever it is (queue, window or KV slot); frees its slot."""
        self._engine.cancel(self.id)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from engine.scheduler import Scheduler  # heavy imports (torch) only when used

        problems = config.validate()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self._ids = itertools.count()
        self._scheduler = Scheduler(config)
        self._lock = threading.Lock()

    @property
    def info(self) -> ModelInfo:
        return self._scheduler.model_info

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Start the scheduler thread (loads nothing: the model loaded in __init__).
        `on_failure` is called from the scheduler thread if it dies."""
        if self.config.debug_crash_scheduler_after:
            from engine.faults import crash_scheduler_after

            crash_scheduler_after(self._scheduler, self.config.debug_crash_scheduler_after)
        if self.config.debug_hang_scheduler_after:
            from engine.faults import hang_scheduler_after

            hang_scheduler_after(self._scheduler, self.config.debug_hang_scheduler_after)
        if self.config.debug_slow_encoder_s:
            from engine.faults import slow_encoder

            slow_encoder(self._scheduler, self.config.debug_slow_encoder_s)
        self._scheduler.start(on_failure)

    def warmup(self) -> None:
        """Run one short utterance end to end; blocks until done."""
        self.submit(np.zeros(SAMPLE_RATE, dtype=np.float32), DecodeOptions()).future.result()

    @property
    def alive(self) -> bool:
        return self._scheduler.alive

    @property
    def progress(self) -> int:
        """Iterations of the scheduler's loop so far (a heartbeat: it stops growing if the loop hangs)."""
        return self._scheduler.loop_iterations

    def validate(self, options: DecodeOptions) -> None:
        """Raise ValueError naming the field if these options cannot be served by this model."""
        self._scheduler.validate(options)

    def submit(
        self,
        audio: np.ndarray,
        options: DecodeOptions | None = None,
        *,
        ready_time: float | None = None,
        request_id: str | None = None,
    ) -> UtteranceHandle:
        """Queue one utterance (float32 mono 16 kHz samples in [-1, 1]).

        `ready_time` (time.monotonic()) is when the utterance's end was detected; latency
        and queue-wait metrics count from it. Raises EngineOverloaded, EngineStopped, ValueError.
        """
        options = options or DecodeOptions()
        self.validate(options)
        rid = request_id or f"u{next(self._ids)}"
        future: Future[Transcript] = Future()
        req = Request(
            id=rid, audio=np.ascontiguousarray(audio, dtype=np.float32), options=options, future=future
        )
        if ready_time is not None:
            req.ready_time = ready_time
        self._scheduler.submit(req)
        return UtteranceHandle(id=rid, future=future, _engine=self)

    def cancel(self, request_id: str) -> None:
        self._scheduler.cancel(request_id)

    def stats(self) -> dict[str, int]:
        """Snapshot: waiting, active, slots_used, slots_free."""
        return self._scheduler.stats()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish nothing new; fail what is queued with EngineStopped; join the thread."""
        self._scheduler.stop(timeout)

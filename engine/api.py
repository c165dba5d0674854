"""The engine's whole public surface: load, start, submit audio, get a future, cancel, stop.

Thread-safe: `submit` and `cancel` may be called from any thread (the gRPC event loop);
the model runs only on the engine core's loop thread (engine/core.py). Results come back as
`concurrent.futures.Future`s; asyncio callers wrap them with `asyncio.wrap_future`.

Tests give the engine their seams as one object, `Engine(config, hooks=EngineHooks(...))`
(engine/hooks.py), and may build the model runner themselves (`runner=ModelRunner.load(config)`)
to reach the model the engine runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.config import EngineConfig, default_cache_dir
from engine.constants import SAMPLE_RATE
from engine.errors import EngineOverloaded, EngineStopped, ModelInfo
from engine.hooks import EngineHooks
from engine.metrics import TIME_BUCKETS
from engine.outputs import Transcript
from engine.parameters import (
    WHISPER_TEMPERATURES,
    DecodeOptions,
    Priority,
    check_keyterm_tokens,
    check_prompt_chars,
)
from engine.scheduling.request import Request

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner

# what service/ may import of the engine, all from here (the `service-meets-engine-in-api` contract):
# the engine, its options and answers, the priority classes, the prompt and keyterm checks a request is
# refused by before it is queued, Whisper's temperature schedule, the engine's flags (ServerConfig builds
# its flags from them), the latency buckets the service's histograms share, and where models' files are
# cached
__all__ = [
    "SAMPLE_RATE",
    "TIME_BUCKETS",
    "WHISPER_TEMPERATURES",
    "DecodeOptions",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "EngineStopped",
    "ModelInfo",
    "Priority",
    "Transcript",
    "UtteranceHandle",
    "check_keyterm_tokens",
    "check_prompt_chars",
    "default_cache_dir",
]


@dataclass
class UtteranceHandle:
    id: str
    future: Future[Transcript]
    _engine: Engine

    def cancel(self) -> None:
        """Drop the utterance wherever it is (queue, window or KV slot); frees its slot."""
        self._engine.cancel(self.id)


class Engine:
    def __init__(
        self, config: EngineConfig, *, hooks: EngineHooks | None = None, runner: ModelRunner | None = None
    ) -> None:
        """Load the model (or take `runner`, built from this config) and make the engine; `hooks`: test
        seams (engine/hooks.py), none by default."""
        from engine.core import EngineCore  # heavy imports (torch) only when used

        problems = config.validate()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self._ids = itertools.count()
        self._hooks = hooks if hooks is not None else EngineHooks()
        self._core = EngineCore(config, self._hooks, runner)

    @property
    def info(self) -> ModelInfo:
        return self._core.model_info

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Start the engine's loop thread (loads nothing: the model loaded in __init__).
        `on_failure` is called from the loop thread if it dies."""
        from engine.faults import install

        install(self.config, self._hooks)  # --debug-* faults (test only; none by default)
        self._core.start(on_failure)

    def warmup(self) -> None:
        """Run one short utterance end to end; blocks until done."""
        self.submit(np.zeros(SAMPLE_RATE, dtype=np.float32), DecodeOptions()).future.result()

    @property
    def alive(self) -> bool:
        return self._core.alive

    @property
    def progress(self) -> int:
        """Iterations of the engine's loop so far (a heartbeat: it stops growing if the loop hangs)."""
        return self._core.loop_iterations

    def validate(self, options: DecodeOptions) -> None:
        """Raise ValueError naming the field if these options cannot be served by this model."""
        self._core.validate(options)

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
        self._core.submit(req)
        return UtteranceHandle(id=rid, future=future, _engine=self)

    def cancel(self, request_id: str) -> None:
        self._core.cancel(request_id)

    def stats(self) -> dict[str, int]:
        """Snapshot: waiting, active, slots_used, slots_free; queued (submitted, not yet in a KV-cache row:
        what the admission bounds count); per class (live, best_effort, recorded) waiting_<class> and
        rows_<class>."""
        return self._core.stats()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish nothing new; fail what is queued with EngineStopped; join the thread."""
        self._core.stop(timeout)

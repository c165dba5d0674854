"""The engine as service/ sees it: one narrow interface, whatever runs the model.

`engine.Engine` (in-process: tests, benchmarks, embedding) and `engine.process.client.EngineClient` (the engine
process over IPC: asr-server's frontends) both provide it; service/ types its engine as this Protocol,
so that nothing here can reach past it into either one's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.api import DecodeOptions, ModelInfo, UtteranceHandle

if TYPE_CHECKING:
    from engine.api import Engine
    from engine.process.client import EngineClient


class RecognitionEngine(Protocol):
    @property
    def info(self) -> ModelInfo:
        """The model served: name, device, dtype, languages, KV-cache size."""
        ...

    @property
    def alive(self) -> bool: ...

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Begin serving; `on_failure` is called (from another thread) if the engine dies."""
        ...

    def validate(self, options: DecodeOptions) -> None:
        """Raise ValueError naming the field if these options cannot be served by this model."""
        ...

    def submit(
        self,
        audio: np.ndarray,
        options: DecodeOptions | None = None,
        *,
        ready_time: float | None = None,
        request_id: str | None = None,
    ) -> UtteranceHandle:
        """Queue one utterance (float32 mono 16 kHz); raises EngineOverloaded, EngineStopped, ValueError."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, int]:
        """Snapshot: waiting, active, slots_used, slots_free."""
        ...

    def stop(self, timeout: float = 10.0) -> None: ...


if TYPE_CHECKING:  # mypy checks here that both engines provide the whole interface

    def _both_implement_it(in_process: Engine, over_ipc: EngineClient) -> list[RecognitionEngine]:
        return [in_process, over_ipc]

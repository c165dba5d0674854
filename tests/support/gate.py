"""Hold a real engine's loop still, so that what a test submits meanwhile surely waits in its queue.

Uses the engine's fault seam (engine/hooks.py `EngineHooks.fault`, called for each request as its encoder
pass begins): a silent sentinel utterance is submitted and the hook holds the loop thread inside its encoder
pass until the test opens the gate. Every request that reaches an encoder pass is recorded, so a test can
tell what the engine actually worked on.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from engine import Engine
from engine.hooks import EngineHooks


class SchedulerGate:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.gate_id = f"gate-{uuid.uuid4().hex[:8]}"
        self.held = threading.Event()
        self.release = threading.Event()
        self.encoded: list[tuple[str, bool]] = []  # (request id, interim) per encoder pass entered

    def __call__(self, req: Any) -> None:
        self.encoded.append((req.id, bool(req.options.interim)))
        if req.id == self.gate_id:
            self.held.set()
            if not self.release.wait(60):
                raise RuntimeError("test gate never opened")

    async def close(self) -> None:
        self.engine.submit(np.zeros(8000, dtype=np.float32), request_id=self.gate_id)
        assert await asyncio.to_thread(self.held.wait, 20), "the scheduler never reached the gate"

    def open(self) -> None:
        self.release.set()

    def queued(self) -> int:
        """Utterances submitted and not yet in a slot (what --max-queue bounds)."""
        return self.engine.stats()["queued"]


@contextmanager
def scheduler_gate(engine: Engine, hooks: EngineHooks) -> Iterator[SchedulerGate]:
    """`hooks`: the ones `engine` was made with."""
    gate = SchedulerGate(engine)
    try:
        with hooks.installed(fault=gate):
            yield gate
    finally:
        gate.release.set()

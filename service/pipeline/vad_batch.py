"""One batched VAD pass per tick for every stream of this process.

A stream's reader pushes each chunk's audio into its channels' endpointers and asks for a pass; the first
request of a tick schedules one VAD_GATHER_S later, so that the chunks of every stream that arrive
meanwhile share it. The pass scores the new windows of every channel that asked in one
batched model call per window depth (service/pipeline/vad.py SileroVad.score), and hands each stream its
probabilities. The stream's endpointers then run their state machines (Endpointer.advance).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from service import metrics
from service.pipeline.vad import SileroVad, VadState, load_vad

log = logging.getLogger("service.pipeline.vad_batch")

# How long a pass waits for more streams' chunks. Without it a pass held 1.3-3.9 channels on average
# with 32 real-time calls in 20 ms chunks (the event loop turns faster than chunks arrive), with 10 ms
# 5.5-10 (scripts/bench_vad.py --server; the CPU it saves there is within this machine's noise, see
# docs/benchmarks.md). It delays an utterance's end being detected by at most this, against the 0.5 s
# of silence that detection waits for anyway.
VAD_GATHER_S = 0.01


class Scored(Protocol):
    """What a pass scores: a channel's windows and its model state (pipeline/endpointing.py Endpointer;
    ManualTurns offers none)."""

    vad_state: VadState

    def windows(self) -> np.ndarray: ...


# probabilities per endpointer, in the order asked, or the error the pass raised
OnScored = Callable[[list[np.ndarray] | Exception], None]


class VadBatcher:
    def __init__(self, vad: SileroVad | None = None, gather_s: float = 0.0) -> None:
        """`gather_s`: 0 runs each pass in the loop's next turn (tests); the server's is VAD_GATHER_S."""
        self._vad = vad or load_vad()
        self.gather_s = gather_s
        self._waiting: dict[object, tuple[Sequence[Scored], OnScored]] = {}
        self._scheduled = False

    def request(self, owner: object, endpointers: Sequence[Scored], on_scored: OnScored) -> None:
        """Score what `endpointers` hold unscored in this tick's pass, then call `on_scored`. Asking
        again before the pass runs changes nothing: the pass scores whatever is pushed by then."""
        if owner not in self._waiting:
            self._waiting[owner] = (endpointers, on_scored)
        if not self._scheduled:
            self._scheduled = True
            loop = asyncio.get_running_loop()
            if self.gather_s > 0:
                loop.call_later(self.gather_s, self._run)
            else:
                loop.call_soon(self._run)

    def waiting(self, owner: object) -> bool:
        """`owner` asked for this tick's pass, which has not run yet."""
        return owner in self._waiting

    def score_now(self, endpointers: Sequence[Scored]) -> list[np.ndarray]:
        """Score one stream's pending windows at once, outside the tick (its end, a drain, or a stream
        that sends faster than the passes come)."""
        return self._score(list(endpointers))

    def _run(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, {}
        flat = [ep for eps, _ in waiting.values() for ep in eps]
        try:
            probs: list[np.ndarray] | Exception = self._score(flat)
        except Exception as e:  # a bug or a broken model: each stream fails on its own, loudly
            log.exception("VAD pass failed")
            probs = e
        at = 0
        for eps, on_scored in waiting.values():
            mine = probs if isinstance(probs, Exception) else probs[at : at + len(eps)]
            at += len(eps)
            try:
                on_scored(mine)
            except Exception:  # one stream's bug must not keep the others from their probabilities
                log.exception("VAD result handler failed")

    def _score(self, endpointers: list[Scored]) -> list[np.ndarray]:
        windows = [ep.windows() for ep in endpointers]
        scored = sum(1 for w in windows if len(w))
        if not scored:
            return [w[:0, 0] for w in windows]
        started = time.perf_counter()
        probs = self._vad.score([ep.vad_state for ep in endpointers], windows)
        metrics.VAD_SECONDS.observe(time.perf_counter() - started)
        metrics.VAD_BATCH_CHANNELS.observe(scored)
        metrics.VAD_WINDOWS.inc(sum(len(w) for w in windows))
        return probs


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, VadBatcher] = weakref.WeakKeyDictionary()


def vad_batcher() -> VadBatcher:
    """The batcher of the running event loop (one per frontend process; tests may run several loops)."""
    loop = asyncio.get_running_loop()
    batcher = _batchers.get(loop)
    if batcher is None:
        batcher = _batchers[loop] = VadBatcher(gather_s=VAD_GATHER_S)
    return batcher

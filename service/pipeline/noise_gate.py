"""Which VAD windows need no model call: a channel's line noise, once the VAD has called it non-speech.

Most of a contact-center channel is not speech: the other party talking, hold, an idle line. Scoring that
hiss with silero is most of the frontend's CPU per call (docs/benchmarks.md "Issue 22"). An absolute
energy threshold cannot tell it from a quiet caller: silero hears speech whose median window sits at
-45 dBFS (a caller 20 dB below the real-speech set), louder than a -50 dBFS line's hiss. So the gate is
relative to the channel's own noise floor, and only opens its shortcut after the model itself has heard
non-speech for a while:

- the floor follows the quietest windows the model called non-speech (down at once, up slowly, so a
  louder line is learnt in seconds and speech never raises it);
- a window is skipped (probability 0, the model state kept) only when it is within `margin_db` of that
  floor (--vad-gate-db, 3 dB by default; 0 turns the gate off) and the GATE_AFTER_WINDOWS windows before it were non-speech;
- anything louder is scored, so speech above the hiss (SNR > `margin_db`) starts as it did without the
  gate, from the model state of the last non-speech window it scored.

The decision is made window by window (a skip depends on the probabilities before it), so splitting a
channel's audio into other passes never changes what is skipped or any probability.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

MARGIN_DB = 3.0  # white noise's 32 ms windows spread about +-1.2 dB around their level
GATE_AFTER_WINDOWS = 16  # 0.5 s of non-speech before the first skip: an utterance's end is the model's
QUIET_PROB = 0.1  # a window the model scores below this is non-speech (silero's end threshold is 0.35)
FLOOR_RISE_DB = 0.15  # per 32 ms window (~5 dB/s): the floor's climb towards louder non-speech
FLOOR_MIN_DB = -100.0  # digital silence (-300) would otherwise hold the floor down for minutes


@dataclass
class NoiseFloor:
    """One channel's gate state, kept with its VAD state; `margin_db` 0 turns its gate off."""

    margin_db: float = MARGIN_DB
    floor_db: float = math.inf  # unknown until the model has called a window non-speech
    quiet_run: int = 0  # windows in a row that were non-speech (skipped ones included)

    def leading_skips(self, levels_db: np.ndarray) -> int:
        """How many of the leading windows (their levels, dBFS) to skip; it counts them as heard."""
        if self.margin_db <= 0:
            return 0
        n = 0
        for level in levels_db.tolist():
            if self.quiet_run < GATE_AFTER_WINDOWS or level > self.floor_db + self.margin_db:
                break
            self._quiet(level)
            n += 1
        return n

    def scored_before_gating(self) -> int:
        """How many windows from here on the model must score before the gate could skip one: a run of
        them needs no decision in between, so it can go to the model in one call."""
        if self.margin_db <= 0:
            return sys.maxsize
        return max(1, GATE_AFTER_WINDOWS - self.quiet_run)

    def heard(self, levels_db: np.ndarray, probs: np.ndarray) -> None:
        """The model scored these windows: learn the floor from the non-speech among them."""
        for level, p in zip(levels_db.tolist(), probs.tolist(), strict=True):
            if p < QUIET_PROB:
                self._quiet(level)
            else:
                self.quiet_run = 0

    def _quiet(self, level_db: float) -> None:
        level = max(level_db, FLOOR_MIN_DB)
        self.floor_db = level if level < self.floor_db else min(level, self.floor_db + FLOOR_RISE_DB)
        self.quiet_run += 1


def levels_db(windows: np.ndarray) -> np.ndarray:
    """Each window's RMS level in dBFS (full scale 1.0); -300 for digital silence."""
    power = np.einsum("ij,ij->i", windows, windows) / max(windows.shape[1], 1)
    return 10.0 * np.log10(np.maximum(power, 1e-30))

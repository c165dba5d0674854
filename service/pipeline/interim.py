"""When a stream asks the engine for an interim hypothesis, and how stable each one is.

Interims are extra, best-effort engine requests on the audio of the utterance in progress: at most one
in flight per channel, at most one per `interim_interval_s`, never on less than MIN_INTERIM_AUDIO_S of
audio, and never sent after the final of their utterance.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import UtteranceHandle

MIN_INTERIM_AUDIO_S = 0.5  # shorter partials rarely hold a whole word: not worth an engine call


def stability(previous: str, current: str) -> float:
    """0.5 for a fresh guess, rising to 0.9 as more of it repeats the previous interim's words."""
    prev, cur = previous.split(), current.split()
    same = 0
    for a, b in zip(prev, cur, strict=False):
        if a.strip(".,?!").lower() != b.strip(".,?!").lower():
            break
        same += 1
    return 0.5 + 0.4 * (same / len(cur) if cur else 0.0)


@dataclass
class InterimPolicy:
    """One channel's interim requests."""

    interval_s: float
    in_flight: UtteranceHandle | None = None  # at most one interim request per channel
    last_wall: float = 0.0
    last_text: str = ""
    first_for: int = -1  # utterance index whose first interim was already sent

    def due(self, now: float, speech_start_wall: float) -> bool:
        """Time to ask again (the caller checks that an utterance is in progress)."""
        return self.in_flight is None and now - max(self.last_wall, speech_start_wall) >= self.interval_s

    @staticmethod
    def enough_audio(samples: int, rate: int) -> bool:
        return samples >= MIN_INTERIM_AUDIO_S * rate

    def asked(self, handle: UtteranceHandle, now: float) -> None:
        self.in_flight = handle
        self.last_wall = now

    def answered(self, handle: UtteranceHandle) -> None:
        if self.in_flight is handle:
            self.in_flight = None

    def cancel(self) -> None:
        """The final covers everything the interim in flight was asked about: save the engine's work."""
        if self.in_flight is not None:
            self.in_flight.cancel()
            self.in_flight = None

    def accept(self, index: int, text: str) -> tuple[float, bool]:
        """An interim for utterance `index` goes out: its stability, and whether it is the utterance's first."""
        first = self.first_for != index
        value = stability("" if first else self.last_text, text)
        self.last_text = text
        self.first_for = index
        return value, first

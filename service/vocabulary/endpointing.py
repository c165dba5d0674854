"""Endpointing's settings: what a request may tune (zero means the default) and how a bad value is named.

The endpointer that applies them is the pipeline's (service/pipeline/endpointing.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class EndpointingError(ValueError):
    """Bad endpointing settings; `field` is the setting to blame (as AudioFormatError)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class EndpointSettings:
    speech_start_threshold: float = 0.5
    speech_end_threshold: float = 0.35
    min_silence_s: float = 0.5
    max_utterance_s: float = 15.0
    min_speech_s: float = 0.2
    speech_pad_s: float = 0.2  # audio kept before speech start and after speech end
    # The semantic end of turn (service/pipeline/turn_model.py), per stream: None / 0 take the server's
    # --turn-model, --turn-threshold and --turn-max-silence-s.
    turn_model: bool | None = None
    turn_threshold: float = 0.0
    turn_max_silence_s: float = 0.0

    @classmethod
    def from_overrides(
        cls,
        speech_start_threshold: float = 0.0,
        speech_end_threshold: float = 0.0,
        min_silence_s: float = 0.0,
        max_utterance_s: float = 0.0,
        min_speech_s: float = 0.0,
    ) -> EndpointSettings:
        """Proto semantics: zero means the default. An unset end threshold follows a set start
        threshold (start - 0.15, as silero does) so that a lone start threshold stays valid."""
        d = cls()
        start = speech_start_threshold or d.speech_start_threshold
        end = speech_end_threshold or (
            max(start - 0.15, 0.01) if speech_start_threshold else d.speech_end_threshold
        )
        s = cls(
            speech_start_threshold=start,
            speech_end_threshold=end,
            min_silence_s=min_silence_s or d.min_silence_s,
            max_utterance_s=max_utterance_s or d.max_utterance_s,
            min_speech_s=min_speech_s or d.min_speech_s,
        )
        s.validate()
        return s

    def validate(self) -> None:
        def bad(name: str, limit: str, value: float) -> EndpointingError:
            return EndpointingError(
                f"endpointing.{name}", f"endpointing.{name} must be {limit}, got {value:g}"
            )

        start, end = self.speech_start_threshold, self.speech_end_threshold
        if not (0.0 < start < 1.0) or math.isnan(start):
            raise bad("speech_start_threshold", "between 0 and 1 (exclusive)", start)
        if not (0.0 < end < 1.0) or math.isnan(end):
            raise bad("speech_end_threshold", "between 0 and 1 (exclusive)", end)
        if end > start:
            raise bad("speech_end_threshold", f"at most speech_start_threshold ({start:g})", end)
        if not 0.1 <= self.min_silence_s <= 5.0:
            raise bad("min_silence_duration", "between 0.1 s and 5 s", self.min_silence_s)
        if not 1.0 <= self.max_utterance_s <= 30.0:  # Whisper hears at most 30 s at once
            raise bad("max_utterance_duration", "between 1 s and 30 s", self.max_utterance_s)
        if not 0.0 <= self.min_speech_s <= self.max_utterance_s:
            raise bad("min_speech_duration", f"between 0 s and {self.max_utterance_s:g} s", self.min_speech_s)
        if not 0.0 <= self.speech_pad_s <= 1.0:
            raise bad("speech_pad", "between 0 s and 1 s", self.speech_pad_s)
        if self.turn_threshold and not 0.0 < self.turn_threshold < 1.0:
            raise bad("turn_threshold", "between 0 and 1 (exclusive)", self.turn_threshold)
        if not 0.0 <= self.turn_max_silence_s <= 10.0:  # below min_silence_s it is raised to it
            raise bad("turn_max_silence", "between 0 s and 10 s", self.turn_max_silence_s)

"""Call metrics' settings (per request) and the numbers a stream reports: what a door asks for and gets back.

The tracker that computes them from the endpointer's segments is the pipeline's
(service/pipeline/call_metrics.py); these are here so that the vocabulary names them without importing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MIN_NON_TALK_S = 2.0
DEFAULT_MIN_INTERRUPTION_OVERLAP_S = 1.0
MIN_NON_TALK_RANGE = (0.1, 60.0)
MIN_INTERRUPTION_OVERLAP_RANGE = (0.1, 10.0)
INTERVAL_RANGE = (1.0, 3600.0)  # call_metrics_interval; 0 means only the last message


class CallMetricsError(ValueError):
    """Bad call-metrics settings; `field` is the proto field to blame (as EndpointingError)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if math.isnan(value) or not low <= value <= high:
        raise CallMetricsError(name, f"{name} must be between {low:g} s and {high:g} s, got {value:g} s")


@dataclass(frozen=True)
class CallMetricsSettings:
    min_non_talk_s: float = DEFAULT_MIN_NON_TALK_S
    min_interruption_overlap_s: float = DEFAULT_MIN_INTERRUPTION_OVERLAP_S

    @classmethod
    def from_overrides(
        cls, min_non_talk_s: float = 0.0, min_interruption_overlap_s: float = 0.0
    ) -> CallMetricsSettings:
        """Proto semantics: zero means the default. Raises CallMetricsError past the bounds."""
        s = cls(
            min_non_talk_s=min_non_talk_s or DEFAULT_MIN_NON_TALK_S,
            min_interruption_overlap_s=min_interruption_overlap_s or DEFAULT_MIN_INTERRUPTION_OVERLAP_S,
        )
        s.validate()
        return s

    def validate(self) -> None:
        _check_range("config.call_metrics.min_non_talk_duration", self.min_non_talk_s, *MIN_NON_TALK_RANGE)
        _check_range(
            "config.call_metrics.min_interruption_overlap",
            self.min_interruption_overlap_s,
            *MIN_INTERRUPTION_OVERLAP_RANGE,
        )


def validate_interval(seconds: float) -> None:
    """`call_metrics_interval`: 0 (only the last message) or within INTERVAL_RANGE."""
    if seconds != 0.0:
        _check_range("call_metrics_interval", seconds, *INTERVAL_RANGE)


@dataclass(frozen=True)
class ChannelMetrics:
    channel_tag: int
    talk_s: float
    interruptions: int
    words_per_minute: float
    mean_loudness_dbfs: float | None  # None: no speech yet
    words: int  # words of the finals counted


@dataclass(frozen=True)
class CallMetrics:
    channels: tuple[ChannelMetrics, ...]
    non_talk_s: float
    overlap_s: float
    total_s: float
    # a diarized mono (or mixed-down) stream: the same figures per speaker (channel_tag: the speaker,
    # 0-based), from its finals' words; a stereo call's channels are its speakers already
    speakers: tuple[ChannelMetrics, ...] = ()

    @property
    def non_talk_share(self) -> float:
        """Non-talk time over the call's length (0 for an empty call), for a Prometheus distribution."""
        return self.non_talk_s / self.total_s if self.total_s > 0 else 0.0

    def talk_share(self, channel_tag: int) -> float:
        """A channel's talk time over the call's length (0 for an empty call)."""
        ch = next(c for c in self.channels if c.channel_tag == channel_tag)
        return ch.talk_s / self.total_s if self.total_s > 0 else 0.0

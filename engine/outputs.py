"""What the engine returns for one utterance: its transcript, segments, word timings and where the time
went. Plain frozen data (it crosses the engine process's wire, engine/process/ipc.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class WordTiming:
    word: str  # as Whisper's tokens spell it, leading space included
    start_s: float  # from the utterance audio's first sample
    end_s: float
    probability: float  # mean probability of the word's tokens


@dataclass(frozen=True)
class UtteranceStats:
    """Where the time went, for logs and metrics."""

    audio_s: float
    queue_wait_s: float  # ready -> its encoder pass began
    encoder_batch_size: int
    decode_steps: int
    latency_s: float  # ready -> result published


@dataclass(frozen=True)
class Transcript:
    text: str
    tokens: tuple[int, ...]
    avg_logprob: float
    no_speech_prob: float
    language: str
    segments: tuple[Segment, ...]
    is_speech: bool  # False when dropped as silence or noise (text is then "")
    stats: UtteranceStats
    words: tuple[WordTiming, ...] = ()  # with DecodeOptions.word_timestamps
    # The highest temperature whose decode a window kept (0: greedy or beams throughout; above: the
    # temperature fallback sampled: DecodeOptions.temperatures)
    temperature: float = 0.0

    @property
    def confidence(self) -> float:
        return math.exp(self.avg_logprob) if self.tokens else 0.0

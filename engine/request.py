"""Request state: what one utterance asks for, its progress, and what it returns."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class DecodeOptions:
    """Per-utterance decoding options (all optional)."""

    language: str | None = None  # Whisper code ("en"); None: English-only model's, or detected
    task: str = "transcribe"  # or "translate" on multilingual models
    prompt: str | None = None  # initial prompt: names, products, jargon
    timestamps: bool = False  # segment-level timestamps
    max_new_tokens: int | None = None  # None: as many as the slot holds
    interim: bool = False  # a partial hypothesis: never returned as silence-dropped, lower priority


@dataclass(frozen=True)
class Segment:
    text: str
    start_s: float
    end_s: float


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

    @property
    def confidence(self) -> float:
        return math.exp(self.avg_logprob) if self.tokens else 0.0


@dataclass(eq=False)
class Request:
    """One utterance inside the engine. Owned by the scheduler thread after submit."""

    id: str
    audio: np.ndarray  # float32, mono, 16 kHz
    options: DecodeOptions
    future: Future[Transcript]
    ready_time: float = field(default_factory=time.monotonic)
    # Filled in by the scheduler:
    prompt_tokens: list[int] = field(default_factory=list)
    sot_index: int = 0
    audio_ctx: int = 0  # encoder positions this utterance uses
    window: int = 0  # index of the 30 s window being decoded (long audio)
    generated: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float = 0.0
    language: str = ""
    encode_start: float = 0.0
    encoder_batch_size: int = 0
    decode_steps: int = 0
    cancelled: bool = False
    finished_windows: list[tuple[list[int], float, float]] = field(default_factory=list)

    @property
    def audio_s(self) -> float:
        return len(self.audio) / 16000.0

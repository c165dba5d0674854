"""A request inside the engine: its lifecycle (RequestStatus, moved along by engine/scheduling/scheduler.py)
and its per-row decode state. What a caller asks is engine/parameters.py, what it gets back
engine/outputs.py."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.constants import N_SAMPLES, SAMPLE_RATE
from engine.outputs import Transcript, WordTiming
from engine.parameters import DecodeOptions, Priority

if TYPE_CHECKING:
    from engine.decoding.beam import BeamTerms
    from engine.decoding.keyterms import KeytermState, TermTrie


class RequestStatus(enum.Enum):
    """Where an utterance is in the engine. The scheduler (engine/scheduling/scheduler.py) moves it along:

    WAITING -> ENCODING -> DECODING -> FINISHED, and back from DECODING to WAITING when a window
    ends and another pass is due (the next 30 s window, or a full-context fallback), or to ENCODING in
    its own rows when the window is decoded again at the next temperature. Any state but
    FINISHED can end in CANCELLED or FAILED. Only ENCODING and DECODING hold a KV-cache row."""

    WAITING = "waiting"  # queued for an encoder pass
    ENCODING = "encoding"  # in an encoder pass and its prefill; holds a row
    DECODING = "decoding"  # takes a decode step each loop; holds a row
    FINISHED = "finished"  # result published
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def holds_row(self) -> bool:
        return self in (RequestStatus.ENCODING, RequestStatus.DECODING)

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass(eq=False)
class Beam:
    """One hypothesis of a beam search: its tokens in this window (prompt excluded, as Request.generated)
    and their summed log-probability. The logit processors read it as they read a request (the fields
    below and the request's options), so Whisper's rules apply to every beam alike."""

    request: Request
    generated: list[int]
    sum_logprob: float = 0.0
    # The greedy keyterm bias (engine/decoding/keyterms.py) never runs over beams; a beam's own place in
    # its request's keyterm list is `terms` (engine/decoding/beam.py: the bonus enters the beams' ranking).
    keyterm: None = None
    terms: BeamTerms | None = None

    @property
    def options(self) -> DecodeOptions:
        return self.request.options

    @property
    def forced(self) -> list[int]:
        return self.request.forced

    @property
    def sample_begin(self) -> int:
        return self.request.sample_begin


@dataclass(frozen=True)
class Attempt:
    """One decode of a window that failed the temperature-fallback thresholds: kept, in case every
    temperature fails and it is the best of them (engine/scheduling/outcome.py best_attempt)."""

    temperature: float
    generated: tuple[int, ...]
    sum_logprob: float  # this window's alone
    sampled: int  # this window's alone
    avg_logprob: float
    compression_ratio: float


@dataclass(eq=False)
class Request:
    """One utterance inside the engine. Owned by the engine's loop thread after submit."""

    id: str
    audio: np.ndarray  # float32, mono, 16 kHz
    options: DecodeOptions
    future: Future[Transcript]
    ready_time: float = field(default_factory=time.monotonic)
    submitted: float = 0.0  # when the engine accepted it (opens the micro-batching window)
    # Filled in by the engine (engine/scheduling/scheduler.py, engine/core.py):
    priority: Priority = Priority.LIVE  # its class (options.work_class), fixed at submit
    prompt_ids: tuple[int, ...] = ()  # options.prompt tokenized once, at submit (engine/decoding/prompt.py)
    status: RequestStatus = RequestStatus.WAITING
    prompt_tokens: list[int] = field(default_factory=list)
    sot_index: int = 0  # where <|startoftranscript|> sits in the prompt (no-speech probability)
    forced: list[int] = field(default_factory=list)  # tokens to emit next regardless of logits
    detect_language: bool = False
    # Where sampling begins in `generated`: after the detected language token and the forced task
    # tokens (openai/whisper's sample_begin). The first-token rules apply to the token at this index.
    sample_begin: int = 0
    language: str = ""
    window: int = 0  # which 30 s window of the audio is being decoded
    audio_ctx: int = 0  # encoder positions this window uses
    full_context: bool = False  # a trimmed pass looped: this window falls back to 30 s
    window_start: tuple[float, int] = (0.0, 0)  # (sum_logprob, sampled) when this window began
    # KV-cache rows while ENCODING or DECODING: one, or one per beam (beam b decodes in rows[b])
    rows: list[int] = field(default_factory=list)
    beams: list[Beam] = field(default_factory=list)  # this window's live beams (beam search only)
    beam_finished: dict[tuple[int, ...], float] = field(default_factory=dict)  # ended beams: summed logprob
    beam_bonus: dict[tuple[int, ...], float] = field(default_factory=dict)  # ended beams: keyterm bonus
    window_done: bool = False  # a beam search ended this window (engine/decoding/beam.py finish)
    length: int = 0  # tokens written to this row's self-attention cache
    max_new: int = 0
    generated: list[int] = field(default_factory=list)  # this window's tokens, forced ones included
    sum_logprob: float = 0.0
    sampled: int = 0  # tokens chosen from logits (forced ones excluded), EOT included
    no_speech_prob: float = 0.0
    window_tokens: list[list[int]] = field(default_factory=list)  # finished windows
    words: list[WordTiming] = field(default_factory=list)  # word timings of finished windows
    encode_start: float | None = None  # its first encoder pass began (None: never admitted yet)
    encoder_batch_size: int = 0
    decode_steps: int = 0
    keyterm: KeytermState | None = (
        None  # the keyterm bias's place in this window (engine/decoding/keyterms.py)
    )
    keyterm_trie: TermTrie | None = None  # its keyterm list compiled, at submit (engine/decoding/keyterms.py)
    # Temperature fallback: the schedule (options.temperatures or the engine's, resolved at submit), which
    # of it this window decodes at, the window's failed decodes, and the temperature each finished window
    # kept. `rng` draws this request's samples (seeded per window, temperature and sample: batch invariant).
    temperatures: tuple[float, ...] = (0.0,)
    attempt: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    samples: list[Attempt] = field(default_factory=list)  # this temperature's earlier samples (best_of)
    window_temperatures: list[float] = field(default_factory=list)
    rng: np.random.Generator | None = None

    @property
    def width(self) -> int:
        """KV-cache rows this request decodes in: one per beam (engine/decoding/beam.py). It keeps them
        while a window is decoded again at a temperature above 0, which samples in the first."""
        return max(1, self.options.beam_size)

    @property
    def searches_beams(self) -> bool:
        """Beam search, not greedy (with keyterms, their bonus enters the beams' ranking:
        engine/decoding/beam.py); at a temperature above 0 it samples instead, as openai-whisper does."""
        return self.options.beam_size > 1 and self.temperature == 0

    @property
    def temperature(self) -> float:
        """The temperature this window decodes at (0: greedy or beams)."""
        return self.temperatures[self.attempt]

    def draw(self) -> float:
        """The next uniform draw in [0, 1) of this request's own sampling generator."""
        if self.rng is None:
            raise RuntimeError(f"request {self.id} samples without a generator")
        return float(self.rng.random())

    @property
    def row(self) -> int | None:
        """Its first KV-cache row (its only one unless it searches beams); None while it holds none."""
        return self.rows[0] if self.rows else None

    @row.setter
    def row(self, value: int | None) -> None:
        self.rows = [] if value is None else [value]

    @property
    def kv_row(self) -> int:
        """Its KV-cache row; only while it holds one."""
        if self.row is None:
            raise RuntimeError(f"request {self.id} holds no KV-cache row ({self.status.value})")
        return self.row

    @property
    def window_sampled(self) -> int:
        return self.sampled - self.window_start[1]

    @property
    def audio_s(self) -> float:
        return len(self.audio) / SAMPLE_RATE

    @property
    def windows(self) -> int:
        return max(1, -(-len(self.audio) // N_SAMPLES))

    def window_audio(self) -> np.ndarray:
        return self.audio[self.window * N_SAMPLES : (self.window + 1) * N_SAMPLES]

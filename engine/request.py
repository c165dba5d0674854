"""Request state: what one utterance asks for, its progress, and what it returns."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.constants import N_SAMPLES, SAMPLE_RATE
from engine.prompt import check_prompt_chars


class Priority(enum.IntEnum):
    """Who is served first (engine/policy.py): a class per kind of work, lower first."""

    LIVE = 0  # a live call's final: a caller is waiting for it
    BEST_EFFORT = 1  # a live call's interim or speculative offer: a preview, refused first
    RECORDED = 2  # recorded audio (Recognize, an HTTP upload): waits for the capacity live work leaves

    @property
    def label(self) -> str:
        """The `class` label of the engine's metrics."""
        return self.name.lower()


if TYPE_CHECKING:
    from engine.beam import BeamTerms
    from engine.keyterms import KeytermState, TermTrie

# Keyterm bounds: what one utterance's list may hold (the trie and the prompt grow with it).
MAX_KEYTERMS = 100
MAX_KEYTERM_CHARS = 50
MAX_KEYTERM_TOKENS = 16  # as the model's tokenizer spells the term after a space (checked by the engine)


@dataclass(frozen=True)
class DecodeOptions:
    """Per-utterance decoding options (all optional)."""

    language: str | None = None  # Whisper code ("en"); None: English-only model's, or detected
    task: str = "transcribe"  # or "translate" on multilingual models
    prompt: str | None = None  # initial prompt: names, products, jargon
    timestamps: bool = False  # segment-level timestamps
    max_new_tokens: int | None = None  # None: as many as the slot holds
    interim: bool = False  # a partial hypothesis: never returned as silence-dropped, lower priority
    word_timestamps: bool = False  # per-word times and probabilities (engine/timing.py)
    priority: Priority = Priority.LIVE  # an interim is BEST_EFFORT whatever this says (unless RECORDED)
    # A BEST_EFFORT request that becomes LIVE at this time.monotonic(): a speculative offer ranks as a final
    # from when its end would be confirmed (engine/policy.py); None: never.
    promote_at: float | None = None
    # Whose work this is (a live stream's id): the engine's live finals take turns by caller.
    caller: str = ""

    @property
    def work_class(self) -> Priority:
        """The class the engine admits and serves this request in."""
        if self.interim and self.priority is Priority.LIVE:
            return Priority.BEST_EFFORT
        return self.priority

    # Names and jargon the caller may say, boosted in decoding (engine/keyterms.py); bounds above.
    keyterms: tuple[str, ...] = ()
    # Beams searched at once (1: greedy). Each beam is a KV-cache row, so a request of n beams takes n of
    # the engine's rows; bounded by --max-beam-size (the engine checks it: validate_beam_size).
    beam_size: int = 1
    # The same channel's earlier final text, set by the server (never a client): conditioned on after the
    # prompt, as Whisper's long-form decoding conditions each window on the text before it. Only its tail
    # is kept, within what the prompt bound leaves after the caller's own prompt (engine/prompt.py).
    context: str | None = None


def validate_options(options: DecodeOptions, *, multilingual: bool, languages: Collection[str]) -> None:
    """Raise ValueError naming the field if a model (multilingual or not, with these language codes)
    cannot serve `options`. One check for the in-process engine and for a client of the engine process."""
    if options.language is not None:
        if not multilingual and options.language != "en":
            raise ValueError(
                f"language_code {options.language!r} is not supported: this model is English-only (use 'en')"
            )
        if multilingual and options.language not in languages:
            raise ValueError(
                f"language_code {options.language!r} is not one of the model's {len(languages)} languages"
            )
    if options.task not in ("transcribe", "translate"):
        raise ValueError(f"task {options.task!r} must be 'transcribe' or 'translate'")
    if options.task == "translate" and not multilingual:
        raise ValueError("task 'translate' needs a multilingual model")
    if options.max_new_tokens is not None and options.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {options.max_new_tokens}")
    check_prompt_chars(options.prompt)  # its length in tokens is checked where the tokenizer is
    check_prompt_chars(options.context, "context")  # its tail is kept: never refused for its tokens
    if not isinstance(options.priority, Priority):
        raise ValueError(
            f"priority {options.priority!r} must be one of {', '.join(p.name for p in Priority)}"
        )
    validate_keyterms(options.keyterms)


def validate_beam_size(beam_size: int, max_beam_size: int, flag: str = "--max-beam-size") -> None:
    """Raise ValueError naming the field and the flag (`flag`, whose value is max_beam_size) for a
    beam_size this engine will not search."""
    if not isinstance(beam_size, int) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be at least 1 (1: greedy), got {beam_size!r}")
    if beam_size > max_beam_size:
        raise ValueError(
            f"beam_size {beam_size} is more beams than this server searches ({flag} {max_beam_size})"
        )


def validate_keyterms(keyterms: Collection[str]) -> None:
    """Raise ValueError naming the field and the bound for a keyterm list past them (the token bound
    needs the model's tokenizer: DecodingRules.validate checks it)."""
    if isinstance(keyterms, str):
        raise ValueError("keyterms must be a list of terms, not one string")
    if len(keyterms) > MAX_KEYTERMS:
        raise ValueError(f"keyterms holds {len(keyterms)} terms; at most {MAX_KEYTERMS}")
    for i, term in enumerate(keyterms):
        if not isinstance(term, str) or not term.strip():
            raise ValueError(f"keyterms[{i}] is empty; each keyterm needs at least one character")
        if len(term.strip()) > MAX_KEYTERM_CHARS:
            raise ValueError(
                f"keyterms[{i}] is {len(term.strip())} characters long; at most {MAX_KEYTERM_CHARS} per keyterm"
            )
        if not term.isprintable():
            raise ValueError(f"keyterms[{i}] holds a control character; keyterms are printable text")


def check_keyterm_tokens(keyterms: Collection[str], tokens: Callable[[str], int]) -> None:
    """Raise ValueError naming the field past MAX_KEYTERM_TOKENS; `tokens(text)`: how many text tokens the
    model's tokenizer spells `text` in. The engine checks with its tokenizer, a frontend process with
    ModelInfo.prompts (the same tokenizer), so both refuse the same lists."""
    for i, term in enumerate(keyterms):
        n = tokens(" " + term.strip())
        if n > MAX_KEYTERM_TOKENS:
            raise ValueError(
                f"keyterms[{i}] is {n} tokens long; at most {MAX_KEYTERM_TOKENS} tokens per keyterm"
            )


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

    @property
    def confidence(self) -> float:
        return math.exp(self.avg_logprob) if self.tokens else 0.0


class RequestStatus(enum.Enum):
    """Where an utterance is in the engine. The scheduler (engine/scheduler.py) moves it along:

    WAITING -> ENCODING -> DECODING -> FINISHED, and back from DECODING to WAITING when a window
    ends and another pass is due (the next 30 s window, or a full-context fallback). Any state but
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
    # The greedy keyterm bias (engine/keyterms.py) never runs over beams; a beam's own place in its
    # request's keyterm list is `terms` (engine/beam.py: the bonus enters the beams' ranking).
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


@dataclass(eq=False)
class Request:
    """One utterance inside the engine. Owned by the engine's loop thread after submit."""

    id: str
    audio: np.ndarray  # float32, mono, 16 kHz
    options: DecodeOptions
    future: Future[Transcript]
    ready_time: float = field(default_factory=time.monotonic)
    submitted: float = 0.0  # when the engine accepted it (opens the micro-batching window)
    # Filled in by the engine (engine/scheduler.py, engine/core.py):
    priority: Priority = Priority.LIVE  # its class (options.work_class), fixed at submit
    prompt_ids: tuple[int, ...] = ()  # options.prompt tokenized once, at submit (engine/prompt.py)
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
    window_done: bool = False  # a beam search ended this window (engine/beam.py finish)
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
    keyterm: KeytermState | None = None  # the keyterm bias's place in this window (engine/keyterms.py)
    keyterm_trie: TermTrie | None = None  # its keyterm list compiled, at submit (engine/keyterms.py)

    @property
    def width(self) -> int:
        """KV-cache rows this request decodes in: one per beam (engine/beam.py)."""
        return self.options.beam_size if self.searches_beams else 1

    @property
    def searches_beams(self) -> bool:
        """Beam search, not greedy (with keyterms, their bonus enters the beams' ranking: engine/beam.py)."""
        return self.options.beam_size > 1

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

"""What a finished decoding window means, beside the decoding rules: has it ended, did it loop (and
why), and the transcript it becomes. No model and no scheduling here: the scheduler (engine/scheduling/scheduler.py)
asks these questions after each token-producing call and decides on the answers."""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING, Literal, Protocol

from engine.constants import CHUNK_SECONDS
from engine.outputs import Transcript, UtteranceStats
from engine.scheduling.request import Attempt, Request

if TYPE_CHECKING:
    from engine.decoding.rules import DecodingRules

COMPRESSION_RATIO_THRESHOLD = 2.4  # openai/whisper's: text this compressible is a loop
# openai/whisper's transcribe(): a window below this mean log-probability is decoded at the next
# temperature, unless its no-speech probability says silence.
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
MIN_REPEATED_SPAN = 4  # shorter repeats ("no, no") happen in real speech

LoopReason = Literal["no_eot", "repeat", "compression"]
TemperatureFailure = Literal["compression", "logprob"]


class _Eot(Protocol):
    @property
    def eot(self) -> int: ...


class TextRules(Protocol):
    """What the loop checks need of the decoding rules (engine/decoding/rules.py DecodingRules): the end of
    text token and the text of tokens."""

    @property
    def vocab(self) -> _Eot: ...

    def text(self, tokens: list[int]) -> str: ...


def repeats_at_end(tokens: list[int], min_span: int = MIN_REPEATED_SPAN) -> bool:
    """True when the text ends with a span of at least `min_span` tokens said twice in a row
    ("Thank you for your help. Thank you for your help."): too short for the compression
    ratio to notice, a loop all the same."""
    return any(tokens[-k:] == tokens[-2 * k : -k] for k in range(min_span, len(tokens) // 2 + 1))


def compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def window_ended(req: Request, eot: int, max_tokens: int, full_audio_ctx: int) -> bool:
    """This window's decode is over: end of text, its token budget spent, its row full, or (trimmed
    windows only) a span just said twice in a row: a trimmed decode that starts looping ("Seven of
    clubs. Seven of clubs. ...", "5 5 5 5 5 5 5 5") stops there, instead of spending the rest of its
    budget, and goes back for its full-context pass (loop_reason says "repeat")."""
    if req.generated[-1] == eot or req.window_sampled >= req.max_new or req.length + 1 >= max_tokens:
        return True
    return req.audio_ctx < full_audio_ctx and repeats_at_end([t for t in req.generated if t < eot])


def loop_reason(req: Request, rules: TextRules, full_audio_ctx: int) -> LoopReason | None:
    """Why a trimmed window's decode counts as a loop ("Please hold. Please hold. ..."), or None:
    a span said twice at the end, no end of text within a generous budget (unless the caller's own
    token limit stopped it), or text that compresses like a loop. Full-context windows are Whisper's
    own decode and never fall back."""
    if req.audio_ctx >= full_audio_ctx:
        return None
    eot = rules.vocab.eot
    ended = req.generated[-1] == eot
    caller_limit = req.options.max_new_tokens
    if not ended and caller_limit is not None and req.window_sampled >= caller_limit:
        return None  # the caller's own limit is no loop
    if repeats_at_end([t for t in req.generated if t < eot]):
        return "repeat"
    if not ended:
        return "no_eot"
    if compression_ratio(rules.text(req.generated)) > COMPRESSION_RATIO_THRESHOLD:
        return "compression"
    return None


def window_avg_logprob(req: Request) -> float:
    """The mean log-probability of this window's sampled tokens (end of text included, as Whisper's)."""
    return (req.sum_logprob - req.window_start[0]) / max(1, req.window_sampled)


def failure_of(decode: Attempt, no_speech_prob: float) -> TemperatureFailure | None:
    """Why a window's decode (`attempt`, or the best of a temperature's samples) fails openai/whisper's
    fallback thresholds, or None: its text compresses more than COMPRESSION_RATIO_THRESHOLD, or its mean
    log-probability is below LOGPROB_THRESHOLD. A window judged silence (no-speech probability above
    NO_SPEECH_THRESHOLD with that low mean) passes: another temperature would only find words in the noise."""
    if decode.compression_ratio > COMPRESSION_RATIO_THRESHOLD:
        return "compression"
    if decode.avg_logprob < LOGPROB_THRESHOLD and not no_speech_prob > NO_SPEECH_THRESHOLD:
        return "logprob"
    return None


def best_sample(samples: list[Attempt]) -> Attempt:
    """Of a temperature's best_of samples, the likeliest by summed log-probability over length, as
    openai/whisper ranks them (length_penalty None): the mean log-probability."""
    return max(samples, key=lambda a: a.avg_logprob)


def attempt(req: Request, rules: TextRules) -> Attempt:
    """This window's decode as it stands, to compare with the decodes at other temperatures."""
    return Attempt(
        temperature=req.temperature,
        generated=tuple(req.generated),
        sum_logprob=req.sum_logprob - req.window_start[0],
        sampled=req.window_sampled,
        avg_logprob=window_avg_logprob(req),
        compression_ratio=compression_ratio(rules.text(req.generated)),
    )


def best_attempt(attempts: list[Attempt]) -> Attempt:
    """When every temperature failed: the decode with the best mean log-probability among those whose
    text does not compress like a loop (all of them if none), as faster-whisper chooses; openai/whisper
    keeps the last, usually a sample at temperature 1 (more words the speaker never said)."""
    unlooped = [a for a in attempts if a.compression_ratio <= COMPRESSION_RATIO_THRESHOLD]
    return max(unlooped or attempts, key=lambda a: a.avg_logprob)


def transcript(req: Request, rules: DecodingRules) -> Transcript:
    """The result of a request whose every window has finished (req.window_tokens)."""
    if req.encode_start is None:
        raise RuntimeError(f"request {req.id} finished without an encoder pass")
    tokens = [t for window in req.window_tokens for t in window]
    text_tokens = [t for t in tokens if t < rules.vocab.eot]
    text = rules.text(text_tokens)
    avg_logprob = req.sum_logprob / max(1, req.sampled)
    is_speech = not rules.is_silence(req.no_speech_prob, avg_logprob, text)
    segments: list = []
    if req.options.timestamps:
        for i, window in enumerate(req.window_tokens):
            segments.extend(rules.segments(window, offset_s=float(CHUNK_SECONDS * i)))
    return Transcript(
        text=text if is_speech else "",
        tokens=tuple(text_tokens),
        avg_logprob=avg_logprob,
        no_speech_prob=req.no_speech_prob,
        language=req.language or "en",
        segments=tuple(segments) if is_speech else (),
        words=tuple(req.words) if is_speech else (),
        is_speech=is_speech,
        temperature=max(req.window_temperatures, default=0.0),
        stats=UtteranceStats(
            audio_s=req.audio_s,
            queue_wait_s=req.encode_start - req.ready_time,
            encoder_batch_size=req.encoder_batch_size,
            decode_steps=req.decode_steps,
            latency_s=time.monotonic() - req.ready_time,
        ),
    )

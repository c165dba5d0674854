"""Domain settings -> what the engine and the result builder are asked for, every bound checked here.

The checks run in the frontend before any audio is read: the audio format, the prompt in characters and
then in tokens with the engine's own tokenizer (ModelInfo.prompts), the language against the model's,
keyterms, and the endpointing knobs. Each failure is a ValueError whose message names the setting
(AudioFormatError and EndpointingError also carry it as `field`); the core turns them into
RecognitionError(INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.api import (
    WHISPER_TEMPERATURES,
    DecodeOptions,
    ModelInfo,
    Priority,
    check_keyterm_tokens,
    check_prompt_chars,
)
from service.pipeline.audio import validate_stream_format
from service.pipeline.results import ResultOptions
from service.vocabulary.call_metrics import CallMetricsSettings, validate_interval
from service.vocabulary.endpointing import EndpointSettings
from service.vocabulary.engine import RecognitionEngine
from service.vocabulary.types import (
    CallInfo,
    DiarizationSettings,
    Formatting,
    RecognitionSettings,
    StreamSettings,
)

# BCP-47 tags: RFC 5646 asks for at least 35 characters; only the primary subtag is read.
MAX_LANGUAGE_CODE_CHARS = 64

# BCP-47 primary subtags that Whisper spells differently.
_BCP47_TO_WHISPER = {"iw": "he", "jv": "jw", "nb": "no", "fil": "tl"}


def whisper_language(code: str, info: ModelInfo) -> str | None:
    """ "en-US" / "en" / "" -> Whisper's code (None: the model's default or detection)."""
    if len(code) > MAX_LANGUAGE_CODE_CHARS:
        raise ValueError(
            f"language_code has {len(code)} characters, over the limit of {MAX_LANGUAGE_CODE_CHARS} "
            "(a BCP-47 tag such as en-US, or Whisper's code)"
        )
    if not code.strip():
        return None
    primary = code.strip().replace("_", "-").split("-")[0].lower()
    lang = _BCP47_TO_WHISPER.get(primary, primary)
    if lang not in info.languages:
        hint = "only en" if info.languages == {"en"} else f"{len(info.languages)} Whisper languages"
        raise ValueError(f"language_code {code!r} is not supported by model {info.name} ({hint})")
    return lang


def beams_for(
    keyterms: tuple[str, ...] | list[str], beam_size: int, keyterm_beam_size: int, asked: int | None = None
) -> int:
    """The beams a request searches: those the call asked for (RecognitionSettings.beam_size), else the
    server's for its kind of work, or with keyterms at least --beam-size-keyterms (a name that starts a
    token behind the model's choice survives as a beam)."""
    if asked is not None:
        return asked
    return max(beam_size, keyterm_beam_size) if keyterms else beam_size


def temperatures_for(temperature: float | None) -> tuple[float, ...] | None:
    """The engine's schedule for RecognitionSettings.temperature (raises ValueError naming it): None the
    server's; 0 openai-whisper's fallback from 0 (as OpenAI documents temperature 0); above 0 that one."""
    if temperature is None:
        return None
    if not 0 <= temperature <= 1:
        raise ValueError(f"temperature must be from 0 to 1, got {temperature!r}")
    return WHISPER_TEMPERATURES if temperature == 0 else (float(temperature),)


def decode_options(
    settings: RecognitionSettings,
    engine: RecognitionEngine,
    priority: Priority = Priority.LIVE,
    beam_size: int = 1,
    keyterm_beam_size: int = 1,
) -> DecodeOptions:
    """The engine's options for these settings (raises ValueError naming the setting); `beam_size`: the
    server's for this kind of work (--beam-size-final, --beam-size-recorded), `keyterm_beam_size` when
    the settings list keyterms (--beam-size-keyterms)."""
    check_prompt_chars(settings.prompt)
    if engine.info.prompts is not None:
        engine.info.prompts.encode(settings.prompt)  # remembered: an in-process engine finds it tokenized
    options = DecodeOptions(
        language=whisper_language(settings.language, engine.info),
        prompt=settings.prompt or None,
        timestamps=settings.segments,
        # diarization gives each word a speaker by its times, asked for or not
        word_timestamps=settings.word_times or settings.word_confidence or settings.diarization is not None,
        keyterms=tuple(settings.keyterms),
        priority=priority,
        beam_size=beams_for(settings.keyterms, beam_size, keyterm_beam_size, settings.beam_size),
        temperatures=temperatures_for(settings.temperature),
    )
    _validate(options, engine)
    return options


def _validate(options: DecodeOptions, engine: RecognitionEngine) -> None:
    """The engine's own checks, and here, in the frontend, the keyterm bound only a tokenizer can check:
    an engine in another process would otherwise find it only at the first utterance."""
    engine.validate(options)
    if options.keyterms and engine.info.prompts is not None:
        check_keyterm_tokens(options.keyterms, engine.info.prompts.text_tokens)


def with_keyterms(
    options: DecodeOptions,
    keyterms: tuple[str, ...],
    engine: RecognitionEngine,
    beam_size: int = 1,
    keyterm_beam_size: int = 1,
    asked_beams: int | None = None,
) -> DecodeOptions:
    """`options` with another keyterm list (and the beams it gets: decode_options; `asked_beams` the
    call's own, StreamPlan.beam_size), checked by the engine (raises ValueError naming keyterms)."""
    beams = beams_for(keyterms, beam_size, keyterm_beam_size, asked_beams)
    changed = dataclasses.replace(options, keyterms=tuple(keyterms), beam_size=beams)
    _validate(changed, engine)
    return changed


def result_options(settings: RecognitionSettings) -> ResultOptions:
    return ResultOptions(
        segments=settings.segments,
        word_times=settings.word_times,
        word_confidence=settings.word_confidence,
        redact=settings.redact,
        smart=settings.formatting is Formatting.SMART,
        speakers=settings.diarization is not None,
    )


@dataclass(frozen=True)
class StreamPlan:
    """A stream's settings, checked and resolved for the pipeline (pipeline/session.py)."""

    encoding: str
    sample_rate_hertz: int
    channels: int
    separate_channels: bool
    options: DecodeOptions
    endpointing: EndpointSettings | None  # None: the client cuts utterances (Stream.finalize)
    interim_results: bool
    single_utterance: bool
    empty_finals: bool = False
    results: ResultOptions = field(default_factory=ResultOptions)
    speech_start_timeout_s: float | None = None  # StreamSettings' voice activity timeouts
    speech_end_timeout_s: float | None = None
    call_metrics: CallMetricsSettings = field(default_factory=CallMetricsSettings)
    report_call_metrics: bool = False  # CallMetricsReport events go out (StreamSettings.call_metrics)
    call_metrics_interval_s: float = 0.0
    call: CallInfo | None = None  # the telephony call the stream carries (StreamSettings.call)
    context_carry: bool | None = None  # RecognitionSettings.context_carry (None: --context-carry)
    beam_size: int | None = None  # RecognitionSettings.beam_size: kept when the keyterms change
    # live speaker labels (service/pipeline/live_diarization.py); separate channels are their own speakers
    diarization: DiarizationSettings | None = None


def plan_stream(
    settings: StreamSettings,
    engine: RecognitionEngine,
    beam_size: int = 1,
    max_speakers: int = 10,
    keyterm_beam_size: int = 1,
) -> StreamPlan:
    """Check a stream's settings in the order a client fixes them (format, decoding, endpointing);
    raises AudioFormatError, EndpointingError or ValueError naming the setting. `beam_size`: its finals'
    (--beam-size-final; interims are greedy), `keyterm_beam_size` theirs with keyterms
    (--beam-size-keyterms). `max_speakers`: --max-diarization-speakers."""
    r = settings.recognition
    rate, channels = validate_stream_format(r.format.encoding, r.format.sample_rate_hertz, r.format.channels)
    options = decode_options(r, engine, beam_size=beam_size, keyterm_beam_size=keyterm_beam_size)
    if settings.endpointing is not None:
        settings.endpointing.validate()
    for name in ("speech_start_timeout", "speech_end_timeout"):
        value = getattr(settings, f"{name}_s")
        if value is None:
            continue
        if settings.endpointing is None:
            raise ValueError(f"{name} needs endpointing: without it no speech is detected")
        if not value > 0:
            raise ValueError(f"{name} must be more than 0 s, got {value:g}")
    r.call_metrics.validate()
    if r.diarization is not None:
        r.diarization.validate(max_speakers)
    validate_interval(settings.call_metrics_interval_s)
    return StreamPlan(
        encoding=r.format.encoding,
        sample_rate_hertz=rate,
        channels=channels,
        separate_channels=r.separate_channels and channels > 1,
        options=options,
        endpointing=settings.endpointing,
        interim_results=settings.interim_results,
        single_utterance=settings.single_utterance,
        empty_finals=settings.empty_finals,
        results=result_options(r),
        speech_start_timeout_s=settings.speech_start_timeout_s,
        speech_end_timeout_s=settings.speech_end_timeout_s,
        call_metrics=r.call_metrics,
        report_call_metrics=settings.call_metrics,
        call_metrics_interval_s=settings.call_metrics_interval_s,
        call=settings.call,
        context_carry=r.context_carry,
        beam_size=r.beam_size,
        diarization=r.diarization,
    )

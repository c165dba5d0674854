"""Riva's RecognitionConfig as plain settings (`RivaRequest`), and those as the core's; the core's
refusals back in Riva's field names."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_audio_pb2 as raudio

from service.vocabulary.endpointing import EndpointingError
from service.vocabulary.errors import RecognitionError
from service.vocabulary.types import (
    MAX_PHRASE_BYTES,
    MAX_PHRASES_READ,
    AudioFormat,
    DiarizationSettings,
    EndpointSettings,
    Formatting,
    RecognitionSettings,
)

# Riva's defaults where the client leaves a field unset (the proto3 zero): 16-bit PCM at 16 kHz, mono.
DEFAULT_ENCODING = "LINEAR16"
DEFAULT_RATE = 16000
# Bounds on the maps a client may send (custom_configuration, runtime_config): plugin parameters of a
# Riva pipeline, which this server reads only to refuse what it cannot honour.
MAX_MAP_ENTRIES = 64
MAX_MAP_CHARS = 1024  # key plus value
STREAM_ENCODINGS = {
    raudio.LINEAR_PCM: "LINEAR16",
    raudio.MULAW: "MULAW",
    raudio.ALAW: "ALAW",
}
# Whole files, for Recognize only: their header says rate and channels.
FILE_ENCODINGS = {raudio.FLAC: "FLAC", raudio.OGGOPUS: "OGG_OPUS"}


class RivaFieldError(ValueError):
    """A request the door refuses: INVALID_ARGUMENT, the message naming the Riva field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


def encoding_name(value: int) -> str:
    if value in raudio.AudioEncoding.values():
        return raudio.AudioEncoding.Name(value)
    return f"unknown value {value}"


@dataclass(frozen=True)
class Endpointing:
    """Riva's endpointing_config as the endpointer's durations (None: the server's default).

    Riva ends an utterance once `stop_threshold` of the last `stop_history` ms of its acoustic model's
    output is blank, and starts one once `start_threshold` of `start_history` ms is not: the silence
    that ends an utterance is stop_history x stop_threshold, the speech that starts one start_history x
    start_threshold (a threshold alone scales the server's default window). The probability thresholds
    of the voice-activity model stay the server's: Riva's thresholds are fractions of frames, not
    probabilities. The 2-pass end of utterance (stop_history_eou, stop_threshold_eou) is checked and
    otherwise a hint: speculative endpointing already starts the final's decode at the short silence.
    """

    min_silence_s: float | None = None
    min_speech_s: float | None = None


@dataclass(frozen=True)
class RivaRequest:
    """A Riva RecognitionConfig (and StreamingRecognitionConfig) as plain settings."""

    # LINEAR16, MULAW, ALAW (streams and raw recordings), FLAC, WAV, OGG_OPUS (recordings); a recording
    # with a header, or a stream whose first bytes are a WAV header, says its own (sniff_container).
    encoding: str
    sample_rate_hertz: int
    channels: int
    separate_channels: bool
    language_code: str  # as sent ("" : the model's default); the core checks the model serves it
    keyterms: tuple[str, ...]
    # where each keyterm came from ("speech_contexts[0].phrases[2]"), for refusals in Riva's terms
    keyterm_fields: tuple[str, ...]
    words: bool  # enable_word_time_offsets: words with start and end (ms) and confidence
    endpointing: Endpointing
    interim_results: bool = False
    # verbatim_transcripts false (Riva's default: inverse text normalization): numbers as digits
    formatting: Formatting = Formatting.VERBATIM
    # Accepted options that change nothing here (the asr-hints metadata): "model", "max_alternatives", ...
    hints: tuple[str, ...] = ()
    # diarization_config: a speaker_tag on every word (streams: placed at each final)
    diarization: DiarizationSettings | None = None

    def recognition_settings(
        self, audio_format: AudioFormat, *, separate_channels: bool
    ) -> RecognitionSettings:
        """The core's settings for audio of `audio_format` (the config's, or what the audio's header says)."""
        return RecognitionSettings(
            format=audio_format,
            separate_channels=separate_channels,
            language=self.language_code,
            keyterms=self.keyterms,
            word_times=self.words,
            word_confidence=self.words,
            formatting=self.formatting,
            diarization=self.diarization,
        )


def _check_map(name: str, entries: Mapping[str, str]) -> None:
    if len(entries) > MAX_MAP_ENTRIES:
        raise RivaFieldError(name, f"{name} has {len(entries)} entries, over the limit of {MAX_MAP_ENTRIES}")
    for key, value in entries.items():
        if len(key) + len(value) > MAX_MAP_CHARS:
            raise RivaFieldError(
                name,
                f"{name} entry {key[:40]!r} has {len(key) + len(value)} characters, over the limit of "
                f"{MAX_MAP_CHARS}",
            )


def _keyterms(contexts: Sequence[rasr.SpeechContext]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """speech_contexts (riva.client's add_word_boosting_to_config) -> keyterms, in order, once each.

    A positive boost is a hint of how strongly (the server's keyterm bias has one strength); a
    negative one asks to suppress a phrase, which this server cannot do: refused, as dropping it would
    turn a suppression into nothing."""
    count = sum(len(context.phrases) for context in contexts)
    if count > MAX_PHRASES_READ:
        raise RivaFieldError(
            "speech_contexts",
            f"speech_contexts hold {count} phrases; at most {MAX_PHRASES_READ} per request (of which at most "
            "100 distinct)",
        )
    size = sum(context.ByteSize() for context in contexts)
    if size > MAX_PHRASE_BYTES:
        raise RivaFieldError(
            "speech_contexts",
            f"speech_contexts hold {size} bytes; at most {MAX_PHRASE_BYTES} bytes of phrases per request",
        )
    terms: dict[str, str] = {}
    for i, context in enumerate(contexts):
        if math.isnan(context.boost) or context.boost < 0:
            raise RivaFieldError(
                f"speech_contexts[{i}].boost",
                f"speech_contexts[{i}].boost is {context.boost:g}: negative boosts (suppressing a phrase) "
                "are not supported; send positive boosts or leave the phrase out",
            )
        for j, phrase in enumerate(context.phrases):
            terms.setdefault(" ".join(phrase.split()), f"speech_contexts[{i}].phrases[{j}]")
    return tuple(terms), tuple(terms.values())


def _fraction(ep: rasr.EndpointingConfig, name: str) -> float | None:
    if not ep.HasField(name):
        return None
    value = getattr(ep, name)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise RivaFieldError(
            f"endpointing_config.{name}",
            f"endpointing_config.{name} must be in (0, 1] (a fraction of the window), got {value:g}",
        )
    return float(value)


def _window_ms(ep: rasr.EndpointingConfig, name: str) -> int | None:
    if not ep.HasField(name):
        return None
    value = getattr(ep, name)
    if value <= 0:
        raise RivaFieldError(
            f"endpointing_config.{name}",
            f"endpointing_config.{name} must be a positive number of ms, got {value}",
        )
    return int(value)


def endpointing(
    config: rasr.RecognitionConfig, default_silence_s: float, default_speech_s: float
) -> Endpointing:
    """endpointing_config -> durations; the defaults are the server's (the window a lone threshold
    scales). The core checks the durations against its bounds (the door names the Riva fields)."""
    if not config.HasField("endpointing_config"):
        return Endpointing()
    ep = config.endpointing_config
    start_ms, start_th = _window_ms(ep, "start_history"), _fraction(ep, "start_threshold")
    stop_ms, stop_th = _window_ms(ep, "stop_history"), _fraction(ep, "stop_threshold")
    eou_ms, _ = _window_ms(ep, "stop_history_eou"), _fraction(ep, "stop_threshold_eou")
    if eou_ms is not None and stop_ms is not None and eou_ms >= stop_ms:
        raise RivaFieldError(
            "endpointing_config.stop_history_eou",
            f"endpointing_config.stop_history_eou ({eou_ms} ms) must be below stop_history ({stop_ms} ms)",
        )

    def scaled(window_ms: int | None, threshold: float | None, default_s: float) -> float | None:
        if window_ms is None and threshold is None:
            return None
        window_s = default_s if window_ms is None else window_ms / 1000
        return window_s * (1.0 if threshold is None else threshold)

    return Endpointing(
        min_silence_s=scaled(stop_ms, stop_th, default_silence_s),
        min_speech_s=scaled(start_ms, start_th, default_speech_s),
    )


def recognition_request(
    config: rasr.RecognitionConfig,
    *,
    default_silence_s: float,
    default_speech_s: float,
    interim_results: bool = False,
) -> RivaRequest:
    """Read a RecognitionConfig; raises RivaFieldError for what the door refuses."""
    if config.encoding in STREAM_ENCODINGS:
        encoding = STREAM_ENCODINGS[config.encoding]
    elif config.encoding in FILE_ENCODINGS:
        encoding = FILE_ENCODINGS[config.encoding]
    elif config.encoding == raudio.ENCODING_UNSPECIFIED:
        encoding = DEFAULT_ENCODING  # unless the audio starts with a header (sniff_container)
    else:
        raise RivaFieldError(
            "encoding",
            f"encoding {encoding_name(config.encoding)} is not supported (LINEAR_PCM, MULAW, ALAW; FLAC and "
            "OGGOPUS files with Recognize)",
        )
    if config.max_alternatives < 0:
        raise RivaFieldError(
            "max_alternatives", f"max_alternatives must be 0 or more, got {config.max_alternatives}"
        )
    diarization = None
    if config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization:
        diarization = DiarizationSettings(max_speakers=config.diarization_config.max_speaker_count)
    if config.profanity_filter:  # dropped silently, a caller would show what it asked to have masked
        raise RivaFieldError(
            "profanity_filter",
            "profanity_filter is not supported: this server masks no profanity (set it false)",
        )
    _check_map("custom_configuration", config.custom_configuration)
    channels = config.audio_channel_count or 1
    keyterms, keyterm_fields = _keyterms(config.speech_contexts)
    hints = [
        name
        for name, on in (
            ("max_alternatives", config.max_alternatives > 1),  # greedy decoding: one alternative
            ("enable_automatic_punctuation", not config.enable_automatic_punctuation),  # Whisper punctuates
            ("model", bool(config.model)),
            ("custom_configuration", bool(config.custom_configuration)),
            ("endpointing_config.stop_history_eou", config.endpointing_config.HasField("stop_history_eou")),
        )
        if on
    ]
    return RivaRequest(
        encoding=encoding,
        sample_rate_hertz=config.sample_rate_hertz or DEFAULT_RATE,
        channels=channels,
        separate_channels=config.enable_separate_recognition_per_channel and channels > 1,
        language_code=config.language_code.strip(),
        keyterms=keyterms,
        keyterm_fields=keyterm_fields,
        words=config.enable_word_time_offsets,
        endpointing=endpointing(config, default_silence_s, default_speech_s),
        interim_results=interim_results,
        formatting=Formatting.VERBATIM if config.verbatim_transcripts else Formatting.SMART,
        hints=tuple(hints),
        diarization=diarization,
    )


def check_runtime_config(request: rasr.StreamingRecognizeRequest) -> None:
    _check_map("runtime_config", request.runtime_config)


# The core's names for the settings it blames -> Riva's (the same unless listed here)
STREAM_NAMES = {
    "keyterms": "speech_contexts",
    "diarization": "diarization_config",
    "diarization.max_speakers": "diarization_config.max_speaker_count",
}
RECOGNIZE_NAMES = {**STREAM_NAMES, "audio_content": "audio"}
_KEYTERM_INDEX = re.compile(r"\bkeyterms\[(\d+)\]")
_ENDPOINTING_FIELDS = {
    "endpointing.min_silence_duration": (
        "endpointing_config.stop_history",
        "x stop_threshold (the silence that ends an utterance)",
    ),
    "endpointing.min_speech_duration": (
        "endpointing_config.start_history",
        "x start_threshold (the speech that starts an utterance)",
    ),
}


def riva_error(e: RecognitionError, names: Mapping[str, str], keyterm_fields: Sequence[str] = ()) -> str:
    """The core's message with the field as Riva names it (a keyterm by its speech_contexts place)."""

    def place(m: re.Match[str]) -> str:
        i = int(m.group(1))
        return keyterm_fields[i] if i < len(keyterm_fields) else m.group()

    if (e.field or "").startswith("keyterms"):
        return _KEYTERM_INDEX.sub(place, e.message).replace("keyterms", "speech_contexts")
    return e.message_for(names)


def endpoint_settings(ep: Endpointing) -> EndpointSettings:
    """Riva's endpointing durations on the server's endpointer (unset: its defaults), checked against
    its bounds with the message in Riva's fields."""
    if ep == Endpointing():
        return EndpointSettings()
    try:
        return EndpointSettings.from_overrides(
            min_silence_s=ep.min_silence_s or 0.0, min_speech_s=ep.min_speech_s or 0.0
        )
    except EndpointingError as e:
        riva, what = _ENDPOINTING_FIELDS.get(e.field, ("endpointing_config", e.field))
        bound = str(e)[str(e).find("must be") :]
        raise RivaFieldError(riva, f"{riva}: {what} {bound} s") from e

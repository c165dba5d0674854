"""Google Cloud Speech-to-Text v1 (`google.cloud.speech.v1.Speech`) on the gRPC port, as a door onto the core.

The messages are google-cloud-speech's own (raw protobuf classes, `Type.pb()`); this module reads them into
plain settings and builds Google's responses from the core's results. What Google's v1 has and this server
does not, where silently doing without it would change what a result means, is refused INVALID_ARGUMENT
naming the field; hint-only options are accepted (docs/operations.md, "The Google Speech door").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.cloud.speech_v1.types import cloud_speech
from google.protobuf import duration_pb2

SERVICE = "google.cloud.speech.v1.Speech"
OPERATIONS_SERVICE = "google.longrunning.Operations"
DOOR = "google"

# The raw protobuf classes the door serves (google-cloud-speech's proto-plus types wrap these).
RecognitionConfig: Any = cloud_speech.RecognitionConfig.pb()
StreamingRecognitionConfig: Any = cloud_speech.StreamingRecognitionConfig.pb()
StreamingRecognizeRequest: Any = cloud_speech.StreamingRecognizeRequest.pb()
StreamingRecognizeResponse: Any = cloud_speech.StreamingRecognizeResponse.pb()
StreamingRecognitionResult: Any = cloud_speech.StreamingRecognitionResult.pb()
RecognizeRequest: Any = cloud_speech.RecognizeRequest.pb()
RecognizeResponse: Any = cloud_speech.RecognizeResponse.pb()
LongRunningRecognizeRequest: Any = cloud_speech.LongRunningRecognizeRequest.pb()
LongRunningRecognizeResponse: Any = cloud_speech.LongRunningRecognizeResponse.pb()
LongRunningRecognizeMetadata: Any = cloud_speech.LongRunningRecognizeMetadata.pb()
SpeechRecognitionResult: Any = cloud_speech.SpeechRecognitionResult.pb()

Encoding = cloud_speech.RecognitionConfig.AudioEncoding
SpeechEvent = cloud_speech.StreamingRecognizeResponse.SpeechEventType

# Google's v1 encodings this server decodes. FLAC (and WAV, which v1 names no encoding for: its header
# says) are whole files, so Recognize and LongRunningRecognize only.
STREAM_ENCODINGS = {Encoding.LINEAR16: "LINEAR16", Encoding.MULAW: "MULAW"}
FILE_MAGIC = {b"fLaC": "FLAC", b"RIFF": "WAV"}
# Google's own bounds (RecognitionConfig's documentation): at most 3 alternative languages, and
# max_alternatives 0-30 (we return one alternative: the server "may return fewer").
MAX_ALTERNATIVE_LANGUAGES = 3
MAX_ALTERNATIVES = 30
# Voice activity timeouts: "greater than 500ms and less than 60s" (Google, "Voice activity events and
# timeouts").
VOICE_TIMEOUT_RANGE_S = (0.5, 60.0)


class GoogleRequestError(Exception):
    """A request the door refuses: the gRPC status and a message naming the field."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> GoogleRequestError:
    return GoogleRequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Recognition:
    """A RecognitionConfig as plain values.

    encoding: LINEAR16 | MULAW for raw audio, FLAC | WAV for a whole file, "" when the file's header must
    say (Recognize with ENCODING_UNSPECIFIED; resolved by `file_encoding`).
    """

    encoding: str
    sample_rate_hertz: int
    channels: int
    separate_channels: bool
    language_code: str
    alternative_language_codes: tuple[str, ...]
    keyterms: tuple[str, ...]
    word_time_offsets: bool
    word_confidence: bool
    model: str


@dataclass(frozen=True)
class Streaming:
    """A StreamingRecognitionConfig as plain values (timeouts in seconds of audio, None: unset)."""

    recognition: Recognition
    single_utterance: bool
    interim_results: bool
    voice_activity_events: bool
    speech_start_timeout_s: float | None
    speech_end_timeout_s: float | None


def _seconds(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(max(seconds, 0.0) * 1e9))
    return d


def _encoding_name(value: int) -> str:
    try:
        return Encoding(value).name
    except ValueError:
        return f"unknown value {value}"


def _keyterms(config: Any) -> tuple[str, ...]:
    """speech_contexts' phrases and adaptation's inline phrase sets, in order, once each.

    Boost has no per-term strength here (the keyterm bias is the server's); a negative boost asks for
    anti-biasing, which Google does not apply either ("negative boost will simply be ignored"), so those
    phrases are left out. Class tokens ($MONTH, ${my-class}) name Google's classes, not words: left out.
    """
    phrases: list[str] = []
    for context in config.speech_contexts:
        if context.boost >= 0:
            phrases.extend(context.phrases)
    adaptation = config.adaptation
    if adaptation.phrase_set_references:
        raise _invalid(
            "config.adaptation.phrase_set_references is not supported: this server keeps no PhraseSet "
            "resources; put the phrases in config.speech_contexts or inline in config.adaptation.phrase_sets"
        )
    if adaptation.HasField("abnf_grammar") and adaptation.abnf_grammar.abnf_strings:
        raise _invalid(
            "config.adaptation.abnf_grammar is not supported: recognition is not restricted to a grammar"
        )
    for phrase_set in adaptation.phrase_sets:
        for phrase in phrase_set.phrases:
            if (phrase.boost or phrase_set.boost) >= 0:
                phrases.append(phrase.value)
    seen: dict[str, None] = {}
    for phrase in phrases:
        text = " ".join(phrase.split())
        if text and not text.startswith("$"):
            seen.setdefault(text, None)
    return tuple(seen)


def _refuse_unsupported(config: Any) -> None:
    """What Google v1 does and this server does not, where doing without it changes what a result means."""
    if config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization:
        raise _invalid(
            "config.diarization_config.enable_speaker_diarization is not supported: this server does not "
            "diarize; send each party on its own channel (audio_channel_count with "
            "enable_separate_recognition_per_channel) for results tagged by channel"
        )
    if config.HasField("transcript_normalization") and config.transcript_normalization.entries:
        raise _invalid(
            "config.transcript_normalization is not supported: transcripts are returned as recognized"
        )
    if config.profanity_filter:
        raise _invalid("config.profanity_filter is not supported: transcripts are returned unfiltered")
    if len(config.alternative_language_codes) > MAX_ALTERNATIVE_LANGUAGES:
        raise _invalid(
            f"config.alternative_language_codes has {len(config.alternative_language_codes)} values, over the "
            f"limit of {MAX_ALTERNATIVE_LANGUAGES}"
        )
    if not 0 <= config.max_alternatives <= MAX_ALTERNATIVES:
        raise _invalid(
            f"config.max_alternatives must be between 0 and {MAX_ALTERNATIVES}, got {config.max_alternatives}"
        )


def recognition(config: Any, *, streaming: bool) -> Recognition:
    """Read a RecognitionConfig; GoogleRequestError for what the door refuses. Ranges the core bounds
    (rate, channels, language, keyterms) are checked there, with the same field names."""
    _refuse_unsupported(config)
    if streaming:
        if config.encoding not in STREAM_ENCODINGS:
            raise _invalid(
                f"config.encoding must be one of {', '.join(STREAM_ENCODINGS.values())} in StreamingRecognize, "
                f"got {_encoding_name(config.encoding)}"
                + (" (a whole file: send it with Recognize)" if config.encoding == Encoding.FLAC else "")
            )
        encoding = STREAM_ENCODINGS[config.encoding]
    elif config.encoding in STREAM_ENCODINGS:
        encoding = STREAM_ENCODINGS[config.encoding]
    elif config.encoding == Encoding.FLAC:
        encoding = "FLAC"
    elif config.encoding == Encoding.ENCODING_UNSPECIFIED:
        encoding = ""
    else:
        raise _invalid(
            "config.encoding must be one of LINEAR16, MULAW, FLAC, or unset for a FLAC or WAV file, "
            f"got {_encoding_name(config.encoding)}"
        )
    return Recognition(
        encoding=encoding,
        sample_rate_hertz=config.sample_rate_hertz,
        channels=config.audio_channel_count or 1,
        separate_channels=config.enable_separate_recognition_per_channel and config.audio_channel_count > 1,
        language_code=config.language_code,
        alternative_language_codes=tuple(config.alternative_language_codes),
        keyterms=_keyterms(config),
        word_time_offsets=config.enable_word_time_offsets,
        word_confidence=config.enable_word_confidence,
        model=config.model,
    )


def file_encoding(declared: str, content: bytes | memoryview) -> str:
    """What a recorded file is: v1 lets the header say for FLAC and WAV (a WAV of LINEAR16 or MULAW may
    also come with that encoding set); raw LINEAR16/MULAW otherwise."""
    kind = FILE_MAGIC.get(bytes(content[:4]))
    if kind is not None and declared in ("", kind, "LINEAR16", "MULAW"):
        return kind
    if declared == "FLAC":
        raise _invalid("config.encoding is FLAC but audio.content is not a FLAC file")
    if not declared:
        raise _invalid(
            "config.encoding is unset and audio.content is neither a FLAC nor a WAV file; set config.encoding"
        )
    return declared


def streaming(config: Any) -> Streaming:
    """Read a StreamingRecognitionConfig."""
    rec = recognition(config.config, streaming=True)
    timeouts: dict[str, float | None] = {"speech_start_timeout": None, "speech_end_timeout": None}
    # Google applies voice_activity_timeout only with enable_voice_activity_events ("The field
    # voice_activity_events must also be set to true"), so without them it is ignored here too.
    if config.enable_voice_activity_events and config.HasField("voice_activity_timeout"):
        vat = config.voice_activity_timeout
        low, high = VOICE_TIMEOUT_RANGE_S
        for name in timeouts:
            if vat.HasField(name):
                value = _seconds(getattr(vat, name))
                if not low < value < high:
                    raise _invalid(
                        f"streaming_config.voice_activity_timeout.{name} must be more than {low:g} s and less "
                        f"than {high:g} s, got {value:g}"
                    )
                timeouts[name] = value
    return Streaming(
        recognition=rec,
        single_utterance=config.single_utterance,
        interim_results=config.interim_results,
        voice_activity_events=config.enable_voice_activity_events,
        speech_start_timeout_s=timeouts["speech_start_timeout"],
        speech_end_timeout_s=timeouts["speech_end_timeout"],
    )


def audio_content(audio: Any) -> bytes:
    """RecognitionAudio's bytes: Cloud Storage URIs are not fetched."""
    if audio.WhichOneof("audio_source") == "uri":
        raise _invalid("audio.uri is not supported: this server reads no Cloud Storage; send audio.content")
    if not audio.content:
        raise _invalid("audio.content is empty")
    return audio.content


def refuse_output_config(request: Any) -> None:
    if request.HasField("output_config") and request.output_config.gcs_uri:
        raise _invalid("output_config.gcs_uri is not supported: the results come back in the operation")


# --- responses -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Word:
    word: str
    start_s: float
    end_s: float
    confidence: float


def alternative(
    message: Any, transcript: str, confidence: float, words: Sequence[Word], rec: Recognition, final: bool
) -> None:
    """Fill one SpeechRecognitionAlternative. Confidence is set on finals only ("set only for the top
    alternative of a non-streaming result or, of a streaming result where is_final=true")."""
    message.transcript = transcript
    if final:
        message.confidence = confidence
        if rec.word_time_offsets or rec.word_confidence:
            for w in words:
                info = message.words.add(word=w.word)
                if rec.word_time_offsets:
                    info.start_time.CopyFrom(duration(w.start_s))
                    info.end_time.CopyFrom(duration(w.end_s))
                if rec.word_confidence:
                    info.confidence = w.confidence


def speech_event(kind: int, at_s: float) -> Any:
    return StreamingRecognizeResponse(speech_event_type=kind, speech_event_time=duration(at_s))


def language_tag(language: str, rec: Recognition) -> str:
    """A result's BCP-47 tag: the caller's own when the language is theirs, else Whisper's code."""
    for tag in (rec.language_code, *rec.alternative_language_codes):
        if tag and tag.replace("_", "-").split("-")[0].lower() == language:
            return tag.lower()
    return language

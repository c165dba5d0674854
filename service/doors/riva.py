"""The NVIDIA Riva ASR door: `nvidia.riva.asr.RivaSpeechRecognition` on the gRPC port, beside asr.v1.

One translation layer, over the generated messages of the `nvidia-riva-client` package (never a copy of
its proto): a Riva RecognitionConfig becomes plain settings (`RivaRequest`), the core's results become
Riva messages. What Riva has and this server does not, and whose silent absence would change what a
result means (speaker diarization, negative word boosts, a language the model does not serve, an
encoding it cannot decode), is refused with INVALID_ARGUMENT naming the Riva field; options that only
shape formatting are accepted (docs/operations.md, "Riva door").
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_audio_pb2 as raudio

SERVICE_NAME = rasr.DESCRIPTOR.services_by_name["RivaSpeechRecognition"].full_name
DOOR = "riva"  # the core's `door` metrics label

# Riva's defaults where the client leaves a field unset (the proto3 zero): 16-bit PCM at 16 kHz, mono.
DEFAULT_ENCODING = "LINEAR16"
DEFAULT_RATE = 16000
# Bounds on the maps a client may send (custom_configuration, runtime_config): plugin parameters of a
# Riva pipeline, which this server reads only to refuse what it cannot honour.
MAX_MAP_ENTRIES = 64
MAX_MAP_CHARS = 1024  # key plus value
# A WAV file streamed as audio_content (riva.client's AudioChunkFileIterator sends the file's bytes,
# header first): its header must be complete within this many bytes.
MAX_WAV_HEADER_BYTES = 64 << 10

_STREAM_ENCODINGS = {
    raudio.LINEAR_PCM: "LINEAR16",
    raudio.MULAW: "MULAW",
    raudio.ALAW: "ALAW",
}
# Whole files, for Recognize only: their header says rate and channels.
_FILE_ENCODINGS = {raudio.FLAC: "FLAC", raudio.OGGOPUS: "OGG_OPUS"}
# What a recording's first bytes say it is (a header always wins over the config's encoding, as Riva's
# own clients send WAV files with encoding LINEAR_PCM or none at all).
_MAGIC = ((b"RIFF", 8, b"WAVE", "WAV"), (b"fLaC", 0, b"", "FLAC"), (b"OggS", 0, b"", "OGG_OPUS"))


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
    words: bool  # enable_word_time_offsets: words with start and end (ms) and confidence
    smart_formatting: bool  # verbatim_transcripts=false (Riva's default): inverse text normalization
    endpointing: Endpointing
    interim_results: bool = False
    # Accepted options that change nothing here (logged, documented): "profanity_filter", ...
    hints: tuple[str, ...] = ()


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


def _keyterms(contexts: Sequence[rasr.SpeechContext]) -> tuple[str, ...]:
    """speech_contexts (riva.client's add_word_boosting_to_config) -> keyterms, in order, once each.

    A positive boost is a hint of how strongly (the server's keyterm bias has one strength); a
    negative one asks to suppress a phrase, which this server cannot do: refused, as dropping it would
    turn a suppression into nothing."""
    terms: dict[str, None] = {}
    for i, context in enumerate(contexts):
        if math.isnan(context.boost) or context.boost < 0:
            raise RivaFieldError(
                f"speech_contexts[{i}].boost",
                f"speech_contexts[{i}].boost is {context.boost:g}: negative boosts (suppressing a phrase) "
                "are not supported; send positive boosts or leave the phrase out",
            )
        for phrase in context.phrases:
            terms.setdefault(" ".join(phrase.split()), None)
    return tuple(terms)


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
    if config.encoding in _STREAM_ENCODINGS:
        encoding = _STREAM_ENCODINGS[config.encoding]
    elif config.encoding in _FILE_ENCODINGS:
        encoding = _FILE_ENCODINGS[config.encoding]
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
    if config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization:
        raise RivaFieldError(
            "diarization_config.enable_speaker_diarization",
            "diarization_config.enable_speaker_diarization is not supported: this server sets no "
            "speaker_tag; record each party on its own channel (audio_channel_count, "
            "enable_separate_recognition_per_channel) and read channel_tag",
        )
    _check_map("custom_configuration", config.custom_configuration)
    channels = config.audio_channel_count or 1
    hints = [
        name
        for name, on in (
            ("max_alternatives", config.max_alternatives > 1),  # greedy decoding: one alternative
            ("profanity_filter", config.profanity_filter),
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
        keyterms=_keyterms(config.speech_contexts),
        words=config.enable_word_time_offsets,
        smart_formatting=not config.verbatim_transcripts,
        endpointing=endpointing(config, default_silence_s, default_speech_s),
        interim_results=interim_results,
        hints=tuple(hints),
    )


def streaming_request(
    sc: rasr.StreamingRecognitionConfig, *, default_silence_s: float, default_speech_s: float
) -> RivaRequest:
    """Read the first StreamingRecognizeRequest's config; whole files are Recognize's."""
    request = recognition_request(
        sc.config,
        default_silence_s=default_silence_s,
        default_speech_s=default_speech_s,
        interim_results=sc.interim_results,
    )
    if request.encoding not in _STREAM_ENCODINGS.values():
        raise RivaFieldError(
            "streaming_config.config.encoding",
            f"streaming_config.config.encoding {encoding_name(sc.config.encoding)} is accepted by Recognize "
            "only (a whole file); StreamingRecognize takes LINEAR_PCM, MULAW, ALAW (or a WAV file's bytes)",
        )
    return request


def check_runtime_config(request: rasr.StreamingRecognizeRequest) -> None:
    _check_map("runtime_config", request.runtime_config)


# --- what the audio says it is -----------------------------------------------------------------------


def sniff_container(data: bytes | bytearray | memoryview) -> str | None:
    """ "WAV", "FLAC" or "OGG_OPUS" when the bytes start with that container's header, else None."""
    head = bytes(data[:12])
    for magic, at, tag, name in _MAGIC:
        if head.startswith(magic) and head[at : at + len(tag)] == tag:
            return name
    return None


@dataclass(frozen=True)
class WavHeader:
    encoding: str  # LINEAR16, MULAW or ALAW
    sample_rate_hertz: int
    channels: int
    data_offset: int  # where the samples begin


# WAVE format tags (RFC 2361) of what a stream can carry; WAVE_FORMAT_EXTENSIBLE names one of them in
# the first two bytes of its SubFormat GUID.
_WAV_TAGS = {1: ("LINEAR16", 16), 6: ("ALAW", 8), 7: ("MULAW", 8)}
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def wav_header(data: bytes | bytearray) -> WavHeader | None:
    """A streamed WAV file's header (RIFF chunks up to `data`); None while more bytes are needed.

    Raises RivaFieldError for a WAV whose samples a stream cannot carry (24-bit, float, ...). Only the
    header is read here: the chunks are walked with `struct` because the stdlib `wave` module reads
    integer PCM only, and libsndfile wants the whole file."""
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            if body + 16 > len(data):
                return None
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _WAVE_FORMAT_EXTENSIBLE and size >= 40 and body + 26 <= len(data):
                tag = struct.unpack_from("<H", data, body + 24)[0]
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if fmt is None:
                break
            tag, channels, rate, bits = fmt
            known = _WAV_TAGS.get(tag)
            if known is None or known[1] != bits:
                raise RivaFieldError(
                    "audio_content",
                    f"audio_content is a WAV file of {bits}-bit samples in format {tag:#06x}: a stream "
                    "carries 16-bit PCM, mu-law or A-law (send other WAV files with Recognize)",
                )
            return WavHeader(known[0], rate, channels, body)
        pos = body + size + (size & 1)  # chunks are padded to an even size
    if len(data) >= MAX_WAV_HEADER_BYTES or (fmt is None and pos + 8 <= len(data)):
        raise RivaFieldError(
            "audio_content",
            f"audio_content starts a WAV file whose header has no fmt and data chunk within "
            f"{MAX_WAV_HEADER_BYTES} bytes",
        )
    return None


# --- results out -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RivaWord:
    text: str
    start_s: float
    end_s: float
    confidence: float | None = None


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def alternative(
    transcript: str, confidence: float, words: Iterable[RivaWord], language: str = ""
) -> rasr.SpeechRecognitionAlternative:
    """One alternative; WordInfo times are ms from the start of the audio (of the stream, per channel)."""
    return rasr.SpeechRecognitionAlternative(
        transcript=transcript,
        confidence=confidence,
        words=[
            rasr.WordInfo(
                word=w.text,
                start_time=_ms(w.start_s),
                end_time=_ms(w.end_s),
                confidence=w.confidence or 0.0,
                language_code=language,
            )
            for w in words
        ],
        language_code=[language] if language else [],
    )


def streaming_response(
    transcript: str,
    *,
    is_final: bool,
    channel_tag: int,
    audio_processed_s: float,
    confidence: float = 0.0,
    stability: float = 0.0,
    words: Iterable[RivaWord] = (),
    language: str = "",
) -> rasr.StreamingRecognizeResponse:
    """One result per response, as Riva sends them; stability on interims only, confidence and words
    on finals only (the proto's rules)."""
    return rasr.StreamingRecognizeResponse(
        results=[
            rasr.StreamingRecognitionResult(
                alternatives=[
                    alternative(
                        transcript, confidence if is_final else 0.0, words if is_final else (), language
                    )
                ],
                is_final=is_final,
                stability=0.0 if is_final else stability,
                channel_tag=channel_tag,
                audio_processed=audio_processed_s,
            )
        ]
    )


def recognition_result(
    transcript: str,
    *,
    channel_tag: int,
    audio_processed_s: float,
    confidence: float,
    words: Iterable[RivaWord] = (),
    language: str = "",
) -> rasr.SpeechRecognitionResult:
    return rasr.SpeechRecognitionResult(
        alternatives=[alternative(transcript, confidence, words, language)],
        channel_tag=channel_tag,
        audio_processed=audio_processed_s,
    )


def riva_language(whisper_code: str) -> str:
    """A Whisper language code as Riva's clients list languages (BCP-47; en is en-US, as Riva's)."""
    return "en-US" if whisper_code == "en" else whisper_code


def config_response(model_name: str, languages: Iterable[str]) -> rasr.RivaSpeechRecognitionConfigResponse:
    """GetRivaSpeechRecognitionConfig: the one model this server serves, once per mode (`type` online
    for StreamingRecognize, offline for Recognize) and language, with the parameters Riva's clients
    read (`type`, `language_code`: riva.client's transcribe scripts, pipecat, LiveKit). Whatever model a
    request names, this one answers it."""
    langs = sorted(languages)
    language = riva_language(langs[0]) if len(langs) == 1 else "multi"
    return rasr.RivaSpeechRecognitionConfigResponse(
        model_config=[
            rasr.RivaSpeechRecognitionConfigResponse.Config(
                model_name=model_name,
                parameters={
                    "type": kind,
                    "streaming": "true" if kind == "online" else "false",
                    "language_code": language,
                    "sample_rate": str(DEFAULT_RATE),
                    "model_family": "whisper",
                },
            )
            for kind in ("online", "offline")
        ]
    )

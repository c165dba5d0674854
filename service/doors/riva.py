"""The NVIDIA Riva ASR door: `nvidia.riva.asr.RivaSpeechRecognition` on the gRPC port, beside asr.v1.

One translation layer, over the generated messages and servicer base of the `nvidia-riva-client`
package (never a copy of its proto): a Riva RecognitionConfig becomes plain settings (`RivaRequest`),
those the core's (`RivaServicer`), and the core's results and errors Riva messages and gRPC statuses
naming Riva's fields. Two Riva conventions live here because they are the protocol's: a stream whose
first bytes are a WAV header (riva.client streams files that way) takes its format from it, and several
channels without enable_separate_recognition_per_channel mean the first channel only. What Riva has and
this server does not, and whose silent absence would change what a result means (speaker diarization,
negative word boosts, a language the model does not serve, an encoding it cannot decode), is refused
with INVALID_ARGUMENT naming the Riva field; options that only shape formatting are accepted and named
in the `asr-hints` initial metadata (docs/operations.md, "The Riva door").
"""

from __future__ import annotations

import asyncio
import math
import re
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
from grpc import aio
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_asr_pb2_grpc as rasr_grpc
from riva.client.proto import riva_audio_pb2 as raudio
from riva.client.proto import riva_common_pb2

from service.doors.shared.auth import bearer_token, identity
from service.doors.shared.grpc_calls import (
    SECOND_CONFIG,
    StreamCall,
    first_request,
    read_requests,
    serve_stream,
)
from service.doors.shared.grpc_status import grpc_code
from service.recognizer.recognizer import Recognizer, Stream, validate_stream_format
from service.vocabulary.endpointing import EndpointingError
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    MAX_PHRASE_BYTES,
    MAX_PHRASES_READ,
    AudioFormat,
    DiarizationSettings,
    EndpointSettings,
    Formatting,
    Identity,
    RecognitionSettings,
    Reconnect,
    Result,
    StreamSettings,
    Word,
)

A = TypeVar("A")
T = TypeVar("T")

SERVICE_NAME = rasr.DESCRIPTOR.services_by_name["RivaSpeechRecognition"].full_name
DOOR = "riva"  # the core's `door` metrics label
# Initial metadata of every answered call: the model that answers whatever `model` a request names, the
# options accepted as hints (comma-separated), and a stream's id (as in the server's logs).
MODEL_HEADER = "asr-model"
HINTS_HEADER = "asr-hints"
STREAM_ID_HEADER = "asr-stream-id"

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
    # where each keyterm came from ("speech_contexts[0].phrases[2]"), for refusals in Riva's terms
    keyterm_fields: tuple[str, ...]
    words: bool  # enable_word_time_offsets: words with start and end (ms) and confidence
    endpointing: Endpointing
    interim_results: bool = False
    # verbatim_transcripts false (Riva's default: inverse text normalization): numbers as digits
    formatting: Formatting = Formatting.VERBATIM
    # Accepted options that change nothing here (the asr-hints metadata): "model", "max_alternatives", ...
    hints: tuple[str, ...] = ()
    # diarization_config (Recognize only): a speaker_tag on every word
    diarization: DiarizationSettings | None = None


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
    speaker: int | None = None  # 0-based, diarized


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
                speaker_tag=0 if w.speaker is None else w.speaker + 1,  # 0: unset (proto3), tags from 1
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


# --- the door: Riva requests -> the core, the core's results and errors -> Riva ---------------------

# The core's names for the settings it blames -> Riva's (the same unless listed here)
_STREAM_NAMES = {
    "keyterms": "speech_contexts",
    "diarization": "diarization_config",
    "diarization.max_speakers": "diarization_config.max_speaker_count",
}
_RECOGNIZE_NAMES = {**_STREAM_NAMES, "audio_content": "audio"}
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


def _check_frames(data: bytes, frame_bytes: int, encoding: str, channels: int) -> None:
    if len(data) % frame_bytes:
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            f"audio_content has {len(data)} bytes, not a multiple of the {frame_bytes}-byte frame "
            f"({encoding}, {channels} channel(s)); send whole frames in every chunk",
            "audio_content",
        )


class _AudioIn:
    """Riva's audio as the core's stream takes it: a streamed WAV file's samples after its header,
    re-framed (a file's bytes are cut anywhere, so a chunk may end inside a frame); and only the first
    channel when several come without enable_separate_recognition_per_channel (Riva: "we only recognize
    the first channel")."""

    def __init__(
        self, encoding: str, channels: int, *, first_only: bool, reframe: bool, max_chunk_bytes: int
    ) -> None:
        self.encoding = encoding
        self.width = 2 if encoding == "LINEAR16" else 1
        self.channels = channels
        self.frame_bytes = self.width * channels
        self.first_only = first_only and channels > 1
        self.reframe = reframe
        self.max_chunk_bytes = max_chunk_bytes  # of what the client sent, before the first channel is taken
        self._rest = b""

    def frames(self, data: bytes) -> bytes:
        """The core's bytes for one chunk (b"": none yet); raises RecognitionError for partial frames
        and, when only the first channel goes on, for a chunk over --max-chunk-bytes."""
        if self.reframe:
            data = self._rest + data
            cut = len(data) - len(data) % self.frame_bytes
            data, self._rest = data[:cut], data[cut:]
        if not self.first_only:
            return data
        if len(data) > self.max_chunk_bytes:
            raise RecognitionError(
                Code.INVALID_ARGUMENT,
                f"audio_content of {len(data)} bytes is over the limit of {self.max_chunk_bytes} bytes per "
                "request (max_chunk_bytes); send smaller chunks",
                "audio_content",
            )
        _check_frames(data, self.frame_bytes, self.encoding, self.channels)
        dtype = "<i2" if self.width == 2 else "u1"
        return np.frombuffer(data, dtype=dtype).reshape(-1, self.channels)[:, 0].tobytes()


@dataclass
class _Opening:
    """What the door read of a stream before opening it: the config, and the first audio when it may
    be a WAV file's header (riva.client's AudioChunkFileIterator streams a file's bytes as they are)."""

    config: rasr.StreamingRecognitionConfig
    request_id: str | None
    head: bytes = b""
    ended: bool = False  # the client half-closed before any more


def _word(w: Word) -> RivaWord:
    return RivaWord(w.text, w.start_s or 0.0, w.end_s or 0.0, w.confidence, w.speaker)


def _channel_tag(channel: int) -> int:
    """The core tags one mixed-down or mono channel 0; Riva's first channel is 1."""
    return channel or 1


def _caller(context: aio.ServicerContext) -> Identity:
    return identity(bearer_token(context.invocation_metadata()), context.peer())


class RivaServicer(rasr_grpc.RivaSpeechRecognitionServicer):
    """nvidia.riva.asr.RivaSpeechRecognition on the core (see the module docstring)."""

    def __init__(self, recognizer: Recognizer) -> None:
        self.recognizer = recognizer
        self._defaults = EndpointSettings()

    # --- settings ---

    def _request(self, config: rasr.RecognitionConfig, interim: bool = False) -> RivaRequest:
        return recognition_request(
            config,
            default_silence_s=self._defaults.min_silence_s,
            default_speech_s=self._defaults.min_speech_s,
            interim_results=interim,
        )

    def _stream_settings(self, opening: _Opening) -> tuple[StreamSettings, RivaRequest, _AudioIn, int]:
        """The stream's settings, what feeds it, and where the samples begin in `opening.head`; raises
        RivaFieldError (a ValueError naming the field: the core refuses it INVALID_ARGUMENT)."""
        sc = opening.config
        request = self._request(sc.config, sc.interim_results)
        if request.diarization is not None:
            raise RivaFieldError(
                "diarization_config.enable_speaker_diarization",
                "diarization_config.enable_speaker_diarization is supported by Recognize only (a whole "
                "file); on a stream record each party on its own channel (audio_channel_count, "
                "enable_separate_recognition_per_channel) and read channel_tag",
            )
        encoding, rate, channels, offset = request.encoding, request.sample_rate_hertz, request.channels, 0
        wav = wav_header(opening.head) if sniff_container(opening.head) == "WAV" else None
        if wav is not None:  # a WAV file's header says what its samples are, whatever the config says
            encoding, rate, channels, offset = (
                wav.encoding,
                wav.sample_rate_hertz,
                wav.channels,
                wav.data_offset,
            )
        elif request.encoding not in _STREAM_ENCODINGS.values():
            raise RivaFieldError(
                "encoding",
                f"encoding {encoding_name(sc.config.encoding)} is accepted by Recognize only (a whole file); "
                "StreamingRecognize takes LINEAR_PCM, MULAW, ALAW (or a WAV file's bytes)",
            )
        validate_stream_format(encoding, rate, channels)  # before the channels are narrowed to the first
        separate = request.separate_channels and channels > 1
        feed = _AudioIn(
            encoding,
            channels,
            first_only=not separate,
            reframe=wav is not None,
            max_chunk_bytes=self.recognizer.config.max_chunk_bytes,
        )
        settings = StreamSettings(
            recognition=RecognitionSettings(
                format=AudioFormat(encoding, rate, channels if separate else 1),
                separate_channels=separate,
                language=request.language_code,
                keyterms=request.keyterms,
                word_times=request.words,
                word_confidence=request.words,
                formatting=request.formatting,
            ),
            endpointing=endpoint_settings(request.endpointing),
            interim_results=request.interim_results,
        )
        return settings, request, feed, offset

    # --- GetRivaSpeechRecognitionConfig ---

    async def GetRivaSpeechRecognitionConfig(
        self, request: rasr.RivaSpeechRecognitionConfigRequest, context: aio.ServicerContext
    ) -> rasr.RivaSpeechRecognitionConfigResponse:
        model = self.recognizer.model
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading; retry shortly")
            raise AssertionError("unreachable: abort raises")
        return config_response(model.name, model.languages)

    # --- StreamingRecognize ---

    async def StreamingRecognize(
        self,
        request_iterator: AsyncIterator[rasr.StreamingRecognizeRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[rasr.StreamingRecognizeResponse]:
        async def refuse(e: RecognitionError) -> None:
            await context.abort(grpc_code(e.code), e.message)  # in Riva's names already (see _respond)

        # an async generator itself: grpc.aio runs any other handler as a synchronous one
        async for out in serve_stream(
            context, lambda call: self._respond(request_iterator, context, call), refuse
        ):
            yield out

    async def _respond(
        self,
        request_iterator: AsyncIterator[rasr.StreamingRecognizeRequest],
        context: aio.ServicerContext,
        call: StreamCall,
    ) -> AsyncGenerator[rasr.StreamingRecognizeResponse, None]:
        requests = aiter(request_iterator)
        opening = await self._opening(requests)
        built: list[tuple[StreamSettings, RivaRequest, _AudioIn, int]] = []

        def settings() -> StreamSettings:
            built.append(self._stream_settings(opening))
            return built[0][0]

        try:  # translated once admitted: a loading, draining or full server says so first
            stream = call.attach(self.recognizer.open_stream(settings, door=DOOR, identity=_caller(context)))
        except RecognitionError as e:
            raise RecognitionError(e.code, riva_error(e, _STREAM_NAMES, _fields(built)), e.field) from e
        _, request, feed, offset = built[0]
        await context.send_initial_metadata(_metadata(stream.id, self.recognizer, request))
        call.read(
            read_requests(
                stream, _after_opening(requests, opening, offset, feed, stream), _taker(feed, stream)
            )
        )
        reconnect: Reconnect | None = None
        async for event in stream.events():
            if isinstance(event, Reconnect):
                reconnect = event
                continue
            if not isinstance(event, Result) or not (event.is_final or event.transcript.strip()):
                continue  # Riva has no speech events; an empty interim says nothing
            yield _streaming_response(event, stream.heard_s, opening.request_id)
        if reconnect is not None:  # Riva's clients know no in-band reconnect: gRPC's "go elsewhere"
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"server is draining: the finals of all {reconnect.offset_s:.2f} s of audio heard were "
                "sent; continue the call on another replica from there",
            )

    async def _opening(self, requests: AsyncIterator[rasr.StreamingRecognizeRequest]) -> _Opening:
        """The config (the first request), and for LINEAR_PCM or no encoding the first audio up to a
        WAV header's end (first_request: refusals come only after the first request is read)."""
        first = await first_request(requests, self.recognizer, DOOR)
        if first is None or first.WhichOneof("streaming_request") != "streaming_config":
            error = RecognitionError(
                Code.INVALID_ARGUMENT,
                "first request must carry streaming_config (then audio_content in later requests)",
            )
            self.recognizer.refused(DOOR, error)
            raise error
        opening = _Opening(first.streaming_config, first.id.value if first.HasField("id") else None)
        if first.streaming_config.config.encoding not in (raudio.ENCODING_UNSPECIFIED, raudio.LINEAR_PCM):
            return opening
        timeout = self.recognizer.config.idle_audio_timeout or None
        try:
            async with asyncio.timeout(timeout):  # --idle-audio-timeout, as once the stream is open
                opening.head, opening.ended = await self._head(requests)
        except TimeoutError:
            error = RecognitionError(
                Code.OUT_OF_RANGE,
                f"Audio Timeout Error: no audio for {timeout:g} s (idle_audio_timeout) after streaming_config; "
                "send audio close to real time, silence too, and half-close the stream when the call ends",
            )
            self.recognizer.refused(DOOR, error)
            raise error from None
        return opening

    async def _head(self, requests: AsyncIterator[rasr.StreamingRecognizeRequest]) -> tuple[bytes, bool]:
        """Enough of the audio to tell a WAV file from raw PCM, and a WAV header whole; and whether the
        client half-closed first."""
        head = bytearray()
        while True:
            if len(head) >= len(b"RIFF....WAVE"):
                if sniff_container(head) != "WAV":
                    return bytes(head), False
                try:
                    if wav_header(head) is not None:
                        return bytes(head), False
                except RivaFieldError:
                    return bytes(head), False  # refused with the settings, once the stream is admitted
            request = await anext(requests, None)
            if request is None:
                return bytes(head), True
            kind = request.WhichOneof("streaming_request")
            if kind == "streaming_config":
                error = RecognitionError(Code.INVALID_ARGUMENT, SECOND_CONFIG)
                self.recognizer.refused(DOOR, error)
                raise error
            if kind == "audio_content":
                head += request.audio_content

    # --- Recognize ---

    async def Recognize(
        self, request: rasr.RecognizeRequest, context: aio.ServicerContext
    ) -> rasr.RecognizeResponse:
        audio = request.audio  # read once: each read of a bytes field is a fresh copy (upb)
        built: list[RivaRequest] = []

        def settings() -> RecognitionSettings:
            try:
                riva = self._request(request.config)
            except RivaFieldError as e:
                raise RecognitionError(Code.INVALID_ARGUMENT, str(e), e.field) from e
            built.append(riva)
            # a file's header says what it is, whatever the config says (riva.client sends WAV files
            # with LINEAR_PCM or no encoding); Riva's rule for several channels without separate
            # recognition, the first only, is kept by recognizing each and answering the first's
            return RecognitionSettings(
                format=AudioFormat(
                    sniff_container(audio) or riva.encoding, riva.sample_rate_hertz, riva.channels
                ),
                separate_channels=True,
                language=riva.language_code,
                keyterms=riva.keyterms,
                word_times=riva.words,
                word_confidence=riva.words,
                formatting=riva.formatting,
                diarization=riva.diarization,
            )

        try:
            result = await self.recognizer.recognize(audio, settings, door=DOOR, identity=_caller(context))
        except RecognitionError as e:
            fields = built[0].keyterm_fields if built else ()
            await context.abort(grpc_code(e.code), riva_error(e, _RECOGNIZE_NAMES, fields))
            raise  # unreachable: abort raises
        riva = built[0]
        await context.send_initial_metadata(_metadata(None, self.recognizer, riva))
        separate = riva.separate_channels
        return rasr.RecognizeResponse(
            results=[
                recognition_result(
                    r.transcript,
                    channel_tag=_channel_tag(r.channel),
                    audio_processed_s=r.end_s,
                    confidence=r.confidence,
                    words=[_word(w) for w in r.words],
                    language=riva_language(r.language),
                )
                for r in result.results
                if separate or r.channel <= 1
            ],
            **_request_id(request.id.value if request.HasField("id") else None),
        )


async def _after_opening(
    requests: AsyncIterator[rasr.StreamingRecognizeRequest],
    opening: _Opening,
    offset: int,
    feed: _AudioIn,
    stream: Stream,
) -> AsyncIterator[rasr.StreamingRecognizeRequest]:
    """The requests after what the opening read: its audio goes into the stream first."""
    if opening.head[offset:]:
        stream.audio(_field_checked(feed.frames, opening.head[offset:]))
    if not opening.ended:
        async for request in requests:
            yield request


def _taker(feed: _AudioIn, stream: Stream) -> Callable[[rasr.StreamingRecognizeRequest], Awaitable[None]]:
    async def take(request: rasr.StreamingRecognizeRequest) -> None:
        """One request after the config into the stream."""
        kind = request.WhichOneof("streaming_request")
        if kind == "streaming_config":
            raise RecognitionError(Code.INVALID_ARGUMENT, SECOND_CONFIG)
        if request.runtime_config:
            _field_checked(check_runtime_config, request)
        if kind == "audio_content":
            chunk = _field_checked(feed.frames, request.audio_content)
            if chunk:
                stream.audio(chunk)
                await stream.pace()

    return take


def _field_checked(check: Callable[[A], T], value: A) -> T:
    """`check(value)`, a RivaFieldError from it as the refusal of the stream naming the field."""
    try:
        return check(value)
    except RivaFieldError as e:
        raise RecognitionError(Code.INVALID_ARGUMENT, str(e), e.field) from e


def _fields(built: Sequence[tuple[StreamSettings, RivaRequest, _AudioIn, int]]) -> tuple[str, ...]:
    return built[0][1].keyterm_fields if built else ()


def _request_id(value: str | None) -> dict[str, riva_common_pb2.RequestId]:
    return {} if value is None else {"id": riva_common_pb2.RequestId(value=value)}


def _streaming_response(r: Result, heard_s: float, request_id: str | None) -> rasr.StreamingRecognizeResponse:
    response = streaming_response(
        r.transcript,
        is_final=r.is_final,
        channel_tag=_channel_tag(r.channel),
        audio_processed_s=max(heard_s, r.end_s),
        confidence=r.confidence,
        stability=r.stability,
        words=[_word(w) for w in r.words],
        language=riva_language(r.language),
    )
    if request_id is not None:
        response.id.value = request_id
    return response


def _metadata(
    stream_id: str | None, recognizer: Recognizer, request: RivaRequest
) -> tuple[tuple[str, str], ...]:
    """Initial metadata: the model that answers whatever model the request named, and the options
    accepted as hints that change nothing here (docs/operations.md, "The Riva door")."""
    model = recognizer.model
    pairs = [(MODEL_HEADER, model.name if model is not None else "")]
    if stream_id is not None:
        pairs.append((STREAM_ID_HEADER, stream_id))
    if request.hints:
        pairs.append((HINTS_HEADER, ",".join(request.hints)))
    return tuple(pairs)

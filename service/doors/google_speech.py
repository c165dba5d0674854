"""The Google Cloud Speech-to-Text v1 door: `google.cloud.speech.v1.Speech` (StreamingRecognize, Recognize,
LongRunningRecognize) and `google.longrunning.Operations` GetOperation, on the gRPC port beside asr.v1.

The messages are google-cloud-speech's own (its proto-plus types' raw protobuf classes, `Type.pb()`),
served with grpc.method_handlers_generic_handler. A translation layer: RecognitionConfig and
StreamingRecognitionConfig -> the core's settings (service/recognizer/), the core's events and errors -> Google's
responses and gRPC statuses (google.rpc codes, messages naming Google's field). What Google's v1 does and
this server does not, where silently doing without it would change what a result means, is refused
INVALID_ARGUMENT naming the field; hint-only options are accepted (docs/operations.md, "The Google
Speech door").

LongRunningRecognize answers with its operation already done (the recording is transcribed inside the
call, as Recognize is): the client's `operation.result()` reads it without polling, and the server keeps
no operation to look up later (GetOperation: NOT_FOUND, saying so).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.cloud.speech_v1.types import cloud_speech
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, duration_pb2, timestamp_pb2
from grpc import aio

from service.doors.shared.auth import bearer_token, identity
from service.doors.shared.grpc_calls import (
    SECOND_CONFIG,
    StreamCall,
    first_request,
    read_requests,
    serve_stream,
)
from service.doors.shared.grpc_status import grpc_code
from service.recognizer.recognizer import RECOGNIZE, Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    MAX_PHRASE_BYTES,
    MAX_PHRASES_READ,
    AudioFormat,
    CallEvent,
    DiarizationSettings,
    EndOfSingleUtterance,
    EndpointSettings,
    Identity,
    RecognitionSettings,
    RecognizeResult,
    Reconnect,
    Result,
    SpeechEnded,
    SpeechStarted,
    SpeechTimeout,
    StreamSettings,
)

SERVICE = "google.cloud.speech.v1.Speech"
OPERATIONS_SERVICE = "google.longrunning.Operations"


def _describe_service() -> None:
    """google-cloud-speech carries Speech's messages (proto-plus puts them in the default descriptor pool)
    but not the service itself, so server reflection (buf curl, grpcurl) could list it yet not describe it:
    a file declaring it over those messages goes into the pool once, when the door is registered on a
    server (GoogleSpeechDoor.handlers): importing the module changes no process-wide pool."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(SERVICE)
        return
    except KeyError:
        pass
    messages = pool.FindMessageTypeByName("google.cloud.speech.v1.RecognizeRequest").file.name
    service = descriptor_pb2.ServiceDescriptorProto(name="Speech")
    for name, request, response, streaming in (
        ("Recognize", ".google.cloud.speech.v1.RecognizeRequest", ".google.cloud.speech.v1.RecognizeResponse", False),
        ("LongRunningRecognize", ".google.cloud.speech.v1.LongRunningRecognizeRequest", ".google.longrunning.Operation", False),
        ("StreamingRecognize", ".google.cloud.speech.v1.StreamingRecognizeRequest", ".google.cloud.speech.v1.StreamingRecognizeResponse", True),
    ):  # fmt: skip
        service.method.add(
            name=name,
            input_type=request,
            output_type=response,
            client_streaming=streaming,
            server_streaming=streaming,
        )
    pool.Add(
        descriptor_pb2.FileDescriptorProto(
            name="google/cloud/speech_v1/speech_service.proto",
            package="google.cloud.speech.v1",
            dependency=[messages, operations_pb2.DESCRIPTOR.name],
            service=[service],
            syntax="proto3",
        )
    )


DOOR = "google"

# The raw protobuf classes the door serves (google-cloud-speech's proto-plus types wrap these).
StreamingRecognizeRequest: Any = cloud_speech.StreamingRecognizeRequest.pb()
StreamingRecognizeResponse: Any = cloud_speech.StreamingRecognizeResponse.pb()
StreamingRecognitionResult: Any = cloud_speech.StreamingRecognitionResult.pb()
RecognizeRequest: Any = cloud_speech.RecognizeRequest.pb()
RecognizeResponse: Any = cloud_speech.RecognizeResponse.pb()
LongRunningRecognizeRequest: Any = cloud_speech.LongRunningRecognizeRequest.pb()
LongRunningRecognizeResponse: Any = cloud_speech.LongRunningRecognizeResponse.pb()
LongRunningRecognizeMetadata: Any = cloud_speech.LongRunningRecognizeMetadata.pb()
SpeechRecognitionResult: Any = cloud_speech.SpeechRecognitionResult.pb()
SpeechRecognitionAlternative: Any = cloud_speech.SpeechRecognitionAlternative.pb()

Encoding = cloud_speech.RecognitionConfig.AudioEncoding
SpeechEvent = cloud_speech.StreamingRecognizeResponse.SpeechEventType

# Google's v1 encodings this server decodes, with their bytes per sample. FLAC (and WAV, which v1 names no
# encoding for: its header says) are whole files, so Recognize and LongRunningRecognize only.
STREAM_ENCODINGS = {Encoding.LINEAR16: "LINEAR16", Encoding.MULAW: "MULAW"}
SAMPLE_BYTES = {"LINEAR16": 2, "MULAW": 1}
FILE_MAGIC = {b"fLaC": "FLAC", b"RIFF": "WAV"}
# Google's own bounds (RecognitionConfig's documentation): at most 3 alternative languages, and
# max_alternatives 0-30 (we return one alternative: the server "may return fewer").
MAX_ALTERNATIVE_LANGUAGES = 3
MAX_ALTERNATIVES = 30
# Voice activity timeouts: "greater than 500ms and less than 60s" (Google, "Voice activity events and
# timeouts").
VOICE_TIMEOUT_RANGE_S = (0.5, 60.0)

# The core's setting names (RecognitionError.field) as Google's v1 names them.
STREAM_FIELDS = {
    "encoding": "config.encoding",
    "sample_rate_hertz": "config.sample_rate_hertz",
    "audio_channel_count": "config.audio_channel_count",
    "language_code": "config.language_code",
    "keyterms": "config.speech_contexts phrases",
    "speech_start_timeout": "streaming_config.voice_activity_timeout.speech_start_timeout",
    "speech_end_timeout": "streaming_config.voice_activity_timeout.speech_end_timeout",
    "audio_content": "audio_content",
    "diarization": "config.diarization_config",
    "diarization.min_speakers": "config.diarization_config.min_speaker_count",
    "diarization.max_speakers": "config.diarization_config.max_speaker_count",
}
RECOGNIZE_FIELDS = {**STREAM_FIELDS, "audio_content": "audio.content"}


def _invalid(message: str) -> RecognitionError:
    return RecognitionError(Code.INVALID_ARGUMENT, message)


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


# --- requests -> the core's settings ---


def _keyterms(config: Any) -> tuple[str, ...]:
    """speech_contexts' phrases and adaptation's inline phrase sets, in order, once each.

    Boost has no per-term strength here (the keyterm bias is the server's); a negative boost asks for
    anti-biasing, which Google does not apply either ("negative boost will simply be ignored"), so those
    phrases are left out. Class tokens ($MONTH, ${my-class}) name Google's classes, not words: left out.
    """
    count = sum(len(c.phrases) for c in config.speech_contexts) + sum(
        len(ps.phrases) for ps in config.adaptation.phrase_sets
    )
    if count > MAX_PHRASES_READ:
        raise _invalid(
            f"config.speech_contexts and config.adaptation.phrase_sets hold {count} phrases; at most "
            f"{MAX_PHRASES_READ} per request (of which at most 100 distinct)"
        )
    size = sum(c.ByteSize() for c in config.speech_contexts) + config.adaptation.ByteSize()
    if size > MAX_PHRASE_BYTES:
        raise _invalid(
            f"config.speech_contexts and config.adaptation hold {size} bytes; at most {MAX_PHRASE_BYTES} "
            "bytes of phrases per request"
        )
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


def _diarized(config: Any) -> bool:
    return config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization


def _diarization(config: Any) -> DiarizationSettings | None:
    """Google's speaker count bounds, with its documented defaults (2 and 6) where unset."""
    if not _diarized(config):
        return None
    d = config.diarization_config
    return DiarizationSettings(d.min_speaker_count or 2, d.max_speaker_count or max(6, d.min_speaker_count))


def _refuse_unsupported(config: Any, *, streaming: bool) -> None:
    """What Google v1 does and this server does not, where doing without it changes what a result means."""
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


@dataclass(frozen=True)
class Call:
    """What the door itself keeps of a RecognitionConfig: the core's settings, the caller's language tags
    (results are tagged in the caller's spelling), and the channel count of audio of which only the first
    channel is recognized (Google: without enable_separate_recognition_per_channel "we will only
    recognize the first channel"), 1 when the audio goes to the core as it came."""

    settings: RecognitionSettings
    language_tags: tuple[str, ...]
    pick_first_of: int = 1

    def language_tag(self, language: str) -> str:
        """A result's BCP-47 tag: the caller's own (lowercase, as Google writes it) when the language is
        the caller's, else Whisper's code."""
        for tag in self.language_tags:
            if tag and tag.replace("_", "-").split("-")[0].lower() == language:
                return tag.lower()
        return language


def _encoding(config: Any, *, streaming: bool) -> str:
    if streaming:
        if config.encoding not in STREAM_ENCODINGS:
            raise RecognitionError(
                Code.INVALID_ARGUMENT,
                f"config.encoding must be one of {', '.join(STREAM_ENCODINGS.values())} in StreamingRecognize, "
                f"got {_encoding_name(config.encoding)}"
                + (" (a whole file: send it with Recognize)" if config.encoding == Encoding.FLAC else ""),
                "encoding",
            )
        return STREAM_ENCODINGS[config.encoding]
    if config.encoding in STREAM_ENCODINGS:
        return STREAM_ENCODINGS[config.encoding]
    if config.encoding == Encoding.FLAC:
        return "FLAC"
    if config.encoding == Encoding.ENCODING_UNSPECIFIED:
        return ""
    raise RecognitionError(
        Code.INVALID_ARGUMENT,
        "config.encoding must be one of LINEAR16, MULAW, FLAC, or unset for a FLAC or WAV file, "
        f"got {_encoding_name(config.encoding)}",
        "encoding",
    )


def file_encoding(declared: str, content: bytes) -> str:
    """What a recorded file is: v1 lets the header say for FLAC and WAV (a WAV of LINEAR16 or MULAW may
    also come with that encoding set); raw LINEAR16/MULAW otherwise."""
    kind = FILE_MAGIC.get(content[:4])
    if kind is not None and declared in ("", kind, "LINEAR16", "MULAW"):
        return kind
    if declared == "FLAC":
        raise RecognitionError(
            Code.INVALID_ARGUMENT, "config.encoding is FLAC but audio.content is not a FLAC file", "encoding"
        )
    if not declared:
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            "config.encoding is unset and audio.content is neither a FLAC nor a WAV file; set config.encoding",
            "encoding",
        )
    return declared


def picked_channels(config: Any, encoding: str) -> int:
    """The channel count of raw audio of which the door passes on the first channel only (several
    channels, not recognized separately), else 1. A FLAC or WAV file's channels are the core's to read;
    those are mixed down (docs/operations.md). Over 8 channels the core refuses the count."""
    channels = config.audio_channel_count or 1
    if encoding in SAMPLE_BYTES and 1 < channels <= 8 and not config.enable_separate_recognition_per_channel:
        return int(channels)
    return 1


def call(config: Any, *, streaming: bool, content: bytes = b"") -> Call:
    """Read a RecognitionConfig (`content`: a recording's bytes, whose header may give its encoding).
    Raises RecognitionError for what the door refuses; ranges the core bounds (rate, channels, language,
    keyterms) are checked there, and their messages say Google's field names (STREAM_FIELDS)."""
    _refuse_unsupported(config, streaming=streaming)
    encoding = _encoding(config, streaming=streaming)
    if not streaming:
        encoding = file_encoding(encoding, content)
    channels = config.audio_channel_count or 1
    pick = picked_channels(config, encoding)
    settings = RecognitionSettings(
        format=AudioFormat(encoding, config.sample_rate_hertz, 1 if pick > 1 else channels),
        separate_channels=config.enable_separate_recognition_per_channel and channels > 1,
        language=config.language_code,
        keyterms=_keyterms(config),
        word_times=config.enable_word_time_offsets,
        word_confidence=config.enable_word_confidence,
        diarization=_diarization(config),  # a stream's words are tagged at each final
    )
    return Call(settings, (config.language_code, *config.alternative_language_codes), pick)


@dataclass(frozen=True)
class StreamingCall:
    call: Call
    settings: StreamSettings
    voice_activity_events: bool


def streaming_call(config: Any) -> StreamingCall:
    """Read a StreamingRecognitionConfig."""
    if not config.HasField("config"):
        raise _invalid("streaming_config.config is required (encoding, sample_rate_hertz, language_code)")
    c = call(config.config, streaming=True)
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
    settings = StreamSettings(
        recognition=c.settings,
        endpointing=EndpointSettings(),
        interim_results=config.interim_results,
        single_utterance=config.single_utterance,
        speech_start_timeout_s=timeouts["speech_start_timeout"],
        speech_end_timeout_s=timeouts["speech_end_timeout"],
    )
    return StreamingCall(c, settings, config.enable_voice_activity_events)


def first_channel(chunk: bytes, encoding: str, channels: int) -> bytes:
    """The first channel of interleaved raw audio (whole frames, else INVALID_ARGUMENT naming
    audio_content)."""
    width = SAMPLE_BYTES[encoding]
    frame = width * channels
    if len(chunk) % frame:
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            f"audio_content has {len(chunk)} bytes, not a multiple of the {frame}-byte frame ({encoding}, "
            f"{channels} channels); send whole frames in every chunk",
            "audio_content",
        )
    samples = np.frombuffer(chunk, dtype=np.int16 if width == 2 else np.uint8).reshape(-1, channels)
    return samples[:, 0].tobytes()


def audio_content(audio: Any) -> bytes:
    """RecognitionAudio's bytes: Cloud Storage URIs are not fetched."""
    if audio.WhichOneof("audio_source") == "uri":
        raise _invalid("audio.uri is not supported: this server reads no Cloud Storage; send audio.content")
    if not audio.content:
        raise RecognitionError(Code.INVALID_ARGUMENT, "audio.content is empty", "audio_content")
    content: bytes = audio.content
    return content


# --- the core's results and events -> responses ---


def alternative(r: Result) -> Any:
    """One SpeechRecognitionAlternative. Confidence is set on finals only ("set only for the top
    alternative of a non-streaming result or, of a streaming result where is_final=true"); words come
    with finals when asked for (the core gives them then)."""
    message = SpeechRecognitionAlternative(transcript=r.transcript)
    if r.is_final:
        message.confidence = r.confidence
    for w in r.words:
        info = message.words.add(word=w.text)
        if w.start_s is not None and w.end_s is not None:
            info.start_time.CopyFrom(duration(w.start_s))
            info.end_time.CopyFrom(duration(w.end_s))
        if w.confidence is not None:
            info.confidence = w.confidence
        if w.speaker is not None:  # Google's tags count from 1
            info.speaker_tag = w.speaker + 1
            info.speaker_label = str(w.speaker + 1)
    return message


def streaming_response(event: CallEvent, c: StreamingCall) -> Any | None:
    """The response for a core event; None for one the caller did not ask for (voice activity events)."""
    if isinstance(event, Result):
        return StreamingRecognizeResponse(
            results=[
                StreamingRecognitionResult(
                    alternatives=[alternative(event)],
                    is_final=event.is_final,
                    stability=0.0 if event.is_final else event.stability,
                    result_end_time=duration(event.end_s),
                    channel_tag=event.channel,
                    language_code=c.call.language_tag(event.language),
                )
            ]
        )
    if isinstance(event, EndOfSingleUtterance):
        return speech_event(SpeechEvent.END_OF_SINGLE_UTTERANCE, event.offset_s)
    if not c.voice_activity_events:
        return None
    if isinstance(event, SpeechStarted):
        return speech_event(SpeechEvent.SPEECH_ACTIVITY_BEGIN, event.offset_s)
    if isinstance(event, SpeechEnded):
        return speech_event(SpeechEvent.SPEECH_ACTIVITY_END, event.offset_s)
    if isinstance(event, SpeechTimeout):
        return speech_event(SpeechEvent.SPEECH_ACTIVITY_TIMEOUT, event.offset_s)
    return None


def speech_event(kind: int, at_s: float) -> Any:
    return StreamingRecognizeResponse(speech_event_type=kind, speech_event_time=duration(at_s))


def recognition_results(result: RecognizeResult, c: Call) -> list[Any]:
    results = [
        SpeechRecognitionResult(
            alternatives=[alternative(r)],
            channel_tag=r.channel,
            result_end_time=duration(r.end_s),
            language_code=c.language_tag(r.language),
        )
        for r in result.results
    ]
    if c.settings.diarization is not None and result.results:
        # As Google's diarized responses end: one more result holding every word of the call with its
        # speaker_tag (clients read the speakers there); each result's own words carry theirs too.
        last = result.results[-1]
        whole = SpeechRecognitionAlternative(
            transcript=" ".join(r.transcript for r in result.results if r.transcript)
        )
        for r in result.results:
            whole.words.extend(alternative(r).words)
        results.append(
            SpeechRecognitionResult(
                alternatives=[whole],
                channel_tag=last.channel,
                result_end_time=duration(max(r.end_s for r in result.results)),
                language_code=c.language_tag(last.language),
            )
        )
    return results


def _caller(context: aio.ServicerContext) -> Identity:
    return identity(bearer_token(context.invocation_metadata()), context.peer())


def _now() -> timestamp_pb2.Timestamp:
    t = timestamp_pb2.Timestamp()
    t.GetCurrentTime()
    return t


async def _abort(context: aio.ServicerContext, e: RecognitionError, names: Mapping[str, str]) -> None:
    await context.abort(grpc_code(e.code), e.message_for(names))


# --- the servicer ---


class GoogleSpeechDoor:
    """google.cloud.speech.v1.Speech and google.longrunning.Operations on the core."""

    def __init__(self, recognizer: Recognizer) -> None:
        self.recognizer = recognizer
        self._operations = itertools.count()
        self._prefix = f"{os.getpid():x}"

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        _describe_service()  # for server reflection, now that the service is served
        speech = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "StreamingRecognize": grpc.stream_stream_rpc_method_handler(
                    self.StreamingRecognize,
                    request_deserializer=StreamingRecognizeRequest.FromString,
                    response_serializer=StreamingRecognizeResponse.SerializeToString,
                ),
                "Recognize": grpc.unary_unary_rpc_method_handler(
                    self.Recognize,
                    request_deserializer=RecognizeRequest.FromString,
                    response_serializer=RecognizeResponse.SerializeToString,
                ),
                "LongRunningRecognize": grpc.unary_unary_rpc_method_handler(
                    self.LongRunningRecognize,
                    request_deserializer=LongRunningRecognizeRequest.FromString,
                    response_serializer=operations_pb2.Operation.SerializeToString,
                ),
            },
        )
        operations = grpc.method_handlers_generic_handler(
            OPERATIONS_SERVICE,
            {
                "GetOperation": grpc.unary_unary_rpc_method_handler(
                    self.GetOperation,
                    request_deserializer=operations_pb2.GetOperationRequest.FromString,
                    response_serializer=operations_pb2.Operation.SerializeToString,
                )
            },
        )
        return [speech, operations]

    async def StreamingRecognize(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async def refuse(e: RecognitionError) -> None:
            await _abort(context, e, STREAM_FIELDS)

        # an async generator itself: grpc.aio runs any other handler as a synchronous one
        async for out in serve_stream(
            context, lambda call: self._respond(request_iterator, context, call), refuse
        ):
            yield out

    async def _respond(
        self, requests: AsyncIterator[Any], context: aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        translated: list[StreamingCall] = []

        def settings() -> StreamSettings:
            c = streaming_call(_first_config(first))
            translated.append(c)
            return c.settings

        first = await first_request(requests, self.recognizer, DOOR)
        # translated once admitted: a loading, draining or full server says so first
        stream = call.attach(self.recognizer.open_stream(settings, door=DOOR, identity=_caller(context)))
        (c,) = translated
        call.read(read_requests(stream, requests, lambda request: self._take(request, stream, c)))
        drained: Reconnect | None = None
        async for event in stream.events():
            if isinstance(event, Reconnect):
                drained = event
                continue
            out = streaming_response(event, c)
            if out is not None:
                yield out
        # "total_billed_time: When available, billed audio seconds for the stream. Set only if this
        # is the last response in the stream."
        yield StreamingRecognizeResponse(total_billed_time=duration(stream.heard_s))
        if drained is not None:
            # Google has no reconnect message: the finals of what was heard came; UNAVAILABLE is what
            # Google's clients retry, on another replica. The server ended the call in order: OK to
            # its metrics, so that a rolling deploy is no server error to the alert.
            drain = RecognitionError(
                Code.UNAVAILABLE,
                f"server is draining: every final of the {drained.offset_s:.2f} s heard was sent; "
                "continue the call on a new stream (another replica)",
            )
            await _abort(context, drain, STREAM_FIELDS)

    async def _take(self, request: Any, stream: Stream, c: StreamingCall) -> None:
        """One request after the config into the stream."""
        kind = request.WhichOneof("streaming_request")
        if kind == "streaming_config":
            raise _invalid(SECOND_CONFIG)
        if kind == "audio_content":
            chunk = request.audio_content
            pick = c.call.pick_first_of
            if pick > 1 and len(chunk) <= self.recognizer.config.max_chunk_bytes:
                chunk = first_channel(chunk, c.settings.recognition.format.encoding, pick)
            stream.audio(chunk)
            await stream.pace()

    async def _recognize(self, request: Any, context: aio.ServicerContext) -> tuple[RecognizeResult, Call]:
        translated: list[Call] = []

        def settings() -> RecognitionSettings:
            c = call(request.config, streaming=False, content=content)
            translated.append(c)
            return c.settings

        try:
            content = audio_content(request.audio)
            config = request.config
            raw = "" if content[:4] in FILE_MAGIC else STREAM_ENCODINGS.get(config.encoding, "")
            pick = picked_channels(config, raw)
            if pick > 1:
                content = first_channel(content, raw, pick)
        except RecognitionError as e:
            self.recognizer.refused(DOOR, e, RECOGNIZE)
            raise
        result = await self.recognizer.recognize(content, settings, door=DOOR, identity=_caller(context))
        return result, translated[0]

    async def Recognize(self, request: Any, context: aio.ServicerContext) -> Any:
        try:
            result, c = await self._recognize(request, context)
        except RecognitionError as e:
            await _abort(context, e, RECOGNIZE_FIELDS)
            raise  # unreachable: abort raises
        return RecognizeResponse(
            results=recognition_results(result, c), total_billed_time=duration(result.duration_s)
        )

    async def LongRunningRecognize(self, request: Any, context: aio.ServicerContext) -> Any:
        started = _now()
        try:
            if request.HasField("output_config") and request.output_config.gcs_uri:
                error = _invalid(
                    "output_config.gcs_uri is not supported: this server writes no Cloud Storage; the "
                    "results come back in the operation"
                )
                self.recognizer.refused(DOOR, error, RECOGNIZE)
                raise error
            result, c = await self._recognize(request, context)
        except RecognitionError as e:
            await _abort(context, e, RECOGNIZE_FIELDS)
            raise  # unreachable: abort raises
        metadata, response = any_pb2.Any(), any_pb2.Any()
        metadata.Pack(
            LongRunningRecognizeMetadata(progress_percent=100, start_time=started, last_update_time=_now())
        )
        response.Pack(
            LongRunningRecognizeResponse(
                results=recognition_results(result, c), total_billed_time=duration(result.duration_s)
            )
        )
        return operations_pb2.Operation(
            name=f"lrr-{self._prefix}-{next(self._operations)}",
            done=True,
            metadata=metadata,
            response=response,
        )

    async def GetOperation(self, request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"operation {request.name!r} is not kept: LongRunningRecognize returns its operation done, "
            "with the results in it",
        )


def _first_config(first: Any | None) -> Any:
    if first is None or first.WhichOneof("streaming_request") != "streaming_config":
        raise _invalid("the first request must carry streaming_config (then audio_content in later requests)")
    return first.streaming_config

"""`RivaServicer`: nvidia.riva.asr.RivaSpeechRecognition on the core (see the package docstring)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc import aio
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_asr_pb2_grpc as rasr_grpc
from riva.client.proto import riva_audio_pb2 as raudio

from service.doors.riva.audio import AudioIn, sniff_container, wav_header
from service.doors.riva.results import (
    channel_tag,
    config_response,
    recognition_result,
    request_id_field,
    result_response,
    riva_language,
    riva_word,
)
from service.doors.riva.settings import (
    RECOGNIZE_NAMES,
    STREAM_ENCODINGS,
    STREAM_NAMES,
    RivaFieldError,
    RivaRequest,
    check_runtime_config,
    encoding_name,
    endpoint_settings,
    recognition_request,
    riva_error,
)
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
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    EndpointSettings,
    Identity,
    RecognitionSettings,
    Reconnect,
    Result,
    StreamSettings,
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


@dataclass
class _Opening:
    """What the door read of a stream before opening it: the config, and the first audio when it may
    be a WAV file's header (riva.client's AudioChunkFileIterator streams a file's bytes as they are)."""

    config: rasr.StreamingRecognitionConfig
    request_id: str | None
    head: bytes = b""
    ended: bool = False  # the client half-closed before any more


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

    def _stream_settings(self, opening: _Opening) -> tuple[StreamSettings, RivaRequest, AudioIn, int]:
        """The stream's settings, what feeds it, and where the samples begin in `opening.head`; raises
        RivaFieldError (a ValueError naming the field: the core refuses it INVALID_ARGUMENT)."""
        sc = opening.config
        request = self._request(sc.config, sc.interim_results)
        encoding, rate, channels, offset = request.encoding, request.sample_rate_hertz, request.channels, 0
        wav = wav_header(opening.head) if sniff_container(opening.head) == "WAV" else None
        if wav is not None:  # a WAV file's header says what its samples are, whatever the config says
            encoding, rate, channels, offset = (
                wav.encoding,
                wav.sample_rate_hertz,
                wav.channels,
                wav.data_offset,
            )
        elif request.encoding not in STREAM_ENCODINGS.values():
            raise RivaFieldError(
                "encoding",
                f"encoding {encoding_name(sc.config.encoding)} is accepted by Recognize only (a whole file); "
                "StreamingRecognize takes LINEAR_PCM, MULAW, ALAW (or a WAV file's bytes)",
            )
        validate_stream_format(encoding, rate, channels)  # before the channels are narrowed to the first
        separate = request.separate_channels and channels > 1
        feed = AudioIn(
            encoding,
            channels,
            first_only=not separate,
            reframe=wav is not None,
            max_chunk_bytes=self.recognizer.config.max_chunk_bytes,
        )
        settings = StreamSettings(
            recognition=request.recognition_settings(
                AudioFormat(encoding, rate, channels if separate else 1), separate_channels=separate
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
        built: list[tuple[StreamSettings, RivaRequest, AudioIn, int]] = []

        def settings() -> StreamSettings:
            built.append(self._stream_settings(opening))
            return built[0][0]

        try:  # translated once admitted: a loading, draining or full server says so first
            stream = call.attach(self.recognizer.open_stream(settings, door=DOOR, identity=_caller(context)))
        except RecognitionError as e:
            raise RecognitionError(e.code, riva_error(e, STREAM_NAMES, _fields(built)), e.field) from e
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
            yield result_response(event, stream.heard_s, opening.request_id)
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
            return riva.recognition_settings(
                AudioFormat(sniff_container(audio) or riva.encoding, riva.sample_rate_hertz, riva.channels),
                separate_channels=True,
            )

        try:
            result = await self.recognizer.recognize(audio, settings, door=DOOR, identity=_caller(context))
        except RecognitionError as e:
            fields = built[0].keyterm_fields if built else ()
            await context.abort(grpc_code(e.code), riva_error(e, RECOGNIZE_NAMES, fields))
            raise  # unreachable: abort raises
        riva = built[0]
        await context.send_initial_metadata(_metadata(None, self.recognizer, riva))
        separate = riva.separate_channels
        return rasr.RecognizeResponse(
            results=[
                recognition_result(
                    r.transcript,
                    channel_tag=channel_tag(r.channel),
                    audio_processed_s=r.end_s,
                    confidence=r.confidence,
                    words=[riva_word(w) for w in r.words],
                    language=riva_language(r.language),
                )
                for r in result.results
                if separate or r.channel <= 1
            ],
            **request_id_field(request.id.value if request.HasField("id") else None),
        )


async def _after_opening(
    requests: AsyncIterator[rasr.StreamingRecognizeRequest],
    opening: _Opening,
    offset: int,
    feed: AudioIn,
    stream: Stream,
) -> AsyncIterator[rasr.StreamingRecognizeRequest]:
    """The requests after what the opening read: its audio goes into the stream first."""
    if opening.head[offset:]:
        stream.audio(_field_checked(feed.frames, opening.head[offset:]))
    if not opening.ended:
        async for request in requests:
            yield request


def _taker(feed: AudioIn, stream: Stream) -> Callable[[rasr.StreamingRecognizeRequest], Awaitable[None]]:
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


def _fields(built: Sequence[tuple[StreamSettings, RivaRequest, AudioIn, int]]) -> tuple[str, ...]:
    return built[0][1].keyterm_fields if built else ()


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

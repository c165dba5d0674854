"""The asr.v1 door: the project's own gRPC protocol (asr.v1.Recognizer: StreamingRecognize, Recognize).

A translation layer and nothing more: requests -> the core's settings and calls (service/recognizer/), the
core's events, results and errors -> asr.v1 messages and gRPC statuses. Every refusal is a gRPC status
whose message names the field and the limit; nothing one call does can fail another.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import grpc
from asr.v1 import asr_pb2, asr_pb2_grpc
from google.protobuf.duration_pb2 import Duration
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
from service.recognizer.call_hub import EVERY_CALL, SubscriberLagged
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    CallEvent,
    CallMetrics,
    CallMetricsReport,
    CallMetricsSettings,
    ChannelMetrics,
    DiarizationSettings,
    EndOfSingleUtterance,
    EndpointSettings,
    Formatting,
    Identity,
    RecognitionSettings,
    RecognizeResult,
    Reconnect,
    Redaction,
    Result,
    SpeechEnded,
    SpeechStarted,
    StreamSettings,
)

DOOR = "asr.v1"
STREAM_ID_HEADER = "asr-stream-id"  # initial metadata of an accepted stream (see StreamingRecognize)
MAX_REDACT_VALUES = 8  # three kinds exist; a repeat is harmless, a million of them is not
EventType = asr_pb2.StreamingRecognizeResponse.SpeechEventType
# The core's setting names -> asr.v1's field paths, where they differ (RecognitionError.message_for).
CONFIG_NAMES = {"keyterms": "config.keyterms", "diarization": "config.diarization"}
UPDATE_NAMES = {"keyterms": "keyterms_update.keyterms"}


# --- requests -> the core's settings ---


def encoding_name(value: int) -> str:
    """The proto enum as the core spells it ("" when unset; an unknown number is named as such, so that
    the refusal says what the client sent)."""
    if value == asr_pb2.ENCODING_UNSPECIFIED:
        return ""
    if value not in asr_pb2.AudioEncoding.values():
        return f"unknown value {value}"
    return asr_pb2.AudioEncoding.Name(value)


def _seconds(d: Duration) -> float:
    return d.seconds + d.nanos / 1e9


def redaction(config: asr_pb2.RecognitionConfig) -> frozenset[Redaction]:
    if len(config.redact) > MAX_REDACT_VALUES:
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            f"redact has {len(config.redact)} values, over the limit of {MAX_REDACT_VALUES} (PCI, SSN, NUMBERS)",
            "redact",
        )
    kinds = set()
    for value in config.redact:
        if value == asr_pb2.REDACTION_UNSPECIFIED:
            continue
        if value not in asr_pb2.Redaction.values():
            raise RecognitionError(
                Code.INVALID_ARGUMENT,
                f"config.redact: unknown value {value} (known: PCI, SSN, NUMBERS)",
                "redact",
            )
        kinds.add(Redaction[asr_pb2.Redaction.Name(value)])
    return frozenset(kinds)


def formatting(value: int) -> Formatting:
    if value == asr_pb2.FORMATTING_UNSPECIFIED:
        return Formatting.VERBATIM
    if value not in asr_pb2.Formatting.values():
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            f"config.formatting: unknown value {value} (known: VERBATIM, SMART)",
            "formatting",
        )
    return Formatting[asr_pb2.Formatting.Name(value)]


def call_metrics_settings(config: asr_pb2.RecognitionConfig) -> CallMetricsSettings:
    """Zero (or unset) durations mean the defaults; past the bounds INVALID_ARGUMENT naming the field."""
    c = config.call_metrics
    try:
        return CallMetricsSettings.from_overrides(
            min_non_talk_s=_seconds(c.min_non_talk_duration),
            min_interruption_overlap_s=_seconds(c.min_interruption_overlap),
        )
    except ValueError as e:
        raise RecognitionError.invalid(e) from e


def recognition_settings(config: asr_pb2.RecognitionConfig) -> RecognitionSettings:
    return RecognitionSettings(
        format=AudioFormat(
            encoding_name(config.encoding), config.sample_rate_hertz, config.audio_channel_count
        ),
        separate_channels=config.enable_separate_recognition_per_channel,
        language=config.language_code,
        prompt=config.prompt,
        keyterms=tuple(config.keyterms),
        context_carry=config.context_carry if config.HasField("context_carry") else None,
        beam_size=config.beam_size if config.HasField("beam_size") else None,
        segments=config.enable_segment_time_offsets,
        word_times=config.enable_word_time_offsets,
        word_confidence=config.enable_word_confidence,
        redact=redaction(config),
        formatting=formatting(config.formatting),
        call_metrics=call_metrics_settings(config),
        diarization=DiarizationSettings(config.diarization.min_speakers, config.diarization.max_speakers)
        if config.diarization.enable
        else None,
    )


def endpoint_settings(ep: asr_pb2.EndpointingConfig) -> EndpointSettings:
    """Zero fields mean the defaults (raises EndpointingError naming the field)."""
    return EndpointSettings.from_overrides(
        speech_start_threshold=ep.speech_start_threshold,
        speech_end_threshold=ep.speech_end_threshold,
        min_silence_s=_seconds(ep.min_silence_duration),
        max_utterance_s=_seconds(ep.max_utterance_duration),
        min_speech_s=_seconds(ep.min_speech_duration),
    )


def first_settings(first: asr_pb2.StreamingRecognizeRequest | None) -> StreamSettings:
    """The stream's settings from its first request, which must carry the config."""
    if first is None or first.WhichOneof("streaming_request") != "streaming_config":
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            "first request must carry streaming_config (then audio_content in later requests)",
        )
    return stream_settings(first.streaming_config)


def stream_settings(sc: asr_pb2.StreamingRecognitionConfig) -> StreamSettings:
    if not sc.HasField("config"):
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            "streaming_config.config: streaming_config.config is required (encoding, rate)",
        )
    try:
        endpointing = endpoint_settings(sc.endpointing)
    except ValueError as e:
        raise RecognitionError.invalid(e) from e
    return StreamSettings(
        recognition=recognition_settings(sc.config),
        endpointing=endpointing,
        interim_results=sc.interim_results,
        single_utterance=sc.single_utterance,
        call_metrics=True,  # asr.v1 always sends them in the last response
        call_metrics_interval_s=_seconds(sc.call_metrics_interval),
    )


# --- the core's events and results -> responses ---


def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def alternative(r: Result) -> asr_pb2.SpeechRecognitionAlternative:
    words = []
    for w in r.words:
        info = asr_pb2.WordInfo(word=w.text)
        if w.start_s is not None and w.end_s is not None:
            info.start_offset.CopyFrom(duration(w.start_s))
            info.end_offset.CopyFrom(duration(w.end_s))
        if w.confidence is not None:
            info.confidence = w.confidence
        if w.speaker is not None:
            info.speaker = w.speaker
        words.append(info)
    return asr_pb2.SpeechRecognitionAlternative(
        transcript=r.transcript,
        confidence=r.confidence,
        segments=[
            asr_pb2.WordOrSegment(text=s.text, start_offset=duration(s.start_s), end_offset=duration(s.end_s))
            for s in r.segments
        ],
        words=words,
    )


def call_metrics(m: CallMetrics) -> asr_pb2.CallMetrics:
    return asr_pb2.CallMetrics(
        channels=_channel_metrics(m.channels),
        non_talk_time=duration(m.non_talk_s),
        overlap_time=duration(m.overlap_s),
        total_time=duration(m.total_s),
        speakers=_channel_metrics(m.speakers),
    )


def _channel_metrics(of: Sequence[ChannelMetrics]) -> list[asr_pb2.ChannelMetrics]:
    channels = []
    for c in of:
        channel = asr_pb2.ChannelMetrics(
            channel_tag=c.channel_tag,
            talk_time=duration(c.talk_s),
            interruptions=c.interruptions,
            words_per_minute=c.words_per_minute,
        )
        if c.mean_loudness_dbfs is not None:
            channel.mean_loudness_dbfs = c.mean_loudness_dbfs
        channels.append(channel)
    return channels


def _speech_event(kind: int, offset_s: float, channel: int) -> asr_pb2.StreamingRecognizeResponse:
    return asr_pb2.StreamingRecognizeResponse(
        speech_event_type=kind,  # type: ignore[arg-type]
        speech_event_offset=duration(offset_s),
        speech_event_channel_tag=channel,
    )


def response(event: CallEvent) -> asr_pb2.StreamingRecognizeResponse:
    if isinstance(event, Result):
        result = asr_pb2.StreamingRecognitionResult(
            alternatives=[alternative(event)],
            is_final=event.is_final,
            stability=event.stability,
            start_offset=duration(event.start_s),
            end_offset=duration(event.end_s),
            channel_tag=event.channel,
            language_code=event.language,
            utterance_index=event.utterance_index,
            **({} if event.speaker is None else {"speaker": event.speaker}),
        )
        return asr_pb2.StreamingRecognizeResponse(results=[result])
    if isinstance(event, SpeechStarted):
        return _speech_event(EventType.SPEECH_ACTIVITY_BEGIN, event.offset_s, event.channel)
    if isinstance(event, SpeechEnded):
        return _speech_event(EventType.SPEECH_ACTIVITY_END, event.offset_s, event.channel)
    if isinstance(event, EndOfSingleUtterance):
        return _speech_event(EventType.END_OF_SINGLE_UTTERANCE, event.offset_s, event.channel)
    if isinstance(event, Reconnect):
        return _speech_event(EventType.RECONNECT, event.offset_s, 0)
    if isinstance(event, CallMetricsReport):
        return asr_pb2.StreamingRecognizeResponse(call_metrics=call_metrics(event.metrics))
    raise TypeError(f"no asr.v1 response for {event!r}")


def recognize_response(result: RecognizeResult) -> asr_pb2.RecognizeResponse:
    return asr_pb2.RecognizeResponse(
        results=[
            asr_pb2.SpeechRecognitionResult(
                alternatives=[alternative(r)],
                channel_tag=r.channel,
                start_offset=duration(r.start_s),
                end_offset=duration(r.end_s),
                language_code=r.language,
                **({} if r.speaker is None else {"speaker": r.speaker}),
            )
            for r in result.results
        ],
        total_audio_duration=duration(result.duration_s),
        call_metrics=None if result.call_metrics is None else call_metrics(result.call_metrics),
    )


def _caller(context: aio.ServicerContext) -> Identity:
    return identity(bearer_token(context.invocation_metadata()), context.peer())


async def _take(request: asr_pb2.StreamingRecognizeRequest, stream: Stream) -> None:
    """One request after the config into the stream."""
    kind = request.WhichOneof("streaming_request")
    if kind == "streaming_config":
        raise RecognitionError(Code.INVALID_ARGUMENT, SECOND_CONFIG)
    if kind == "audio_content":
        stream.audio(request.audio_content)
        await stream.pace()
    elif kind == "keyterms_update":
        try:
            stream.update_keyterms(request.keyterms_update.keyterms)
        except RecognitionError as e:
            raise RecognitionError(e.code, e.message_for(UPDATE_NAMES), e.field) from e


# --- the servicer ---


class RecognizerServicer(asr_pb2_grpc.RecognizerServicer):
    def __init__(self, recognizer: Recognizer) -> None:
        self.recognizer = recognizer

    async def StreamingRecognize(
        self,
        request_iterator: AsyncIterator[asr_pb2.StreamingRecognizeRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[asr_pb2.StreamingRecognizeResponse]:
        async def refuse(e: RecognitionError) -> None:
            await context.abort(grpc_code(e.code), e.message_for(CONFIG_NAMES))

        # an async generator itself: grpc.aio runs any other handler as a synchronous one
        async for out in serve_stream(
            context, lambda call: self._respond(request_iterator, context, call), refuse
        ):
            yield out

    async def _respond(
        self,
        requests: AsyncIterator[asr_pb2.StreamingRecognizeRequest],
        context: aio.ServicerContext,
        call: StreamCall,
    ) -> AsyncGenerator[asr_pb2.StreamingRecognizeResponse, None]:
        first = await first_request(requests, self.recognizer, DOOR)
        # translated once admitted: a loading, draining or full server says so first
        stream = call.attach(
            self.recognizer.open_stream(lambda: first_settings(first), door=DOOR, identity=_caller(context))
        )
        # Headers now, not with the first result: they tell the client its stream was accepted, so it
        # starts sending audio only then. A client still writing when a refusal arrives gets INTERNAL
        # instead of the refusal from grpc.aio (grpc/grpc#36066); RecognizerClient waits for this.
        await context.send_initial_metadata(((STREAM_ID_HEADER, stream.id),))
        call.read(read_requests(stream, requests, lambda request: _take(request, stream)))
        async for event in stream.events():
            yield response(event)

    async def Recognize(
        self, request: asr_pb2.RecognizeRequest, context: aio.ServicerContext
    ) -> asr_pb2.RecognizeResponse:
        try:
            # audio_content read once: each read of a bytes field is a fresh copy (upb)
            result = await self.recognizer.recognize(
                request.audio_content,
                lambda: recognition_settings(request.config),
                door=DOOR,
                identity=_caller(context),
            )
        except RecognitionError as e:
            await context.abort(grpc_code(e.code), e.message_for(CONFIG_NAMES))
            raise  # unreachable: abort raises
        return recognize_response(result)

    async def FollowCalls(
        self, request: asr_pb2.FollowCallsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[asr_pb2.CallEvent]:
        hub = self.recognizer.call_hub
        ended = False
        try:
            async with hub.subscribe(request.call_id or EVERY_CALL) as subscription:
                # headers once subscribed: a follower that waits for them misses nothing of the call
                await context.send_initial_metadata(())
                async for message in subscription:
                    event = call_event(message)
                    ended = event.HasField("ended") and bool(request.call_id)
                    yield event
        except SubscriberLagged as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this follower fell behind: {e}")
        if not ended and hub.closed:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "server is draining; follow the call on another replica"
            )


def call_event(message: dict[str, Any]) -> asr_pb2.CallEvent:
    """A message of the call hub (service/recognizer/call_hub.py) as asr.v1's CallEvent."""
    event = asr_pb2.CallEvent(call_id=message["call_id"])
    kind = message["type"]
    if kind == "call_started":
        event.started.platform = message["platform"]
        event.started.stream_id = message["stream_id"]
        event.started.channels.extend(message["channels"])
        event.started.attributes.update(message["attributes"])
    elif kind == "transcript":
        t = event.transcript
        t.channel, t.is_final, t.text = message["channel"], message["is_final"], message["text"]
        t.start_offset.FromNanoseconds(round(message["start_s"] * 1e9))
        t.end_offset.FromNanoseconds(round(message["end_s"] * 1e9))
    elif kind == "call_ended":
        event.ended.status = message["status"]
        m = message["metrics"]
        event.ended.metrics.CopyFrom(
            call_metrics(
                CallMetrics(
                    channels=tuple(
                        ChannelMetrics(
                            channel_tag=c["channel_tag"],
                            talk_s=c["talk_s"],
                            interruptions=c["interruptions"],
                            words_per_minute=c["words_per_minute"],
                            mean_loudness_dbfs=c["mean_loudness_dbfs"],
                            words=0,
                        )
                        for c in m["channels"]
                    ),
                    non_talk_s=m["non_talk_s"],
                    overlap_s=m["overlap_s"],
                    total_s=m["total_s"],
                )
            )
        )
    return event

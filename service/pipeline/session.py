"""One live stream, as its door sees it: audio in, controls, events out, and the stream's life.

Whoever feeds it (a door, through service/recognizer/recognizer.py's Stream) and three kinds of asyncio tasks,
so that no one of them can stall the others, each run by one part this session wires together:
- intake.py: `audio()` decodes each chunk, the process's VAD pass scores it and the channels' endpointers
  turn it into events, each utterance submitted the moment its end is detected;
- finals.py: one finalizer per channel awaits that channel's utterances in order and queues their finals;
- outbox.py: the writer (`events()`, iterated by the door) hands over whatever is queued, at the client's
  pace, bounded in bytes.
Interim hypotheses are extra engine requests (interims.py). Each channel's state is a channel.py Channel;
the server flags the parts read are a SessionSettings (session_settings.py); the stream's life is one
StreamState (stream_state.py). Every way it ends is a RecognitionError (service/vocabulary/errors.py) or a
normal end of `events()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from engine.api import DecodeOptions
from service import metrics
from service.pipeline.audio import AudioFormatError
from service.pipeline.call_metrics import CallMetrics, CallMetricsTracker
from service.pipeline.channel import SessionShared, build_channels
from service.pipeline.finals import Finals
from service.pipeline.intake import Intake
from service.pipeline.interims import Interims
from service.pipeline.options import StreamPlan
from service.pipeline.outbox import Outbox
from service.pipeline.session_settings import SessionSettings
from service.pipeline.speculation import Speculations
from service.pipeline.stream_state import StreamState
from service.vocabulary.endpointing import EndpointingError
from service.vocabulary.engine import RecognitionEngine
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import CallEvent, CallMetricsReport, Reconnect

log = logging.getLogger("service.pipeline.session")


def internal(e: Exception) -> RecognitionError:
    return RecognitionError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}")


class StreamSession:
    def __init__(
        self,
        stream_id: str,
        settings: StreamPlan,
        engine: RecognitionEngine,
        flags: SessionSettings,
    ) -> None:
        self.id = stream_id
        # the engine's live finals take turns by caller (engine/scheduling/policy.py): this stream is one
        settings = dataclasses.replace(
            settings, options=dataclasses.replace(settings.options, caller=stream_id)
        )
        self.settings = settings
        self.engine = engine
        self._flags = flags
        self.channels = build_channels(settings, engine, flags)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.state = StreamState.OPEN
        self._finalize_held = False  # a Finalize waits for --max-finals-in-flight (finalize's `hold`)
        ep = settings.endpointing
        self._speculations = Speculations(  # service/pipeline/speculation.py
            engine, stream_id, confirm_after_s=ep.min_silence_s - ep.speech_pad_s if ep is not None else 0.0
        )
        self._call_metrics = CallMetricsTracker(
            [ch.tag for ch in self.channels],
            settings.call_metrics,
            interval_s=settings.call_metrics_interval_s if settings.report_call_metrics else 0.0,
        )
        self._outbox = Outbox(flags.max_response_backlog_bytes, shed=self.abandon)
        shared = SessionShared(
            self,
            stream_id,
            settings,
            flags,
            engine,
            self.channels,
            self._speculations,
            self._call_metrics,
            self._outbox,
        )
        self._finals = Finals(shared, on_settle=self._run_held_finalize, on_queued=self._buffer_moved)
        self._intake = Intake(shared, self._finals, Interims(shared))

    def _become(self, new: StreamState) -> bool:
        """Move forward to `new`; False (and no move) when the stream is already past it."""
        if not self.state.can_become(new):
            return False
        self.state = new
        return True

    # --- the door's side: start, audio, controls, and the writer it iterates ---

    def start(self) -> None:
        """Begin: the finalizers run and the idle-audio clock starts (in the event loop)."""
        self._finals.start()
        self._intake.start()

    def events(self) -> AsyncIterator[CallEvent]:
        """Yields events until the stream is over; raises RecognitionError to end it with that code."""
        return self._outbox.events()

    def call_metrics(self) -> CallMetrics:
        """The call's metrics so far (the whole call once the stream has ended)."""
        return self._finals.with_speakers(self._call_metrics.snapshot(), self.heard_s)

    @property
    def heard_s(self) -> float:
        """Seconds of audio (per channel) received so far."""
        return self._intake.heard_s

    @property
    def lead_s(self) -> float:
        """How far the audio received runs ahead of the wall clock since the first audio (seconds; 0 or
        less for a real-time client)."""
        return self._intake.lead_s

    @property
    def backlog_bytes(self) -> int:
        """Bytes (event_size) of the events queued for the client and not yet taken by the door."""
        return self._outbox.backlog_bytes

    def audio(self, chunk: bytes) -> None:
        """One chunk of the stream's audio, whole frames (every channel of a sample). Never raises: what
        is wrong with it ends the stream, and `events()` raises why."""
        if self.state.ending:
            return
        try:
            if len(chunk) > self._flags.max_chunk_bytes:
                raise RecognitionError(
                    Code.INVALID_ARGUMENT,
                    f"audio_content of {len(chunk)} bytes is over the limit of "
                    f"{self._flags.max_chunk_bytes} bytes per request (max_chunk_bytes); send smaller chunks",
                    "audio_content",
                )
            if not self.state.takes_audio:
                return  # single utterance or draining: later audio is ignored
            self._intake.audio(chunk)
        except Exception as e:
            self.fail_with(e, "stream audio failed")

    def finish(self) -> None:
        """The client half-closed: what it sent gets its finals, then `events()` ends."""
        try:
            self.finish_input(flush=True)
        except Exception as e:
            self.fail_with(e, "stream finish failed")

    def finalize(self, *, hold: bool = False) -> bool:
        """End each channel's utterance in progress now, as a half-close would, and go on listening: its
        final (ended_by FINALIZE) comes as soon as the engine has it. True if an utterance ended so.
        Past --max-finals-in-flight the flush waits for one of this stream's finals (`hold`: True now, the
        flush runs then) or is refused RESOURCE_EXHAUSTED: a stream that flushes faster than it is served
        merges its own turns instead of filling the engine's queue, which every stream shares."""
        if not self.state.takes_audio:
            return False
        if self._finals.in_flight_full():
            metrics.refused("max_finals_in_flight")
            if hold:
                self._finalize_held = True
                return True
            raise RecognitionError(
                Code.RESOURCE_EXHAUSTED,
                f"{self._flags.max_finals_in_flight} finals of this stream are still being recognized "
                "(--max-finals-in-flight): the audio stays in the utterance in progress; flush again later",
            )
        return self._intake.finalize()

    def _run_held_finalize(self) -> None:
        """A final settled: a Finalize held for --max-finals-in-flight runs once there is room."""
        if self._finalize_held and not self._finals.in_flight_full():
            self._finalize_held = False
            self.finalize()

    def _buffer_moved(self) -> None:
        """A final went out: the audio waiting for transcription shrank (asr_stream_buffer_seconds)."""
        self._intake.update_buffer()

    def keep_alive(self) -> None:
        """The client is there though it sends no audio now (Deepgram's KeepAlive): the --idle-audio-timeout
        clock starts again."""
        self._intake.keep_alive()

    def clear(self) -> bool:
        """Drop the audio of each channel's utterance in progress (and its interim in flight): no final of
        it comes. Utterances that already ended keep their finals. True if it dropped one in progress
        (with endpointing: one whose SpeechStarted was sent)."""
        if not self.state.takes_audio:
            return False
        return self._intake.clear()

    def update_options(self, options: DecodeOptions) -> None:
        """Decode with `options` (checked by the caller) the utterances whose speech starts from now on:
        at or after the audio received so far, even when the VAD reports that start only later; one
        under way keeps the options it started with."""
        self.settings = dataclasses.replace(self.settings, options=options)
        self._intake.update_options(options)

    @property
    def held_option_changes(self) -> int:
        """How many option changes the stream holds for utterances whose start is not yet reported."""
        return len(self._intake.options)

    def fail(self, error: RecognitionError) -> None:
        """End the stream now with `error`: what is already queued goes out first."""
        self._fail(error)

    def drain(self) -> None:
        """Server shutdown: tell the client to reconnect, finish what was heard, end with OK. The event's
        offset is how much audio was heard (all of it is transcribed; later audio is not): the client
        continues the call on a new stream from there, losing nothing and repeating nothing."""
        self._outbox.put(Reconnect(self.heard_s))
        self.finish_input(flush=True)

    def abandon(self) -> None:
        """The call is over: free every engine slot it held and stop its tasks, at once (sync, so that
        it can run from a door's callback when its client is gone, whatever the door's handler is doing)."""
        if not self._become(StreamState.CLOSED):
            return
        self._speculations.cancel_all()
        self._finals.abandon()
        for ch in self.channels:
            ch.interim.cancel()
        for t in self._tasks:
            t.cancel()
        self._intake.stop()
        self._outbox.close()  # what is queued is never to be sent

    async def close(self) -> None:
        """The stream is over (however it ended): abandon what is left and wait for the tasks to stop."""
        tasks = [t for t in self._tasks if not t.done()]
        self.abandon()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- what the parts ask (channel.py StreamHost) ---

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def fail_with(self, e: Exception, what: str) -> None:
        if isinstance(e, RecognitionError):
            self._fail(e)
        elif isinstance(e, AudioFormatError | EndpointingError):
            self._fail(RecognitionError(Code.INVALID_ARGUMENT, f"{e.field}: {e}", e.field))
        else:  # a bug of ours: fail this stream only, loudly
            log.exception(what, extra={"fields": {"stream_id": self.id}})
            self._fail(internal(e))

    def end_after_admitted(self, error: RecognitionError) -> None:
        """Stop taking audio; every utterance already admitted, on every channel, gets its final (and every
        final a redacting channel holds back is sent), then the first such `error` ends the stream."""
        self._outbox.keep_first_status(error)
        self.finish_input(flush=False)

    def finish_input(self, *, flush: bool) -> None:
        """No more audio: optionally endpoint what was heard as if the client half-closed, then let the
        finalizers drain and end the stream."""
        if not self.state.takes_audio:
            return
        if flush:
            try:
                self._intake.flush()
            except RecognitionError as e:
                self._fail(e)
                return
            if not self.state.takes_audio:
                return  # single_utterance ended the input while flushing
        self._speculations.cancel_all()  # what was not confirmed by now is not an utterance
        self._become(StreamState.FINISHING)
        self._finals.finish()
        self.spawn(self._complete())

    async def _complete(self) -> None:
        await self._finals.drained()
        if self._become(StreamState.ENDED):
            self._call_metrics.advance(self.heard_s)
            call = self.call_metrics()
            metrics.observe_call(call)
            if self.settings.report_call_metrics:
                self._outbox.put(CallMetricsReport(call, last=True))  # after every final
            self._outbox.end()

    def _fail(self, error: RecognitionError) -> None:
        """End the stream with an error status: nothing more is read or sent after what is queued."""
        if self._become(StreamState.FAILED):
            self._outbox.end_status = error
            self._outbox.end()

"""A live stream's audio in: decoded, pushed to each channel's endpointer, scored by the process's VAD pass,
and the endpointers' events out (speech starts and ends, utterances to service/pipeline/finals.py).

`audio()` decodes each chunk and pushes it to each channel's endpointer; the process's VAD pass scores every
stream's new audio in one batched call per event-loop tick (service/pipeline/vad_batch.py) and hands back
the probabilities (_on_scored), whereupon the endpointers' events go out. Also here, as they are clocked by
the audio: the voice activity and idle timeouts, the stream's length and buffer limits, the turn model's
questions, and which options each utterance is decoded with (update_options)."""

from __future__ import annotations

import asyncio
import collections
import time

import numpy as np

from engine.api import DecodeOptions
from service import metrics
from service.pipeline.audio import StreamDecoder, mixdown
from service.pipeline.channel import Channel, SessionShared
from service.pipeline.endpointing import (
    Endpointer,
    Event,
    ManualTurns,
    SpeculationCancelled,
    SpeculativeEnd,
    SpeechEnded,
    SpeechStarted,
    Utterance,
)
from service.pipeline.finals import Finals
from service.pipeline.interims import Interims
from service.pipeline.results import end_reason
from service.pipeline.turn_model import turn_batcher
from service.pipeline.vad_batch import vad_batcher
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import CallMetricsReport, EndOfSingleUtterance, EndReason, SpeechTimeout
from service.vocabulary.types import SpeechEnded as SpeechEndedEvent
from service.vocabulary.types import SpeechStarted as SpeechStartedEvent

_SCORE_NOW_S = 0.25  # unscored audio a stream may hold while it waits for the VAD pass
# How long a keyterms update is remembered by the audio time it came at (the VAD reports a speech start
# a fraction of a second after it; see OptionChanges.at).
_OPTIONS_KEPT_S = 30.0
# Changes held at most: past it the oldest go (an utterance reported that late falls back to the oldest
# kept), so a stream that updates between tiny chunks cannot grow the list within _OPTIONS_KEPT_S.
MAX_HELD_OPTION_CHANGES = 32
# Per-chunk figures reach Prometheus in steps: in multiprocess mode each write is a lock and an mmap write,
# a measurable share of a frontend's CPU when done for every 20 ms chunk of every stream.
_METRIC_FLUSH_S = 1.0  # asr_audio_seconds_total: added every second of a stream's audio, and at its end
_BUFFER_STEP_S = 0.1  # asr_stream_buffer_seconds: each stream's share, to a tenth of a second


class OptionChanges:
    """update_options' changes by the audio position they came at, the first the stream's own options: an
    utterance is decoded with those in force where its speech started, however late the VAD reports it."""

    def __init__(self, options: DecodeOptions) -> None:
        # (stream seconds from which they apply, options)
        self._changes: collections.deque[tuple[float, DecodeOptions]] = collections.deque(
            [(0.0, options)], maxlen=MAX_HELD_OPTION_CHANGES
        )

    def __len__(self) -> int:
        return len(self._changes)

    @property
    def latest(self) -> DecodeOptions:
        return self._changes[-1][1]

    def update(self, options: DecodeOptions, heard_s: float) -> None:
        changes = self._changes
        if changes[-1][0] == heard_s:
            # no utterance can start between two updates at the same audio position: the last one wins
            changes[-1] = (heard_s, options)
        else:
            changes.append((heard_s, options))  # past maxlen the oldest goes

    def at(self, start_s: float, heard_s: float) -> DecodeOptions:
        """The options of an utterance whose speech starts at `start_s` (stream seconds)."""
        changes = self._changes
        # a start is reported well within _OPTIONS_KEPT_S of the audio: older changes are dead
        while len(changes) > 1 and changes[1][0] <= heard_s - _OPTIONS_KEPT_S:
            changes.popleft()
        return next((o for at, o in reversed(changes) if at <= start_s), changes[0][1])


class Intake:
    def __init__(self, shared: SessionShared, finals: Finals, interims: Interims) -> None:
        self._shared = shared
        plan = shared.plan
        self._finals = finals
        self._interims = interims
        self.decoder = StreamDecoder(plan.encoding, plan.sample_rate_hertz, plan.channels)
        self._vad = vad_batcher()
        self._endpointers = [ch.endpointer for ch in shared.channels]
        self.options = OptionChanges(plan.options)
        channel_mode = "mono" if plan.channels == 1 else "separate" if plan.separate_channels else "mixdown"
        self._audio_counter = metrics.AUDIO_SECONDS.labels(channel_mode)
        self._audio_unflushed_s = 0.0  # received, not yet added to asr_audio_seconds_total
        self.heard_s = 0.0  # seconds of audio (per channel) received so far
        self._first_audio_at: float | None = None  # monotonic time of the first audio: the pace's origin
        self._buffer_s = 0.0  # this stream's share of asr_stream_buffer_seconds
        self._last_audio = time.monotonic()  # for --idle-audio-timeout (_check_idle)
        self._idle_timer: asyncio.TimerHandle | None = None
        # the voice activity timeouts' clock (_check_voice_timeouts): None until speech first starts, then
        # the offset of the last speech event
        self._last_speech_end_s: float | None = None

    # --- what the session asks ---

    def start(self) -> None:
        """The idle-audio clock starts (in the event loop)."""
        self._last_audio = time.monotonic()
        self._check_idle()

    def stop(self) -> None:
        """The call is over: no timer left, the stream's figures settled."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._set_buffer(0.0)
        self._flush_audio_seconds()

    @property
    def lead_s(self) -> float:
        """How far the audio received runs ahead of the wall clock since the first audio (seconds; 0 or
        less for a real-time client)."""
        if self._first_audio_at is None:
            return 0.0
        return self.heard_s - (time.monotonic() - self._first_audio_at)

    def audio(self, chunk: bytes) -> None:
        """One chunk of the stream's audio, whole frames; raises what is wrong with it."""
        if chunk:
            self._last_audio = time.monotonic()
            if self._first_audio_at is None:
                self._first_audio_at = self._last_audio
        self._process(chunk)

    def keep_alive(self) -> None:
        self._last_audio = time.monotonic()

    def flush(self) -> None:
        """The input ends: what the decoder holds is endpointed as at a half-close (END_OF_AUDIO)."""
        tail = self.decoder.flush()
        self._push_audio(tail)
        self._endpoint(self._vad.score_now(self._endpointers))  # no wait for the tick
        for ch in self._shared.channels:
            for event in ch.endpointer.flush() if self._shared.host.state.takes_audio else []:
                self._on_event(ch, event, ended_by=EndReason.END_OF_AUDIO)

    def finalize(self) -> bool:
        """End each channel's utterance in progress now (ended_by FINALIZE); True if one ended so."""
        ended = False
        try:
            self._endpoint(self._vad.score_now(self._endpointers))  # what was pushed is heard first
            for ch in self._shared.channels:
                cut = ch.endpointer.cut if isinstance(ch.endpointer, ManualTurns) else ch.endpointer.flush
                for event in cut() if self._shared.host.state.takes_audio else []:
                    ended |= isinstance(event, Utterance)
                    self._on_event(ch, event, ended_by=EndReason.FINALIZE)
                self._next_manual_turn(ch)
        except Exception as e:
            self._shared.host.fail_with(e, "stream finalize failed")
        return ended

    def clear(self) -> bool:
        """Drop each channel's utterance in progress and its interim in flight; True if it dropped one in
        progress (with endpointing: one whose SpeechStarted was sent)."""
        dropped = False
        try:
            self._endpoint(self._vad.score_now(self._endpointers))
            for ch in self._shared.channels:
                if not self._shared.host.state.takes_audio:
                    return dropped
                dropped = dropped or ch.endpointer.in_speech
                for event in ch.endpointer.clear():
                    self._on_event(ch, event)
                ch.interim.cancel()
                ch.next_index = ch.endpointer.next_index
                ch.cleared = ch.next_index
                self._next_manual_turn(ch)
        except Exception as e:
            self._shared.host.fail_with(e, "stream clear failed")
        return dropped

    def update_options(self, options: DecodeOptions) -> None:
        """Decode with `options` the utterances whose speech starts at or after the audio received so far."""
        self.options.update(options, self.heard_s)

    def update_buffer(self) -> float:
        """How far the audio received runs ahead of transcription: from the end of the oldest utterance
        still being transcribed to the newest sample (about latency + min silence in a live call). A turn
        the client has not cut yet counts from its start (the endpointer bounds its own by
        max_utterance_duration)."""
        oldest = min(
            (ch.unsettled[0].utterance.end_s for ch in self._shared.channels if ch.unsettled),
            default=self.heard_s,
        )
        for ch in self._shared.channels:
            if isinstance(ch.endpointer, ManualTurns) and ch.endpointer.in_speech:
                oldest = min(oldest, ch.endpointer.held_from_s)
        buffered = self.heard_s - oldest
        self._set_buffer(buffered)
        return buffered

    # --- audio to events ---

    def _check_idle(self) -> None:
        """--idle-audio-timeout: a stream that sends no audio for that long, and does not half-close, is
        over (a client that hung, or whose network died). What it sent still gets its finals, as at a
        half-close; then OUT_OF_RANGE, the code and words Google Speech answers with. One timer per
        stream, re-armed from the last audio when it fires: nothing per chunk."""
        timeout = self._shared.flags.idle_audio_timeout
        if not timeout or not self._shared.host.state.takes_audio:
            return
        # audio sent ahead of real time covers the wall time it lasts (the door may be pacing the client)
        heard_until = self._last_audio
        if self._first_audio_at is not None:
            heard_until = max(heard_until, self._first_audio_at + self.heard_s)
        idle = time.monotonic() - heard_until
        if idle < timeout:
            self._idle_timer = asyncio.get_running_loop().call_later(timeout - idle, self._check_idle)
            return
        self._shared.outbox.keep_first_status(
            RecognitionError(
                Code.OUT_OF_RANGE,
                f"Audio Timeout Error: no audio for {timeout:g} s (idle_audio_timeout); send audio close to "
                "real time, silence too, and half-close the stream when the call ends",
            )
        )
        try:
            self._shared.host.finish_input(flush=True)
        except Exception as e:
            self._shared.host.fail_with(e, "stream idle timeout failed")

    def _process(self, chunk: bytes) -> None:
        frames = len(chunk) // self.decoder.frame_bytes
        seconds = frames / self.decoder.rate
        if self.heard_s + seconds > self._shared.flags.max_stream_seconds:
            # Finals for what was heard still go out; the status tells the client to open a new stream.
            self._shared.outbox.end_status = RecognitionError(
                Code.OUT_OF_RANGE,
                f"stream is longer than the limit of {self._shared.flags.max_stream_seconds:g} s of audio "
                "(max_stream_seconds); open a new stream to continue",
            )
            self._shared.host.finish_input(flush=True)
            return
        self.heard_s += seconds
        self._audio_unflushed_s += seconds
        if self._audio_unflushed_s >= _METRIC_FLUSH_S:
            self._flush_audio_seconds()
        self._push_audio(self.decoder.feed(chunk))
        if self._vad.waiting(self) and max(ep.unscored_s for ep in self._endpointers) >= _SCORE_NOW_S:
            # Audio piles up before the pass: the client sends faster than real time. Endpoint now, as
            # chunks were before batching, so that the buffer limit is still checked as audio comes and
            # unscored audio stays small. (Real-time calls, even bunched by a late loop, stay batched.)
            self._on_scored(self._vad.score_now(self._endpointers))
        else:
            # This tick's VAD pass scores every stream's new audio at once; _on_scored goes on from there.
            self._vad.request(self, self._endpointers, self._on_scored)

    def _push_audio(self, audio: np.ndarray) -> None:
        """Decoded audio -> endpointer of each channel (or the mixdown), to be scored."""
        if not self._shared.plan.separate_channels:
            audio = mixdown(audio)[None]
        for i, ch in enumerate(self._shared.channels):
            ch.endpointer.push(audio[i])

    def _on_scored(self, probs: list[np.ndarray] | Exception) -> None:
        """This tick's VAD probabilities for each channel: events, interims, buffer limits."""
        if not self._shared.host.state.takes_audio:
            return  # what was pushed was scored when the input ended (flush)
        try:
            if isinstance(probs, Exception):
                raise probs
            self._endpoint(probs)
            so_far = self._shared.call_metrics.advance(self.heard_s)
            if so_far is not None:
                self._shared.outbox.put(
                    CallMetricsReport(self._finals.with_speakers(so_far, self.heard_s), last=False)
                )
            self._finals.release_held(self.heard_s)
            if self._shared.host.state.takes_audio:
                self._check_buffer()
        except Exception as e:
            self._shared.host.fail_with(e, "stream endpointing failed")

    def _endpoint(self, probs: list[np.ndarray]) -> None:
        """Each channel's state machine over its scored windows -> events (and interims)."""
        for ch, p in zip(self._shared.channels, probs, strict=True):
            if not self._shared.host.state.takes_audio:
                return  # an engine refusal (or single utterance) ended the input: nothing more is sent
            for event in ch.endpointer.advance(p):
                self._on_event(ch, event)
                if not self._shared.host.state.takes_audio:
                    return
            if self._shared.plan.interim_results:
                self._interims.maybe_ask(ch, self.heard_s)
        self._ask_turn_model()
        self._check_voice_timeouts()

    def _ask_turn_model(self) -> None:
        """Pauses the endpointers want judged go to this tick's turn-model pass (one call for all streams)."""
        asked = [
            (ch, q)
            for ch in self._shared.channels
            if isinstance(ch.endpointer, Endpointer) and (q := ch.endpointer.question()) is not None
        ]
        if asked:
            turn_batcher().request(
                [q for _, q in asked], lambda p: self._on_judged([ch for ch, _ in asked], p)
            )

    def _on_judged(self, channels: list[Channel], complete: list[float] | Exception) -> None:
        """The turn model's verdicts: a complete turn ends now. Should the model fail, the pause ends the
        turn, as silence-only endpointing would have (the failure is logged by the batcher)."""
        if not self._shared.host.state.takes_audio:
            return
        try:
            verdicts = [1.0] * len(channels) if isinstance(complete, Exception) else complete
            for ch, p in zip(channels, verdicts, strict=True):
                assert isinstance(ch.endpointer, Endpointer)
                for event in ch.endpointer.judged(p):
                    self._on_event(ch, event)
                    if not self._shared.host.state.takes_audio:
                        return
            self._finals.release_held(self.heard_s)
        except Exception as e:
            self._shared.host.fail_with(e, "stream endpointing failed")

    def _check_voice_timeouts(self) -> None:
        """SpeechTimeout once the VAD has scored past a voice activity timeout with no channel in speech:
        the stream takes no more audio (utterances that ended keep their finals)."""
        s = self._shared.plan
        if (
            s.speech_start_timeout_s is None and s.speech_end_timeout_s is None
        ) or not self._shared.host.state.takes_audio:
            return
        endpointers = self._endpointers
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
        self._shared.outbox.put(SpeechTimeout(at))
        self._shared.host.finish_input(flush=False)

    def _on_event(self, ch: Channel, event: Event, ended_by: EndReason | None = None) -> None:
        """`ended_by`: what ends an utterance this event completes, when not the endpointer's silence or
        cut (a finalize, the end of the audio)."""
        if isinstance(event, SpeculativeEnd):
            # submitted now, held until the end is confirmed (Finals.submit). The interim in flight is left
            # alone until then, as without speculation: on a miss the utterance goes on and the interim is
            # still wanted (cancelling it at each offer starved interims on a busy engine)
            self._shared.speculations.offer(ch.tag, event.utterance, ch.next_options(), time.monotonic())
        elif isinstance(event, SpeculationCancelled):
            self._shared.speculations.cancel(ch.tag)
        elif isinstance(event, SpeechStarted):
            # keyterms changed mid-stream apply from here
            ch.options = self.options.at(event.offset_s, self.heard_s)
            self._shared.call_metrics.speech_started(ch.tag, event.offset_s)
            ch.speech_start_s = event.offset_s
            ch.speech_start_wall = time.monotonic()
            self._last_speech_end_s = max(self._last_speech_end_s or 0.0, event.offset_s)
            self._shared.outbox.put(SpeechStartedEvent(ch.tag, event.offset_s))
        elif isinstance(event, SpeechEnded):
            self._last_speech_end_s = max(self._last_speech_end_s or 0.0, event.offset_s)
            self._shared.outbox.put(SpeechEndedEvent(ch.tag, event.offset_s))
        else:
            self._shared.call_metrics.utterance(ch.tag, event)
            self._finals.submit(ch, event, ended_by or end_reason(event))
            if not self._shared.host.state.takes_audio:
                return  # refused: the stream ends once what was admitted has its final
            if event.forced_cut:  # speech goes on: the next utterance starts at the cut
                ch.speech_start_s = event.end_s
                ch.speech_start_wall = time.monotonic()
            if self._shared.plan.single_utterance:
                self._shared.outbox.put(EndOfSingleUtterance(ch.tag, event.end_s))
                self._shared.host.finish_input(flush=False)

    def _next_manual_turn(self, ch: Channel) -> None:
        """A channel the client cuts: its next utterance begins here (no SpeechStarted says so)."""
        if isinstance(ch.endpointer, ManualTurns):
            ch.options = self.options.latest
            ch.speech_start_s = ch.endpointer.held_from_s
            ch.speech_start_wall = time.monotonic()

    # --- buffering ahead of transcription ---

    def _check_buffer(self) -> None:
        buffered = self.update_buffer()
        limit = self._shared.flags.max_buffer_seconds
        if buffered > limit:
            raise RecognitionError(
                Code.RESOURCE_EXHAUSTED,
                f"{buffered:.0f} s of audio is waiting to be transcribed, over the limit of "
                f"{limit:g} s (max_buffer_seconds); "
                + (
                    "end turns (commit) sooner"
                    if self._shared.plan.endpointing is None
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

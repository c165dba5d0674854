"""A whole recording: decoded, resampled and endpointed a block at a time, its utterances fed to the engine
through a bounded window, its finals built and redacted per channel.

The core (service/recognizer/recognizer.py Recognizer.recognize) checks the call's limits first; everything here
raises RecognitionError (or AudioFormatError, naming the field) for what goes wrong.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from engine.api import DecodeOptions, EngineOverloaded, EngineStopped, Transcript, UtteranceHandle
from service import metrics
from service.pipeline.audio import (
    TARGET_RATE,
    AudioFormatError,
    AudioTooLong,
    EncodedAudio,
    RecordingInfo,
    decode_blocks,
    mixdown,
)
from service.pipeline.call_metrics import CallMetricsTracker, SpeakerMetrics, speaker_words
from service.pipeline.endpointing import Endpointer, Utterance
from service.pipeline.finals import await_transcript, engine_refusal
from service.pipeline.noise_gate import MARGIN_DB
from service.pipeline.results import ResultOptions, SpeakerOf, recognize_results
from service.vocabulary.call_metrics import CallMetrics, CallMetricsSettings
from service.vocabulary.endpointing import EndpointSettings
from service.vocabulary.engine import RecognitionEngine
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import DiarizationSettings, RecognizeResult, Result

log = logging.getLogger("service.pipeline.recording")


def cut_utterances(audio: np.ndarray, settings: EndpointSettings) -> list[Utterance]:
    """A whole channel through the endpointer, as if streamed (tools and tests)."""
    endpointer = Endpointer(settings)
    events = endpointer.feed(audio) + endpointer.flush()
    return [e for e in events if isinstance(e, Utterance)]


class RecordingCutter:
    """A recording, a block at a time: decoded, resampled and endpointed per channel (or the mixdown), so
    that memory follows the block, not the file (service/pipeline/audio.py decode_blocks)."""

    def __init__(
        self,
        data: EncodedAudio,
        info: RecordingInfo,
        separate: bool,
        settings: EndpointSettings,
        max_seconds: float | None = None,
        gate_margin_db: float = MARGIN_DB,
        keep_audio: bool = False,
    ) -> None:
        """`keep_audio`: the mono (or mixed-down) channel is kept whole for diarization."""
        self.separate = separate
        self._kept: list[np.ndarray] | None = [] if keep_audio and not separate else None
        self.samples = 0  # decoded so far, per channel, at 16 kHz
        self._blocks = decode_blocks(data, info, max_seconds=max_seconds)
        self._endpointers = [
            Endpointer(settings, gate_margin_db=gate_margin_db)
            for _ in range(info.channels if separate else 1)
        ]
        self._done = False
        self.at_end: list[Utterance] = []  # the utterances the end of the recording cut

    def _tag(self, i: int) -> int:
        return i + 1 if self.separate else 0

    @property
    def tags(self) -> list[int]:
        """The channel tags of the recording's results."""
        return [self._tag(i) for i in range(len(self._endpointers))]

    def step(self) -> list[tuple[int, Utterance]] | None:
        """The utterances (channel tag, utterance) that end in the next block; None once all is done."""
        if self._done:
            return None
        block = next(self._blocks, None)
        found: list[tuple[int, Utterance]] = []
        if block is None:
            self._done = True
            for i, endpointer in enumerate(self._endpointers):
                found += [(self._tag(i), e) for e in endpointer.flush() if isinstance(e, Utterance)]
            self.at_end = [u for _, u in found]
            return found
        self.samples += block.shape[1]
        per_channel = block if self.separate else mixdown(block)[None]
        for i, (endpointer, x) in enumerate(zip(self._endpointers, per_channel, strict=True)):
            found += [(self._tag(i), e) for e in endpointer.feed(x) if isinstance(e, Utterance)]
        if self._kept is not None:
            self._kept.append(per_channel[0].astype(np.float16))  # half the memory; ample for the models
        return found

    def kept_audio(self) -> np.ndarray | None:
        """The whole channel at 16 kHz (float32), when kept; the cutter lets go of it."""
        if self._kept is None:
            return None
        audio = np.concatenate(self._kept).astype(np.float32) if self._kept else np.zeros(0, np.float32)
        self._kept = []
        return audio


def too_long(what: str, limit_s: float) -> RecognitionError:
    return RecognitionError(
        Code.OUT_OF_RANGE,
        f"{what}, over the limit of {limit_s:g} s (max_recognize_seconds); "
        "split the recording or use StreamingRecognize",
        "audio_content",
    )


async def recognize_recording(
    engine: RecognitionEngine,
    cutter: RecordingCutter,
    options: DecodeOptions,
    result_opts: ResultOptions,
    *,
    inflight: int,
    limit_s: float,
    mode: str,
    call_metrics: CallMetricsSettings | None = None,
    diarization: DiarizationSettings | None = None,
) -> RecognizeResult:
    """Every utterance of the recording through the engine, at most `inflight` at once: a recording of
    any length is fed to the engine as it is decoded, and one long file cannot fill the engine's queue
    ahead of live calls."""
    window: collections.deque[tuple[int, Utterance, UtteranceHandle]] = collections.deque()
    jobs: list[tuple[int, Utterance]] = []
    transcripts: list[Transcript] = []

    async def settle_oldest() -> None:
        tag, u, handle = window[0]
        while True:
            try:
                transcripts.append(await await_transcript(handle))
                break
            except EngineOverloaded:
                # An engine in another process refuses on the future, not in submit(): once one of
                # our own later utterances is done (a place freed), this one goes in again.
                pending = [asyncio.wrap_future(h.future) for _, _, h in window if not h.future.done()]
                if not pending:
                    raise  # nothing of ours to wait for: the server is busy with other calls
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                handle = engine.submit(u.audio, options, ready_time=time.monotonic())
                window[0] = (tag, u, handle)
        window.popleft()
        jobs.append((tag, u))

    async def submit(u: Utterance) -> UtteranceHandle:
        while True:
            try:
                return engine.submit(u.audio, options, ready_time=time.monotonic())
            except EngineOverloaded:
                if not window:
                    raise  # nothing of ours to wait for: the server is busy with other calls
                await settle_oldest()  # a recording can wait: our oldest frees a place first

    try:
        while (found := await asyncio.to_thread(cutter.step)) is not None:
            for tag, u in found:
                while len(window) >= inflight:
                    await settle_oldest()
                window.append((tag, u, await submit(u)))
        while window:
            await settle_oldest()
    except AudioTooLong as e:  # the header claimed less than the file holds
        raise too_long(str(e), limit_s) from e
    except ValueError as e:
        if isinstance(e, AudioFormatError):
            raise RecognitionError.invalid(e) from e
        raise engine_refusal(e) from e
    except (EngineOverloaded, EngineStopped) as e:
        raise engine_refusal(e) from e
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("recognize failed")
        raise RecognitionError(Code.INTERNAL, f"recognition failed: {type(e).__name__}: {e}") from e
    finally:
        for _, _, h in window:  # frees their slots if the call failed or the client went away
            if not h.future.done():
                h.cancel()
                metrics.UTTERANCES.labels("cancelled").inc()
    metrics.AUDIO_SECONDS.labels(mode).inc(cutter.samples / TARGET_RATE)
    speakers = await recording_speakers(cutter, diarization)
    # Each channel's utterances are redacted together (a card number may span two of them).
    results: list[Result] = []
    for result in recognize_results(jobs, transcripts, result_opts, cutter.at_end, speakers):
        metrics.UTTERANCES.labels("empty" if result is None else "final").inc()
        if result is not None:
            results.append(result)
    results.sort(key=lambda r: (round(r.start_s * 1e9), r.channel))
    duration_s = cutter.samples / TARGET_RATE
    call = recording_call_metrics(cutter.tags, jobs, transcripts, duration_s, call_metrics)
    if diarization is not None and not cutter.separate:  # one channel: its speakers are the parties
        per_speaker = SpeakerMetrics(call_metrics)
        for r in sorted(results, key=lambda r: r.end_s):
            per_speaker.words(speaker_words(r))
        call = dataclasses.replace(call, speakers=per_speaker.snapshot(duration_s))
    metrics.observe_call(call)
    return RecognizeResult(results=tuple(results), duration_s=duration_s, call_metrics=call)


async def recording_speakers(
    cutter: RecordingCutter, settings: DiarizationSettings | None
) -> Callable[[int], SpeakerOf | None] | None:
    """Each channel tag's speakers: diarized over the whole mono (or mixed-down) channel, in a thread
    (seconds of CPU a call minute); a separate-channel recording's channels are its speakers (tag 1 is
    speaker 0). None: not asked for."""
    if settings is None:
        return None
    if cutter.separate:

        def channel_speaker(tag: int) -> SpeakerOf:
            return lambda _start, _end: tag - 1

        return channel_speaker
    audio = cutter.kept_audio()
    if audio is None:
        return None
    # here, not at import: torch is loaded only by a frontend that is asked to diarize
    from service.pipeline.diarization import diarize
    from service.pipeline.speaker_models import MissingWeights

    started = time.perf_counter()
    try:
        found = await asyncio.to_thread(diarize, audio, settings.min_speakers, settings.max_speakers)
    except MissingWeights as e:
        raise RecognitionError(Code.UNAVAILABLE, f"diarization is not installed on this server: {e}") from e
    log.info(
        "diarized %.1f s of audio in %.2f s: %d speakers",
        len(audio) / TARGET_RATE,
        time.perf_counter() - started,
        found.speakers,
    )
    return lambda _tag: found.speaker_of


def recording_call_metrics(
    tags: list[int],
    jobs: list[tuple[int, Utterance]],
    transcripts: list[Transcript],
    duration_s: float,
    settings: CallMetricsSettings | None,
) -> CallMetrics:
    """The recording's call metrics: its utterances fed as a stream would report them (in the order
    they end), each with its final's words (before formatting and redaction)."""
    tracker = CallMetricsTracker(tags, settings)
    for (tag, u), t in sorted(zip(jobs, transcripts, strict=True), key=lambda job: job[0][1].end_s):
        tracker.utterance(tag, u)
        words = len(t.text.split()) if t.is_speech else 0
        tracker.final(tag, u.start_s, u.end_s, words)
    tracker.advance(duration_s)
    return tracker.snapshot()

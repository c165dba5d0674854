"""A live stream's utterances to the engine and their finals back, in order per channel.

Each utterance is submitted the moment its end is detected (utterances of many calls then meet in one
micro-batch); one finalizer task per channel awaits that channel's utterances in order and queues their
finals (service/pipeline/results.py builds them; a redacting channel may hold one back), with their
speakers when the stream is diarized."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram

from engine.api import EngineOverloaded, EngineStopped, Transcript, UtteranceHandle
from service import metrics
from service.pipeline.audio import TARGET_RATE
from service.pipeline.call_metrics import CallMetrics, SpeakerMetrics, speaker_words
from service.pipeline.channel import Channel, Pending, SessionShared
from service.pipeline.endpointing import Utterance
from service.pipeline.results import SpeakerOf
from service.pipeline.stream_state import StreamState
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import EndReason, Result

log = logging.getLogger("service.pipeline.session")  # the stream's log, whichever part writes


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


def observe_since(start: float, histogram: Histogram = metrics.UTTERANCE_LATENCY) -> None:
    histogram.observe(time.monotonic() - start)


class Finals:
    def __init__(
        self, shared: SessionShared, *, on_settle: Callable[[], None], on_queued: Callable[[], None]
    ) -> None:
        """`on_settle`: called as each utterance settles, before its final is queued (a flush held for
        --max-finals-in-flight may go now); `on_queued`: once it is queued (the buffer shrank)."""
        self._shared = shared
        self._on_settle = on_settle
        self._on_queued = on_queued
        self._finalizers: list[asyncio.Task[Any]] = []
        # a diarized mono stream's speakers as channels (spoke)
        self._speaker_metrics = (
            SpeakerMetrics(shared.plan.call_metrics)
            if any(ch.speakers is not None for ch in shared.channels)
            else None
        )

    def start(self) -> None:
        """One finalizer per channel, in the event loop."""
        self._finalizers = [self._shared.host.spawn(self._finalize(ch)) for ch in self._shared.channels]

    def finish(self) -> None:
        """No more utterances: each finalizer ends once its channel's finals are out."""
        for ch in self._shared.channels:
            ch.finals.put_nowait(None)

    async def drained(self) -> None:
        """Every finalizer has ended."""
        await asyncio.gather(*self._finalizers, return_exceptions=True)

    def abandon(self) -> None:
        """Free the engine slot of every utterance still waiting for its final."""
        for ch in self._shared.channels:
            for p in ch.unsettled:
                p.handle.cancel()
                metrics.UTTERANCES.labels("cancelled").inc()
            ch.unsettled.clear()

    def in_flight_full(self) -> bool:
        """--max-finals-in-flight of the stream's finals (all channels) are still being recognized."""
        limit = self._shared.flags.max_finals_in_flight
        return limit > 0 and sum(len(ch.unsettled) for ch in self._shared.channels) >= limit

    def submit(self, ch: Channel, utterance: Utterance, ended_by: EndReason) -> None:
        """An utterance ended: to the engine now (or its confirmed speculation), its final in order."""
        ready = time.monotonic()
        try:
            options = ch.next_options()
            handle = self._shared.speculations.take(
                ch.tag, utterance, options.context
            ) or self._shared.engine.submit(
                utterance.audio,
                options,
                ready_time=ready,
                request_id=f"{self._shared.id}-{ch.tag}-{utterance.index}",
            )
        except (EngineOverloaded, EngineStopped, ValueError) as e:
            # What was admitted before the refusal still gets its final; then the stream ends with the
            # refusal's status (also while draining: finish_input's flush lands here).
            self._shared.host.end_after_admitted(engine_refusal(e))
            return
        ch.interim.cancel()  # the final covers everything the interim in flight was asked about
        ch.context.submitted(forced_cut=utterance.forced_cut)
        pending = Pending(utterance, handle, ready, ended_by)
        if ch.speakers is not None:
            pending.embedding = ch.speakers.submit(utterance)  # beside the decoding, off the event loop
        ch.unsettled.append(pending)
        ch.next_index = utterance.index + 1
        ch.finals.put_nowait(pending)

    def with_speakers(self, call: CallMetrics, heard_s: float) -> CallMetrics:
        """A diarized mono stream's metrics with its speakers' (talk time, interruptions, words per
        minute) beside the channel's."""
        if self._speaker_metrics is None:
            return call
        return dataclasses.replace(call, speakers=self._speaker_metrics.snapshot(heard_s))

    def release_held(self, heard_s: float) -> None:
        """A redacting stream holds back a final that ends in digits until the next (see
        service/pipeline/redaction.py); once enough audio passed with no next utterance, it goes out."""
        for ch in self._shared.channels:
            if ch.results.holding and not ch.unsettled and not ch.endpointer.in_speech:
                for result, on_sent in ch.results.release(heard_s=heard_s):
                    self._shared.outbox.put(result, on_sent=on_sent)

    async def _finalize(self, ch: Channel) -> None:
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
                self._shared.host.end_after_admitted(
                    RecognitionError(Code.UNAVAILABLE, f"recognition engine stopped: {e}")
                )
                continue
            except (EngineOverloaded, ValueError) as e:  # an engine in another process refuses on the future
                self._settle(ch, pending, "error", None)
                self._shared.host.end_after_admitted(engine_refusal(e))
                continue
            except Exception as e:
                log.exception(
                    "utterance failed", extra={"fields": {"stream_id": self._shared.id, "channel": ch.tag}}
                )
                self._settle(ch, pending, "error", None)
                self._shared.host.end_after_admitted(
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
                self._shared.call_metrics.final(ch.tag, u.start_s, u.end_s, words)
            if t is not None and outcome == "final":
                ready = ch.results.final(
                    t,
                    u,
                    pending.ended_by,
                    functools.partial(observe_since, pending.ready_time),
                    await self._speakers(ch, pending),
                )
            else:
                if pending.embedding is not None:
                    pending.embedding.cancel()  # no words to label: its speaker would not be heard
                ready = ch.results.release()
                if outcome == "empty" and self._shared.plan.empty_finals:
                    ready.append((ch.results.empty(t, u, pending.ended_by), None))
            for result, on_sent in ready:
                self._spoke(result)
                self._shared.outbox.put(result, on_sent=on_sent)
            if self._shared.host.state is not StreamState.CLOSED:
                self._on_queued()
        self._send_held(ch)  # the channel is over: nothing more to wait for

    def _spoke(self, result: Result) -> None:
        if self._speaker_metrics is not None:
            self._speaker_metrics.words(speaker_words(result))

    async def _speakers(self, ch: Channel, pending: Pending) -> SpeakerOf | None:
        """The final's speakers: its channel's (separate channels), or its utterance's live speakers once
        embedded, waited for at most --live-diarization-wait-s; None past it (the final goes out without
        speakers, on time) or when not diarized."""
        if ch.fixed_speaker is not None:
            fixed = ch.fixed_speaker
            return lambda _start, _end: fixed
        if ch.speakers is None or pending.embedding is None:
            return None
        future = pending.embedding
        wait_s = self._shared.flags.live_diarization_wait_s
        if not future.done():
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), wait_s)
            except TimeoutError:
                pass
            except Exception:
                pass  # its exception is read below
        if not future.done():
            future.cancel()  # dropped (a queued one never runs); the call's speakers are not changed
            metrics.LIVE_DIARIZATION_LATE.inc()
            log.warning(
                "final sent without speakers: its embedding took over %g s (live_diarization_wait_s)",
                wait_s,
                extra={"fields": {"stream_id": self._shared.id, "channel": ch.tag}},
            )
            return None
        try:
            embedded = future.result()
        except Exception:
            log.exception("speaker embedding failed", extra={"fields": {"stream_id": self._shared.id}})
            return None
        return ch.speakers.assign(embedded)

    def _send_held(self, ch: Channel) -> None:
        """Send the finals a redacting channel still holds back (a final the client finished is never
        lost, even when the stream then ends with an error)."""
        for result, on_sent in ch.results.release():
            self._shared.outbox.put(result, on_sent=on_sent)

    def _settle(self, ch: Channel, pending: Pending, outcome: str, t: Transcript | None) -> None:
        if ch.unsettled and ch.unsettled[0] is pending:
            ch.unsettled.popleft()
        self._on_settle()
        ch.settled = pending.utterance.index + 1
        metrics.UTTERANCES.labels(outcome).inc()
        self._log_utterance(ch, pending, outcome, t)

    def _log_utterance(self, ch: Channel, pending: Pending, outcome: str, t: Transcript | None) -> None:
        u = pending.utterance
        fields: dict[str, Any] = {
            "stream_id": self._shared.id,
            "utterance_id": pending.handle.id,
            "utterance_index": u.index,
            "channel": ch.tag,
            "audio_s": round(len(u.audio) / TARGET_RATE, 3),
            "start_s": round(u.start_s, 3),
            "end_s": round(u.end_s, 3),
            "forced_cut": u.forced_cut,
            "outcome": outcome,
        }
        if (call := self._shared.plan.call) is not None:
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
            if self._shared.flags.log_transcripts:
                fields["transcript"] = ch.results.log_text(t)
        log.info("utterance", extra={"fields": fields})

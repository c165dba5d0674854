"""A live stream's interim hypotheses: extra engine requests on the utterance in progress, whose results are
queued unless the final overtook them (when to ask, and how stable each is: service/pipeline/interim.py)."""

from __future__ import annotations

import dataclasses
import functools
import time

from engine.api import EngineOverloaded, EngineStopped, UtteranceHandle
from service import metrics
from service.pipeline.audio import TARGET_RATE
from service.pipeline.channel import Channel, SessionShared
from service.pipeline.finals import await_transcript, engine_refusal, observe_since


class Interims:
    def __init__(self, shared: SessionShared) -> None:
        self._shared = shared

    def maybe_ask(self, ch: Channel, heard_s: float) -> None:
        """Ask for an interim of `ch`'s utterance in progress if one is due (`heard_s`: the audio so far)."""
        now = time.monotonic()
        if (
            not self._shared.host.state.takes_audio
            or not ch.endpointer.in_speech
            or not ch.interim.due(now, ch.speech_start_wall)
            or self._shared.speculations.pending(ch.tag)  # a final candidate is already being recognized
        ):
            return
        audio = ch.endpointer.partial()
        if audio is None or not ch.interim.enough_audio(len(audio), TARGET_RATE):
            return
        # a preview: greedy, however many beams the final searches (--beam-size-final)
        options = dataclasses.replace(ch.next_options(), interim=True, timestamps=False, beam_size=1)
        try:
            handle = self._shared.engine.submit(audio, options, ready_time=now)
        except EngineOverloaded:
            return  # interims are best effort: the final still comes
        except EngineStopped as e:
            self._shared.host.end_after_admitted(engine_refusal(e))  # UNAVAILABLE, as for a final
            return
        ch.interim.asked(handle, now)
        self._shared.host.spawn(self._result(ch, handle, ch.next_index, ch.speech_start_s, heard_s))

    async def _result(
        self, ch: Channel, handle: UtteranceHandle, index: int, start_s: float, end_s: float
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
            on_sent = functools.partial(observe_since, ch.speech_start_wall, metrics.TIME_TO_FIRST_INTERIM)
        self._shared.outbox.put(result, on_sent=on_sent)

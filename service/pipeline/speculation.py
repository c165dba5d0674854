"""Speculative end of utterance: a stream's engine requests for utterances whose end is not yet confirmed.

The endpointer (`Endpointer(speculative=True)`) offers an utterance as soon as its audio is all there
(`SpeculativeEnd`), about `min_silence_s - speech_pad_s` before the silence is long enough to confirm it.
It is submitted to the engine at once as a final; its result is held here, never sent, until:
- the endpointer confirms the very same utterance: `take()` hands the request over to become the
  final (no second engine call), so the wait for silence and the recognition overlap;
- speech resumes (`SpeculationCancelled`), or the stream ends another way: the request is cancelled in
  the engine (in its own process too, through the engine client) and counted as a miss.
An engine that refuses the speculative request (or fails it) costs nothing: the utterance is submitted
again when it is confirmed, exactly as without speculation.

In the engine an offer is best effort (engine/scheduling/policy.py): it is admitted only in the room live finals
leave, so it can never get a live call refused, and it ranks after live finals until the moment its end
would be confirmed (`confirm_after_s` after the offer), from which it ranks as the live final it then is.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass

from engine.api import DecodeOptions, EngineOverloaded, EngineStopped, Priority, UtteranceHandle
from service import metrics
from service.pipeline.audio import TARGET_RATE
from service.pipeline.endpointing import Utterance
from service.vocabulary.engine import RecognitionEngine


@dataclass
class _Offer:
    utterance: Utterance
    handle: UtteranceHandle
    context: str | None  # the channel's carried text it was decoded with (DecodeOptions.context)


class Speculations:
    """The speculative requests of one stream, at most one per channel (keyed by channel tag)."""

    def __init__(self, engine: RecognitionEngine, stream_id: str, confirm_after_s: float) -> None:
        """`confirm_after_s`: from an offer to its end's confirmation, in a real-time call (the silence
        still to come: min_silence_duration less the speech pad already heard)."""
        self._engine = engine
        self._confirm_after_s = max(0.0, confirm_after_s)
        self._stream_id = stream_id
        self._offers: dict[int, _Offer] = {}
        self._attempts = 0  # request ids stay unique: a cancelled id may still be in flight

    def pending(self, channel: int) -> bool:
        return channel in self._offers

    def offer(self, channel: int, utterance: Utterance, options: DecodeOptions, ready_time: float) -> bool:
        """Submit `utterance` as a final candidate, decoded with the final's `options`; False when the
        engine refused it (then the confirmed utterance is submitted the ordinary way)."""
        self.cancel(channel)
        self._attempts += 1
        options = dataclasses.replace(
            options, priority=Priority.BEST_EFFORT, promote_at=ready_time + self._confirm_after_s
        )
        try:
            handle = self._engine.submit(
                utterance.audio,
                options,
                ready_time=ready_time,
                request_id=f"{self._stream_id}-{channel}-{utterance.index}-spec{self._attempts}",
            )
        except (EngineOverloaded, EngineStopped, ValueError):
            metrics.SPECULATIVE_ENDPOINTS.labels("refused").inc()
            return False
        self._offers[channel] = _Offer(utterance, handle, options.context)
        return True

    def take(self, channel: int, utterance: Utterance, context: str | None = None) -> UtteranceHandle | None:
        """The confirmed `utterance`'s request if it was offered and is still good, else None (and what
        was offered instead is cancelled). `context`: the channel's carried text now; an offer decoded with
        other text (a final came back meanwhile) is not the final speculation off would give."""
        offer = self._offers.pop(channel, None)
        if offer is None:
            return None
        if offer.utterance is not utterance or offer.context != context:
            self._cancelled(offer)  # the endpointer cancels first; kept against a missed cancel
            return None
        if _failed(offer.handle):
            # an engine in another process refuses on the future: submit again now, as without speculation
            metrics.SPECULATIVE_ENDPOINTS.labels("refused").inc()
            return None
        metrics.SPECULATIVE_ENDPOINTS.labels("hit").inc()
        return offer.handle

    def cancel(self, channel: int) -> None:
        """Speech resumed (or the stream ends): the offered request is dropped in the engine."""
        offer = self._offers.pop(channel, None)
        if offer is not None:
            self._cancelled(offer)

    def cancel_all(self) -> None:
        for channel in list(self._offers):
            self.cancel(channel)

    @staticmethod
    def _cancelled(offer: _Offer) -> None:
        offer.handle.cancel()
        metrics.SPECULATIVE_ENDPOINTS.labels("miss").inc()
        metrics.SPECULATIVE_WASTED_AUDIO.inc(len(offer.utterance.audio) / TARGET_RATE)


def _failed(handle: UtteranceHandle) -> bool:
    """The request already failed (refused, cancelled): the confirmed utterance is better submitted again,
    whose outcome is then exactly that of the path without speculation."""
    future = handle.future
    if not future.done():
        return False
    try:
        return future.exception(timeout=0) is not None
    except concurrent.futures.CancelledError:
        return True

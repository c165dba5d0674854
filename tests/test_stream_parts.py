"""The parts service/pipeline/session.py was split into, where one stands alone: the stream-state enum, the
interim policy, the outbox."""

from __future__ import annotations

import itertools
from concurrent.futures import Future

import pytest

from engine import UtteranceHandle
from service.pipeline.interim import MIN_INTERIM_AUDIO_S, InterimPolicy, stability
from service.pipeline.outbox import Outbox, event_size
from service.pipeline.stream_state import StreamState as S
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import Reconnect, SpeechEnded, SpeechStarted


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ([S.OPEN, S.FINISHING, S.ENDED, S.CLOSED], True),  # half-close: finals, then OK
        ([S.OPEN, S.FAILED, S.CLOSED], True),  # a bad chunk
        ([S.OPEN, S.FINISHING, S.FAILED, S.CLOSED], True),  # an utterance fails while finishing
        ([S.OPEN, S.CLOSED], True),  # the client cancels
        ([S.OPEN, S.FINISHING, S.ENDED, S.FAILED], False),  # once the end is queued, nothing overrides it
        ([S.OPEN, S.FAILED, S.ENDED], False),  # the first failure wins
        ([S.OPEN, S.FINISHING, S.OPEN], False),  # no audio after the input ended
        ([S.OPEN, S.CLOSED, S.FAILED], False),  # a closed call stays closed
    ],
)
def test_states_only_move_forward(path: list[S], ok: bool) -> None:
    assert all(a.can_become(b) for a, b in itertools.pairwise(path)) is ok
    if ok:  # audio is taken in the first state only
        assert path[0].takes_audio and not any(s.takes_audio for s in path[1:])


def test_only_an_ending_state_stops_the_writer() -> None:
    assert {s for s in S if s.ending} == {S.ENDED, S.FAILED, S.CLOSED}


def test_stability_rises_as_the_interim_repeats_itself() -> None:
    assert stability("", "i would like") == pytest.approx(0.5)
    assert stability("i would", "I would like to") == pytest.approx(0.5 + 0.4 * 2 / 4)
    assert stability("i would like to", "I would like to.") == pytest.approx(0.9)
    assert stability("you would", "i would") == pytest.approx(0.5)


def test_interim_policy_asks_at_most_once_in_flight_and_once_per_interval() -> None:
    policy = InterimPolicy(interval_s=1.0)
    assert not policy.enough_audio(round(MIN_INTERIM_AUDIO_S * 16000) - 1, 16000)
    assert policy.enough_audio(round(MIN_INTERIM_AUDIO_S * 16000), 16000)
    assert not policy.due(now=10.5, speech_start_wall=10.0)  # speech began half a second ago
    assert policy.due(now=11.0, speech_start_wall=10.0)
    # (cancelling goes through the engine: tests/test_service_streaming.py covers it with a real one)
    handle = UtteranceHandle(id="i1", future=Future(), _engine=None)  # type: ignore[arg-type]
    policy.asked(handle, now=11.0)
    assert not policy.due(now=13.0, speech_start_wall=10.0)  # one in flight
    policy.answered(handle)
    assert not policy.due(now=11.5, speech_start_wall=10.0) and policy.due(now=12.0, speech_start_wall=10.0)
    assert policy.accept(0, "i would") == (pytest.approx(0.5), True)
    assert policy.accept(0, "i would like") == (pytest.approx(0.5 + 0.4 * 2 / 3), False)
    assert policy.accept(1, "thanks") == (pytest.approx(0.5), True)  # a new utterance starts afresh
    policy.cancel()  # nothing in flight: nothing to cancel
    assert policy.in_flight is None


async def test_the_outbox_sheds_a_client_past_its_backlog_and_then_ends_with_why() -> None:
    sizes = [event_size(e) for e in (SpeechStarted(0, 1.0), SpeechEnded(0, 2.0), Reconnect(3.0))]
    box = Outbox(sum(sizes[:2]), shed=lambda: box.close())  # the session's abandon closes it
    box.put(SpeechStarted(0, 1.0))
    box.put(SpeechEnded(0, 2.0))
    assert box.backlog_bytes == sum(sizes[:2])  # at the limit, not past it: kept
    box.put(Reconnect(3.0))
    assert box.backlog_bytes == 0  # past it: what was queued is dropped, never sent
    box.put(SpeechStarted(0, 4.0))  # nothing more goes in
    with pytest.raises(RecognitionError) as ended:
        _ = [e async for e in box.events()]
    assert ended.value.code is Code.RESOURCE_EXHAUSTED
    assert f"{sum(sizes)} bytes of responses behind reading" in ended.value.message
    assert "max_response_backlog_bytes" in ended.value.message


async def test_the_outbox_hands_over_in_order_and_keeps_the_first_status() -> None:
    box = Outbox(1 << 20, shed=lambda: None)
    box.put(SpeechStarted(0, 1.0))
    box.keep_first_status(RecognitionError(Code.OUT_OF_RANGE, "first"))
    box.keep_first_status(RecognitionError(Code.UNAVAILABLE, "second"))
    box.put(SpeechEnded(0, 2.0))
    box.end()
    got = []
    with pytest.raises(RecognitionError) as ended:
        async for e in box.events():
            got.append(e)
    assert got == [SpeechStarted(0, 1.0), SpeechEnded(0, 2.0)] and ended.value.message == "first"
    assert box.backlog_bytes == 0

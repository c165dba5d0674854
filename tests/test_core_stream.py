"""The recognition core's Stream as a door sees it (service/recognizer/recognizer.py), driven by a fake door on the
real tiny.en: the controls the WebSocket doors need (finalize, clear, keyterms mid-stream), the refusals
every door maps to its own terms, and the per-door metrics. The asr.v1 and HTTP doors' own suites prove
the rest through real servers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine import Engine
from service.config import ServerConfig
from service.pipeline.endpointing import MIN_FLUSHED_TURN_S
from service.pipeline.intake import MAX_HELD_OPTION_CHANGES
from service.recognizer.recognizer import KEYTERM_UPDATE_BURST, Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    CallEvent,
    EndReason,
    RecognitionSettings,
    Result,
    SpeechStarted,
    StreamSettings,
)
from tests.support.audio import silence, speak, speech_bounds, to_linear16_bytes

pytestmark = pytest.mark.slow

PCM16 = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 16000)))
CHUNK = 640  # 20 ms of 16 kHz LINEAR16


def spoken(text: str) -> np.ndarray:
    """espeak speech with its own trailing silence cut off: the utterance is still going on at its end."""
    audio = speak(text)
    start, end = speech_bounds(audio)
    return audio[round(start * 16000) : round(end * 16000)]


def feed(stream: Stream, audio: np.ndarray) -> None:
    data = to_linear16_bytes(audio)
    for i in range(0, len(data), CHUNK):
        stream.audio(data[i : i + CHUNK])


async def wait_for(events: list[CallEvent], predicate: Any, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not any(predicate(e) for e in events):
        assert time.monotonic() < deadline, f"not within {within_s:g} s: {what}"
        await asyncio.sleep(0.02)


async def collect(stream: Stream, events: list[CallEvent]) -> None:
    async for event in stream.events():
        events.append(event)


@contextlib.asynccontextmanager
async def streaming(
    recognizer: Recognizer, settings: StreamSettings
) -> AsyncIterator[tuple[Stream, list[CallEvent], asyncio.Task[None]]]:
    """A stream of `recognizer` whose events a task (awaited by the test) collects; closed at the end."""
    stream = recognizer.open_stream(settings, door="test")
    events: list[CallEvent] = []
    reading = asyncio.create_task(collect(stream, events))
    try:
        yield stream, events, reading
    finally:
        await stream.close()


def finals(events: list[CallEvent]) -> list[Result]:
    return [e for e in events if isinstance(e, Result) and e.is_final]


class RecordingEngine:
    """The real engine, with the options of every request submitted to it noted."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.submitted: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, audio: np.ndarray, options: Any = None, **kwargs: Any) -> Any:
        self.submitted.append(options)
        return self._engine.submit(audio, options, **kwargs)


@pytest.fixture(scope="module")
def order() -> np.ndarray:
    return spoken("I would like to check the status of my order.")


@pytest.fixture(scope="module")
def thanks() -> np.ndarray:
    return spoken("Thank you very much for your help.")


@pytest.fixture
def recognizer(service_engine: Engine) -> Iterator[Recognizer]:
    yield Recognizer(ServerConfig(), service_engine)


async def test_finalize_ends_the_utterance_in_progress_and_the_stream_goes_on(
    recognizer: Recognizer, order: np.ndarray, thanks: np.ndarray
) -> None:
    async with streaming(recognizer, PCM16) as (stream, events, reading):
        feed(stream, np.concatenate([silence(0.5), order]))  # no silence after it: nothing ends it but us
        assert stream.finalize(), "an utterance was in progress"
        await wait_for(events, lambda e: isinstance(e, Result) and e.is_final, 60, "the finalized final")
        assert stream.takes_audio
        assert not stream.finalize(), "nothing was in progress"
        feed(stream, np.concatenate([silence(0.5), thanks, silence(1.0)]))
        stream.finish()
        await asyncio.wait_for(reading, 120)
    first, second = finals(events)
    assert first.ended_by is EndReason.FINALIZE and "order" in first.transcript.lower()
    assert first.end_s == pytest.approx(0.5 + len(order) / 16000, abs=0.1)
    assert second.ended_by is EndReason.SILENCE and "help" in second.transcript.lower()
    assert (first.utterance_index, second.utterance_index) == (0, 1)


async def test_clear_drops_the_utterance_in_progress_and_keeps_the_next(
    recognizer: Recognizer, order: np.ndarray, thanks: np.ndarray
) -> None:
    async with streaming(recognizer, PCM16) as (stream, events, reading):
        feed(stream, np.concatenate([silence(0.5), order]))
        stream.clear()
        feed(stream, np.concatenate([silence(1.0), thanks, silence(1.0)]))
        stream.finish()
        await asyncio.wait_for(reading, 120)
    (only,) = finals(events)  # none for the cleared utterance
    assert "help" in only.transcript.lower() and "order" not in only.transcript.lower()
    assert only.utterance_index == 1  # the cleared one's index is not given again
    assert len([e for e in events if isinstance(e, SpeechStarted)]) == 2


async def test_keyterms_change_from_the_next_utterance_and_bad_ones_change_nothing(
    service_engine: Engine, order: np.ndarray, thanks: np.ndarray
) -> None:
    engine = RecordingEngine(service_engine)
    recognizer = Recognizer(ServerConfig(), engine)  # type: ignore[arg-type]
    settings = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 16000), keyterms=("Kestoria",)))
    async with streaming(recognizer, settings) as (stream, events, reading):
        feed(stream, np.concatenate([silence(0.5), order]))
        await wait_for(events, lambda e: isinstance(e, SpeechStarted), 30, "speech of the first utterance")
        with pytest.raises(RecognitionError) as refused:
            stream.update_keyterms(["x" * 51])
        assert refused.value.code is Code.INVALID_ARGUMENT and refused.value.field == "keyterms"
        assert "keyterms[0] is 51 characters long" in refused.value.message
        stream.update_keyterms(["Moxilar"])  # the utterance under way keeps the list it started with
        feed(stream, np.concatenate([silence(1.0), thanks, silence(1.0)]))
        stream.finish()
        await asyncio.wait_for(reading, 120)
    assert len(finals(events)) == 2
    # each utterance's requests for its final (speculative offers too) carry the list its speech began with
    lists = [o.keyterms for o in engine.submitted if not o.interim]
    assert [k for i, k in enumerate(lists) if i == 0 or lists[i - 1] != k] == [("Kestoria",), ("Moxilar",)]
    # every request names the stream as its caller, whose finals take turns with other streams' (issue 26)
    assert {o.caller for o in engine.submitted} == {stream.id}


async def test_a_keyterm_flood_holds_a_bounded_list_and_the_newest_list_applies(
    service_engine: Engine, thanks: np.ndarray
) -> None:
    """Issue 26 #3: updates between KeepAlives (no audio) or between tiny chunks used to be held for 30 s
    of audio each; now one per audio position and MAX_HELD_OPTION_CHANGES at most, and the utterance
    that starts after the flood still decodes with the newest list."""
    engine = RecordingEngine(service_engine)
    recognizer = Recognizer(ServerConfig(max_keyterm_updates_per_s=0), engine)  # type: ignore[arg-type]
    async with streaming(recognizer, PCM16) as (stream, events, reading):
        for i in range(500):  # a KeepAlive-only stream: no audio between the updates
            stream.update_keyterms([f"term{i}", "Zentrix"])
        assert stream._session.held_option_changes == 1
        for i in range(500):  # 2 ms of audio between updates
            stream.update_keyterms([f"word{i}", "Moxilar"])
            stream.audio(b"\0" * 64)
        assert stream._session.held_option_changes <= MAX_HELD_OPTION_CHANGES
        feed(stream, np.concatenate([silence(0.5), thanks, silence(1.0)]))
        stream.finish()
        await asyncio.wait_for(reading, 120)
    assert len(finals(events)) == 1
    assert {o.keyterms for o in engine.submitted if not o.interim} == {("word499", "Moxilar")}


async def test_keyterm_updates_past_the_rate_are_refused_and_change_nothing(service_engine: Engine) -> None:
    """Issue 26 #3: each update costs a tokenizer pass on the event loop every stream of the frontend
    shares; past --max-keyterm-updates-per-s (burst 10) it is refused RESOURCE_EXHAUSTED naming the flag.
    The current list again is free."""
    recognizer = Recognizer(ServerConfig(max_keyterm_updates_per_s=0.5), service_engine)
    stream = recognizer.open_stream(PCM16, door="test")
    try:
        for i in range(KEYTERM_UPDATE_BURST):
            stream.update_keyterms([f"term{i}"])
        for _ in range(50):
            stream.update_keyterms([f"term{KEYTERM_UPDATE_BURST - 1}"])  # unchanged: never refused
        with pytest.raises(RecognitionError) as refused:
            stream.update_keyterms(["Kestoria"])
        assert refused.value.code is Code.RESOURCE_EXHAUSTED and refused.value.field == "keyterms"
        assert "--max-keyterm-updates-per-s" in refused.value.message
        assert stream._session.settings.options.keyterms == (f"term{KEYTERM_UPDATE_BURST - 1}",)
    finally:
        await stream.close()


async def test_keyterms_reach_interims_and_speculative_offers_too(
    service_engine: Engine, order: np.ndarray
) -> None:
    """Every request of the stream's utterance carries its list: the final's, the interims' (asked for as
    the speech is fed at the pace of a call) and a speculative offer's."""
    engine = RecordingEngine(service_engine)
    recognizer = Recognizer(ServerConfig(interim_interval_s=0.5), engine)  # type: ignore[arg-type]
    settings = StreamSettings(
        RecognitionSettings(AudioFormat("LINEAR16", 16000), keyterms=("Kestoria",)), interim_results=True
    )
    async with streaming(recognizer, settings) as (stream, events, reading):
        data = to_linear16_bytes(np.concatenate([silence(0.3), order, silence(1.0)]))
        for i in range(0, len(data), CHUNK):  # 20 ms at a time, in real time
            stream.audio(data[i : i + CHUNK])
            await asyncio.sleep(0.02)
        stream.finish()
        await asyncio.wait_for(reading, 120)
    assert len(finals(events)) == 1
    assert any(o.interim for o in engine.submitted), "no interim was asked for"
    assert [o.keyterms for o in engine.submitted] == [("Kestoria",)] * len(engine.submitted)


async def test_without_endpointing_the_client_cuts_each_utterance(
    recognizer: Recognizer, order: np.ndarray, thanks: np.ndarray
) -> None:
    manual = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 16000)), endpointing=None)
    first_turn = np.concatenate([silence(0.5), order, silence(1.0)])  # a pause the endpointer would cut at
    async with streaming(recognizer, manual) as (stream, events, reading):
        feed(stream, first_turn)
        stream.finalize()  # the client's commit
        feed(stream, np.concatenate([silence(0.3), thanks]))
        stream.finish()
        await asyncio.wait_for(reading, 120)
    first, second = finals(events)
    assert (first.start_s, first.end_s) == (0.0, pytest.approx(len(first_turn) / 16000, abs=0.02))
    assert first.ended_by is EndReason.FINALIZE and "order" in first.transcript.lower()
    assert second.ended_by is EndReason.END_OF_AUDIO and "help" in second.transcript.lower()
    assert second.start_s == pytest.approx(first.end_s, abs=0.02)
    assert not [e for e in events if not isinstance(e, Result)]  # no speech events without endpointing


async def test_a_flushed_turn_shorter_than_the_minimum_joins_the_next_turn(
    recognizer: Recognizer, thanks: np.ndarray
) -> None:
    """Issue 26 #1, the minimum flushed turn: a client flushing every few milliseconds (Deepgram Finalize
    with endpointing=false) made each sliver a final of its own, one engine decode each. A turn shorter than
    MIN_FLUSHED_TURN_S is not cut: finalize says so (False) and its audio starts the next turn."""
    manual = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 16000)), endpointing=None)
    sliver = int(MIN_FLUSHED_TURN_S * 16000) // 2
    async with streaming(recognizer, manual) as (stream, events, reading):
        feed(stream, silence(0.3)[:sliver])
        assert not stream.finalize()  # too short to be a turn: kept
        feed(stream, np.concatenate([silence(0.3), thanks]))
        assert stream.finalize()
        stream.finish()
        await asyncio.wait_for(reading, 120)
    (turn,) = finals(events)
    assert turn.start_s == 0.0 and turn.ended_by is EndReason.FINALIZE and "help" in turn.transcript.lower()


async def test_empty_finals_answer_every_turn_and_finalize_and_clear_say_what_they_cut(
    recognizer: Recognizer, thanks: np.ndarray
) -> None:
    """A door that answers every turn the client ends (OpenAI Realtime's commit): with empty_finals a turn
    of silence gets its final too, and finalize / clear say whether there was a turn to end or drop."""
    settings = StreamSettings(
        RecognitionSettings(AudioFormat("LINEAR16", 16000)), endpointing=None, empty_finals=True
    )
    async with streaming(recognizer, settings) as (stream, events, reading):
        assert not stream.finalize()  # nothing heard yet: no turn
        feed(stream, silence(1.0))
        assert stream.finalize()  # a turn of silence
        feed(stream, silence(0.5))
        assert stream.clear() and not stream.clear()  # dropped once; then nothing is left to drop
        feed(stream, np.concatenate([silence(0.3), thanks]))
        assert stream.finalize()
        stream.finish()
        await asyncio.wait_for(reading, 120)
    quiet, spoken_turn = finals(events)
    assert (quiet.transcript, quiet.utterance_index, quiet.ended_by) == ("", 0, EndReason.FINALIZE)
    assert (quiet.start_s, quiet.end_s) == (0.0, pytest.approx(1.0, abs=0.02))
    assert spoken_turn.utterance_index == 2 and "help" in spoken_turn.transcript.lower()


async def test_with_endpointing_finalize_says_whether_speech_was_in_progress(
    recognizer: Recognizer, order: np.ndarray
) -> None:
    async with streaming(recognizer, PCM16) as (stream, events, reading):
        feed(stream, silence(0.5))
        assert not stream.finalize() and not stream.clear()  # silence: no speech to end or drop
        feed(stream, order)
        assert stream.finalize()
        stream.finish()
        await asyncio.wait_for(reading, 120)
    (only,) = finals(events)  # without empty_finals the silence has none
    assert only.ended_by is EndReason.FINALIZE and "order" in only.transcript.lower()


async def test_a_turn_never_cut_is_bounded_by_the_buffer_limit(service_engine: Engine) -> None:
    recognizer = Recognizer(ServerConfig(max_buffer_seconds=3.0), service_engine)
    manual = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 16000)), endpointing=None)
    stream = recognizer.open_stream(manual, door="test")
    try:
        feed(stream, silence(5.0))
        with pytest.raises(RecognitionError) as over:
            async with asyncio.timeout(60):  # a stream the limit missed would wait for audio for ever
                async for _ in stream.events():
                    pass
    finally:
        await stream.close()
    assert over.value.code is Code.RESOURCE_EXHAUSTED
    assert "over the limit of 3 s (max_buffer_seconds); end turns (commit) sooner" in over.value.message


def door_calls(door: str, code: str) -> float:
    labels = {"door": door, "kind": "stream", "code": code}
    return REGISTRY.get_sample_value("asr_door_calls_total", labels) or 0.0


async def test_refusals_name_the_setting_and_every_stream_is_counted_by_its_door(
    service_engine: Engine,
) -> None:
    recognizer = Recognizer(ServerConfig(max_streams=1), service_engine)
    before = {code: door_calls("fake", code) for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")}
    bad_rate = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 4000)))
    with pytest.raises(RecognitionError) as bad:
        recognizer.open_stream(bad_rate, door="fake")
    assert (bad.value.code, bad.value.field) == (Code.INVALID_ARGUMENT, "sample_rate_hertz")
    # a door whose protocol spells the field otherwise names it its own way
    assert bad.value.message_for({"sample_rate_hertz": "sample_rate"}).startswith(
        "sample_rate must be between"
    )

    stream = recognizer.open_stream(PCM16, door="fake")
    with pytest.raises(RecognitionError) as full:
        recognizer.open_stream(PCM16, door="fake")
    assert full.value.code is Code.RESOURCE_EXHAUSTED and "(max_streams)" in full.value.message
    stream.finish()
    assert [e async for e in stream.events()] == []  # nothing said, nothing to send
    await stream.close()
    again = recognizer.open_stream(PCM16, door="fake")  # its place came back
    again.cancel()
    await again.close()

    recognizer.drain()
    with pytest.raises(RecognitionError) as draining:
        recognizer.open_stream(PCM16, door="fake")
    assert draining.value.code is Code.UNAVAILABLE
    assert door_calls("fake", "OK") == before["OK"] + 1
    assert door_calls("fake", "INVALID_ARGUMENT") == before["INVALID_ARGUMENT"] + 1
    assert door_calls("fake", "RESOURCE_EXHAUSTED") == before["RESOURCE_EXHAUSTED"] + 1
    assert door_calls("fake", "CANCELLED") >= 1


def test_check_refuses_what_open_stream_would_and_holds_nothing(service_engine: Engine) -> None:
    recognizer = Recognizer(ServerConfig(max_streams=1), service_engine)
    bad = StreamSettings(RecognitionSettings(AudioFormat("LINEAR16", 16000), prompt="x" * 5000))
    with pytest.raises(RecognitionError) as refused:
        recognizer.check(bad)
    assert (refused.value.code, refused.value.field) == (Code.INVALID_ARGUMENT, "prompt")
    with pytest.raises(RecognitionError) as opened:
        recognizer.open_stream(bad, door="test")
    assert (opened.value.code, opened.value.field) == (Code.INVALID_ARGUMENT, "prompt")
    for _ in range(3):
        recognizer.check(PCM16)
    assert recognizer.stream_limit.take() is None  # its one place (max_streams 1) is still free
    assert not recognizer.sessions


def test_a_door_names_a_field_in_its_own_words_and_only_that_field() -> None:
    error = RecognitionError.invalid(
        ValueError("language_code 'xx' is not supported by model tiny.en (only en)")
    )
    assert (error.code, error.field) == (Code.INVALID_ARGUMENT, "language_code")
    assert (
        error.message_for({"language_code": "language"})
        == "language 'xx' is not supported by model tiny.en (only en)"
    )
    assert error.message_for({"prompt": "context"}) == error.message
    unnamed = RecognitionError(Code.UNAVAILABLE, "server is draining; retry on another replica")
    assert unnamed.message_for({"language_code": "language"}) == unnamed.message

"""Speculative end of utterance (--speculative-endpointing): the endpointer offers an utterance as soon as
its audio is known, the session recognizes it at once and sends the final only once the end is confirmed.

Real silero-vad, real tiny.en behind real gRPC servers on loopback, espeak-ng speech and jfk.flac.
The proof that matters: with speculation on and off, the same audio gives the same finals (text and
timings), and the endpointer's utterances are identical sample for sample.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2
from grpc import aio
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine
from engine.hooks import EngineHooks
from service.config import ServerConfig
from service.pipeline.audio import decode_file, mixdown
from service.pipeline.endpointing import (
    Endpointer,
    Event,
    SpeculationCancelled,
    SpeculativeEnd,
    SpeechEnded,
    Utterance,
)
from service.vocabulary.endpointing import EndpointSettings
from tests.support.audio import JFK_FLAC, RATE, make_conversation, silence, speak, speech_bounds
from tests.support.calls import OpenStream, config_request
from tests.support.gate import scheduler_gate
from tests.support.server import ServerProcess, ServerThread

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
]
# Shorter than min_silence_s (0.5 s) but longer than the speech pad (0.2 s): speech stops long enough
# for the utterance to be offered, then resumes before the end is confirmed.
SHORT_PAUSE_S = 0.38


def run(audio: np.ndarray, speculative: bool, chunk: int = 320, **settings: float) -> list[Event]:
    ep = Endpointer(EndpointSettings(**settings), speculative=speculative)
    events = [e for i in range(0, len(audio), chunk) for e in ep.feed(audio[i : i + chunk])]
    return events + ep.flush()


def utterances(events: list[Event]) -> list[Utterance]:
    return [e for e in events if isinstance(e, Utterance)]


def assert_same_utterances(a: list[Utterance], b: list[Utterance]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.index, x.start_s, x.end_s, x.lead_s, x.forced_cut) == (
            y.index,
            y.start_s,
            y.end_s,
            y.lead_s,
            y.forced_cut,
        )
        np.testing.assert_array_equal(x.audio, y.audio)


def spoken(text: str) -> np.ndarray:
    audio = speak(text)
    start, end = speech_bounds(audio)
    return audio[round(start * RATE) : round(end * RATE)]


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    audio, _ = decode_file(JFK_FLAC.read_bytes(), "FLAC", 0, 0)  # 44.1 kHz stereo -> 16 kHz
    return mixdown(audio)


@pytest.fixture(scope="module")
def resumed() -> np.ndarray:
    """Two sentences with a pause too short to end the utterance, then a long pause."""
    return np.concatenate(
        [silence(0.5), spoken(SENTENCES[0]), silence(SHORT_PAUSE_S), spoken(SENTENCES[1]), silence(1.0)]
    )


@pytest.fixture(scope="module")
def mixed(jfk: np.ndarray, resumed: np.ndarray) -> np.ndarray:
    """Hits (sentence ends, jfk's pauses), misses (the short pause, jfk's shorter pauses)."""
    conversation, _ = make_conversation(SENTENCES, pause_s=0.8)
    return np.concatenate([conversation, resumed, jfk, silence(1.0)])


# --- the endpointer ---


@pytest.mark.parametrize("chunk", [160, 320, 16000])
def test_speculation_changes_no_utterance(mixed: np.ndarray, chunk: int) -> None:
    on, off = run(mixed, True, chunk), run(mixed, False, chunk)
    assert not any(isinstance(e, SpeculativeEnd | SpeculationCancelled) for e in off)
    assert_same_utterances(utterances(on), utterances(off))
    # without the speculative events the event streams are the same
    plain = [e for e in on if not isinstance(e, SpeculativeEnd | SpeculationCancelled)]
    assert [type(e) for e in plain] == [type(e) for e in off]
    offered = [e.utterance for e in on if isinstance(e, SpeculativeEnd)]
    hits = [u for u in utterances(on) if any(u is o for o in offered)]
    assert len(hits) >= 3  # every pause of 0.8 s or more ends an utterance that was offered first
    assert sum(isinstance(e, SpeculationCancelled) for e in on) >= 1  # the short pause at least


def test_offers_do_not_depend_on_how_fast_audio_arrives(mixed: np.ndarray) -> None:
    """Sent faster than real time, the pad is buffered at the first silent window: an offer there would
    cost an engine request at every dip between words. Offers wait for the pad to be scored silent, so
    they fall at the same windows whether audio comes in 10 ms chunks or all at once."""

    def offers(chunk: int) -> list[tuple[str, int, float]]:
        out = []
        for e in run(mixed, True, chunk):
            if isinstance(e, SpeculativeEnd):
                out.append(("offer", e.utterance.index, e.utterance.end_s))
            elif isinstance(e, SpeculationCancelled):
                out.append(("cancel", e.index, 0.0))
        return out

    assert offers(160) == offers(len(mixed))


def test_offer_comes_once_the_pad_is_there_and_before_the_end(jfk: np.ndarray) -> None:
    """The utterance is offered as soon as the audio through its trailing pad is buffered: well before
    the silence reaches min_silence_s, and it is the object the end then confirms."""
    conversation, truth = make_conversation(SENTENCES[:1], pause_s=1.0)
    ep = Endpointer(speculative=True)
    events: list[tuple[int, Event]] = []
    for i in range(0, len(conversation), 160):
        events += [(i + 160, e) for e in ep.feed(conversation[i : i + 160])]
    offered_at, offer = next((at, e) for at, e in events if isinstance(e, SpeculativeEnd))
    ended_at = next(at for at, e in events if isinstance(e, SpeechEnded))
    confirmed = next(e for _, e in events if isinstance(e, Utterance))
    assert confirmed is offer.utterance
    pad, min_silence = 0.2, 0.5
    speech_end = confirmed.end_s
    # offered within a window (32 ms) and a chunk of the pad being heard; confirmed 0.3 s later
    assert speech_end + pad <= offered_at / RATE <= speech_end + pad + 0.032 + 0.01
    assert ended_at / RATE >= speech_end + min_silence
    assert (ended_at - offered_at) / RATE >= min_silence - pad - 0.032
    assert abs(confirmed.end_s - truth[0][1]) < 0.3


def test_resumed_speech_cancels_the_offer_and_one_longer_utterance_follows(resumed: np.ndarray) -> None:
    on, off = run(resumed, True), run(resumed, False)
    kinds = [type(e).__name__ for e in on]
    assert kinds == [
        "SpeechStarted",
        "SpeculativeEnd",
        "SpeculationCancelled",
        "SpeculativeEnd",
        "SpeechEnded",
        "Utterance",
    ]
    (utt,) = utterances(on)
    first = next(e for e in on if isinstance(e, SpeculativeEnd)).utterance
    assert utt.end_s > first.end_s + 1.0  # the final covers both sentences
    assert_same_utterances([utt], utterances(off))


LONG_SENTENCE = (
    "I have been waiting on the line for a very long time and I would really like to speak with "
    "someone who can help me with the bill that arrived this morning"
)


def test_forced_cuts_are_not_speculative() -> None:
    """At max_utterance_s the cut is chosen where speech goes on: it is never offered, nor is an end the
    cut would overtake; the utterances are those of the endpointer without speculation."""
    audio = np.concatenate(
        [silence(0.3), spoken(LONG_SENTENCE), silence(0.8), spoken(SENTENCES[0]), silence(0.8)]
    )
    on, off = run(audio, True, max_utterance_s=2.0), run(audio, False, max_utterance_s=2.0)
    assert_same_utterances(utterances(on), utterances(off))
    forced = [u for u in utterances(on) if u.forced_cut]
    assert forced
    offered = [e.utterance for e in on if isinstance(e, SpeculativeEnd)]
    assert offered and not any(u is o for u in forced for o in offered)
    open_offers = 0
    for e in on:
        if isinstance(e, SpeculativeEnd):
            open_offers += 1
        elif isinstance(e, SpeculationCancelled) or (isinstance(e, Utterance) and open_offers):
            open_offers -= 1
        assert open_offers in (0, 1)
    assert open_offers == 0


def test_end_of_stream_confirms_the_pending_offer() -> None:
    audio = np.concatenate([silence(0.3), spoken(SENTENCES[0]), silence(0.35)])
    ep = Endpointer(speculative=True)
    events = ep.feed(audio)
    offer = events[-1]  # the offer is pending when the stream ends
    assert isinstance(offer, SpeculativeEnd) and not utterances(events)
    (utt,) = utterances(ep.flush())
    assert utt is offer.utterance
    assert_same_utterances([utt], utterances(run(audio, False)))


def test_a_pad_longer_than_min_silence_is_offered_only_to_its_true_cut(mixed: np.ndarray) -> None:
    """With speech_pad_s over min_silence_s the end cuts at the confirming window, not at the pad: the
    offer (if any) carries exactly that audio."""
    settings = dict(min_silence_s=0.15)
    on, off = run(mixed, True, **settings), run(mixed, False, **settings)
    assert_same_utterances(utterances(on), utterances(off))


# --- through the server ---


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def servers(service_engine: Engine) -> Iterator[dict[bool, ServerThread]]:
    """Two real servers on one engine: speculation on and off."""
    on = ServerThread(ServerConfig(speculative_endpointing=True), service_engine).start()
    off = ServerThread(ServerConfig(speculative_endpointing=False), service_engine).start()
    try:
        yield {True: on, False: off}
    finally:
        on.stop()
        off.stop()


def pcm(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()


async def stream(
    server: ServerThread, audio: np.ndarray, *, pace: float = 0.0, chunk_s: float = 0.1
) -> list[asr_pb2.StreamingRecognizeResponse]:
    """Stream 16 kHz audio in chunks, `pace` seconds of wall time per second of audio (0: at once)."""
    async with aio.insecure_channel(server.target) as channel:
        s = OpenStream(channel, config=config_request(enable_word_time_offsets=True))
        await s.open()
        data, step = pcm(audio), round(chunk_s * RATE) * 2
        for i in range(0, len(data), step):
            await s.send(data[i : i + step], chunk_bytes=step)
            if pace:
                await asyncio.sleep(chunk_s * pace)
        outcome = await s.finish()
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    return outcome.responses


def final_results(responses: list[asr_pb2.StreamingRecognizeResponse]) -> list[tuple[object, ...]]:
    return [
        (
            r.utterance_index,
            r.alternatives[0].transcript,
            r.start_offset.ToNanoseconds(),
            r.end_offset.ToNanoseconds(),
            [
                (w.word, w.start_offset.ToNanoseconds(), w.end_offset.ToNanoseconds())
                for w in r.alternatives[0].words
            ],
        )
        for x in responses
        for r in x.results
        if r.is_final
    ]


@pytest.mark.slow
def test_finals_are_identical_with_speculation_on_and_off(
    servers: dict[bool, ServerThread], resumed: np.ndarray, jfk: np.ndarray
) -> None:
    audio = np.concatenate([resumed, jfk, silence(1.0)])
    hits, misses = (metric("asr_speculative_endpoints_total", outcome=o) for o in ("hit", "miss"))
    wasted = metric("asr_speculative_wasted_audio_seconds_total")
    # paced at four times real time: the silence waits are real, so speculative results are held a while
    on = asyncio.run(stream(servers[True], audio, pace=0.25))
    off = asyncio.run(stream(servers[False], audio, pace=0.25))
    assert len(final_results(on)) >= 3
    assert final_results(on) == final_results(off)
    assert metric("asr_speculative_endpoints_total", outcome="hit") - hits >= 2
    assert metric("asr_speculative_endpoints_total", outcome="miss") - misses >= 1
    assert metric("asr_speculative_wasted_audio_seconds_total") > wasted


async def wait_until(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


def offer_pending(server: ServerThread) -> bool:
    return any(s._speculations.pending(0) for s in list(server.server.recognizer.sessions))


def spoken_then_pause() -> np.ndarray:
    """A sentence and a pause long enough for the offer, too short for the end (0.35 s < 0.5 s)."""
    return np.concatenate([silence(0.3), spoken(SENTENCES[0]), silence(0.35)])


async def final_off(servers: dict[bool, ServerThread], audio: np.ndarray) -> list[tuple[object, ...]]:
    return final_results(await stream(servers[False], audio))


@pytest.mark.slow
async def test_half_close_with_an_offer_pending_still_gets_the_final(
    service_engine: Engine, engine_hooks: EngineHooks, servers: dict[bool, ServerThread]
) -> None:
    audio = spoken_then_pause()
    hits = metric("asr_speculative_endpoints_total", outcome="hit")
    with scheduler_gate(
        service_engine, engine_hooks
    ) as recorder:  # never closed: only records what is encoded
        async with aio.insecure_channel(servers[True].target) as channel:
            s = OpenStream(channel, config=config_request(enable_word_time_offsets=True))
            stream_id = await s.open()
            await s.send(pcm(audio))
            await wait_until(lambda: offer_pending(servers[True]), 30, "the utterance offered")
            outcome = await s.finish()
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert len(final_results(outcome.responses)) == 1
    # the speculative request became the final: none was made at the confirmation (its id would be
    # the plain "<stream>-<channel>-<index>" of service/pipeline/finals.py)
    encoded = [rid for rid, _ in recorder.encoded if rid.startswith(f"{stream_id}-")]
    assert encoded and "-spec" in encoded[-1] and f"{stream_id}-0-0" not in encoded
    assert final_results(outcome.responses) == await final_off(servers, audio)
    assert metric("asr_speculative_endpoints_total", outcome="hit") == hits + 1  # the flush confirmed it


@pytest.mark.slow
async def test_drain_with_an_offer_pending_sends_the_final(
    service_engine: Engine, servers: dict[bool, ServerThread]
) -> None:
    audio = spoken_then_pause()
    server = ServerThread(ServerConfig(speculative_endpointing=True), service_engine).start()
    try:
        async with aio.insecure_channel(server.target) as channel:
            s = OpenStream(channel, config=config_request(enable_word_time_offsets=True))
            await s.open()
            await s.send(pcm(audio))
            await wait_until(lambda: offer_pending(server), 30, "the utterance offered")
            server.loop.call_soon_threadsafe(server.server.recognizer.drain)
            outcome = await s.finish(half_close=False)
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert outcome.events(asr_pb2.StreamingRecognizeResponse.RECONNECT) == 1
    assert final_results(outcome.responses) == await final_off(servers, audio)


@pytest.mark.slow
async def test_engine_refusing_the_offer_falls_back_to_submitting_at_the_end(
    service_engine: Engine,
    engine_hooks: EngineHooks,
    servers: dict[bool, ServerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--max-queue 1 and the engine held with one utterance queued: the offer is refused. Once the queue
    has room, the end is confirmed and the utterance is submitted then: its final arrives as usual."""
    audio = spoken_then_pause()
    refused = metric("asr_speculative_endpoints_total", outcome="refused")
    monkeypatch.setattr(service_engine.config, "max_queue", 1)
    with scheduler_gate(service_engine, engine_hooks) as gate:
        await gate.close()
        filler = service_engine.submit(silence(0.5))
        async with aio.insecure_channel(servers[True].target) as channel:
            s = OpenStream(channel, config=config_request(enable_word_time_offsets=True))
            await s.open()
            await s.send(pcm(audio))
            await wait_until(
                lambda: metric("asr_speculative_endpoints_total", outcome="refused") > refused,
                30,
                "the offer refused",
            )
            assert not offer_pending(servers[True])
            filler.cancel()
            gate.open()
            await wait_until(lambda: gate.queued() == 0, 30, "the queue emptied")
            await s.send(pcm(silence(0.5)))  # the silence now confirms the end
            outcome = await s.finish()
    monkeypatch.undo()
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert final_results(outcome.responses) == await final_off(servers, audio)


@pytest.mark.slow
def test_a_miss_is_cancelled_in_the_engine_process(
    server_process: ServerProcess, resumed: np.ndarray
) -> None:
    """asr-server with its engine in its own process: speech resuming cancels the offered request there."""

    def scrape() -> dict[tuple[str, str], float]:
        url = f"http://127.0.0.1:{server_process.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "asr_speculative_endpoints_total":
                    out["speculative", sample.labels["outcome"]] = sample.value
                if sample.name == "asr_engine_requests_total" and sample.labels.get("kind") == "final":
                    out["engine", sample.labels["outcome"]] = sample.value
        return out

    async def run() -> list[asr_pb2.StreamingRecognizeResponse]:
        async with aio.insecure_channel(server_process.target) as channel:
            s = OpenStream(channel, config=config_request())
            await s.open()
            await s.send(pcm(resumed))
            outcome = await s.finish()
        assert outcome.code == grpc.StatusCode.OK, outcome.details
        return outcome.responses

    before = scrape()
    responses = asyncio.run(run())
    after = scrape()
    assert len(final_results(responses)) == 1  # one final for both sentences
    assert after.get(("speculative", "miss"), 0) >= before.get(("speculative", "miss"), 0) + 1
    assert after.get(("speculative", "hit"), 0) == before.get(("speculative", "hit"), 0) + 1
    # sent at once, the cancel reaches the engine process before it has recognized the offer
    assert after.get(("engine", "cancelled"), 0) >= before.get(("engine", "cancelled"), 0) + 1


@pytest.mark.slow
async def test_interims_as_without_speculation(
    service_engine: Engine, engine_hooks: EngineHooks, servers: dict[bool, ServerThread]
) -> None:
    """An offer leaves the interim in flight alone (on a miss it is still wanted); the confirmation
    supersedes the interim as a final always did: no interim result follows the final, and the final
    is the one without speculation."""
    audio = spoken_then_pause()
    head = round(1.2 * RATE)
    server = ServerThread(
        ServerConfig(speculative_endpointing=True, interim_interval_s=0.2), service_engine
    ).start()
    try:
        with scheduler_gate(service_engine, engine_hooks) as gate:
            await gate.close()
            async with aio.insecure_channel(server.target) as channel:
                config = config_request(enable_word_time_offsets=True)
                config.streaming_config.interim_results = True
                s = OpenStream(channel, config=config)
                await s.open()
                await s.send(pcm(audio[:head]))  # speech has begun
                await asyncio.sleep(0.3)  # longer than the interim interval
                await s.send(pcm(audio[head : head + 3200]))
                await wait_until(lambda: gate.queued() == 1, 30, "an interim submitted")
                (session,) = server.server.recognizer.sessions
                interim = session.channels[0].interim.in_flight
                assert interim is not None
                await s.send(pcm(audio[head + 3200 :]))
                await wait_until(lambda: offer_pending(server), 30, "the utterance offered")
                assert session.channels[0].interim.in_flight is interim  # still in flight, not cancelled
                assert not interim.future.cancelled()
                gate.open()
                outcome = await s.finish()
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    kinds = [r.is_final for x in outcome.responses for r in x.results]
    assert kinds and kinds[-1] and kinds.count(True) == 1  # nothing after the final
    assert final_results(outcome.responses) == await final_off(servers, audio)

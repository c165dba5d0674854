"""StreamingRecognize end to end: real server on loopback, real tiny.en, espeak-ng speech with known text.

One conversation paced in real time carries most assertions (finals per sentence, offsets, WER, interims,
latency metric); the rest stream as fast as the wire takes, which costs no wall time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio
from prometheus_client import REGISTRY

from clients.client import RecognizerClient
from clients.scoring import corpus_wer, normalize
from engine import Engine, EngineConfig
from engine.hooks import EngineHooks
from service.config import ServerConfig
from tests.support.audio import (
    JFK_FLAC,
    JFK_TEXT,
    make_conversation,
    silence,
    stereo,
    to_alaw_8k_bytes,
    to_linear16_bytes,
    to_mulaw_8k_bytes,
    white_noise,
)
from tests.support.calls import OpenStream, Outcome, config_request
from tests.support.gate import scheduler_gate
from tests.support.server import ServerThread, sync_stream

pytestmark = pytest.mark.slow

Event = asr_pb2.StreamingRecognizeResponse.SpeechEventType

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
    "Your order was shipped yesterday and should arrive on Friday.",
    "Great, thank you very much for your help.",
]
# Measured on tiny.en (CPU, fp32, 2 threads) with these espeak-ng sentences. 16 kHz measured 0.0 every
# time: its bound allows 3 of the 38 words.
PACED_WER_MEASURED, PACED_WER_BOUND = 0.0, 0.08
# 8 kHz bounds: measured 2026-12-02 (identical each run: sox converts with -D, no dither, and greedy
# decoding is deterministic), each bound the measurement plus 2 words, so that a regression of 3 words
# fails. Re-measure when the model, the engine's decoding or the endpointer changes. The 10 s encoder
# context floor moved these espeak clips both ways (mu-law 14 -> 12 errors, A-law 7 -> 15; 40 espeak
# telephone clips 36.7 -> 37.1 %, real speech 7.1 -> 6.2 %: docs/benchmarks.md "Issue 22").
TELEPHONE_WER = {  # encoding: (measured, bound) over the 38 words of SENTENCES
    "MULAW": (0.316, 0.37),  # 12 errors, bound 14
    "ALAW": (0.395, 0.45),  # 15 errors, bound 17
}
JFK_MULAW_WER_MEASURED, JFK_MULAW_WER_BOUND = 0.045, 0.14  # of 22 words: 1 error, bound 3
OFFSET_TOLERANCE_S = 0.3


@dataclass
class Received:
    at: float  # seconds after the stream began
    response: asr_pb2.StreamingRecognizeResponse


def finals(received: list[Received]) -> list[asr_pb2.StreamingRecognitionResult]:
    return [r for x in received for r in x.response.results if r.is_final]


def interims(received: list[Received]) -> list[asr_pb2.StreamingRecognitionResult]:
    return [r for x in received for r in x.response.results if not r.is_final]


def events(received: list[Received]) -> list[int]:
    return [x.response.speech_event_type for x in received if x.response.speech_event_type]


def seconds(d: object) -> float:
    return d.ToTimedelta().total_seconds()  # type: ignore[attr-defined]


async def collect(responses: AsyncIterator[asr_pb2.StreamingRecognizeResponse]) -> list[Received]:
    start, out = time.monotonic(), []
    async for response in responses:
        out.append(Received(time.monotonic() - start, response))
    return out


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def conversation() -> tuple[np.ndarray, list[tuple[float, float]]]:
    return make_conversation(SENTENCES, pause_s=1.0)


@pytest.fixture(scope="module")
def paced_run(
    asr_server: ServerThread, conversation: tuple[np.ndarray, list[tuple[float, float]]]
) -> list[Received]:
    """The conversation (~15 s) in 20 ms chunks at real-time pace, interim results on."""
    audio, _ = conversation
    latency_before = metric("asr_utterance_latency_seconds_count")

    async def run() -> list[Received]:
        async with RecognizerClient(asr_server.target) as client:
            return await collect(
                client.stream_file(audio, rate=16000, chunk_ms=20, realtime=True, interim=True)
            )

    received = asyncio.run(run())
    assert metric("asr_utterance_latency_seconds_count") - latency_before == len(finals(received))
    return received


def test_paced_stream_one_final_per_sentence_in_order_with_true_offsets(
    paced_run: list[Received], conversation: tuple[np.ndarray, list[tuple[float, float]]]
) -> None:
    _, bounds = conversation
    results = finals(paced_run)
    assert [r.utterance_index for r in results] == list(range(len(SENTENCES)))
    for result, (start, end) in zip(results, bounds, strict=True):
        assert abs(seconds(result.start_offset) - start) < OFFSET_TOLERANCE_S, (result, start)
        assert abs(seconds(result.end_offset) - end) < OFFSET_TOLERANCE_S, (result, end)
        assert result.channel_tag == 0 and result.language_code == "en"
        assert 0 < result.alternatives[0].confidence <= 1
    assert events(paced_run).count(Event.SPEECH_ACTIVITY_BEGIN) == len(SENTENCES)
    assert events(paced_run).count(Event.SPEECH_ACTIVITY_END) == len(SENTENCES)


def test_paced_stream_wer(paced_run: list[Received]) -> None:
    hypotheses = [r.alternatives[0].transcript for r in finals(paced_run)]
    wer = corpus_wer(SENTENCES, hypotheses)
    print(
        f"paced stream WER {wer:.3f} (measured {PACED_WER_MEASURED}, bound {PACED_WER_BOUND}): {hypotheses}"
    )
    assert wer <= PACED_WER_BOUND


def test_paced_stream_interims_come_before_their_final_never_after(paced_run: list[Received]) -> None:
    final_at = {}
    for x in paced_run:
        for r in x.response.results:
            if r.is_final:
                final_at[r.utterance_index] = x.at
    partial = [(x.at, r) for x in paced_run for r in x.response.results if not r.is_final]
    assert partial, "interim_results was asked for"
    for at, r in partial:
        assert at <= final_at[r.utterance_index], "an interim followed its utterance's final"
        assert r.alternatives[0].transcript
        assert 0 < r.stability <= 1
    # most sentences (2-3 s each) are long enough for an interim at the 1 s interval
    assert len({r.utterance_index for _, r in partial}) >= len(SENTENCES) // 2


async def test_jfk_as_8k_mulaw_stream(asr_server: ServerThread) -> None:
    import soundfile as sf

    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    data = to_mulaw_8k_bytes(audio.mean(axis=1), rate)
    async with RecognizerClient(asr_server.target) as client:
        audio_chunks = [data[i : i + 160] for i in range(0, len(data), 160)]  # 20 ms of 8 kHz G.711
        config = asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000)
        )
        received = await collect(client.stream(config, audio_chunks))
    hypothesis = " ".join(r.alternatives[0].transcript for r in finals(received))
    text = normalize(hypothesis)
    assert "ask not what your country can do for you" in text
    assert "ask what you can do for your country" in text
    # tiny.en may mishear the band-limited "my fellow Americans" (today "my fellow america"; with an
    # earlier engine "am I fell America", as transformers' generate() said), so the opening is held
    # to a WER bound instead.
    wer = corpus_wer([JFK_TEXT], [hypothesis])
    print(
        f"jfk 8 kHz mu-law WER {wer:.3f} (measured {JFK_MULAW_WER_MEASURED}, bound {JFK_MULAW_WER_BOUND}): {hypothesis}"
    )
    assert wer <= JFK_MULAW_WER_BOUND, hypothesis


@pytest.mark.parametrize("encoding", ["MULAW", "ALAW"])
async def test_telephone_conversation_wer_and_no_interims_unless_asked(
    asr_server: ServerThread, conversation: tuple[np.ndarray, list[tuple[float, float]]], encoding: str
) -> None:
    audio, bounds = conversation
    data = (to_mulaw_8k_bytes if encoding == "MULAW" else to_alaw_8k_bytes)(audio)
    async with RecognizerClient(asr_server.target) as client:
        config = asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(
                encoding=asr_pb2.AudioEncoding.Value(encoding), sample_rate_hertz=8000
            )
        )
        received = await collect(client.stream(config, [data[i : i + 160] for i in range(0, len(data), 160)]))
    assert not interims(received), "interim results were not asked for"
    results = finals(received)
    hypotheses = [r.alternatives[0].transcript for r in results]
    wer = corpus_wer(SENTENCES, hypotheses) if len(results) == len(SENTENCES) else 1.0
    measured, bound = TELEPHONE_WER[encoding]
    print(f"{encoding} 8 kHz WER {wer:.3f} (measured {measured}, bound {bound}): {hypotheses}")
    assert len(results) == len(SENTENCES), hypotheses
    assert wer <= bound, hypotheses
    for result, (start, end) in zip(results, bounds, strict=True):
        assert abs(seconds(result.start_offset) - start) < OFFSET_TOLERANCE_S
        assert abs(seconds(result.end_offset) - end) < OFFSET_TOLERANCE_S


async def test_separate_channels_two_voices_tagged_by_channel(asr_server: ServerThread) -> None:
    agent, _ = make_conversation(
        ["Thank you for calling the billing department."], pause_s=0.8, voice="en-us"
    )
    customer, _ = make_conversation(
        ["My internet bill is too high this month."], pause_s=0.8, lead_s=0.9, voice="en-gb"
    )
    both = stereo(agent, customer)  # the two talk over each other: a mixdown could not separate them
    async with RecognizerClient(asr_server.target) as client:
        received = await collect(client.stream_file(both, rate=16000, separate_channels=True))
    by_channel: dict[int, str] = {}
    for r in finals(received):
        by_channel[r.channel_tag] = by_channel.get(r.channel_tag, "") + " " + r.alternatives[0].transcript
    assert set(by_channel) == {1, 2}
    assert corpus_wer(["Thank you for calling the billing department."], [by_channel[1]]) <= 0.2, by_channel
    assert corpus_wer(["My internet bill is too high this month."], [by_channel[2]]) <= 0.2, by_channel
    begin_tags = {x.response.speech_event_channel_tag for x in received if x.response.speech_event_type == 1}
    assert begin_tags == {1, 2}


async def test_single_utterance_ends_the_stream_after_the_first_utterance(
    asr_server: ServerThread, conversation: tuple[np.ndarray, list[tuple[float, float]]]
) -> None:
    audio, bounds = conversation
    async with RecognizerClient(asr_server.target) as client:
        received = await collect(
            client.stream_file(audio, rate=16000, realtime=True, single_utterance=True, interim=False)
        )
    results = finals(received)
    assert len(results) == 1
    assert corpus_wer(SENTENCES[:1], [results[0].alternatives[0].transcript]) <= 0.2
    kinds = events(received)
    assert Event.END_OF_SINGLE_UTTERANCE in kinds
    # the stream ended with the first sentence's final, long before the audio ran out
    assert received[-1].at < bounds[1][0] + 3.0
    # the final is the last result; the call's metrics close every asr.v1 stream
    assert received[-1].response.HasField("call_metrics") and not received[-1].response.results
    assert received[-2].response.results and received[-2].response.results[0].is_final


async def test_prompt_reaches_the_decoder_and_bcp47_language_is_accepted(asr_server: ServerThread) -> None:
    audio, _ = make_conversation(["Please send the invoice to Katelynn Smythe."], pause_s=0.8)

    async def text(**kw: str) -> str:
        async with RecognizerClient(asr_server.target) as client:
            received = await collect(client.stream_file(audio, rate=16000, **kw))
        assert all(r.language_code == "en" for r in finals(received))
        return " ".join(r.alternatives[0].transcript for r in finals(received))

    plain, prompted = await asyncio.gather(
        text(language="en-US"), text(prompt="Katelynn Smythe", language="en")
    )
    assert "Katelynn Smythe" not in plain  # tiny.en alone spells the name otherwise...
    assert "Katelynn Smythe" in prompted  # ...the hint text is what changed it


async def test_silence_and_noise_give_no_finals(asr_server: ServerThread) -> None:
    audio = np.concatenate(
        [silence(5.0), white_noise(5.0, dbfs=-30), silence(1.0), white_noise(3.0, dbfs=-20)]
    )
    async with RecognizerClient(asr_server.target) as client:
        received = await collect(client.stream_file(audio, rate=16000))
    assert [r.alternatives[0].transcript for r in finals(received) if r.alternatives[0].transcript] == []


async def test_client_cancel_frees_engine_slots(
    asr_server: ServerThread,
    engine_hooks: EngineHooks,
    conversation: tuple[np.ndarray, list[tuple[float, float]]],
) -> None:
    audio, _ = conversation
    engine = asr_server.engine
    cancelled_before = metric("asr_utterances_total", outcome="cancelled")
    # Hold the scheduler at its next encoder pass, so the utterances are surely still in flight
    # when the client cancels (on a fast engine or a slow-reading client they could all finish).
    gate = threading.Event()

    def hold(request: object) -> None:
        gate.wait(30)

    try:
        with engine_hooks.installed(fault=hold):
            async with RecognizerClient(asr_server.target) as client:
                responses = client.stream_file(audio, rate=16000)
                async for response in responses:  # all audio goes at once; leave when the first one ended
                    if response.speech_event_type == Event.SPEECH_ACTIVITY_END:
                        break
                await responses.aclose()  # cancels the call
            # The gate opens only once the server has seen the cancel (and freed the stream's slots): opened
            # at once, a busy server could finish the utterances before the cancel reached it.
            sessions = asr_server.server.recognizer.sessions
            await wait_until(lambda: not sessions, 30, "the server saw the cancel")
    finally:
        gate.set()
    deadline = time.monotonic() + 30  # an encoder pass already running finishes first (slow on a busy CPU)
    stats = engine.stats()
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["waiting"] == 0 and stats["active"] == 0 and stats["slots_used"] == 0:
            break
        await asyncio.sleep(0.05)
    assert stats["waiting"] == 0 and stats["active"] == 0 and stats["slots_used"] == 0, stats
    assert stats["slots_free"] == engine.config.kv_slots
    assert metric("asr_utterances_total", outcome="cancelled") > cancelled_before, "nothing was in flight"


# --- refusals: a clear status naming the field or the limit ---


def _config(**kw: object) -> asr_pb2.StreamingRecognizeRequest:
    rc = {"encoding": asr_pb2.LINEAR16, "sample_rate_hertz": 16000, **kw}
    return asr_pb2.StreamingRecognizeRequest(
        streaming_config=asr_pb2.StreamingRecognitionConfig(config=asr_pb2.RecognitionConfig(**rc))  # type: ignore[arg-type]
    )


def _audio(n: int) -> asr_pb2.StreamingRecognizeRequest:
    return asr_pb2.StreamingRecognizeRequest(audio_content=b"\0" * n)


@pytest.mark.parametrize(
    ("requests", "code", "expected"),
    [
        ([_audio(320)], grpc.StatusCode.INVALID_ARGUMENT, "first request must carry streaming_config"),
        ([], grpc.StatusCode.INVALID_ARGUMENT, "first request must carry streaming_config"),
        ([_config(), _audio(320), _config()], grpc.StatusCode.INVALID_ARGUMENT, "streaming_config"),
        ([_config(encoding=asr_pb2.FLAC)], grpc.StatusCode.INVALID_ARGUMENT, "encoding"),
        ([_config(sample_rate_hertz=96000)], grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hertz"),
        ([_config(audio_channel_count=9)], grpc.StatusCode.INVALID_ARGUMENT, "audio_channel_count"),
        ([_config(language_code="klingon")], grpc.StatusCode.INVALID_ARGUMENT, "language_code"),
        ([_config(), _audio(3)], grpc.StatusCode.INVALID_ARGUMENT, "audio_content"),
        ([_config(), _audio((1 << 20) + 2)], grpc.StatusCode.INVALID_ARGUMENT, "max_chunk_bytes"),
    ],
    ids=[
        "audio-first",
        "empty",
        "second-config",
        "flac",
        "rate",
        "channels",
        "language",
        "odd-bytes",
        "chunk-size",
    ],
)
def test_bad_stream_requests_get_invalid_argument(
    asr_server: ServerThread,
    requests: list[asr_pb2.StreamingRecognizeRequest],
    code: grpc.StatusCode,
    expected: str,
) -> None:
    _, got, details = sync_stream(asr_server.target, requests)
    assert got == code
    assert expected in details


async def test_bad_endpointing_settings_name_the_field(asr_server: ServerThread) -> None:
    request = _config()
    request.streaming_config.endpointing.max_utterance_duration.FromSeconds(60)
    async with RecognizerClient(asr_server.target) as client:
        with pytest.raises(aio.AioRpcError) as e:
            await collect(client.stream(request.streaming_config, []))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_utterance_duration" in (e.value.details() or "")


async def test_max_streams_refused_at_once(asr_server: ServerThread) -> None:
    limit = asr_server.config.max_streams
    async with aio.insecure_channel(asr_server.target) as channel:
        stub = asr_pb2_grpc.RecognizerStub(channel)
        hold = asyncio.Event()

        async def idle_requests() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
            yield _config()
            await hold.wait()

        calls = [stub.StreamingRecognize(idle_requests()) for _ in range(limit)]
        for call in calls:
            await call.wait_for_connection()
        for _ in range(500):  # the server admits each stream once its config arrives
            if len(asr_server.server.recognizer.sessions) == limit:
                break
            await asyncio.sleep(0.02)
        _, code, details = await asyncio.to_thread(sync_stream, asr_server.target, [_config(), _audio(320)])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{limit} concurrent streams (max_streams)" in details
        for call in calls:
            call.cancel()
        hold.set()


# --- overload, drain and a stopped engine: what was admitted still gets its final ---


async def wait_until(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


def count_events(stream: OpenStream, kind: int) -> int:
    return sum(1 for x in stream.responses if x.speech_event_type == kind)


def interim_config() -> asr_pb2.StreamingRecognizeRequest:
    request = config_request()
    request.streaming_config.interim_results = True
    return request


def engine_requests(kind: str, outcome: str) -> float:
    return metric("asr_engine_requests_total", kind=kind, outcome=outcome)


async def test_refused_utterance_ends_the_stream_after_the_finals_of_those_admitted(
    asr_server: ServerThread,
    service_engine: Engine,
    engine_hooks: EngineHooks,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--max-queue 2, engine held: sentences 0 and 1 are admitted, sentence 2 is refused. The stream
    still gets the finals of 0 and 1, then RESOURCE_EXHAUSTED. (Speculation off: an offer is best effort,
    not counted against the live finals' queue, and the refused offer's sentence would be let in.)"""
    monkeypatch.setattr(service_engine.config, "max_queue", 2)
    monkeypatch.setattr(asr_server.config, "speculative_endpointing", False)
    audio, _ = make_conversation(SENTENCES[:3], pause_s=1.0)
    with scheduler_gate(service_engine, engine_hooks) as gate:
        await gate.close()
        async with aio.insecure_channel(asr_server.target) as channel:
            stream = OpenStream(channel)
            await stream.open()
            await stream.send(to_linear16_bytes(audio))
            # the third sentence's end is detected (and its utterance refused) while the engine is held
            await wait_until(
                lambda: count_events(stream, Event.SPEECH_ACTIVITY_END) == 3 or stream.call.done(),
                30,
                "three sentences ended",
            )
            gate.open()
            outcome = await stream.finish()
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert "--max-queue" in outcome.details
    assert [r.utterance_index for r in outcome.finals] == [0, 1], outcome
    assert corpus_wer(SENTENCES[:2], [r.alternatives[0].transcript for r in outcome.finals]) <= 0.2


async def test_drain_with_a_refused_utterance_still_sends_the_admitted_finals(
    service_engine: Engine, engine_hooks: EngineHooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drain flushes the sentence in progress; the engine (--max-queue 1, held) refuses it. The sentence
    admitted before still gets its final, then the refusal's status."""
    monkeypatch.setattr(service_engine.config, "max_queue", 1)
    first, _ = make_conversation(SENTENCES[:1], pause_s=1.0)
    second, _ = make_conversation(SENTENCES[1:2], pause_s=0.0, lead_s=0.0)  # still speaking at the end
    server = ServerThread(ServerConfig(speculative_endpointing=False), service_engine).start()
    try:
        with scheduler_gate(service_engine, engine_hooks) as gate:
            await gate.close()
            async with aio.insecure_channel(server.target) as channel:
                stream = OpenStream(channel)
                await stream.open()
                await stream.send(to_linear16_bytes(np.concatenate([first, second])))
                await wait_until(
                    lambda: count_events(stream, Event.SPEECH_ACTIVITY_BEGIN) == 2 and gate.queued() == 1,
                    30,
                    "first sentence admitted, second under way",
                )
                server.loop.call_soon_threadsafe(server.server.recognizer.drain)
                await wait_until(
                    lambda: count_events(stream, Event.RECONNECT) == 1 or stream.call.done(), 30, "drain"
                )
                gate.open()
                outcome = await stream.finish()
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert outcome.events(Event.RECONNECT) == 1
    assert [r.utterance_index for r in outcome.finals] == [0], outcome
    assert corpus_wer(SENTENCES[:1], [outcome.text]) <= 0.2, outcome.text


async def test_interim_meeting_a_stopped_engine_ends_the_stream_unavailable() -> None:
    """An interim request refused because the engine stopped ends the stream UNAVAILABLE (the status
    docs/operations.md promises for a stopped engine), not INTERNAL."""
    engine = Engine(EngineConfig(model="tiny.en", threads=1, warmup=False))
    engine.start()
    server = ServerThread(ServerConfig(interim_interval_s=0.2), engine).start()
    long_sentence = (
        "I have been waiting on the line for a very long time and I would really like to speak with "
        "someone who can help me with the bill that arrived this morning"
    )
    audio, _ = make_conversation([long_sentence], pause_s=0.0, lead_s=0.3)
    data = to_linear16_bytes(audio)
    try:
        async with aio.insecure_channel(server.target) as channel:
            stream = OpenStream(channel, config=interim_config(), deadline_s=60)
            await stream.open()
            head = 16000 * 2 * 3 // 2  # 1.5 s: speech has begun
            await stream.send(data[:head])
            await wait_until(
                lambda: count_events(stream, Event.SPEECH_ACTIVITY_BEGIN) == 1, 30, "speech begun"
            )
            await asyncio.to_thread(engine.stop)
            for i in range(head, len(data), 3200):  # 0.1 s chunks, paced: an interim falls due
                if not await stream.send(data[i : i + 3200]) or stream.call.done():
                    break
                await asyncio.sleep(0.05)
            outcome = await stream.finish(half_close=False)  # the interim, not the flush, must end it
    finally:
        server.stop()
        engine.stop()
    assert outcome.code == grpc.StatusCode.UNAVAILABLE, outcome
    assert "stopped" in outcome.details


async def test_final_cancels_its_interim_still_in_flight(
    service_engine: Engine, engine_hooks: EngineHooks
) -> None:
    """With the engine held, an interim is queued for the sentence in progress; then the sentence ends
    and its final is queued. The interim is cancelled before the engine works on it."""
    server = ServerThread(ServerConfig(interim_interval_s=0.2), service_engine).start()
    audio, _ = make_conversation(SENTENCES[2:3], pause_s=1.0, lead_s=0.3)
    data = to_linear16_bytes(audio)
    split = len(data) // 2 // 2 * 2  # mid-sentence, on a sample
    cancelled_before = engine_requests("interim", "cancelled")
    try:
        with scheduler_gate(service_engine, engine_hooks) as gate:
            await gate.close()
            async with aio.insecure_channel(server.target) as channel:
                stream = OpenStream(channel, config=interim_config())
                await stream.open()
                await stream.send(data[:split])
                await wait_until(
                    lambda: count_events(stream, Event.SPEECH_ACTIVITY_BEGIN) == 1, 30, "speech begun"
                )
                await asyncio.sleep(0.3)  # past interim_interval_s: the next audio brings an interim
                sessions = server.server.recognizer.sessions
                await stream.send(data[split : split + 3200])
                await wait_until(
                    lambda: any(ch.interim.in_flight is not None for s in sessions for ch in s.channels),
                    30,
                    "an interim submitted",
                )
                await stream.send(data[split + 3200 :])  # the sentence ends: its final is submitted
                await wait_until(
                    lambda: count_events(stream, Event.SPEECH_ACTIVITY_END) == 1, 30, "sentence ended"
                )
                gate.open()
                outcome: Outcome = await stream.finish()
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.OK, outcome
    assert corpus_wer(SENTENCES[2:3], [outcome.text]) <= 0.2, outcome.text
    assert engine_requests("interim", "cancelled") - cancelled_before == 1
    assert [rid for rid, interim in gate.encoded if interim] == [], "the engine worked on the interim"

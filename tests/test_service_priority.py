"""Recorded work beside live calls, through a real server (issue 19, scenario 3): live finals first, then
interims and speculative offers, then recordings, which wait for the capacity live calls leave."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from clients.client import RecognizerClient
from clients.scoring import corpus_wer
from engine import Engine, EngineConfig
from engine.hooks import EngineHooks
from engine.parameters import Priority
from service.config import ServerConfig
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import Outcome, audio_requests, config_request, paced, run_stream
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

LIVE = [
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
    "The technician will visit your home on Thursday afternoon.",
]
RECORDED = [
    "Good morning, thank you for calling.",
    "I need help with my bill.",
    "The payment did not go through.",
    "Can you check my account for me?",
    "I paid on Monday afternoon.",
    "Please send me a receipt by email.",
    "Thank you for waiting.",
    "Have a nice evening.",
]
WER_BOUND = 0.2


HOOKS = EngineHooks()  # small_engine's test seams


@pytest.fixture(scope="module")
def small_engine() -> Iterator[Engine]:
    """tiny.en with 8 KV rows (half of them for recorded work) and room for 4 live finals waiting: a few
    recordings are then more than the engine holds at once."""
    engine = Engine(
        EngineConfig(
            model="tiny.en", threads=2, kv_slots=8, max_queue=4, max_queue_recorded=24, max_recorded_rows=4
        ),
        hooks=HOOKS,
    )
    engine.start()
    engine.warmup()
    yield engine
    engine.stop()


async def test_bulk_recordings_beside_live_calls_never_cost_a_live_final(small_engine: Engine) -> None:
    """Three recordings of eight utterances go in at once (24 utterances: three times the KV rows) beside
    three real-time calls, one with interims. Every live call ends OK with all its finals, every recording
    completes whole, and no recorded utterance ever went into an encoder pass while a live one waited or
    decoded (its encoder work never held a live call up), nor held more than its 4 KV rows."""
    overtaken: list[dict[str, int]] = []
    peak_recorded_rows = 0

    def watch(stage: str, reqs: Sequence[object]) -> None:
        nonlocal peak_recorded_rows
        if stage != "encoder":
            return
        batch = [r for r in reqs if r.priority is Priority.RECORDED]  # type: ignore[attr-defined]
        stats = small_engine.stats()  # on the engine's loop thread: its state as this pass begins
        live = {k: v for k, v in stats.items() if k.endswith(("_live", "_best_effort")) and v}
        if batch and live:
            overtaken.append(live)
        peak_recorded_rows = max(peak_recorded_rows, stats["rows_recorded"])

    live_audio, _ = make_conversation(LIVE, pause_s=1.0)
    recording, _ = make_conversation(RECORDED, pause_s=0.8)
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    server = ServerThread(ServerConfig(recognize_inflight=8, max_recognize_calls=3), small_engine).start()
    try:
        with HOOKS.installed(stage=watch):
            async with (
                RecognizerClient(server.target) as client,
                aio.insecure_channel(server.target) as channel,
            ):

                async def live(interim: bool) -> Outcome:
                    return await run_stream(channel, paced(to_linear16_bytes(live_audio), interim))

                calls = [live(interim=True), live(interim=False), live(interim=False)]
                bulk = [
                    client.recognize(to_linear16_bytes(recording), config, deadline_s=300) for _ in range(3)
                ]
                results = await asyncio.gather(*calls, *bulk)
    finally:
        server.stop()
    outcomes: list[Outcome] = results[:3]  # type: ignore[assignment]
    responses: list[asr_pb2.RecognizeResponse] = results[3:]  # type: ignore[assignment]
    for outcome in outcomes:
        assert outcome.code == grpc.StatusCode.OK, outcome
        assert [r.utterance_index for r in outcome.finals] == [0, 1, 2], outcome.finals
        assert corpus_wer(LIVE, [r.alternatives[0].transcript for r in outcome.finals]) <= WER_BOUND
    for response in responses:
        texts = [r.alternatives[0].transcript for r in response.results]
        assert len(texts) == len(RECORDED) and corpus_wer(RECORDED, texts) <= WER_BOUND, texts
    assert overtaken == [], "recorded work went into an encoder pass while live work waited or decoded"
    assert peak_recorded_rows <= 4


async def test_recognize_calls_over_their_bound_wait_their_turn_while_live_calls_go_on(
    service_engine: Engine,
) -> None:
    """Issue 26 #15: with --max-recognize-calls 1 and one recording under way, two more Recognize calls
    wait in the queue (first come, first served) instead of being refused RESOURCE_EXHAUSTED as they
    were, and all three get every utterance; a live call is admitted and served meanwhile."""
    recording, _ = make_conversation(RECORDED[:4], pause_s=0.8)
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    request = asr_pb2.RecognizeRequest(config=config, audio_content=to_linear16_bytes(recording))
    server = ServerThread(ServerConfig(max_recognize_calls=1), service_engine).start()
    try:
        async with aio.insecure_channel(server.target) as channel:
            stub = asr_pb2_grpc.RecognizerStub(channel)
            first = asyncio.ensure_future(stub.Recognize(request, timeout=300))
            await _until_recognizing(server, first)
            queued = [asyncio.ensure_future(stub.Recognize(request, timeout=300)) for _ in range(2)]
            deadline = time.monotonic() + 30
            while server.call(_queued(server)) < 2:
                assert time.monotonic() < deadline, "the two calls past the bound never queued"
                await asyncio.sleep(0.01)
            live_audio, _ = make_conversation(LIVE[:1], pause_s=0.8)
            live = await run_stream(
                channel, [config_request(), *audio_requests(to_linear16_bytes(live_audio), 3200)]
            )
            responses = await asyncio.gather(first, *queued)
    finally:
        server.stop()
    assert [len(r.results) for r in responses] == [4, 4, 4]
    assert live.code == grpc.StatusCode.OK and len(live.finals) == 1, live


async def test_recognize_calls_past_the_queue_bytes_are_refused_and_a_cancelled_wait_frees_its_bytes(
    service_engine: Engine,
) -> None:
    """The queue is bounded by the audio bytes it holds (--max-recognize-queue-bytes, here one
    recording's): past it a call is refused RESOURCE_EXHAUSTED naming the flag; a waiting call whose
    client goes away leaves the queue and its bytes with it."""
    recording, _ = make_conversation(RECORDED[:2], pause_s=0.8)
    data = to_linear16_bytes(recording)
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    request = asr_pb2.RecognizeRequest(config=config, audio_content=data)
    server_config = ServerConfig(max_recognize_calls=1, max_recognize_queue_bytes=len(data))
    server = ServerThread(server_config, service_engine).start()
    try:
        async with aio.insecure_channel(server.target) as channel:
            stub = asr_pb2_grpc.RecognizerStub(channel)
            first = asyncio.ensure_future(stub.Recognize(request, timeout=300))
            await _until_recognizing(server, first)
            waiting = stub.Recognize(request, timeout=300)
            deadline = time.monotonic() + 30
            while server.call(_queued(server)) < 1:
                assert time.monotonic() < deadline, "the second call never queued"
                await asyncio.sleep(0.01)
            with pytest.raises(aio.AioRpcError) as refused:
                await stub.Recognize(request, timeout=60)
            waiting.cancel()
            while server.call(_queued(server)) > 0:
                assert time.monotonic() < deadline, "the cancelled call never left the queue"
                await asyncio.sleep(0.01)
            after = asyncio.ensure_future(stub.Recognize(request, timeout=300))
            responses = await asyncio.gather(first, after)
    finally:
        server.stop()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details() or ""
    assert f"{len(data)} bytes (max_recognize_queue_bytes)" in details, details
    assert [len(r.results) for r in responses] == [2, 2]


async def _until_recognizing(server: ServerThread, first: asyncio.Future[object]) -> None:
    deadline = time.monotonic() + 30
    while server.call(_recognizing(server)) == 0:  # the first one is under way
        assert time.monotonic() < deadline and not first.done(), "the first Recognize never started"
        await asyncio.sleep(0.01)


async def _queued(server: ServerThread) -> int:
    return server.server.recognizer.recognize_queued


async def _recognizing(server: ServerThread) -> int:
    return server.server.recognizer._recognizing

"""Beams per kind of work through a real server (issue 29): a live call's finals search
--beam-size-final beams, its interims stay greedy, recorded audio searches --beam-size-recorded."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from clients.client import RecognizerClient
from clients.scoring import corpus_wer
from engine import DecodeOptions, Engine, EngineConfig
from engine.hooks import EngineHooks
from service.config import ServerConfig
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import Outcome, paced, run_stream
from tests.support.server import ServerThread

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
]
HOOKS = EngineHooks()


def watch_encoder(encoded: list[DecodeOptions]) -> Callable[[str, Sequence[object]], None]:
    """A stage hook that keeps the options of every utterance the encoder takes."""

    def watch(stage: str, reqs: Sequence[object]) -> None:
        if stage == "encoder":
            encoded.extend(r.options for r in reqs)  # type: ignore[attr-defined]

    return watch


@pytest.fixture(scope="module")
def beam_engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(model="tiny.en", threads=2, kv_slots=16, max_recorded_rows=8), hooks=HOOKS)
    engine.start()
    yield engine
    engine.stop()


async def test_finals_interims_and_recordings_search_their_own_beams(beam_engine: Engine) -> None:
    encoded: list[DecodeOptions] = []
    audio, _ = make_conversation(SENTENCES, pause_s=1.0)
    data = to_linear16_bytes(audio)
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    server = ServerThread(ServerConfig(beam_size_final=3, beam_size_recorded=2), beam_engine).start()
    try:
        with HOOKS.installed(stage=watch_encoder(encoded)):
            async with (
                RecognizerClient(server.target) as client,
                aio.insecure_channel(server.target) as channel,
            ):
                live: Outcome = await run_stream(channel, paced(data))
                recorded = await client.recognize(data, config, deadline_s=300)
    finally:
        server.stop()
    assert live.code == grpc.StatusCode.OK, live
    assert corpus_wer(SENTENCES, [r.alternatives[0].transcript for r in live.finals]) <= 0.2
    assert corpus_wer(SENTENCES, [r.alternatives[0].transcript for r in recorded.results]) <= 0.2
    seen = [(o.priority.label, o.interim, o.beam_size) for o in encoded]  # (class, interim, beam_size)
    finals = {b for c, interim, b in seen if c != "recorded" and not interim}
    interims = {b for c, interim, b in seen if interim}
    assert finals == {3} and interims == {1}, seen
    assert {b for c, _, b in seen if c == "recorded"} == {2}, seen


async def test_keyterm_requests_search_the_keyterm_beams(
    beam_engine: Engine,
) -> None:
    """--beam-size-keyterms: a final or a recording whose request lists keyterms searches that many beams
    (their bonus enters the ranking); without keyterms the kind of work's own (greedy here). Interims
    are greedy whatever the list (the session asks beam_size 1 for them: the test above)."""
    encoded: list[DecodeOptions] = []
    audio, _ = make_conversation(SENTENCES, pause_s=1.0)
    data = to_linear16_bytes(audio)
    terms = ["Kestoria", "Moxilar"]

    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    listed = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000, keyterms=terms)
    server = ServerThread(ServerConfig(beam_size_keyterms=4), beam_engine).start()
    try:
        with HOOKS.installed(stage=watch_encoder(encoded)):
            async with (
                RecognizerClient(server.target) as client,
                aio.insecure_channel(server.target) as channel,
            ):
                live: Outcome = await run_stream(channel, paced(data, keyterms=terms))
                await client.recognize(data, listed, deadline_s=300)
                await client.recognize(data, config, deadline_s=300)
    finally:
        server.stop()
    assert live.code == grpc.StatusCode.OK, live
    assert corpus_wer(SENTENCES, [r.alternatives[0].transcript for r in live.finals]) <= 0.2
    seen = [(o.priority.label, o.interim, o.beam_size, bool(o.keyterms)) for o in encoded]
    assert {b for c, interim, b, k in seen if c != "recorded" and not interim} == {4}, seen
    assert {(b, k) for c, _, b, k in seen if c == "recorded"} == {(4, True), (1, False)}, seen


async def test_a_call_asks_its_own_beams(beam_engine: Engine) -> None:
    """asr.v1 RecognitionConfig.beam_size: a stream's finals and a recording search the beams the call asks
    for, over the server's defaults (greedy here); interims stay greedy; more than --max-beam-size, or
    fewer than 1, is INVALID_ARGUMENT naming beam_size, on a stream and on Recognize alike."""
    encoded: list[DecodeOptions] = []
    audio, _ = make_conversation(SENTENCES, pause_s=1.0)
    data = to_linear16_bytes(audio)
    asked = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000, beam_size=2)
    too_many = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000, beam_size=99)
    server = ServerThread(ServerConfig(), beam_engine).start()
    try:
        with HOOKS.installed(stage=watch_encoder(encoded)):
            async with (
                RecognizerClient(server.target) as client,
                aio.insecure_channel(server.target) as channel,
            ):
                live: Outcome = await run_stream(channel, paced(data, beam_size=3))
                await client.recognize(data, asked, deadline_s=300)
                refused_stream: Outcome = await run_stream(channel, paced(data[:3200], beam_size=99))
                refused_zero: Outcome = await run_stream(channel, paced(data[:3200], beam_size=0))
                with pytest.raises(grpc.aio.AioRpcError) as refused_recording:
                    await client.recognize(data, too_many, deadline_s=300)
    finally:
        server.stop()
    assert live.code == grpc.StatusCode.OK, live
    assert corpus_wer(SENTENCES, [r.alternatives[0].transcript for r in live.finals]) <= 0.2
    seen = [(o.priority.label, o.interim, o.beam_size) for o in encoded]
    assert {b for c, interim, b in seen if c != "recorded" and not interim} == {3}, seen
    assert {b for _, interim, b in seen if interim} == {1}, seen
    assert {b for c, _, b in seen if c == "recorded"} == {2}, seen
    for outcome in (refused_stream, refused_zero):
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert "beam_size" in outcome.details, outcome
    assert refused_recording.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "beam_size" in (refused_recording.value.details() or "")

"""Word timings (engine/model/timing.py) on the real tiny.en: jfk.flac's words where a listener hears them,
batched the same as alone, through a real server as WordInfo offsets. The comparison with faster-whisper
on telephone audio is scripts/bench_word_timings.py."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import torch
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from engine import DecodeOptions, Engine
from engine.model.timing import dtw, median_filter
from service.config import ServerConfig
from tests.support.audio import JFK_FLAC, make_conversation, speak
from tests.support.calls import Outcome, audio_requests, config_request, run_stream
from tests.support.engine import jfk_16k
from tests.support.server import ServerThread
from tests.support.wait import wait_until

WORDS = DecodeOptions(word_timestamps=True)
# Start times of jfk.flac's words as heard (openai/whisper's word_timestamps agree within ~0.1 s).
JFK_STARTS = {1: ("so", 0.9), 5: ("ask", 3.3), 6: ("not", 3.9), 7: ("what", 5.1), 14: ("ask", 8.3)}
TOLERANCE_S = 0.3


def test_dtw_follows_the_cheapest_monotonic_path() -> None:
    cost = np.array([[0, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0]], dtype=float)
    tokens, frames = dtw(cost)
    assert tokens.tolist() == [0, 1, 1, 2] and frames.tolist() == [0, 1, 2, 3]


def test_median_filter_removes_a_spike() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0]])
    assert median_filter(x, 7).tolist() == [[1.0] * 8]


def test_jfk_words_in_order_inside_the_audio_at_the_times_heard(tiny_engine: Engine) -> None:
    audio = jfk_16k()
    t = tiny_engine.submit(audio, WORDS).future.result(timeout=120)
    words = t.words
    assert "".join(w.word for w in words).strip() == t.text
    for previous, word in itertools.pairwise(words):
        assert previous.start_s <= word.start_s and previous.end_s <= word.end_s + 1e-6
    assert all(0 <= w.start_s <= w.end_s <= len(audio) / 16000 for w in words)
    assert all(0 < w.probability <= 1 for w in words)
    for index, (text, start) in JFK_STARTS.items():
        assert words[index].word.strip(" ,.").lower() == text
        assert abs(words[index].start_s - start) < TOLERANCE_S, (words[index], start)


def test_words_batched_equal_alone(tiny_engine: Engine) -> None:
    clips = [jfk_16k(), speak("My account number is four five seven two nine."), jfk_16k()[: 16000 * 4]]
    alone = [tiny_engine.submit(c, WORDS).future.result(timeout=120).words for c in clips]
    handles = [tiny_engine.submit(c, WORDS) for c in clips[:2]]
    wait_until(lambda: tiny_engine.stats()["active"], 60, "the first two utterances never started decoding")
    handles.append(tiny_engine.submit(clips[2], WORDS))  # joins while the others decode
    together = [h.future.result(timeout=120).words for h in handles]
    for a, b in zip(alone, together, strict=True):
        assert [w.word for w in a] == [w.word for w in b]
        assert np.allclose([w.start_s for w in a], [w.start_s for w in b], atol=0.021)
        assert np.allclose([w.end_s for w in a], [w.end_s for w in b], atol=0.021)
        assert np.allclose([w.probability for w in a], [w.probability for w in b], atol=1e-3)


def test_no_words_unless_asked(tiny_engine: Engine) -> None:
    assert tiny_engine.submit(jfk_16k()).future.result(timeout=120).words == ()


def test_recognize_returns_word_offsets_from_the_stream_start(asr_server: ServerThread) -> None:
    audio, bounds = make_conversation(
        ["Thank you for calling.", "Your order was shipped yesterday."], pause_s=1.5
    )
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()

    async def call() -> asr_pb2.RecognizeResponse:
        async with aio.insecure_channel(asr_server.target) as channel:
            return await asr_pb2_grpc.RecognizerStub(channel).Recognize(
                asr_pb2.RecognizeRequest(
                    config=asr_pb2.RecognitionConfig(
                        encoding=asr_pb2.LINEAR16,
                        sample_rate_hertz=16000,
                        enable_word_time_offsets=True,
                        enable_word_confidence=True,
                    ),
                    audio_content=pcm,
                ),
                timeout=120,
            )

    response = asyncio.run(call())
    assert len(response.results) == 2
    for result, (start, end) in zip(response.results, bounds, strict=True):
        words = result.alternatives[0].words
        assert " ".join(w.word for w in words) == result.alternatives[0].transcript
        starts = [w.start_offset.ToTimedelta().total_seconds() for w in words]
        ends = [w.end_offset.ToTimedelta().total_seconds() for w in words]
        assert starts == sorted(starts) and all(s <= e for s, e in zip(starts, ends, strict=True))
        assert start - TOLERANCE_S < starts[0] and ends[-1] < end + TOLERANCE_S, (starts, ends, start, end)
        assert all(0 < w.confidence <= 1 for w in words)


@pytest.mark.parametrize("field", ["enable_word_time_offsets", "enable_word_confidence"])
def test_recognize_words_carry_only_what_was_asked(asr_server: ServerThread, field: str) -> None:
    async def call() -> asr_pb2.RecognizeResponse:
        async with aio.insecure_channel(asr_server.target) as channel:
            config = asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC, **{field: True})
            return await asr_pb2_grpc.RecognizerStub(channel).Recognize(
                asr_pb2.RecognizeRequest(config=config, audio_content=JFK_FLAC.read_bytes()), timeout=120
            )

    words = [w for r in asyncio.run(call()).results for w in r.alternatives[0].words]
    assert len(words) >= 20
    if field == "enable_word_confidence":
        assert all(w.confidence > 0 and not w.HasField("end_offset") for w in words)
    else:
        assert all(w.confidence == 0 and w.HasField("end_offset") for w in words)


def test_streaming_finals_carry_word_offsets_from_the_stream_start(service_engine: Engine) -> None:
    """Sent at real time, so that interims fall due while each utterance is spoken (every 0.25 s): the
    finals carry words with offsets from the stream start, the interims carry none."""
    audio, bounds = make_conversation(
        ["Thank you for calling.", "Your order was shipped yesterday."], pause_s=1.5
    )
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    config = config_request(enable_word_time_offsets=True)
    config.streaming_config.interim_results = True
    chunk = 3200  # 100 ms of 16 kHz LINEAR16

    async def paced() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
        yield config
        start = time.monotonic()
        for n, request in enumerate(audio_requests(pcm, chunk)):
            await asyncio.sleep(max(0.0, start + n * 0.1 - time.monotonic()))
            yield request

    server = ServerThread(ServerConfig(interim_interval_s=0.25), service_engine).start()
    try:

        async def call() -> Outcome:
            async with aio.insecure_channel(server.target) as channel:
                return await run_stream(channel, paced())

        outcome = asyncio.run(call())
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.OK, outcome
    assert len(outcome.finals) == 2, outcome.finals
    for result, (start, end) in zip(outcome.finals, bounds, strict=True):
        words = result.alternatives[0].words
        assert " ".join(w.word for w in words) == result.alternatives[0].transcript
        starts = [w.start_offset.ToTimedelta().total_seconds() for w in words]
        ends = [w.end_offset.ToTimedelta().total_seconds() for w in words]
        assert starts == sorted(starts), starts
        assert start - TOLERANCE_S < starts[0] and ends[-1] < end + TOLERANCE_S, (starts, ends, start, end)
    interims = [r for x in outcome.responses for r in x.results if not r.is_final]
    assert interims, "no interim fell due: the check below would hold whatever interims carry"
    assert all(r.alternatives[0].transcript for r in interims)
    assert not [r.alternatives[0].words for r in interims if r.alternatives[0].words]  # words: finals only

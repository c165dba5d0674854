"""asr.v1 Recognize with config.diarization, against the real server and the real tiny.en: two real
speakers on one 8 kHz mu-law channel (tests/support/two_speakers.py)."""

from __future__ import annotations

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from clients.client import RecognizerClient
from tests.support.audio import JFK_FLAC, to_mulaw_8k_bytes
from tests.support.calls import audio_requests, config_request, run_stream
from tests.support.server import ServerThread
from tests.support.two_speakers import two_speaker_call, word_accuracy

pytestmark = pytest.mark.slow


def mulaw_config(**diarization: int | bool) -> asr_pb2.RecognitionConfig:
    return asr_pb2.RecognitionConfig(
        encoding=asr_pb2.MULAW,
        sample_rate_hertz=8000,
        enable_word_time_offsets=True,
        diarization=asr_pb2.DiarizationConfig(**diarization),  # type: ignore[arg-type]
    )


async def test_a_diarized_mono_call_has_two_speakers_on_its_words_and_results(
    asr_server: ServerThread,
) -> None:
    call = two_speaker_call()
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(to_mulaw_8k_bytes(call.audio), mulaw_config(enable=True))
    words = [w for r in response.results for w in r.alternatives[0].words]
    assert len(words) >= 20 and all(w.HasField("speaker") for w in words)
    assert {w.speaker for w in words} == {0, 1} and words[0].speaker == 0
    timed = [
        (w.start_offset.ToTimedelta().total_seconds(), w.end_offset.ToTimedelta().total_seconds(), w.speaker)
        for w in words
    ]
    assert word_accuracy(call, timed) >= 0.85
    assert all(r.HasField("speaker") for r in response.results)
    assert {r.speaker for r in response.results} == {0, 1}


async def test_without_diarization_nothing_carries_a_speaker(asr_server: ServerThread) -> None:
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC, enable_word_time_offsets=True)
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(JFK_FLAC.read_bytes(), config)
    words = [w for r in response.results for w in r.alternatives[0].words]
    assert words and not any(w.HasField("speaker") for w in words)
    assert not any(r.HasField("speaker") for r in response.results)


@pytest.mark.parametrize(
    ("bounds", "named"),
    [
        ({"min_speakers": 3, "max_speakers": 2}, "config.diarization.min_speakers"),
        ({"max_speakers": 11}, "config.diarization.max_speakers"),
    ],
)
async def test_bad_speaker_bounds_are_invalid_argument_naming_the_field(
    asr_server: ServerThread, bounds: dict[str, int], named: str
) -> None:
    async with RecognizerClient(asr_server.target) as client:
        with pytest.raises(aio.AioRpcError) as e:
            await client.recognize(b"\xff" * 8000, mulaw_config(enable=True, **bounds))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (e.value.details() or ""), e.value.details()


async def test_a_stream_asking_for_diarization_is_refused_naming_it(asr_server: ServerThread) -> None:
    async with aio.insecure_channel(asr_server.target) as channel:
        out = await run_stream(
            channel,
            [
                config_request(asr_pb2.MULAW, 8000, diarization=asr_pb2.DiarizationConfig(enable=True)),
                *audio_requests(b"\xff" * 1600),
            ],
        )
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT and "config.diarization" in out.details, out

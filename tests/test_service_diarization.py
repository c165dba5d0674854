"""asr.v1 Recognize and StreamingRecognize with config.diarization, against the real server and the real
tiny.en: two real speakers on one 8 kHz mu-law channel (tests/support/two_speakers.py)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2
from grpc import aio
from prometheus_client import REGISTRY

from clients.client import RecognizerClient
from service.pipeline import live_diarization
from tests.support.audio import JFK_FLAC, to_linear16_bytes, to_mulaw_8k_bytes
from tests.support.calls import Outcome, audio_requests, config_request, run_stream
from tests.support.server import ServerThread
from tests.support.two_speakers import Call, one_speaker_call, two_speaker_call, word_accuracy

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


async def test_a_diarized_recordings_call_metrics_count_its_speakers(asr_server: ServerThread) -> None:
    """Recognize: the call metrics carry each speaker's talk time and words beside the one channel."""
    call = live_call()
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(to_mulaw_8k_bytes(call.audio), mulaw_config(enable=True))
    speakers = response.call_metrics.speakers
    assert [s.channel_tag for s in speakers] == [0, 1]
    assert all(s.talk_time.ToTimedelta().total_seconds() > 1.5 and s.words_per_minute > 0 for s in speakers)
    assert len(response.call_metrics.channels) == 1


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


# --- live streams ------------------------------------------------------------------------------------


async def stream(target: str, data: bytes, encoding: int, rate: int, **config: object) -> Outcome:
    async with aio.insecure_channel(target) as channel:
        out = await run_stream(
            channel,
            [
                config_request(encoding, rate, enable_word_time_offsets=True, **config),
                *audio_requests(data + b"\xff" * 8000, 800),  # 1 s of silence after: the last turn ends
            ],
        )
    assert out.code == grpc.StatusCode.OK, out
    return out


def timed_words(out: Outcome) -> list[tuple[float, float, int]]:
    return [
        (w.start_offset.ToTimedelta().total_seconds(), w.end_offset.ToTimedelta().total_seconds(), w.speaker)
        for r in out.finals
        for w in r.alternatives[0].words
    ]


# turns of 2-3 s each (the clips of 1188 and 1995 cut at a pause): a second of silence between all four
def live_call() -> Call:
    return two_speaker_call("1188", "1995", gap_s=1.0, overlap_s=-1.0)


async def live_diarized(target: str, call: Call) -> Outcome:
    return await stream(
        target,
        to_mulaw_8k_bytes(call.audio),
        asr_pb2.MULAW,
        8000,
        diarization=asr_pb2.DiarizationConfig(enable=True),
    )


async def test_a_live_two_speaker_mono_stream_labels_both_consistently_across_finals(
    asr_server: ServerThread,
) -> None:
    """Two LibriSpeech speakers, A B A B, turns of 2-3 s a second apart: the endpointer cuts one utterance
    per turn; each final's words carry the speaker found for its utterance, numbered from 0 in order of
    appearance, and A's and B's second turns (later finals) get their first turns' labels."""
    call = live_call()
    out = await live_diarized(asr_server.target, call)
    words = [w for r in out.finals for w in r.alternatives[0].words]
    assert len(out.finals) >= 3 and len(words) >= 20
    assert all(w.HasField("speaker") for w in words)
    assert {w.speaker for w in words} == {0, 1} and words[0].speaker == 0
    assert word_accuracy(call, timed_words(out)) >= 0.85
    assert all(r.HasField("speaker") for r in out.finals)
    assert [r.speaker for r in out.finals] == [0, 1, 0, 1]


async def test_a_live_diarized_mono_streams_call_metrics_count_its_speakers(asr_server: ServerThread) -> None:
    """The last response's call metrics carry, beside the one channel, each speaker's talk time and
    words (from its finals' words); a stream without diarization has no speakers there."""
    call = live_call()
    out = await live_diarized(asr_server.target, call)
    (metrics,) = [r.call_metrics for r in out.responses if r.HasField("call_metrics")]
    assert [s.channel_tag for s in metrics.speakers] == [0, 1]
    words = timed_words(out)
    for s in metrics.speakers:
        mine = [(a, b) for a, b, who in words if who == s.channel_tag]
        assert s.talk_time.ToTimedelta().total_seconds() > 1.5
        assert s.words_per_minute > 0
        assert s.talk_time.ToTimedelta().total_seconds() <= sum(b - a for a, b in mine) + 2.0
    (channel,) = metrics.channels
    talk = sum(s.talk_time.ToTimedelta().total_seconds() for s in metrics.speakers)
    assert talk <= channel.talk_time.ToTimedelta().total_seconds() + 0.5
    plain = await stream(asr_server.target, to_mulaw_8k_bytes(call.audio), asr_pb2.MULAW, 8000)
    (metrics,) = [r.call_metrics for r in plain.responses if r.HasField("call_metrics")]
    assert not metrics.speakers and len(metrics.channels) == 1


async def test_a_live_one_speaker_mono_stream_has_one_speaker(asr_server: ServerThread) -> None:
    out = await live_diarized(asr_server.target, one_speaker_call("1188"))
    words = [w for r in out.finals for w in r.alternatives[0].words]
    assert len(out.finals) >= 2 and len(words) >= 10
    assert {w.speaker for w in words} == {0} and all(w.HasField("speaker") for w in words)
    assert {r.speaker for r in out.finals} == {0}


async def test_a_live_stream_without_diarization_carries_no_speaker(asr_server: ServerThread) -> None:
    call = live_call()
    out = await stream(asr_server.target, to_mulaw_8k_bytes(call.audio), asr_pb2.MULAW, 8000)
    words = [w for r in out.finals for w in r.alternatives[0].words]
    assert words and not any(w.HasField("speaker") for w in words)
    assert not any(r.HasField("speaker") for r in out.finals)


async def test_a_live_stereo_stream_keeps_its_channels_as_speakers(asr_server: ServerThread) -> None:
    """Separate recognition per channel with diarization asked: each channel is one speaker (channel 1
    is speaker 0), not diarized within."""
    call = live_call()
    a, b = np.zeros_like(call.audio), np.zeros_like(call.audio)
    for start, end, who in call.turns:
        lo, hi = int(start * 16000), int(end * 16000)
        (a if who == "1188" else b)[lo:hi] = call.audio[lo:hi]
    stereo = np.stack([a, b])
    out = await stream(
        asr_server.target,
        to_linear16_bytes(stereo),
        asr_pb2.LINEAR16,
        16000,
        audio_channel_count=2,
        enable_separate_recognition_per_channel=True,
        diarization=asr_pb2.DiarizationConfig(enable=True),
    )
    by_channel = {r.channel_tag for r in out.finals}
    assert by_channel == {1, 2}
    for r in out.finals:
        assert r.speaker == r.channel_tag - 1
        assert r.alternatives[0].words and all(
            w.speaker == r.channel_tag - 1 for w in r.alternatives[0].words
        )


def late_finals() -> float:
    return REGISTRY.get_sample_value("asr_live_diarization_late_total") or 0.0


async def test_a_final_whose_speakers_are_late_goes_out_without_them(asr_server: ServerThread) -> None:
    """The diarization thread is held busy: each final waits --live-diarization-wait-s (1 s) for its
    utterance's embedding, then goes out without speakers; the stream ends normally."""
    release = threading.Event()
    busy = live_diarization._EXECUTOR.submit(release.wait, 120)
    before = late_finals()
    try:
        out = await live_diarized(asr_server.target, one_speaker_call())
    finally:
        release.set()
        await asyncio.wrap_future(busy)
    words = [w for r in out.finals for w in r.alternatives[0].words]
    assert len(out.finals) >= 2 and words
    assert not any(w.HasField("speaker") for w in words)
    assert not any(r.HasField("speaker") for r in out.finals)
    assert late_finals() - before == len(out.finals)

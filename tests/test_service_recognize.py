"""Recognize (whole recordings) against the real server and the real tiny.en."""

from __future__ import annotations

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from clients.client import RecognizerClient
from clients.scoring import corpus_wer, normalize
from tests.support.audio import JFK_FLAC, make_conversation, stereo, to_linear16_bytes
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow


async def test_recognize_jfk_flac_44k_stereo(asr_server: ServerThread) -> None:
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(
            JFK_FLAC.read_bytes(), asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC)
        )
    text = normalize(" ".join(r.alternatives[0].transcript for r in response.results))
    assert "my fellow americans" in text
    assert "ask not what your country can do for you" in text
    assert abs(response.total_audio_duration.ToTimedelta().total_seconds() - 11.0) < 0.1
    starts = [r.start_offset.ToTimedelta().total_seconds() for r in response.results]
    assert starts == sorted(starts)
    assert all(r.channel_tag == 0 and r.language_code == "en" for r in response.results)
    assert all(0 < r.alternatives[0].confidence <= 1 for r in response.results)


async def test_recognize_cuts_long_audio_at_pauses_and_offsets_segments(asr_server: ServerThread) -> None:
    sentences = ["The parcel will arrive on Monday morning.", "Please call us back if it does not."]
    audio, bounds = make_conversation(sentences, pause_s=1.2)
    config = asr_pb2.RecognitionConfig(
        encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000, enable_segment_time_offsets=True
    )
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(to_linear16_bytes(audio), config)
    assert len(response.results) == len(sentences)
    for result, (start, end) in zip(response.results, bounds, strict=True):
        assert abs(result.start_offset.ToTimedelta().total_seconds() - start) < 0.3
        assert abs(result.end_offset.ToTimedelta().total_seconds() - end) < 0.3
        segments = result.alternatives[0].segments
        assert segments, "enable_segment_time_offsets asks for segments"
        # segment times are shifted to the recording's clock, inside (about) the utterance
        assert segments[0].start_offset.ToTimedelta().total_seconds() >= start - 0.5
        assert segments[-1].end_offset.ToTimedelta().total_seconds() <= end + 0.7


@pytest.mark.parametrize(
    ("config", "audio", "expected"),
    [
        (asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC), b"", "audio_content is empty"),
        (asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC), b"not a flac file", "audio_content"),
        (asr_pb2.RecognitionConfig(sample_rate_hertz=16000), b"\0\0" * 160, "encoding"),
        (
            asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=1000),
            b"\0\0",
            "sample_rate_hertz",
        ),
        (
            asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000, language_code="xx-YY"),
            b"\xff" * 800,
            "language_code",
        ),
    ],
    ids=["empty", "bad-flac", "no-encoding", "bad-rate", "bad-language"],
)
async def test_recognize_bad_input_is_invalid_argument_naming_the_field(
    asr_server: ServerThread, config: asr_pb2.RecognitionConfig, audio: bytes, expected: str
) -> None:
    async with RecognizerClient(asr_server.target) as client:
        with pytest.raises(aio.AioRpcError) as e:
            await client.recognize(audio, config)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in (e.value.details() or "")


async def test_recognize_stereo_wav_separate_channels(asr_server: ServerThread) -> None:
    import io

    import soundfile as sf

    agent, _ = make_conversation(
        ["Thank you for calling the billing department."], pause_s=0.8, voice="en-us"
    )
    customer, _ = make_conversation(
        ["My internet bill is too high this month."], pause_s=0.8, lead_s=0.9, voice="en-gb"
    )
    wav = io.BytesIO()
    sf.write(wav, stereo(agent, customer).T, 16000, format="WAV", subtype="PCM_16")
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.WAV, enable_separate_recognition_per_channel=True)
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(wav.getvalue(), config)
    by_channel = {r.channel_tag: r.alternatives[0].transcript for r in response.results}
    assert set(by_channel) == {1, 2}
    assert corpus_wer(["Thank you for calling the billing department."], [by_channel[1]]) <= 0.2, by_channel
    assert corpus_wer(["My internet bill is too high this month."], [by_channel[2]]) <= 0.2, by_channel

"""Recognize (whole recordings) against the real server and the real tiny.en."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import soundfile as sf
import soxr
from asr.v1 import asr_pb2
from grpc import aio
from prometheus_client import REGISTRY

from clients.client import RecognizerClient
from clients.scoring import corpus_wer, normalize
from engine import Engine
from service.config import ServerConfig, parse_args
from service.pipeline.audio import mixdown
from service.pipeline.recording import cut_utterances
from service.vocabulary.endpointing import EndpointSettings
from tests.support.audio import JFK_FLAC, make_conversation, stereo, to_linear16_bytes
from tests.support.calls import config_request, run_stream
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


# --- recordings of any length: a bounded window per call, a length limit read before decoding ---

# Twelve short sentences: many more utterances than the engine's recorded queue (--max-queue-recorded 4
# below) holds.
CALL = [
    "Good morning, thank you for calling.",
    "I need help with my bill.",
    "The payment did not go through.",
    "Can you check my account for me?",
    "I paid on Monday afternoon.",
    "The bank says the money left my account.",
    "Please send me a receipt by email.",
    "My email address is on file.",
    "Thank you for waiting.",
    "Is there anything else I can do?",
    "No, that is all for today.",
    "Have a nice evening.",
]


@pytest.mark.parametrize("inflight", [3, 8], ids=["window-below-queue", "window-above-queue"])
async def test_recording_with_more_utterances_than_the_engine_queue_is_answered_whole_in_order(
    service_engine: Engine, monkeypatch: pytest.MonkeyPatch, inflight: int
) -> None:
    """--max-queue-recorded 4 and a recording of 12 utterances: every utterance is answered, in order,
    with its true offsets; a window above the recorded share waits on its own oldest utterance instead of
    being refused. A live stream beside it is served either way (recorded work never counts against
    --max-queue, here 4 as well)."""
    monkeypatch.setattr(service_engine.config, "max_queue", 4)
    monkeypatch.setattr(service_engine.config, "max_queue_recorded", 4)
    audio, bounds = make_conversation(CALL, pause_s=0.8)
    live_audio, _ = make_conversation(["I would like to check the status of my order."], pause_s=0.8)
    server = ServerThread(ServerConfig(recognize_inflight=inflight), service_engine).start()
    try:
        config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
        async with RecognizerClient(server.target) as client, aio.insecure_channel(server.target) as channel:
            live_requests = [
                config_request(),
                asr_pb2.StreamingRecognizeRequest(audio_content=to_linear16_bytes(live_audio)),
            ]
            response, live = await asyncio.gather(
                client.recognize(to_linear16_bytes(audio), config), run_stream(channel, live_requests)
            )
    finally:
        server.stop()
    texts = [r.alternatives[0].transcript for r in response.results]
    assert len(texts) == len(CALL), texts
    assert corpus_wer(CALL, texts) <= 0.15, texts
    for result, (start, end) in zip(response.results, bounds, strict=True):
        assert abs(result.start_offset.ToTimedelta().total_seconds() - start) < 0.3
        assert abs(result.end_offset.ToTimedelta().total_seconds() - end) < 0.3
    assert live.code == grpc.StatusCode.OK, live
    assert corpus_wer(["I would like to check the status of my order."], [live.text]) <= 0.2


@pytest.fixture(scope="module")
def one_minute_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(max_recognize_seconds=60), service_engine).start()
    yield server
    server.stop()


def _silence_file(seconds: float, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(round(seconds * rate), dtype=np.int16), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("encoding", "rate", "data", "seconds"),
    [
        ("FLAC", 0, _silence_file(600, 16000, "FLAC"), 600),
        ("WAV", 0, _silence_file(61, 8000, "WAV"), 61),
        ("MULAW", 8000, b"\xff" * 8000 * 61, 61),
    ],
    ids=["flac-10min", "wav-61s", "mulaw-61s"],
)
async def test_recording_over_the_length_limit_is_refused_before_decoding(
    one_minute_server: ServerThread, encoding: str, rate: int, data: bytes, seconds: int
) -> None:
    audio_before = sum(
        REGISTRY.get_sample_value("asr_audio_seconds_total", {"channel_mode": m}) or 0.0
        for m in ("mono", "mixdown", "separate")
    )
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.AudioEncoding.Value(encoding), sample_rate_hertz=rate)
    async with RecognizerClient(one_minute_server.target) as client:
        with pytest.raises(aio.AioRpcError) as e:
            await client.recognize(data, config)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE, e.value
    details = e.value.details() or ""
    assert f"holds {seconds} s of audio" in details and "limit of 60 s (max_recognize_seconds)" in details
    audio_after = sum(
        REGISTRY.get_sample_value("asr_audio_seconds_total", {"channel_mode": m}) or 0.0
        for m in ("mono", "mixdown", "separate")
    )
    assert audio_after == audio_before, "nothing was decoded"


async def test_recognize_matches_whole_file_decoding_on_jfk(
    asr_server: ServerThread, service_engine: Engine
) -> None:
    """The block path (decode, resample, endpoint a block at a time) answers exactly what decoding the
    whole file at once and endpointing it in one go gives, utterance for utterance."""
    data = JFK_FLAC.read_bytes()
    pcm, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    whole = np.clip(soxr.resample(pcm, rate, 16000, quality="HQ").T, -1.0, 1.0).astype(np.float32)
    expected = []
    for u in cut_utterances(mixdown(whole), EndpointSettings()):
        t = await asyncio.wrap_future(service_engine.submit(u.audio).future)
        if t.is_speech and t.text.strip():
            expected.append((round(u.start_s, 3), round(u.end_s, 3), t.text.strip()))
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize(data, asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC))
    got = [
        (
            round(r.start_offset.ToTimedelta().total_seconds(), 3),
            round(r.end_offset.ToTimedelta().total_seconds(), 3),
            r.alternatives[0].transcript,
        )
        for r in response.results
    ]
    assert got == expected
    assert len(got) >= 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recognize-inflight", "0"], "--recognize-inflight must be at least 1"),
        (["--max-recognize-seconds", "0"], "--max-recognize-seconds must be positive"),
    ],
)
def test_recognize_flags_out_of_range_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in str(e.value)

"""Bad input, one case per test, each against a real loopback server while a well-formed stream runs beside
it on another connection, mid-utterance: the bad call gets a clear status whose message names the field and
the limit, and the good stream gets that utterance's final, word for word (and ends OK with every final
once, when the module is done)."""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import numpy as np
import pytest
import soundfile as sf
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from engine import Engine
from service.config import ServerConfig
from tests.support.audio import make_conversation, silence, to_linear16_bytes
from tests.support.calls import (
    GoodStreamThread,
    Outcome,
    Request,
    alongside_good_stream,
    audio_requests,
    config_request,
    good_stream_seconds,
    run_stream,
)
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

INVALID, OUT_OF_RANGE, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
SPEECH_CHUNK = 3200  # 100 ms of 16 kHz LINEAR16
MAX_BUFFER_S = 3.0
MAX_RECOGNIZE_BYTES = 200_000


def _audio(n: int) -> Request:
    return Request(audio_content=b"\0" * n)


def _with_endpointing(**seconds: float) -> Request:
    request = config_request()
    for name, value in seconds.items():
        getattr(request.streaming_config.endpointing, name).FromNanoseconds(round(value * 1e9))
    return request


@pytest.fixture(scope="module")
def good(asr_server: ServerThread) -> Iterator[GoodStreamThread]:
    stream = GoodStreamThread(asr_server.target)
    yield stream
    stream.close()


@pytest.fixture(scope="module")
def limits_server(service_engine: Engine) -> Iterator[ServerThread]:
    """Small stream and Recognize limits (a good stream of `alongside_good_stream` fits in them)."""
    config = ServerConfig(
        max_stream_seconds=math.ceil(good_stream_seconds()) + 1.0,
        max_buffer_seconds=MAX_BUFFER_S,
        max_recognize_bytes=MAX_RECOGNIZE_BYTES,
    )
    server = ServerThread(config, service_engine).start()
    yield server
    server.stop()


async def bad_stream(target: str, requests: list[Request]) -> Outcome:
    async with aio.insecure_channel(target) as channel:
        return await run_stream(channel, requests, deadline_s=60)


def assert_refused(outcome: Outcome, code: grpc.StatusCode, *needles: str) -> None:
    assert outcome.code == code, outcome
    for needle in needles:
        assert needle in outcome.details, (needle, outcome.details)


def assert_no_stream_left(server: ServerThread, besides: int = 0) -> None:
    """Only the good stream (if it is still open) is left on the server: the bad ones were let go."""
    deadline = time.monotonic() + 5
    while len(server.server.recognizer.sessions) > besides and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.server.recognizer.sessions) == besides


# --- StreamingRecognize: the request sequence and the config ---

STREAM_CASES = {
    "audio-before-config": (
        [_audio(320), config_request()],
        INVALID,
        ["first request must carry streaming_config"],
    ),
    "no-request-at-all": ([], INVALID, ["first request must carry streaming_config"]),
    "two-configs": (
        [config_request(), _audio(320), config_request()],
        INVALID,
        ["streaming_config may only be sent in the first request"],
    ),
    "encoding-unset": (
        [config_request(encoding=asr_pb2.ENCODING_UNSPECIFIED)],
        INVALID,
        ["encoding must be one of LINEAR16, MULAW, ALAW", "got none"],
    ),
    "encoding-unknown-number": (
        [config_request(encoding=99)],
        INVALID,
        ["encoding must be one of LINEAR16, MULAW, ALAW", "got unknown value 99"],
    ),
    "encoding-file-format-in-a-stream": (
        [config_request(encoding=asr_pb2.FLAC)],
        INVALID,
        ["encoding FLAC is accepted by Recognize only"],
    ),
    "sample-rate-too-high": (
        [config_request(sample_rate_hertz=96000)],
        INVALID,
        ["sample_rate_hertz must be between 8000 and 48000", "got 96000"],
    ),
    "sample-rate-too-low": (
        [config_request(sample_rate_hertz=4000)],
        INVALID,
        ["sample_rate_hertz must be between 8000 and 48000", "got 4000"],
    ),
    "sample-rate-unset": (
        [config_request(sample_rate_hertz=0)],
        INVALID,
        ["sample_rate_hertz must be between 8000 and 48000", "got 0"],
    ),
    "channels-too-many": (
        [config_request(audio_channel_count=9)],
        INVALID,
        ["audio_channel_count must be between 1 and 8", "got 9"],
    ),
    "channels-negative": (
        [config_request(audio_channel_count=-1)],
        INVALID,
        ["audio_channel_count must be between 1 and 8", "got -1"],
    ),
    "language-the-model-lacks": (
        [config_request(language_code="de-DE")],
        INVALID,
        ["language_code 'de-DE' is not supported by model", "only en"],
    ),
    "endpointing-out-of-range": (
        [_with_endpointing(max_utterance_duration=60)],
        INVALID,
        ["endpointing.max_utterance_duration must be between 1 s and 30 s", "got 60"],
    ),
    "linear16-odd-byte-count": (
        [config_request(), _audio(640), _audio(641)],
        INVALID,
        ["audio_content has 641 bytes, not a multiple of the 2-byte frame"],
    ),
    "stereo-partial-frame": (
        [config_request(audio_channel_count=2), _audio(6)],
        INVALID,
        ["audio_content has 6 bytes, not a multiple of the 4-byte frame"],
    ),
    "chunk-over-the-size-limit": (
        [config_request(), _audio((1 << 20) + 2)],
        INVALID,
        [f"audio_content of {(1 << 20) + 2} bytes is over the limit of {1 << 20} bytes", "max_chunk_bytes"],
    ),
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
async def test_bad_stream(asr_server: ServerThread, good: GoodStreamThread, case: str) -> None:
    requests, code, needles = STREAM_CASES[case]
    outcome = await good.beside(lambda: bad_stream(asr_server.target, requests))
    assert_refused(outcome, code, *needles)
    assert not outcome.finals
    assert_no_stream_left(asr_server, besides=1)


# --- StreamingRecognize: limits in time ---


async def test_stream_longer_than_the_maximum_duration(limits_server: ServerThread) -> None:
    limit = limits_server.config.max_stream_seconds
    # silence costs the engine nothing: only the duration counts
    data = to_linear16_bytes(silence(limit + 2.0))
    requests = [config_request(), *audio_requests(data, SPEECH_CHUNK)]
    outcome = await alongside_good_stream(
        limits_server.target, lambda: bad_stream(limits_server.target, requests)
    )
    assert_refused(outcome, OUT_OF_RANGE, f"limit of {limit:g} s of audio (max_stream_seconds)")
    assert_no_stream_left(limits_server)


async def test_audio_far_faster_than_real_time_beyond_the_buffer(limits_server: ServerThread) -> None:
    audio, _ = make_conversation(
        [
            "I would like to check the status of my order.",
            "It was shipped last week from the warehouse.",
            "Nobody has called me back about it since then.",
        ],
        pause_s=0.8,
    )
    requests = [config_request(), *audio_requests(to_linear16_bytes(audio), SPEECH_CHUNK)]
    outcome = await alongside_good_stream(
        limits_server.target, lambda: bad_stream(limits_server.target, requests)
    )
    assert_refused(outcome, EXHAUSTED, f"over the limit of {MAX_BUFFER_S:g} s (max_buffer_seconds)")
    assert_no_stream_left(limits_server)


# --- Recognize ---


def _flac(seconds: float) -> bytes:
    out = io.BytesIO()
    sf.write(out, silence(seconds), 16000, format="FLAC")
    return out.getvalue()


def _wav(seconds: float) -> bytes:
    out = io.BytesIO()
    sf.write(out, silence(seconds), 16000, format="WAV", subtype="PCM_16")
    return out.getvalue()


_rng = np.random.default_rng(7)
RECOGNIZE_CASES = {
    "empty-audio": (asr_pb2.FLAC, 0, b"", ["audio_content is empty"]),
    "undecodable-flac": (
        asr_pb2.FLAC,
        0,
        b"fLaC" + _rng.bytes(2000),
        ["audio_content is not a valid FLAC file"],
    ),
    "undecodable-wav": (
        asr_pb2.WAV,
        0,
        b"RIFF\x10\x00\x00\x00WAVEfmt " + _rng.bytes(2000),
        ["audio_content is not a valid WAV file"],
    ),
    "truncated-wav-header": (asr_pb2.WAV, 0, _wav(1.0)[:30], ["audio_content is not a valid WAV file"]),
    "flac-sent-as-wav": (
        asr_pb2.WAV,
        0,
        _flac(0.5),
        ["not a valid WAV file (it is FLAC); set encoding=FLAC"],
    ),
    "encoding-unset": (
        asr_pb2.ENCODING_UNSPECIFIED,
        16000,
        b"\0\0" * 1600,
        ["encoding must be one of", "got none"],
    ),
    "language-the-model-lacks": (
        asr_pb2.LINEAR16,
        16000,
        b"\0\0" * 1600,
        ["language_code 'fr' is not supported by model"],
    ),
    "sample-rate-out-of-range": (
        asr_pb2.MULAW,
        1000,
        b"\xff" * 800,
        ["sample_rate_hertz must be between 8000 and 48000", "got 1000"],
    ),
    "odd-byte-count": (asr_pb2.LINEAR16, 16000, b"\0" * 3201, ["audio_content has 3201 bytes"]),
}


def bad_recognize(
    target: str, config: asr_pb2.RecognitionConfig, data: bytes
) -> Callable[[], Awaitable[aio.AioRpcError]]:
    async def bad() -> aio.AioRpcError:
        async with aio.insecure_channel(target) as channel:
            stub = asr_pb2_grpc.RecognizerStub(channel)
            with pytest.raises(aio.AioRpcError) as e:
                await stub.Recognize(asr_pb2.RecognizeRequest(config=config, audio_content=data), timeout=30)
            return e.value

    return bad


@pytest.mark.parametrize("case", list(RECOGNIZE_CASES))
async def test_bad_recognize(asr_server: ServerThread, good: GoodStreamThread, case: str) -> None:
    encoding, rate, data, needles = RECOGNIZE_CASES[case]
    config = asr_pb2.RecognitionConfig(
        encoding=encoding,  # type: ignore[arg-type]
        sample_rate_hertz=rate,
        language_code="fr" if case == "language-the-model-lacks" else "",
    )
    error = await good.beside(bad_recognize(asr_server.target, config, data))
    assert error.code() == INVALID, error
    for needle in needles:
        assert needle in (error.details() or ""), (needle, error.details())


async def test_recognize_over_the_size_limit(limits_server: ServerThread) -> None:
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    data = b"\0" * (MAX_RECOGNIZE_BYTES + 2)
    error = await alongside_good_stream(
        limits_server.target, bad_recognize(limits_server.target, config, data)
    )
    assert error.code() == INVALID, error
    assert f"audio_content of {len(data)} bytes is over the limit of {MAX_RECOGNIZE_BYTES} bytes" in (
        error.details() or ""
    )
    assert "max_recognize_bytes" in (error.details() or "")


async def test_many_bad_streams_at_once_leave_the_good_one_alone(
    asr_server: ServerThread, good: GoodStreamThread
) -> None:
    """Every kind of bad stream above, all at the same moment, beside one good stream."""

    async def all_bad() -> list[Outcome]:
        return await asyncio.gather(
            *(bad_stream(asr_server.target, requests) for requests, _, _ in STREAM_CASES.values())
        )

    outcomes = await good.beside(all_bad)
    for (case, (_, code, needles)), outcome in zip(STREAM_CASES.items(), outcomes, strict=True):
        assert outcome.code == code, (case, outcome)
        assert all(n in outcome.details for n in needles), (case, outcome.details)
    assert_no_stream_left(asr_server, besides=1)

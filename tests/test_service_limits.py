"""Stream limits: each refusal is a clear status naming the limit, after the finals already earned."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from clients.client import RecognizerClient
from engine import Engine
from service.config import ServerConfig
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.server import ServerThread, sync_stream

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def limited_server(service_engine: Engine) -> Iterator[ServerThread]:
    """A second server on the same engine, with a short stream limit."""
    server = ServerThread(ServerConfig(max_stream_seconds=4.5), service_engine).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_buffer_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(max_buffer_seconds=3.0), service_engine).start()
    yield server
    server.stop()


async def test_stream_over_max_stream_seconds_ends_out_of_range_after_its_finals(
    limited_server: ServerThread,
) -> None:
    audio, bounds = make_conversation(
        ["Thank you for calling, how can I help you today?", "I would like to check my order."], pause_s=1.0
    )
    assert (
        bounds[0][1] + 0.6 < 4.5 < len(audio) / 16000
    )  # the first sentence ends (and is heard to end) in time
    received = []
    async with RecognizerClient(limited_server.target) as client:
        with pytest.raises(aio.AioRpcError) as e:
            async for response in client.stream_file(audio, rate=16000, chunk_ms=100):
                received.append(response)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "max_stream_seconds" in (e.value.details() or "") and "4.5 s" in (e.value.details() or "")
    texts = [r.alternatives[0].transcript for x in received for r in x.results if r.is_final]
    assert texts and "thank you for calling" in texts[0].lower()


async def test_audio_far_ahead_of_transcription_is_resource_exhausted(
    small_buffer_server: ServerThread,
) -> None:
    audio, _ = make_conversation(
        ["The first sentence is here.", "Then comes a second one.", "And finally a third."], pause_s=0.8
    )
    data = to_linear16_bytes(audio)
    requests = [
        asr_pb2.StreamingRecognizeRequest(
            streaming_config=asr_pb2.StreamingRecognitionConfig(
                config=asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
            )
        ),
        *(
            asr_pb2.StreamingRecognizeRequest(audio_content=data[i : i + 3200])
            for i in range(0, len(data), 3200)
        ),
    ]
    # as fast as the wire takes, so the server is still reading when it refuses
    _, code, details = await asyncio.to_thread(sync_stream, small_buffer_server.target, requests)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_buffer_seconds" in details and "3 s" in details


async def test_a_failing_stream_does_not_harm_another(limited_server: ServerThread) -> None:
    """One stream refused mid-way (odd byte count) while another, at the same time, runs to completion."""
    audio, _ = make_conversation(["I would like to check the status of my order."], pause_s=0.8)
    config = asr_pb2.StreamingRecognitionConfig(
        config=asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
    )
    async with RecognizerClient(limited_server.target) as client:

        async def good() -> list[str]:
            responses = client.stream_file(audio, rate=16000, realtime=True)
            return [r.alternatives[0].transcript async for x in responses for r in x.results if r.is_final]

        async def bad() -> grpc.StatusCode:
            await asyncio.sleep(0.5)  # while the good stream is in speech
            with pytest.raises(aio.AioRpcError) as e:
                async for _ in client.stream(config, [b"\0" * 640, b"\0" * 3]):
                    pass
            return e.value.code()

        finals, code = await asyncio.gather(good(), bad())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert finals and "status of my order" in finals[0].lower()


async def test_refusals_reach_the_python_client_as_the_servers_code_every_time(
    service_engine: Engine,
) -> None:
    """grpc.aio can report INTERNAL for a status racing a client write (grpc/grpc#36066): the server
    refuses only after reading the config, and RecognizerClient sends audio only once accepted."""
    server = ServerThread(ServerConfig(), service_engine).start()
    server.server.recognizer.draining = True  # as after SIGTERM
    codes = []
    try:
        async with RecognizerClient(server.target) as client:
            for _ in range(30):
                with pytest.raises(aio.AioRpcError) as e:
                    async for _ in client.stream_file(np.zeros(8000, np.float32), rate=16000):
                        pass
                codes.append((e.value.code(), e.value.details()))
    finally:
        server.stop()
    assert set(codes) == {(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")}

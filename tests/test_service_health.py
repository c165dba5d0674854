"""Health, reflection and the metrics the server exports (read from the process's own registry)."""

from __future__ import annotations

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client import REGISTRY

from clients.client import RecognizerClient
from engine import Engine
from service.config import ServerConfig
from service.runtime.interceptors import FLUSH_MESSAGES, CallMetrics
from tests.support.audio import JFK_FLAC
from tests.support.server import ServerThread, sync_stream

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

pytestmark = pytest.mark.slow


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_health_serving_for_the_service_and_the_server(asr_server: ServerThread) -> None:
    async with RecognizerClient(asr_server.target) as client:
        assert await client.health("asr.v1.Recognizer") == "SERVING"
        assert await client.health("") == "SERVING"
        with pytest.raises(aio.AioRpcError) as e:
            await client.health("no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_recognizer_and_health(asr_server: ServerThread) -> None:
    with grpc.insecure_channel(asr_server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"asr.v1.Recognizer", "grpc.health.v1.Health"} <= services
        methods = {m.name for m in db.FindFileContainingSymbol("asr.v1.Recognizer").service[0].method}
    assert methods == {"StreamingRecognize", "Recognize", "FollowCalls"}


async def test_grpc_server_metrics_count_calls_messages_and_codes(asr_server: ServerThread) -> None:
    labels = {"grpc_type": "unary", "grpc_service": "asr.v1.Recognizer", "grpc_method": "Recognize"}
    started = sample("grpc_server_started_total", **labels)
    ok = sample("grpc_server_handled_total", **labels, grpc_code="OK")
    bad = sample("grpc_server_handled_total", **labels, grpc_code="INVALID_ARGUMENT")
    handled_s = sample("grpc_server_handling_seconds_count", **labels)
    stream = {
        "grpc_type": "bidi_stream",
        "grpc_service": "asr.v1.Recognizer",
        "grpc_method": "StreamingRecognize",
    }
    stream_received = sample("grpc_server_msg_received_total", **stream)
    stream_sent = sample("grpc_server_msg_sent_total", **stream)
    streams_ok = sample("asr_streams_total", grpc_code="OK")
    finals = sample("asr_utterances_total", outcome="final")
    audio_s = sample("asr_audio_seconds_total", channel_mode="mixdown")

    async with RecognizerClient(asr_server.target) as client:
        await client.recognize(JFK_FLAC.read_bytes(), asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC))
        with pytest.raises(aio.AioRpcError):
            await client.recognize(b"", asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC))
        # 70 ms: the stream's length is no whole number of the audio counter's steps
        responses = [r async for r in client.stream_file(JFK_FLAC, chunk_ms=70)]

    assert sample("grpc_server_started_total", **labels) == started + 2
    assert sample("grpc_server_handled_total", **labels, grpc_code="OK") == ok + 1
    assert sample("grpc_server_handled_total", **labels, grpc_code="INVALID_ARGUMENT") == bad + 1
    assert sample("grpc_server_handling_seconds_count", **labels) == handled_s + 2
    chunks = -(-11_000 // 70)  # 11 s of audio in 70 ms chunks, plus the config
    assert sample("grpc_server_msg_received_total", **stream) - stream_received in (chunks + 1, chunks + 2)
    assert sample("grpc_server_msg_sent_total", **stream) - stream_sent == len(responses)
    assert sample("asr_streams_total", grpc_code="OK") == streams_ok + 1
    assert sample("asr_utterances_total", outcome="final") >= finals + 4 + 1
    assert sample("asr_active_streams") == 0
    # 11 s of the Recognize call, and 11 s of the stream: counted in steps while the stream runs, the rest
    # added when it ends
    assert sample("asr_audio_seconds_total", channel_mode="mixdown") - audio_s == pytest.approx(
        22.0, abs=0.01
    )


def test_message_counts_reach_prometheus_in_batches_and_at_the_end() -> None:
    """The interceptor adds a call's message counts every FLUSH_MESSAGES messages (so a long stream's
    counters move while it runs) and the rest when it ends, instead of one counter write per message."""
    labels = {"grpc_type": "bidi_stream", "grpc_service": "test.Batching", "grpc_method": "Count"}
    call = CallMetrics(*labels.values())
    for _ in range(FLUSH_MESSAGES - 1):
        call.count_received()
        call.count_sent()
    assert sample("grpc_server_msg_received_total", **labels) == 0
    call.count_received()
    assert sample("grpc_server_msg_received_total", **labels) == FLUSH_MESSAGES
    for _ in range(5):
        call.count_received()
    call.finish("OK")
    assert sample("grpc_server_msg_received_total", **labels) == FLUSH_MESSAGES + 5
    assert sample("grpc_server_msg_sent_total", **labels) == FLUSH_MESSAGES - 1
    assert sample("grpc_server_handled_total", **labels, grpc_code="OK") == 1


async def test_health_watch_streams_through_the_interceptor(asr_server: ServerThread) -> None:
    """Watch writes with context.write (not a generator): the interceptor must pass it through."""
    async with aio.insecure_channel(asr_server.target) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="asr.v1.Recognizer")
        )
        first = await call.read()
        call.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


def test_not_serving_until_the_engine_is_ready(service_engine: Engine) -> None:
    server = ServerThread(ServerConfig(), service_engine)
    server._thread.start()
    try:
        server.call(server.server.start())  # listening, engine not attached yet (as while a model loads)
        with grpc.insecure_channel(server.target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service="asr.v1.Recognizer")).status == NOT_SERVING
            assert check(health_pb2.HealthCheckRequest(service="")).status == NOT_SERVING
            assert REGISTRY.get_sample_value("asr_serving") == 0
            _, code, details = sync_stream(server.target, [])
            assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details
            server.call(server.server.load())
            assert check(health_pb2.HealthCheckRequest(service="asr.v1.Recognizer")).status == SERVING
            assert REGISTRY.get_sample_value("asr_serving") == 1
    finally:
        server.stop()

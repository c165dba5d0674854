"""Issue 26 #5: a streaming request past --max-chunk-bytes (plus room for the config) is refused on its
serialized length, before it is parsed, by every gRPC door in its own terms; the server goes on serving.
Through each door's official client (asr.v1 stubs, google-cloud-speech, riva.client), and once with bytes
that are not protobuf at all: refused by their size, not by a parse error."""

from __future__ import annotations

import grpc
import pytest
import riva.client
from asr.v1 import asr_pb2, asr_pb2_grpc
from google.api_core import exceptions as gexc

from service.runtime.message_limit import CONFIG_SLACK_BYTES
from tests.doors.test_riva import refusal, riva_asr, streaming_config
from tests.doors.test_riva import stream as riva_stream
from tests.support.calls import config_request
from tests.support.server import DOOR_TOKEN, ServerThread
from tests.test_door_google import mulaw_config
from tests.test_door_google import stream as google_stream

pytestmark = pytest.mark.slow
AUTH = (("authorization", f"Bearer {DOOR_TOKEN}"),)
TWO_MIB = 2 << 20


def limit_of(server: ServerThread) -> int:
    return server.config.max_chunk_bytes + CONFIG_SLACK_BYTES


def assert_refused_by_size(details: str, server: ServerThread) -> None:
    assert f"over the limit of {limit_of(server)} bytes (max_chunk_bytes" in details, details


def asr_v1_stream(target: str, requests: list[asr_pb2.StreamingRecognizeRequest]) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        stub = asr_pb2_grpc.RecognizerStub(channel)
        return refusal(lambda: list(stub.StreamingRecognize(iter(requests), metadata=AUTH, timeout=60)))


def test_asr_v1_refuses_a_request_past_the_bound_by_its_size(door_server: ServerThread) -> None:
    error = asr_v1_stream(
        door_server.target,
        [config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=bytes(TWO_MIB))],
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert_refused_by_size(error.details() or "", door_server)


def test_bytes_that_are_not_protobuf_are_refused_by_their_size_not_parsed(door_server: ServerThread) -> None:
    """Before, the server parsed them first: UNKNOWN DecodeError 'Wire format was corrupt'."""
    with grpc.insecure_channel(door_server.target) as channel:
        call = channel.stream_stream(
            "/asr.v1.Recognizer/StreamingRecognize",
            request_serializer=lambda raw: raw,
            response_deserializer=asr_pb2.StreamingRecognizeResponse.FromString,
        )
        error = refusal(lambda: list(call(iter([b"\xff" * TWO_MIB]), metadata=AUTH, timeout=60)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert_refused_by_size(error.details() or "", door_server)


def test_google_refuses_a_request_past_the_bound_by_its_size(door_server: ServerThread) -> None:
    call = google_stream(door_server.target, mulaw_config(), [bytes(800), bytes(TWO_MIB)])
    assert isinstance(call.error, gexc.InvalidArgument), call.error
    assert_refused_by_size(call.error.message, door_server)


def test_riva_refuses_a_request_past_the_bound_by_its_size_and_serves_the_next(
    door_server: ServerThread,
) -> None:
    config = streaming_config(encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000)
    with riva_asr(door_server.target) as asr:
        error = refusal(lambda: riva_stream(asr, [bytes(3200), bytes(TWO_MIB)], config))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert_refused_by_size(error.details(), door_server)
        assert riva_stream(asr, [bytes(3200)], config) is not None  # the server goes on

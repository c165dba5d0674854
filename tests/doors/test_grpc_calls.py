"""What the gRPC doors share (service/doors/shared/grpc_calls.py), through each door on one real server: a stream
that sends no first request is refused in time, in the door's own terms, and counted under that door."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from prometheus_client import REGISTRY

from service.doors.shared import grpc_calls
from tests.support.server import ServerThread
from tests.support.wait import wait_until

# (door label, the StreamingRecognize method each protocol's stubs call)
STREAMING_METHODS = {
    "asr.v1": "/asr.v1.Recognizer/StreamingRecognize",
    "riva": "/nvidia.riva.asr.RivaSpeechRecognition/StreamingRecognize",
    "google": "/google.cloud.speech.v1.Speech/StreamingRecognize",
}
SHORT_WAIT_S = 0.5


def refusals(door: str) -> float:
    labels = {"door": door, "kind": "stream", "code": "INVALID_ARGUMENT"}
    return REGISTRY.get_sample_value("asr_door_calls_total", labels) or 0.0


@pytest.mark.parametrize("door", list(STREAMING_METHODS))
async def test_a_stream_that_sends_nothing_is_refused_once_the_first_request_wait_is_over(
    asr_server: ServerThread, door: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_calls, "FIRST_REQUEST_TIMEOUT_S", SHORT_WAIT_S)  # in-process server
    before = refusals(door)

    async def nothing() -> AsyncIterator[bytes]:
        await asyncio.sleep(30)  # connected, silent: no config, no half-close
        yield b""

    async with aio.insecure_channel(asr_server.target) as channel:
        call = channel.stream_stream(
            STREAMING_METHODS[door], request_serializer=bytes, response_deserializer=bytes
        )(nothing(), timeout=20)
        with pytest.raises(aio.AioRpcError) as refused:
            async for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "streaming_config" in (refused.value.details() or "")
    assert f"{SHORT_WAIT_S:g} s" in (refused.value.details() or "")
    wait_until(lambda: refusals(door) == before + 1, 5, "the refusal counted under its door")

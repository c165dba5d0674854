"""A client that sends audio but never reads its responses (issue 19, scenario 14): the stream's queue of
responses is bounded (--max-response-backlog-bytes); past it the stream's work stops, what was queued is
dropped, and the client gets RESOURCE_EXHAUSTED with a message once it reads."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import grpc
import pytest
from asr.v1 import asr_pb2_grpc
from grpc import aio
from prometheus_client import REGISTRY

from engine import Engine
from service.config import ServerConfig
from service.pipeline.session import StreamSession
from service.pipeline.stream_state import StreamState
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import _write, audio_requests, config_request
from tests.support.server import ServerThread
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

LIMIT = 2048
SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
    "The technician will visit your home on Thursday afternoon.",
    "The payment will be taken on the first of next month.",
    "Great, thank you very much for your help.",
    "Good morning, thank you for calling.",
    "I need help with my bill.",
    "The payment did not go through.",
    "Can you check my account for me?",
    "I paid on Monday afternoon.",
    "Please send me a receipt by email.",
    "Have a nice evening.",
]
# A reader that never reads: the stream's HTTP/2 window stays at 1 KiB (no BDP probing to widen it), so
# what the server cannot send piles up in its own queue.
NEVER_READS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def backlog_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(max_response_backlog_bytes=LIMIT), service_engine).start()
    yield server
    server.stop()


def backlog_gauge() -> float:
    return REGISTRY.get_sample_value("asr_response_backlog_bytes") or 0.0


async def test_a_client_that_never_reads_is_ended_resource_exhausted_in_bounded_memory(
    backlog_server: ServerThread, service_engine: Engine
) -> None:
    audio, _ = make_conversation(SENTENCES, pause_s=0.8)
    config = config_request(enable_word_time_offsets=True, enable_word_confidence=True)
    sessions = backlog_server.server.recognizer.sessions
    before = backlog_gauge()
    async with aio.insecure_channel(backlog_server.target, options=NEVER_READS) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(timeout=180)

        async def send() -> None:
            for request in [config, *audio_requests(to_linear16_bytes(audio), 3200)]:
                if not await _write(call, request):
                    return

        sender = asyncio.create_task(send())  # its writes stall once the server stops reading
        deadline = time.monotonic() + 120
        session: StreamSession | None = None
        while session is None or session.state is not StreamState.CLOSED:
            assert time.monotonic() < deadline, "the stream was never ended for its backlog"
            assert not call.done(), "the call ended while its client was not reading"
            session = next(iter(sessions), None)
            await asyncio.sleep(0.05)
        # ended while the client still reads nothing: nothing is queued for it, nothing of it in the engine
        assert session.backlog_bytes == 0
        assert backlog_gauge() == before
        assert not any(ch.unsettled for ch in session.channels)
        responses = [r async for r in _read_all(call)]  # the client reads at last
        code, details = await call.code(), await call.details()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert f"over the limit of {LIMIT} bytes (max_response_backlog_bytes)" in details
    finals = [r for x in responses for r in x.results if r.is_final]
    assert len(finals) < len(SENTENCES)  # what fit in the window, not the whole call
    # its place is given back once the call is over (the server's handler may finish just after the
    # client has read the status)
    wait_until(lambda: not sessions, 10, "the stream's place given back")


async def _read_all(call: aio.StreamStreamCall) -> object:  # type: ignore[type-arg]
    with contextlib.suppress(aio.AioRpcError):
        async for response in call:
            yield response

"""Idle and vanished clients against real loopback servers and the real tiny.en: a stream that sends its
config and then nothing, or stops sending audio without half-closing, is ended by --idle-audio-timeout
(OUT_OF_RANGE, after the finals of what it sent); a client whose network dies without a FIN is found
by the server's keepalive pings (through a TCP proxy that stops forwarding); --max-concurrent-rpcs
refuses RESOURCE_EXHAUSTED; --max-connection-age never cuts a call in flight."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.scoring import corpus_wer
from engine import Engine
from service.config import ServerConfig
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import OpenStream, config_request, run_stream
from tests.support.server import HOST, ServerThread

pytestmark = pytest.mark.slow
SENTENCE = "Thank you for calling, how can I help you today?"
IDLE_S = 1.0
# a fresh TCP connection per channel (grpc otherwise shares one between channels to the same target)
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


async def wait_until(condition: object, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def idle_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(idle_audio_timeout=IDLE_S), service_engine).start()
    yield server
    server.stop()


async def test_config_then_no_audio_ends_out_of_range_after_the_idle_timeout(
    idle_server: ServerThread,
) -> None:
    async with aio.insecure_channel(idle_server.target) as channel:
        stream = OpenStream(channel)
        assert await stream.open()
        # never half-closed: only the server's timeout can end it
        outcome = await asyncio.wait_for(stream.finish(half_close=False), 30)
    assert outcome.code == grpc.StatusCode.OUT_OF_RANGE, outcome
    assert outcome.details.startswith("Audio Timeout Error"), outcome.details
    assert f"no audio for {IDLE_S:g} s (idle_audio_timeout)" in outcome.details, outcome.details
    assert not outcome.finals
    await wait_until(lambda: not idle_server.server.recognizer.sessions, 5, "the stream's session is gone")


async def test_audio_that_stops_without_half_close_gets_its_finals_then_out_of_range(
    idle_server: ServerThread,
) -> None:
    """The client sent a sentence (no silence after it: its end is not yet heard) and then went quiet:
    what it sent is transcribed before the status, as at a half-close."""
    audio, _ = make_conversation([SENTENCE], pause_s=0.0, lead_s=0.3)
    async with aio.insecure_channel(idle_server.target) as channel:
        stream = OpenStream(channel)
        assert await stream.open()
        assert await stream.send(to_linear16_bytes(audio))
        outcome = await asyncio.wait_for(stream.finish(half_close=False), 60)
    assert outcome.code == grpc.StatusCode.OUT_OF_RANGE, outcome
    assert "idle_audio_timeout" in outcome.details
    assert len(outcome.finals) == 1 and corpus_wer([SENTENCE], [outcome.text]) <= 0.2, outcome.text


async def test_audio_sent_in_time_is_not_idle(idle_server: ServerThread) -> None:
    """Chunks closer together than the timeout (here half of it, for three timeouts) keep the stream."""
    audio, _ = make_conversation([SENTENCE], pause_s=0.8, lead_s=0.3)
    data = to_linear16_bytes(audio)
    chunk = len(data) // 6 // 2 * 2

    async def requests() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
        yield config_request()
        for i in range(6):
            await asyncio.sleep(IDLE_S / 2)
            yield asr_pb2.StreamingRecognizeRequest(audio_content=data[i * chunk : (i + 1) * chunk])
        yield asr_pb2.StreamingRecognizeRequest(audio_content=data[6 * chunk :])

    async with aio.insecure_channel(idle_server.target) as channel:
        outcome = await run_stream(channel, requests())
    assert outcome.code == grpc.StatusCode.OK, outcome
    assert corpus_wer([SENTENCE], [outcome.text]) <= 0.2


async def test_audio_sent_ahead_of_real_time_is_not_idle_while_it_lasts(idle_server: ServerThread) -> None:
    """A client that sends 4 s of its call at once and the rest 2.5 s later has not gone quiet: its audio
    covers that time (a door pacing a fast client holds it just so). Idle counts from where the audio
    it sent ends in wall time, not from the last message."""
    audio, _ = make_conversation([SENTENCE], pause_s=0.8, lead_s=3.5)
    data = to_linear16_bytes(audio)
    head = 4 * 16000 * 2

    async def requests() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
        yield config_request()
        yield asr_pb2.StreamingRecognizeRequest(audio_content=data[:head])
        await asyncio.sleep(2.5 * IDLE_S)
        yield asr_pb2.StreamingRecognizeRequest(audio_content=data[head:])

    async with aio.insecure_channel(idle_server.target) as channel:
        outcome = await run_stream(channel, requests())
    assert outcome.code == grpc.StatusCode.OK, outcome
    assert corpus_wer([SENTENCE], [outcome.text]) <= 0.2


class StallingProxy:
    """A TCP proxy on loopback that can stop forwarding without closing anything: to both ends the
    network has died without a FIN (a cable pulled, a NAT that dropped the flow)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> StallingProxy:
        self._server = await asyncio.start_server(self._connect, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        self._writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._pumps.add(task)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()

    def stall(self) -> None:
        """Stop forwarding either way; every socket stays open."""
        for task in self._pumps:
            task.cancel()

    async def close(self) -> None:
        self.stall()
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()


@pytest.fixture()
def keepalive_server(service_engine: Engine) -> Iterator[ServerThread]:
    # the idle-audio timeout off: only keepalive may notice the vanished client
    config = ServerConfig(max_streams=1, keepalive_time=1.0, keepalive_timeout=1.0, idle_audio_timeout=0.0)
    server = ServerThread(config, service_engine).start()
    yield server
    server.stop()


async def test_a_client_whose_network_dies_without_fin_is_found_by_keepalive(
    keepalive_server: ServerThread,
) -> None:
    proxy = await StallingProxy(keepalive_server.server.port).start()
    try:
        async with aio.insecure_channel(f"{HOST}:{proxy.port}") as far:
            vanishing = OpenStream(far, deadline_s=None)
            assert await vanishing.open()  # holds the server's only place
            proxy.stall()
            # the server pings the silent connection, gets no answer, closes it, frees the place
            await wait_until(
                lambda: not keepalive_server.server.recognizer.sessions,
                20,
                "the vanished client's stream is freed",
            )
            async with aio.insecure_channel(keepalive_server.target) as near:
                outcome = await run_stream(
                    near, [config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=b"\0\0" * 1600)]
                )
            assert outcome.code == grpc.StatusCode.OK, outcome
            vanishing.call.cancel()
    finally:
        await proxy.close()


async def test_concurrent_rpcs_over_the_bound_are_refused_resource_exhausted(service_engine: Engine) -> None:
    server = ServerThread(ServerConfig(max_concurrent_rpcs=2), service_engine).start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            channels = [
                await stack.enter_async_context(aio.insecure_channel(server.target, options=OWN_CONNECTION))
                for _ in range(3)
            ]
            streams = [OpenStream(channels[0]), OpenStream(channels[1])]
            assert all([await s.open() for s in streams])
            with pytest.raises(aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channels[2]).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert (await streams[0].finish()).code == grpc.StatusCode.OK
            # one ended: room for another call
            await health_pb2_grpc.HealthStub(channels[2]).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert (await streams[1].finish()).code == grpc.StatusCode.OK
    finally:
        server.stop()


async def test_max_connection_age_never_cuts_a_call_in_flight(service_engine: Engine) -> None:
    """The connection's age (1 s here) passes while a stream is open: it goes on to its final and OK
    (the grace is --max-stream-seconds), and the client's next call goes over a new connection."""
    server = ServerThread(ServerConfig(max_connection_age=1.0), service_engine).start()
    audio, _ = make_conversation([SENTENCE], pause_s=0.8, lead_s=0.3)
    try:
        async with aio.insecure_channel(server.target) as channel:
            stream = OpenStream(channel)
            assert await stream.open()
            # the age is in effect: the server's GOAWAY moves the channel off READY, the stream goes on
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 20)
            assert await stream.send(to_linear16_bytes(audio))
            outcome = await stream.finish()
            assert outcome.code == grpc.StatusCode.OK, outcome
            assert corpus_wer([SENTENCE], [outcome.text]) <= 0.2
            again = await run_stream(channel, [config_request()])
            assert again.code == grpc.StatusCode.OK, again
    finally:
        server.stop()

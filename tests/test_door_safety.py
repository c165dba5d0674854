"""Issue 26: one caller cannot harm another, whatever it sends. The engine here is small (2 KV slots, a live
queue of 12) so that an attack that could fill the queue every stream shares does so at once; the attack
runs beside a well-behaved call, which must end OK with its words."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import websockets
from grpc import aio
from prometheus_client import REGISTRY

from clients.client import RecognizerClient
from engine import Engine, EngineConfig
from harness.raw_websocket import masked_text_frame, silent_websocket
from service.config import ServerConfig
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import AudioFormat, CallEvent, RecognitionSettings, Result, StreamSettings
from tests.support.audio import make_conversation, to_mulaw_8k_bytes
from tests.support.calls import OpenStream
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(model="tiny.en", threads=2, kv_slots=2, max_queue=12))
    engine.start()
    engine.warmup()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def speech_chunks() -> list[bytes]:
    """A spoken sentence as 8 kHz mu-law in 3200-byte pieces (0.4 s): each flush has speech to decode."""
    audio, _ = make_conversation(["Please read me the balance of my savings account."], pause_s=0.0)
    data = to_mulaw_8k_bytes(audio)
    return [data[i : i + 3200] for i in range(0, len(data) - 3200, 3200)]


def refusals(limit: str) -> float:
    """asr_limit_refusals_total for one bound (the servers here run in this process)."""
    return REGISTRY.get_sample_value("asr_limit_refusals_total", {"limit": limit}) or 0.0


async def _events(stream: Stream, into: list[CallEvent]) -> RecognitionError | None:
    try:
        async for event in stream.events():
            into.append(event)
    except RecognitionError as e:
        return e
    return None


async def test_a_flush_flood_cannot_fill_the_live_queue_every_stream_shares(
    small_engine: Engine, speech_chunks: list[bytes]
) -> None:
    """#1: each flush (Deepgram Finalize, Realtime commit) submitted a live final with no bound per
    stream: 50 flushes in a row filled the engine's queue (12, shared) and the next final of any other
    call was refused RESOURCE_EXHAUSTED. Now a stream's flushes past --max-finals-in-flight (4) wait
    (`hold`, Deepgram) or are refused to that stream alone (Realtime), and the other call is served."""
    recognizer = Recognizer(ServerConfig(), small_engine)
    held_before = refusals("max_finals_in_flight")
    manual = StreamSettings(RecognitionSettings(AudioFormat("MULAW", 8000)), endpointing=None)
    flood, good, refused = (recognizer.open_stream(manual, door="test") for _ in range(3))
    flood_events: list[CallEvent] = []
    good_events: list[CallEvent] = []
    readers = [
        asyncio.create_task(_events(flood, flood_events)),
        asyncio.create_task(_events(good, good_events)),
    ]
    try:
        for i in range(50):
            flood.audio(speech_chunks[i % len(speech_chunks)])
            flood.finalize(hold=True)
        for chunk in speech_chunks:
            good.audio(chunk)
        good.finalize()
        good.finish()
        refused.audio(speech_chunks[0])
        refused.finalize()
        refusal: RecognitionError | None = None
        try:  # past the bound, without hold: refused, and the audio stays in the utterance in progress
            for chunk in speech_chunks[1:6]:
                refused.audio(chunk)
                refused.finalize()
        except RecognitionError as e:
            refusal = e
        flood.finish()
        good_end, flood_end = await asyncio.wait_for(asyncio.gather(*readers), 120)
    finally:
        for stream in (flood, good, refused):
            await stream.close()
    assert good_end is None, f"the good call was harmed: {good_end}"
    good_text = " ".join(e.transcript for e in good_events if isinstance(e, Result) and e.is_final)
    assert "read me" in good_text.lower(), good_text
    assert flood_end is None and sum(isinstance(e, Result) and e.is_final for e in flood_events) >= 2
    assert refusal is not None and refusal.code is Code.RESOURCE_EXHAUSTED
    assert "--max-finals-in-flight" in refusal.message
    assert refusals("max_finals_in_flight") > held_before  # operators see the flood


@pytest.fixture(scope="module")
def one_place_server(small_engine: Engine) -> Iterator[ServerThread]:
    """One stream place; a client's writes bounded at 1 s. No WebSocket heartbeat (a client that reads a
    frame now and then answers pings and still stalls every send) and a long idle-audio timeout: this
    test is about the send bound alone (the reply backlog's bound is set past what the flood queues, and
    no text message rate ends the flood first)."""
    yield from one_place_server_with(small_engine, ws_send_timeout=1.0, max_response_backlog_bytes=1 << 30)


def one_place_server_with(engine: Engine, **bounds: float) -> Iterator[ServerThread]:
    """A server of one stream place for a Finalize flood from a client that reads nothing: no WebSocket
    heartbeat, no text message rate, a long idle-audio timeout, and the write `bounds` under test."""
    config = ServerConfig(
        max_streams=1, max_text_messages_per_s=0, keepalive_time=0, idle_audio_timeout=600, **bounds
    )
    server = ServerThread(config, engine, http=True).start()
    yield server
    server.stop()


async def finalize_flood(host: str, port: int, path: str) -> socket.socket:
    """A Deepgram socket that sends Finalize after Finalize (an empty final each) and reads none of the
    answers: ~16 MB of them, more than the socket buffers hold; until the server stops reading it."""
    silent = await silent_websocket(host, port, path)
    finalize = masked_text_frame(json.dumps({"type": "Finalize"}))
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):  # TimeoutError too: the server stopped reading this client
        for _ in range(40_000):
            await asyncio.wait_for(loop.sock_sendall(silent, finalize), 3)
    return silent


async def next_call_transcript(url: str, speech_chunks: list[bytes], deadline: float) -> str:
    """The finals of a good Deepgram call, made as soon as the server has a stream place for it again
    (429 until the silent client's place is given back); fails past `deadline` (monotonic)."""
    while True:
        assert time.monotonic() < deadline, "the silent client still holds the only stream place"
        transcript = ""
        try:
            async with websockets.connect(url) as ws:
                for chunk in speech_chunks:
                    await ws.send(chunk)
                await ws.send(json.dumps({"type": "CloseStream"}))
                async for message in ws:
                    body = json.loads(message)
                    if body.get("type") == "Results" and body["is_final"]:
                        transcript += body["channel"]["alternatives"][0]["transcript"]
            if transcript:
                return transcript
        except websockets.InvalidStatus as e:
            assert e.response.status_code == 429, e  # the place is still held: try again
            await asyncio.sleep(0.5)


async def test_a_client_that_never_reads_is_cut_off_and_its_place_given_back(
    one_place_server: ServerThread, speech_chunks: list[bytes]
) -> None:
    """#2: a Deepgram client that sends Finalize after Finalize and reads none of the answers (an empty
    final each) used to hold its stream place for ever: the server's send waited on it, under the lock
    its reader shares. Now the send gives up after --ws-send-timeout, the connection is aborted, and the
    next call gets the place and its final."""
    host, port = "127.0.0.1", one_place_server.server.http_port
    path = "/v1/listen?encoding=mulaw&sample_rate=8000&endpointing=false"
    cut_before = refusals("ws_send_timeout")
    silent = await finalize_flood(host, port, path)
    transcript = await next_call_transcript(f"ws://{host}:{port}{path}", speech_chunks, time.monotonic() + 60)
    assert "read me" in transcript.lower(), transcript
    assert refusals("ws_send_timeout") == cut_before + 1
    silent.close()


@pytest.fixture(scope="module")
def backlog_server(small_engine: Engine) -> Iterator[ServerThread]:
    """One stream place, a send bound far longer than the test waits, and a small reply backlog; no text
    message rate (the flood below is of answers, not of requests)."""
    yield from one_place_server_with(small_engine, ws_send_timeout=120.0, max_response_backlog_bytes=64 << 10)


async def test_replies_wait_in_the_writers_queue_and_past_the_backlog_the_client_is_cut_off_at_once(
    backlog_server: ServerThread, speech_chunks: list[bytes]
) -> None:
    """#2: the reader answered controls itself (an empty final per Finalize), awaiting a client that reads
    nothing under the lock the writer shares, so the connection was held until --ws-send-timeout (120 s
    here). Replies now go to the connection's writer queue; the reader never waits on the client, and once
    the queue holds more than --max-response-backlog-bytes the connection is aborted and the place given
    back at once."""
    host, port = "127.0.0.1", backlog_server.server.http_port
    path = "/v1/listen?encoding=mulaw&sample_rate=8000&endpointing=false"
    cut_before = refusals("max_response_backlog_bytes")
    started = time.monotonic()
    silent = await finalize_flood(host, port, path)
    transcript = await next_call_transcript(f"ws://{host}:{port}{path}", speech_chunks, started + 30)
    assert "read me" in transcript.lower(), transcript
    assert refusals("max_response_backlog_bytes") == cut_before + 1
    silent.close()


@pytest.fixture(scope="module")
def rate_server(small_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(max_text_messages_per_s=10), small_engine, http=True).start()
    yield server
    server.stop()


async def test_a_control_flood_ends_that_deepgram_stream_in_its_own_terms(rate_server: ServerThread) -> None:
    """#11: text messages had no rate limit: each is parsed on the loop every stream of the frontend shares.
    Past --max-text-messages-per-s (10 here, burst 20) Deepgram's stream ends 1008 naming the limit."""
    url = rate_server.http_url.replace("http://", "ws://") + "/v1/listen?encoding=mulaw&sample_rate=8000"
    errors: list[str] = []
    refused_before = refusals("max_text_messages_per_s")
    async with websockets.connect(url) as ws:

        async def read() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                async for message in ws:
                    body = json.loads(message)
                    if body.get("type") == "Error":
                        errors.append(body["description"])

        reader = asyncio.create_task(read())
        with contextlib.suppress(websockets.ConnectionClosed):
            for _ in range(40):  # twice the burst, about at once; no more once refused (nothing left unread)
                if errors:
                    break
                await ws.send(json.dumps({"type": "KeepAlive"}))
                await asyncio.sleep(0.002)
        await asyncio.wait_for(reader, 30)
    assert errors and "max_text_messages_per_s" in errors[0], errors
    assert ws.close_code == 1008, ws.close_code
    assert refusals("max_text_messages_per_s") > refused_before


async def test_an_event_flood_on_realtime_is_answered_rate_limit_exceeded(rate_server: ServerThread) -> None:
    """#11 on Realtime: past the rate each event gets an error rate_limit_exceeded and is dropped; the
    session goes on."""
    url = rate_server.http_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    async with websockets.connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for _ in range(60):
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        codes: list[str] = []
        with contextlib.suppress(TimeoutError):
            while len(codes) < 60:
                body = json.loads(await asyncio.wait_for(ws.recv(), 10))
                codes.append(body["error"]["code"] if body["type"] == "error" else body["type"])
    assert codes.count("rate_limit_exceeded") >= 30, codes
    assert codes[0] != "rate_limit_exceeded", codes  # the burst went through


@pytest.fixture(scope="module")
def paced_server(small_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(
        ServerConfig(max_audio_lead_seconds=1.0, idle_audio_timeout=1.0), small_engine
    ).start()
    yield server
    server.stop()


async def test_audio_sent_faster_than_real_time_is_paced_once_it_is_far_ahead(
    paced_server: ServerThread,
) -> None:
    """#7: noise passes the VAD's noise gate without being buffered, so nothing bounded how fast a stream
    could make the loop every stream shares score it. Now a door reads a stream's next chunk only while
    its audio is at most --max-audio-lead-seconds (1 s here) ahead of the wall clock: 6 s of noise sent
    as fast as the client can takes at least 5 s to be taken in. Pausing the client that way does not
    make it idle (--idle-audio-timeout is 1 s here too): its audio ends with its words."""
    rng = np.random.default_rng(26)
    noise = rng.normal(0, 0.05, 16000 * 6).astype(np.float32)
    speech, _ = make_conversation(["Please read me the balance of my savings account."], pause_s=0.0)
    audio = np.concatenate([noise, speech, np.zeros(16000, np.float32)])
    started = time.monotonic()
    texts: list[str] = []
    async with RecognizerClient(paced_server.target) as client:
        async for response in client.stream_file(audio, rate=16000, chunk_ms=100):
            texts += [r.alternatives[0].transcript for r in response.results if r.is_final]
    elapsed = time.monotonic() - started
    heard_s = len(audio) / 16000
    assert elapsed >= heard_s - 1.0 - 0.2, f"{heard_s:.1f} s of audio taken in {elapsed:.1f} s"
    assert "savings account" in " ".join(texts).lower(), texts


@pytest.fixture(scope="module")
def per_token_server(
    small_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("tenant-a-token\ntenant-b-token\n")
    config = ServerConfig(auth_tokens_file=str(tokens), max_streams_per_token=2)
    server = ServerThread(config, small_engine).start()
    yield server
    server.stop()


async def test_one_token_cannot_take_every_stream_place(per_token_server: ServerThread) -> None:
    """#8: one token could hold every --max-streams place (with KeepAlives, for ever). With
    --max-streams-per-token 2 its third stream is refused RESOURCE_EXHAUSTED naming the flag, while
    another tenant's token is admitted; a place the token gives back is its own again."""

    def auth(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),)

    async with aio.insecure_channel(per_token_server.target) as channel:
        held = [OpenStream(channel, metadata=auth("tenant-a-token")) for _ in range(2)]
        assert all([await s.open() for s in held])
        third = OpenStream(channel, metadata=auth("tenant-a-token"))
        assert not await third.open()
        refused = await third.finish()
        other = OpenStream(channel, metadata=auth("tenant-b-token"))
        assert await other.open()
        assert (await held.pop().finish()).code == grpc.StatusCode.OK
        again = OpenStream(channel, metadata=auth("tenant-a-token"))
        assert await again.open()
        for s in (*held, other, again):
            assert (await s.finish()).code == grpc.StatusCode.OK
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "limit of 2 concurrent streams (max_streams_per_token)" in refused.details, refused

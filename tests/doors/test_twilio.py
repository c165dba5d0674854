"""The Twilio Media Streams door and the call-transcript subscribers, end to end on a real server with real
tiny.en. No Twilio component runs offline: the client sends the messages of Twilio's Media Streams
documentation (connected, start, media per track with base64 mu-law and timestamps, stop), and its
X-Twilio-Signature is made by the `twilio` package's RequestValidator, which the server checks with.
Subscribers follow the call by its callSid on `/v1/calls/{call_id}/transcripts`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import soundfile as sf
import soxr
from asr.v1 import asr_pb2, asr_pb2_grpc
from twilio.request_validator import RequestValidator

from clients.scoring import corpus_wer, normalize
from service.doors.twilio import PATH, TrackMixer
from tests.support.audio import JFK_FLAC, JFK_TEXT, RATE, silence, speak, to_mulaw_8k_bytes
from tests.support.server import DOOR_TOKEN, TWILIO_AUTH_TOKEN, ServerProcess, ServerThread

pytestmark = pytest.mark.slow
CALL_DEADLINE_S = 120.0
AGENT = "Thank you for calling the billing department, how can I help?"
FRAME = 160  # 20 ms of 8 kHz mu-law, as Twilio sends it
Server = ServerThread | ServerProcess


@pytest.fixture(scope="module")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


def ws_url(server: Server, path: str) -> str:
    return server.http_url.replace("http://", "ws://") + path


def signed(server: Server, token: str = TWILIO_AUTH_TOKEN) -> dict[str, str]:
    """Twilio's signature over the URL it dialled (no query: Twilio takes none on a stream)."""
    return {"X-Twilio-Signature": RequestValidator(token).compute_signature(ws_url(server, PATH), {})}


def jfk_mulaw() -> bytes:
    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    return to_mulaw_8k_bytes(soxr.resample(audio.mean(axis=1), rate, RATE).astype(np.float32))


def start_message(call_sid: str, tracks: list[str], **parameters: str) -> dict[str, Any]:
    return {
        "event": "start",
        "sequenceNumber": "1",
        "start": {
            "accountSid": "AC" + "0" * 32,
            "streamSid": "MZ" + call_sid[2:],
            "callSid": call_sid,
            "tracks": tracks,
            "customParameters": parameters,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        },
        "streamSid": "MZ" + call_sid[2:],
    }


def media_messages(call_sid: str, tracks: dict[str, bytes]) -> Iterator[dict[str, Any]]:
    """Each track's audio in 20 ms media messages, in time order across tracks, as Twilio sends them."""
    sequence = itertools.count(2)
    longest = max(len(a) for a in tracks.values())
    for chunk, at in enumerate(range(0, longest, FRAME)):
        for track, audio in tracks.items():
            if at < len(audio):
                yield {
                    "event": "media",
                    "sequenceNumber": str(next(sequence)),
                    "media": {
                        "track": track,
                        "chunk": str(chunk + 1),
                        "timestamp": str(at * 1000 // 8000),
                        "payload": base64.b64encode(audio[at : at + FRAME]).decode(),
                    },
                    "streamSid": "MZ" + call_sid[2:],
                }


@dataclass
class Followed:
    messages: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def ended(self, call_id: str) -> None:
        while not any(m["type"] == "call_ended" and m["call_id"] == call_id for m in self.messages):
            self.arrived.clear()
            await self.arrived.wait()

    def finals(self, channel: str) -> str:
        return " ".join(
            m["text"]
            for m in self.messages
            if m["type"] == "transcript" and m["is_final"] and m["channel"] == channel
        )


@asynccontextmanager
async def follow(
    server: ServerThread, call_id: str | None
) -> AsyncIterator[tuple[Followed, asyncio.Task[None]]]:
    """A subscriber of one call (or every call), subscribed when this enters."""
    path = f"/v1/calls/{call_id}/transcripts" if call_id else "/v1/calls/transcripts"
    followed = Followed()
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(ws_url(server, path), headers={"Authorization": f"Bearer {DOOR_TOKEN}"}) as ws,
    ):

        async def read() -> None:
            async for msg in ws:
                followed.messages.append(json.loads(msg.data))
            followed.close_code = ws.close_code

        reader = asyncio.create_task(read())
        try:
            yield followed, reader
        finally:
            reader.cancel()


async def send_call(
    server: Server,
    call_sid: str,
    tracks: dict[str, bytes],
    *,
    stop: bool = True,
    headers: dict[str, str] | None = None,
    **parameters: str,
) -> int | None:
    """One Media Stream; the server's close code (None: the client hung up first)."""
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(ws_url(server, PATH), headers=headers or signed(server)) as ws:
            await ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
            await ws.send_json(start_message(call_sid, list(tracks), **parameters))
            for message in media_messages(call_sid, tracks):
                await ws.send_json(message)
            if stop:
                await ws.send_json({"event": "stop", "sequenceNumber": "9999", "stop": {"callSid": call_sid}})
                async for _ in ws:
                    pass
                return ws.close_code
            # the call hangs up: the socket closes without stop
        return None


async def test_two_leg_real_speech_call_reaches_its_subscribers_by_call_sid(server: ServerThread) -> None:
    """jfk (a real recording) on the inbound track and an agent's line before it on the outbound track, as
    Twilio's both_tracks stream sends them: subscribers of the callSid (subscribed before the call) and of
    every call get call_started with both legs, each leg's finals labelled by its track, in time order,
    then call_ended; the one-call subscriber's socket closes 1000."""
    call_sid = "CA" + "1" * 32
    agent = to_mulaw_8k_bytes(speak(AGENT))
    customer = (
        to_mulaw_8k_bytes(silence(len(agent) / 8000 + 0.5)) + jfk_mulaw() + to_mulaw_8k_bytes(silence(1.0))
    )
    async with asyncio.timeout(CALL_DEADLINE_S):
        async with follow(server, call_sid) as (one, one_reader), follow(server, None) as (every, _):
            code = await send_call(
                server, call_sid, {"inbound": customer, "outbound": agent}, queue="billing"
            )
            await one_reader
            await every.ended(call_sid)
    assert code == 1000
    assert one.close_code == 1000
    started = one.messages[0]
    assert started["type"] == "call_started" and started["platform"] == "twilio"
    assert started["channels"] == ["inbound", "outbound"]
    assert started["attributes"]["queue"] == "billing" and started["attributes"]["streamSid"].startswith("MZ")
    ended = one.messages[-1]
    assert (ended["type"], ended["call_id"], ended["status"]) == ("call_ended", call_sid, "OK")
    # the call's metrics come with its end, each leg by its label: who talked how long, the call's length
    metrics = ended["metrics"]
    assert [c["channel"] for c in metrics["channels"]] == ["inbound", "outbound"]
    talk = {c["channel"]: c["talk_s"] for c in metrics["channels"]}
    assert 6.0 < talk["inbound"] < 10.0 and 1.0 < talk["outbound"] < 5.0, metrics  # jfk: ~8 s of speech
    assert metrics["total_s"] == pytest.approx(len(customer) / 8000, abs=0.5)
    assert all(c["words_per_minute"] > 60 for c in metrics["channels"]), metrics
    assert corpus_wer([normalize(JFK_TEXT)], [normalize(one.finals("inbound"))]) < 0.2, one.finals("inbound")
    assert "thank you for calling" in normalize(one.finals("outbound")), one.finals("outbound")
    assert "country" not in normalize(one.finals("outbound"))
    for leg in ("inbound", "outbound"):
        finals = [
            m for m in one.messages if m["type"] == "transcript" and m["is_final"] and m["channel"] == leg
        ]
        assert all(a["end_s"] <= b["start_s"] + 0.01 for a, b in itertools.pairwise(finals))
    jfk_start = len(agent) / 8000 + 0.5
    first_inbound = next(m for m in one.messages if m["type"] == "transcript" and m["channel"] == "inbound")
    assert first_inbound["start_s"] >= jfk_start - 0.5  # the call's own time, the leg's silence counted
    mine = [m for m in every.messages if m["call_id"] == call_sid]
    assert mine == one.messages  # the every-call subscriber saw this call exactly as its own subscriber


async def test_a_hang_up_without_stop_still_transcribes_the_last_words(server: ServerThread) -> None:
    """The socket closes mid-call (Twilio's side went away) right after the last word: that final is still
    made and published, then call_ended."""
    call_sid = "CA" + "2" * 32
    async with asyncio.timeout(CALL_DEADLINE_S), follow(server, call_sid) as (one, reader):
        await send_call(server, call_sid, {"inbound": jfk_mulaw()}, stop=False)
        await reader
    assert one.messages[0]["channels"] == ["inbound"]
    assert "country" in normalize(one.finals("inbound")), one.messages
    assert one.messages[-1]["type"] == "call_ended"


async def test_signatures_are_checked_over_the_dialled_url(server: ServerThread) -> None:
    """No signature, one made with another auth token, or a bearer token alone: 403 before the upgrade,
    naming X-Twilio-Signature (a server with a Twilio auth token takes only Twilio)."""
    async with aiohttp.ClientSession() as session:
        for headers in (
            {},
            signed(server, token="another-account-token"),
            {"Authorization": f"Bearer {DOOR_TOKEN}"},
        ):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(ws_url(server, PATH), headers=headers)
            assert refused.value.status == 403, headers
            async with session.get(server.http_url + PATH, headers=headers) as response:
                assert response.status == 403
                assert "X-Twilio-Signature" in (await response.json())["error"]["message"]


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        (
            [{"event": "media", "media": {"track": "inbound", "timestamp": "0", "payload": "AAAA"}}],
            "media: before start",
        ),
        ([{"event": "start", "start": {"tracks": ["inbound"]}}], "start.callSid"),
        ([{"event": "start", "start": {"callSid": "CA9", "tracks": ["speaker"]}}], "start.tracks"),
        (
            [
                start_message("CA" + "3" * 32, ["inbound"]),
                {"event": "media", "media": {"track": "inbound", "timestamp": "0", "payload": "not base64!"}},
            ],
            "media.payload",
        ),
        (["{not json"], "not JSON"),
    ],
)
async def test_bad_messages_close_1008_naming_the_field(
    server: ServerThread, messages: list[Any], named: str
) -> None:
    """Twilio's messages out of order or malformed: the close (1008) names the field; nothing else is sent."""
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(ws_url(server, PATH), headers=signed(server)) as ws,
    ):
        for message in messages:
            await (ws.send_str(message) if isinstance(message, str) else ws.send_json(message))
        closing = await asyncio.wait_for(ws.receive(), 30)
        assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1008
        assert named in closing.extra, closing.extra


def test_tracks_are_laid_side_by_side_by_their_timestamps() -> None:
    mixer = TrackMixer(("inbound", "outbound"))
    assert mixer.push("inbound", 0, b"\x01" * 160) == b""  # waits for the other leg
    out = mixer.push("outbound", 0, b"\x02" * 160)
    assert out == b"\x01\x02" * 160
    # a lost outbound packet (20-40 ms) is silence once the next arrives
    mixer.push("inbound", 20, b"\x03" * 160)
    mixer.push("inbound", 40, b"\x04" * 160)
    out = mixer.push("outbound", 40, b"\x05" * 160)
    assert out == b"\x03\xff" * 160 + b"\x04\x05" * 160
    # one leg silent for good: the other goes on, MAX_TRACK_SKEW_S behind at most
    out = b"".join(mixer.push("inbound", 60 + 20 * i, b"\x06" * 160) for i in range(100))
    assert len(out) // 2 == 100 * 160 - 8000
    assert set(out[1::2]) == {0xFF}
    assert len(mixer.flush()) // 2 == 8000


async def test_subscribers_on_every_frontend_get_the_call(two_frontend_process: ServerProcess) -> None:
    """asr-server with two frontend processes sharing the HTTP port: the call's socket lands on one, its
    subscribers on either (SO_REUSEPORT); each gets the whole call through the supervisor's forwarder.
    The auth token comes from the environment (TWILIO_AUTH_TOKEN), as a Kubernetes Secret gives it."""
    server = two_frontend_process
    call_sid = "CA" + "4" * 32
    async with asyncio.timeout(CALL_DEADLINE_S), contextlib.AsyncExitStack() as subscribers:
        followers = [await subscribers.enter_async_context(follow(server, call_sid)) for _ in range(6)]
        code = await send_call(server, call_sid, {"inbound": to_mulaw_8k_bytes(speak(AGENT))})
        for _, reader in followers:
            await reader
    assert code == 1000
    for followed, _ in followers:
        assert followed.messages[0]["type"] == "call_started"
        assert followed.messages[-1]["type"] == "call_ended", followed.messages
        assert "thank you for calling" in normalize(followed.finals("inbound")), followed.messages


async def test_a_grpc_follower_gets_the_call_as_asr_v1_events(server: ServerThread) -> None:
    """asr.v1 FollowCalls for the callSid, subscribed (its headers came) before the call: started (platform, legs), the finals of
    each leg labelled, then ended, and the stream ends OK."""
    call_sid = "CA" + "5" * 32
    metadata = (("authorization", f"Bearer {DOOR_TOKEN}"),)
    async with grpc.aio.insecure_channel(server.target) as channel:
        follower = asr_pb2_grpc.RecognizerStub(channel).FollowCalls(
            asr_pb2.FollowCallsRequest(call_id=call_sid), metadata=metadata, timeout=CALL_DEADLINE_S
        )
        await follower.initial_metadata()  # sent once the server has subscribed
        code = await send_call(server, call_sid, {"inbound": to_mulaw_8k_bytes(speak(AGENT))})
        events = [e async for e in follower]
        assert await follower.code() == grpc.StatusCode.OK
    assert code == 1000
    assert events[0].started.platform == "twilio" and list(events[0].started.channels) == ["inbound"]
    finals = [e.transcript for e in events if e.HasField("transcript") and e.transcript.is_final]
    assert finals and all(f.channel == "inbound" for f in finals)
    assert "thank you for calling" in normalize(" ".join(f.text for f in finals))
    assert finals[0].end_offset.ToNanoseconds() > finals[0].start_offset.ToNanoseconds() > 0
    assert events[-1].ended.status == "OK" and all(e.call_id == call_sid for e in events)
    (leg,) = events[-1].ended.metrics.channels  # tag 0: the one leg, CallStarted.channels[0]
    assert leg.talk_time.ToNanoseconds() > 1e9 and leg.words_per_minute > 60
    assert events[-1].ended.metrics.total_time.ToNanoseconds() >= leg.talk_time.ToNanoseconds()

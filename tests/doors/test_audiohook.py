"""The Genesys AudioHook door, end to end on a real server with real tiny.en. Genesys' own reference client
and compliance suite (purecloudlabs/audiohook-reference-implementation) cannot be committed: they were run
against this door by hand (docs/operations.md records the result). Here a client written from the
protocol: Genesys' headers, an HTTP message signature made with `http-message-signatures` (RFC 9421,
HMAC-SHA256 over the components Genesys signs), the open/opened, ping/pong, paused/resumed,
close/closed exchange with its sequence numbers, and stereo PCMU as Genesys sends it."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest
import requests
import soundfile as sf
import soxr
from http_message_signatures import HTTPMessageSigner, HTTPSignatureKeyResolver, algorithms

from clients.scoring import corpus_wer, normalize
from service.doors.audiohook import PATH, SIGNED_COMPONENTS, parse_duration
from tests.doors.test_twilio import follow
from tests.support.audio import JFK_FLAC, JFK_TEXT, RATE, silence, speak, to_mulaw_8k_bytes
from tests.support.server import AUDIOHOOK_API_KEY, AUDIOHOOK_CLIENT_SECRET, ServerThread

pytestmark = pytest.mark.slow
AGENT = "Thank you for calling, how can I help you today?"
FRAME_S = 0.1


@pytest.fixture(scope="module")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


class _Secret(HTTPSignatureKeyResolver):
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def resolve_private_key(self, key_id: str) -> bytes:
        return self.secret

    def resolve_public_key(self, key_id: str) -> bytes:
        return self.secret


def genesys_headers(
    url: str,
    session_id: str,
    *,
    api_key: str = AUDIOHOOK_API_KEY,
    secret: str = AUDIOHOOK_CLIENT_SECRET,
    created: datetime.datetime | None = None,
) -> dict[str, str]:
    """The upgrade's headers as Genesys sends them, signed with the integration's client secret."""
    headers = {
        "Audiohook-Organization-Id": str(uuid.UUID(int=7)),
        "Audiohook-Session-Id": session_id,
        "Audiohook-Correlation-Id": str(uuid.uuid4()),
        "X-API-KEY": api_key,
    }
    request = requests.Request("GET", url.replace("ws://", "http://"), headers=headers).prepare()
    created = created or datetime.datetime.now(datetime.UTC)
    HTTPMessageSigner(
        signature_algorithm=algorithms.HMAC_SHA256, key_resolver=_Secret(base64.b64decode(secret))
    ).sign(
        request,
        key_id=api_key,
        label="sig1",
        nonce=base64.b64encode(uuid.uuid4().bytes).decode(),
        created=created,
        expires=created + datetime.timedelta(seconds=30),
        covered_component_ids=SIGNED_COMPONENTS,
    )
    return {k: v for k, v in request.headers.items() if v is not None}


@dataclass
class Session:
    """A client of the protocol: its sequence numbers, the server's messages as they come."""

    ws: aiohttp.ClientWebSocketResponse
    session_id: str
    seq: int = 0
    serverseq: int = 0
    position_s: float = 0.0
    received: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, kind: str, parameters: dict[str, Any]) -> None:
        self.seq += 1
        message = {
            "version": "2",
            "id": self.session_id,
            "type": kind,
            "seq": self.seq,
            "serverseq": self.serverseq,
            "position": f"PT{self.position_s:.2f}S",
            "parameters": parameters,
        }
        await self.ws.send_str(json.dumps(message))

    async def next(self, kind: str) -> dict[str, Any]:
        """The server's messages up to the first of `kind` (events on the way are kept)."""
        async with asyncio.timeout(60):
            while True:
                msg = await self.ws.receive()
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                message = json.loads(msg.data)
                self.received.append(message)
                assert message["seq"] == self.serverseq + 1, message  # the server's seq counts up by one
                self.serverseq = message["seq"]
                if message["type"] == kind:
                    return message

    async def audio(self, stereo_pcmu: bytes) -> None:
        step = round(FRAME_S * 8000) * 2
        for i in range(0, len(stereo_pcmu), step):
            await self.ws.send_bytes(stereo_pcmu[i : i + step])
            self.position_s += len(stereo_pcmu[i : i + step]) / 2 / 8000
            await asyncio.sleep(0)

    def transcripts(self) -> list[dict[str, Any]]:
        return [
            e["data"]
            for m in self.received
            if m["type"] == "event"
            for e in m["parameters"]["entities"]
            if e["type"] == "transcript"
        ]


def interleave(a: bytes, b: bytes) -> bytes:
    n = max(len(a), len(b))
    left = np.frombuffer(a.ljust(n, b"\xff"), dtype=np.uint8)
    right = np.frombuffer(b.ljust(n, b"\xff"), dtype=np.uint8)
    return np.stack([left, right], axis=1).tobytes()


def jfk_pcmu() -> bytes:
    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    return to_mulaw_8k_bytes(soxr.resample(audio.mean(axis=1), rate, RATE).astype(np.float32))


def open_parameters(conversation_id: str, media: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "organizationId": str(uuid.UUID(int=7)),
        "conversationId": conversation_id,
        "participant": {
            "id": str(uuid.uuid4()),
            "ani": "+15551230000",
            "aniName": "",
            "dnis": "+15559870000",
        },
        "media": media
        or [
            {"type": "audio", "format": "PCMU", "channels": ["external", "internal"], "rate": 8000},
            {"type": "audio", "format": "PCMU", "channels": ["external"], "rate": 8000},
        ],
        "language": "en-US",
        "supportedLanguages": True,
        "customConfig": {},
    }


async def test_a_stereo_call_with_a_pause_gets_every_final_before_closed(server: ServerThread) -> None:
    """The agent speaks on `internal`, then the customer (jfk, a real recording) on `external`, with a
    pause of 2 s between (audio discarded by Genesys): opened picks the offered stereo media and lists the
    languages; ping gets pong with the sequence numbers; every final comes as a transcript event before
    `closed`, each channel's words where they were said in Genesys' positions (the pause included); the
    call's subscribers get the same finals by conversationId."""
    url = server.http_url.replace("http://", "ws://") + PATH
    session_id, conversation = str(uuid.uuid4()), str(uuid.uuid4())
    agent = to_mulaw_8k_bytes(speak(AGENT)) + to_mulaw_8k_bytes(silence(0.8))
    customer = jfk_pcmu() + to_mulaw_8k_bytes(silence(1.0))
    async with (
        asyncio.timeout(120),
        follow(server, conversation) as (followed, follower),
        aiohttp.ClientSession() as http,
        http.ws_connect(url, headers=genesys_headers(url, session_id)) as ws,
    ):
        client = Session(ws, session_id)
        await client.send("open", open_parameters(conversation))
        opened = await client.next("opened")
        assert opened["parameters"]["media"] == [open_parameters(conversation)["media"][0]]
        assert opened["parameters"]["supportedLanguages"] == ["en-US"]
        assert opened["clientseq"] == 1 and opened["id"] == session_id
        await client.send("ping", {})
        pong = await client.next("pong")
        assert pong["clientseq"] == 2
        await client.audio(interleave(b"\xff" * len(agent), agent))  # the agent, on internal
        await client.send("paused", {})
        paused_at = client.position_s
        client.position_s += 2.0
        await client.send("resumed", {"start": f"PT{client.position_s:.2f}S", "discarded": "PT2.0S"})
        await client.audio(interleave(customer, b"\xff" * len(customer)))  # the customer, on external
        await client.send("close", {"reason": "end"})
        closed = await client.next("closed")
        assert closed["parameters"] == {}
        await follower
    transcripts = client.transcripts()
    assert transcripts and all(t["isFinal"] for t in transcripts)
    by_channel = {
        c: " ".join(
            t["alternatives"][0]["interpretations"][0]["transcript"]
            for t in transcripts
            if t["channelId"] == c
        )
        for c in (0, 1)
    }
    assert corpus_wer([normalize(JFK_TEXT)], [normalize(by_channel[0])]) < 0.2, by_channel
    assert "thank you for calling" in normalize(by_channel[1]), by_channel
    for t in transcripts:
        offset = parse_duration(t["offset"], "offset")
        if t["channelId"] == 0:  # jfk comes after the agent and the 2 s Genesys discarded
            assert offset >= paused_at + 2.0 - 0.3, (t, paused_at)
        tokens = t["alternatives"][0]["interpretations"][0]["tokens"]
        assert tokens and all(parse_duration(w["offset"], "offset") >= offset - 0.3 for w in tokens)
        assert 0.0 <= t["alternatives"][0]["confidence"] <= 1.0
    assert followed.messages[0]["channels"] == ["customer", "agent"]
    published = [m["text"] for m in followed.messages if m["type"] == "transcript" and m["is_final"]]
    assert sorted(published) == sorted(
        t["alternatives"][0]["interpretations"][0]["transcript"] for t in transcripts
    )


async def test_credentials_and_signatures_are_checked_before_the_upgrade(server: ServerThread) -> None:
    """A wrong API key, a signature made with another secret, one created ten minutes ago, or none: 401."""
    url = server.http_url.replace("http://", "ws://") + PATH
    session_id = str(uuid.uuid4())
    stale = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=10)
    unsigned = {
        k: v
        for k, v in genesys_headers(url, session_id).items()
        if k.lower() not in ("signature", "signature-input")
    }
    async with aiohttp.ClientSession() as http:
        for headers in (
            genesys_headers(url, session_id, api_key="another-key"),
            genesys_headers(url, session_id, secret=base64.b64encode(b"another secret").decode()),
            genesys_headers(url, session_id, created=stale),
            unsigned,
        ):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(url, headers=headers)
            assert refused.value.status == 401, headers


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"media": [{"type": "audio", "format": "opus", "channels": ["external"], "rate": 48000}]},
            "open.parameters.media",
        ),
        ({"customConfig": {"endpointing_ms": "short"}}, "customConfig.endpointing_ms"),
    ],
)
async def test_an_open_it_cannot_take_gets_disconnect_naming_the_field_then_closed(
    server: ServerThread, change: dict[str, Any], named: str
) -> None:
    url = server.http_url.replace("http://", "ws://") + PATH
    session_id = str(uuid.uuid4())
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(url, headers=genesys_headers(url, session_id)) as ws,
    ):
        client = Session(ws, session_id)
        await client.send("open", open_parameters(str(uuid.uuid4())) | change)
        disconnect = await client.next("disconnect")
        assert disconnect["parameters"]["reason"] == "error"
        assert named in disconnect["parameters"]["info"]
        await client.send("close", {"reason": "error"})
        await client.next("closed")

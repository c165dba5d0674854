"""Asterisk's media doors with a real Asterisk 22 (tests/support/asterisk.py: a Debian-unstable chroot):
a real SIP call (PJSUA2, tests/support/sip_phone.py) into Asterisk's PJSIP, whose caller says jfk's speech
(a real recording, 8 kHz, sent as mu-law RTP), reaches the server over AudioSocket (TCP) and over
chan_websocket (`Dial(WebSocket/...)`, mu-law), each through Asterisk's own dialplan applications.
Subscribers follow the call by the id the dialplan gives it; the caller's BYE finalises it."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import soundfile as sf

from clients.scoring import corpus_wer, normalize
from engine import Engine
from service.config import ServerConfig
from service.doors.asterisk.websocket import audio_format, parse_media_start
from service.vocabulary.types import AudioFormat
from tests.doors.test_twilio import follow
from tests.support.asterisk import Asterisk
from tests.support.audio import JFK_FLAC, JFK_TEXT
from tests.support.server import DOOR_TOKEN, HOST, ServerThread, free_port

pytestmark = pytest.mark.slow
CALL_DEADLINE_S = 120.0
ARI_APP = "asr-test"


@pytest.fixture(scope="module")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


@pytest.fixture(scope="module")
def asterisk(server: ServerThread) -> Iterator[Asterisk]:
    dialplan = f"""
[from-phone]
exten => to-audiosocket,1,Answer()
 same => n,AudioSocket(${{CALL_UUID}},{HOST}:{server.config.audiosocket_port})
 same => n,Hangup()

exten => to-websocket,1,Answer()
 same => n,Dial(WebSocket/asr/c(ulaw)v(call_id=${{CALL_UUID}}))
 same => n,Hangup()

exten => to-ari,1,Answer()
 same => n,Stasis({ARI_APP})
 same => n,Hangup()
"""
    connection = f"""type = websocket_client
uri = ws://{HOST}:{server.server.http_port}/v1/telephony/asterisk
protocols = media
username = asterisk
password = {DOOR_TOKEN}
connection_type = per_call_config
connection_timeout = 2000
reconnect_interval = 500
reconnect_attempts = 3
tls_enabled = no
"""
    # the dialplan's connection, and one for ARI's External Media channels (which pass no v() options)
    clients = f"[asr]\n{connection}\n[asr-ari]\n{connection}"
    pbx = Asterisk(dialplan, clients, sip_port=free_port(), ari_port=free_port()).start()
    yield pbx
    pbx.stop()


@pytest.fixture(scope="module")
def jfk_8k_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the phone says: jfk.flac as an 8 kHz 16-bit WAV (a narrowband call's audio)."""
    import soxr

    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    path = tmp_path_factory.mktemp("phone") / "jfk-8k.wav"
    sf.write(path, soxr.resample(audio.mean(axis=1), rate, 8000), 8000, subtype="PCM_16")
    return path


async def sip_call(pbx: Asterisk, extension: str, wav: Path) -> None:
    """A SIP call from the PJSUA2 phone to `extension` on `pbx`, saying `wav`, then BYE."""
    uri = pbx.sip_uri(extension)
    phone = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.sip_phone", uri, str(wav), stderr=asyncio.subprocess.PIPE
    )
    _, errors = await phone.communicate()
    assert phone.returncode == 0, errors.decode(errors="replace")[-2000:] + pbx.log()[-3000:]


@pytest.mark.parametrize("route", ["to-audiosocket", "to-websocket"])
async def test_a_sip_call_through_asterisk_is_transcribed_for_its_subscribers(
    server: ServerThread, asterisk: Asterisk, jfk_8k_wav: Path, route: str
) -> None:
    call_id = str(uuid.uuid4())
    asterisk.set_global("CALL_UUID", call_id)
    async with asyncio.timeout(CALL_DEADLINE_S), follow(server, call_id) as (followed, reader):
        await sip_call(asterisk, route, jfk_8k_wav)
        await reader
    started, ended = followed.messages[0], followed.messages[-1]
    assert started["type"] == "call_started" and started["platform"] == "asterisk", followed.messages
    assert started["channels"] == ["caller"]
    assert (ended["type"], ended["call_id"], ended["status"]) == ("call_ended", call_id, "OK"), (
        asterisk.log()[-3000:]
    )
    (caller,) = ended["metrics"]["channels"]
    assert caller["channel"] == "caller" and 6.0 < caller["talk_s"] < 10.0, ended[
        "metrics"
    ]  # jfk: ~8 s of speech
    text = followed.finals("caller")
    assert corpus_wer([normalize(JFK_TEXT)], [normalize(text)]) < 0.2, text
    assert "country" in normalize(text)  # the last word, before the caller hung up


class Ari:
    """The few ARI requests a Stasis application needs here, written from Asterisk's ARI REST reference
    (no ARI client for Python is kept up; Asterisk, the real component, answers them)."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session, self.base = session, f"http://127.0.0.1:{port}/ari"

    async def __call__(self, method: str, path: str, **params: str) -> dict[str, object]:
        async with self.session.request(method, self.base + path, params=params) as response:
            assert response.status < 300, f"{method} {path}: {response.status} {await response.text()}"
            return await response.json() if response.content_type == "application/json" else {}


async def external_media_application(ari: Ari, events: aiohttp.ClientWebSocketResponse, call_id: str) -> None:
    """An integrator's Stasis application: the caller's channel into a mixing bridge with an External Media
    channel over chan_websocket (`transport=websocket`, websocket_client.conf's `asr-ari`), whose channel id
    is the call id subscribers follow; when the caller hangs up, the External Media channel is hung up."""
    caller = bridge = ""
    async for message in events:
        event = json.loads(message.data)
        channel = str(event.get("channel", {}).get("id", ""))
        if event["type"] == "StasisStart" and channel != call_id:
            caller = channel
            bridge = str((await ari("POST", "/bridges", type="mixing"))["id"])
            await ari("POST", f"/bridges/{bridge}/addChannel", channel=caller)
            await ari(
                "POST",
                "/channels/externalMedia",
                app=ARI_APP,
                channelId=call_id,
                external_host="asr-ari",
                transport="websocket",
                encapsulation="none",
                format="ulaw",
            )
        elif event["type"] == "StasisStart":  # the External Media channel, once its socket is up
            await ari("POST", f"/bridges/{bridge}/addChannel", channel=call_id)
        elif event["type"] == "StasisEnd" and channel == caller:
            await ari("DELETE", f"/channels/{call_id}")
            await ari("DELETE", f"/bridges/{bridge}")
            return


async def test_ari_external_media_over_chan_websocket_is_transcribed_for_its_subscribers(
    server: ServerThread, asterisk: Asterisk, jfk_8k_wav: Path
) -> None:
    """ARI `externalMedia` (Asterisk 22.6+), the way an ARI application takes a call's audio out: the SIP
    call enters a Stasis application that bridges it with an External Media channel over chan_websocket;
    the server takes it on /v1/telephony/asterisk as it takes a Dial(WebSocket/...), the call id being the
    channel id the application chose. The caller's BYE ends it; its last word is transcribed."""
    call_id = str(uuid.uuid4())
    user, password = asterisk.ari_auth
    events_url = f"ws://127.0.0.1:{asterisk.ari_port}/ari/events?app={ARI_APP}&api_key={user}:{password}"
    async with (
        asyncio.timeout(CALL_DEADLINE_S),
        aiohttp.ClientSession(auth=aiohttp.BasicAuth(user, password)) as session,
        session.ws_connect(events_url) as events,
        follow(server, call_id) as (followed, reader),
    ):
        application = asyncio.create_task(
            external_media_application(Ari(session, asterisk.ari_port), events, call_id)
        )
        await sip_call(asterisk, "to-ari", jfk_8k_wav)
        await application
        await reader
    started, ended = followed.messages[0], followed.messages[-1]
    assert started["type"] == "call_started" and started["platform"] == "asterisk", followed.messages
    assert (ended["type"], ended["status"]) == ("call_ended", "OK"), asterisk.log()[-3000:]
    text = followed.finals("caller")
    assert corpus_wer([normalize(JFK_TEXT)], [normalize(text)]) < 0.2, text
    assert "country" in normalize(text)


# --- bad input, answered in each protocol's own terms (a client written from the protocol) ---------------


async def audiosocket_exchange(port: int, frames: bytes) -> bytes:
    """Send raw AudioSocket frames; everything the server sends until it closes (a close with our bytes
    unread reaches us as a reset)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    answer = b""
    try:
        writer.write(frames)
        await writer.drain()
        async with asyncio.timeout(30):
            answer = await reader.read()
    except ConnectionResetError:
        pass
    writer.close()
    return answer


async def test_audiosocket_frames_it_does_not_take_are_answered_with_a_hangup(server: ServerThread) -> None:
    """No UUID first, or audio at a rate this door does not take (0x12, 16 kHz): Asterisk gets the hangup
    frame (AudioSocket has no error text towards it) and the connection closes."""
    port = server.config.audiosocket_port
    assert await audiosocket_exchange(port, bytes((0x10, 0, 2, 0, 0))) == bytes((0, 0, 0))
    call = uuid.uuid4().bytes
    frames = bytes((0x01, 0, 16)) + call + bytes((0x12, 0, 4, 0, 0, 0, 0))
    assert await audiosocket_exchange(port, frames) == bytes((0, 0, 0))


async def test_audiosocket_peers_outside_the_allow_list_are_closed_before_a_byte_is_read(
    service_engine: Engine,
) -> None:
    config = ServerConfig(audiosocket_port=free_port(), audiosocket_allowed_peers="10.0.0.0/8, 192.0.2.7")
    own = ServerThread(config, service_engine).start()
    try:
        call = uuid.uuid4().bytes
        assert await audiosocket_exchange(config.audiosocket_port, bytes((0x01, 0, 16)) + call) == b""
        assert not own.server.recognizer.sessions
    finally:
        own.stop()


async def test_chan_websocket_credentials_and_formats(server: ServerThread) -> None:
    """Without the token (websocket_client.conf's password, HTTP Basic): 401. A format the server does not
    take: the HANGUP command, then close 1003 naming the format."""
    url = f"ws://{HOST}:{server.server.http_port}/v1/telephony/asterisk"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(
                url,
                protocols=("media",),
                headers={"Authorization": aiohttp.BasicAuth("asterisk", "wrong-token").encode()},
            )
        assert refused.value.status == 401
        async with session.ws_connect(
            url,
            protocols=("media",),
            headers={"Authorization": aiohttp.BasicAuth("asterisk", DOOR_TOKEN).encode()},
        ) as ws:
            assert ws.protocol == "media"
            await ws.send_str("MEDIA_START connection_id:asr channel:WebSocket/asr/0x1 format:g729 ptime:20")
            hangup = await asyncio.wait_for(ws.receive(), 30)
            assert hangup.type == aiohttp.WSMsgType.TEXT and hangup.data == "HANGUP"
            closing = await asyncio.wait_for(ws.receive(), 30)
            assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1003
            assert "format: 'g729'" in closing.extra


def test_media_start_in_both_control_formats() -> None:
    plain = "MEDIA_START connection_id:asr channel:WebSocket/asr/0x5140 channel_id:1761245643.1 format:ulaw"
    assert parse_media_start(plain)["channel_id"] == "1761245643.1"
    as_json = json.dumps(
        {
            "event": "MEDIA_START",
            "connection_id": "asr",
            "channel_id": "1761245643.1",
            "format": "slin16",
            "optimal_frame_size": 640,
            "channel_variables": {"MEDIA_WEBSOCKET_CONNECTION_ID": "asr"},
        }
    )
    start = parse_media_start(as_json)
    assert start["format"] == "slin16" and start["optimal_frame_size"] == "640"
    assert audio_format(start["format"]) == AudioFormat("LINEAR16", 16000, 1)

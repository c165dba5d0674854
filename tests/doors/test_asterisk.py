"""Asterisk's media doors with a real Asterisk 22 (tests/support/asterisk.py: a Debian-unstable chroot):
a call whose caller says jfk's speech (a real recording, played by Asterisk from an 8 kHz WAV) reaches
the server over AudioSocket (TCP) and over chan_websocket (`Dial(WebSocket/...)`, mu-law), each through
Asterisk's own dialplan applications. Subscribers follow the call by the id the dialplan gives it; the
caller's hangup (the file ends) finalises it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import soundfile as sf

from clients.scoring import corpus_wer, normalize
from tests.doors.test_twilio import follow
from tests.support.asterisk import Asterisk
from tests.support.audio import JFK_FLAC, JFK_TEXT
from tests.support.server import DOOR_TOKEN, HOST, ServerThread

pytestmark = pytest.mark.slow
CALL_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


@pytest.fixture(scope="module")
def asterisk(server: ServerThread) -> Iterator[Asterisk]:
    dialplan = f"""
[play]
exten => s,1,Answer()
 same => n,Playback(${{CALL_AUDIO}})
 same => n,Wait(0.3)
 same => n,Hangup()

[to-audiosocket]
exten => s,1,Answer()
 same => n,AudioSocket(${{CALL_UUID}},{HOST}:{server.config.audiosocket_port})
 same => n,Hangup()

[to-websocket]
exten => s,1,Dial(WebSocket/asr/c(ulaw)v(call_id=${{CALL_UUID}}))
 same => n,Hangup()
"""
    clients = f"""
[asr]
type = websocket_client
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
    pbx = Asterisk(dialplan, clients).start()
    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    pbx.set_global("CALL_AUDIO", pbx.audio_file("jfk", audio.mean(axis=1), rate))
    yield pbx
    pbx.stop()


@pytest.mark.parametrize("route", ["to-audiosocket", "to-websocket"])
async def test_a_call_through_asterisk_is_transcribed_for_its_subscribers(
    server: ServerThread, asterisk: Asterisk, route: str
) -> None:
    call_id = str(uuid.uuid4())
    asterisk.set_global("CALL_UUID", call_id)
    async with asyncio.timeout(CALL_DEADLINE_S), follow(server, call_id) as (followed, reader):
        await asyncio.to_thread(asterisk.originate, "play", route)
        await reader
    started, ended = followed.messages[0], followed.messages[-1]
    assert started["type"] == "call_started" and started["platform"] == "asterisk", followed.messages
    assert started["channels"] == ["caller"]
    assert ended == {"type": "call_ended", "call_id": call_id, "status": "OK"}, asterisk.log()[-3000:]
    text = followed.finals("caller")
    assert corpus_wer([normalize(JFK_TEXT)], [normalize(text)]) < 0.2, text
    assert "country" in normalize(text)  # the last word, before the caller hung up

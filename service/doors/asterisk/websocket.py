"""The Asterisk chan_websocket door: `GET /v1/telephony/asterisk` (WebSocket, subprotocol `media`) on the
HTTP port, dialled by Asterisk 22.6+ as `Dial(WebSocket/<connection>/c(ulaw))` with the connection's
`uri` in websocket_client.conf pointing here.

Asterisk's protocol: first a TEXT `MEDIA_START` event (plain text `MEDIA_START connection_id:.. channel:..
channel_id:.. format:ulaw optimal_frame_size:160 ptime:20`, or the JSON form `{"event": "MEDIA_START",
...}` with `f(json)` / chan_websocket.conf), then BINARY frames of audio in that format (ulaw, alaw, slin
at 8 kHz, slin16 ... slin48), and other TEXT events (MEDIA_XOFF, DTMF_END, ...) that need nothing here.
The one leg is what the dialled channel hears: the caller. The call id subscribers follow is the
`call_id` query parameter (the dialplan passes one with `v(call_id=${UNIQUEID})`), else the event's
channel_id.

Credentials: websocket_client.conf's `username`/`password` go out as HTTP Basic; the password is checked
as a bearer token (or `Authorization: Bearer`). Asterisk closing the socket is the hangup: the last words
are transcribed and published. Bad input is answered with the `HANGUP` command, then a close (1003 for a
format the server does not take, 1008 otherwise) whose reason names it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re

from aiohttp import WSMsgType, web

from service.config import ServerConfig
from service.doors.shared.auth import TOKEN_SYNTAX, TokenStore, bearer_token, identity
from service.doors.shared.http_door import HttpDoor
from service.doors.shared.telephony_socket import TelephonySockets, refusal
from service.doors.shared.ws_deadline import write_within
from service.recognizer.call_hub import CALL_ID_SYNTAX
from service.recognizer.framing import Reframer
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import AudioFormat, CallInfo, Identity, RecognitionSettings, StreamSettings

log = logging.getLogger("service.doors.asterisk.websocket")

DOOR = "asterisk-websocket"
PATH = "/v1/telephony/asterisk"
SUBPROTOCOL = "media"
FORMATS = {"ulaw": ("MULAW", 8000), "alaw": ("ALAW", 8000), "slin": ("LINEAR16", 8000)}
SLIN = re.compile(r"slin(12|16|24|32|44|48)")
START_WITHIN_S = 10.0  # Asterisk sends MEDIA_START as soon as the socket opens
FRAME_SLACK_BYTES = 4096


class BadInput(ValueError):
    def __init__(self, message: str, close_code: int = 1008) -> None:
        super().__init__(message)
        self.close_code = close_code


def parse_media_start(text: str) -> dict[str, str]:
    """MEDIA_START in either of Asterisk's control formats -> its fields as strings."""
    if text.lstrip().startswith("{"):
        try:
            event = json.loads(text)
        except ValueError as e:
            raise BadInput(f"a control message that is not JSON: {e}") from e
        if not isinstance(event, dict) or event.get("event") != "MEDIA_START":
            raise BadInput("the first message must be the MEDIA_START event")
        return {k: str(v) for k, v in event.items() if not isinstance(v, dict | list)}
    command, *fields = text.split()
    if command != "MEDIA_START":
        raise BadInput(f"the first message must be MEDIA_START, got {command[:40]!r}")
    return dict(field.partition(":")[::2] for field in fields)


def audio_format(name: str) -> AudioFormat:
    if name in FORMATS:
        encoding, rate = FORMATS[name]
        return AudioFormat(encoding, rate, 1)
    match = SLIN.fullmatch(name)
    if match:
        khz = int(match.group(1))
        return AudioFormat("LINEAR16", 44100 if khz == 44 else khz * 1000, 1)
    raise BadInput(
        f"format: {name!r} is not taken here: dial with c(ulaw), c(alaw) or c(slin) ... c(slin48)", 1003
    )


class AsteriskWebSocketDoor(HttpDoor):
    def __init__(self, config: ServerConfig, recognizer: Recognizer, tokens: TokenStore) -> None:
        super().__init__(config, recognizer, tokens)
        self.sockets = TelephonySockets(PATH)

    def register(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.media)

    def _token(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization", "")
        if header[:6].lower() == "basic ":
            try:
                _, _, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return ""
            return password if TOKEN_SYNTAX.fullmatch(password) else ""
        return bearer_token(request.headers.items())

    def _authenticate(self, request: web.Request) -> Identity | None:
        peer = request.remote or ""
        if not self.tokens.enabled:
            return identity(None, peer)
        token = self._token(request)
        return identity(token, peer) if token and self.tokens.check(token) else None

    async def media(self, request: web.Request) -> web.StreamResponse:
        caller = self._authenticate(request)
        if caller is None:
            why = "credentials: set websocket_client.conf's password to a token of this server (HTTP Basic)"
            self.recognizer.refused(DOOR, RecognitionError(Code.UNAUTHENTICATED, why))
            return refusal(401, why)
        call_id = request.query.get("call_id", "")
        if call_id and not CALL_ID_SYNTAX.fullmatch(call_id):
            return refusal(400, "call_id: 1 to 256 visible ASCII characters")
        ws = web.WebSocketResponse(
            protocols=(SUBPROTOCOL,),
            heartbeat=self.config.keepalive_time or None,
            max_msg_size=self.config.max_chunk_bytes + FRAME_SLACK_BYTES,
        )
        upgraded = await self.sockets.upgrade(request, ws)
        if upgraded is ws:
            await self.sockets.run(MediaCall(self, request, ws, caller, call_id).run(), "asterisk-call")
        return upgraded


class MediaCall:
    def __init__(
        self,
        door: AsteriskWebSocketDoor,
        request: web.Request,
        ws: web.WebSocketResponse,
        caller: Identity,
        call_id: str,
    ) -> None:
        self.door, self.request, self.ws, self.caller, self.call_id = door, request, ws, caller, call_id
        self.stream: Stream | None = None
        self.reframer: Reframer | None = None
        self.json_control = False
        self._refusal: tuple[int, str] | None = None

    async def run(self) -> None:
        events: asyncio.Task[None] | None = None
        try:
            try:
                await self._start()
                assert self.stream is not None
                events = asyncio.create_task(self._events(self.stream))
                await self._media()
                self.stream.finish()
            except BadInput as e:
                self._refusal = (e.close_code, str(e))
                if self.stream is not None:
                    self.stream.fail(RecognitionError(Code.INVALID_ARGUMENT, str(e)))
            except RecognitionError as e:  # the core refused the call: limits, draining, settings
                self._refusal = (1008 if e.code is Code.INVALID_ARGUMENT else 1013, e.message)
            if events is not None:
                await events
        finally:
            if events is not None:
                events.cancel()
            if self.stream is not None:
                await self.stream.close()
        await self._close()

    async def _start(self) -> None:
        try:
            msg = await self.ws.receive(timeout=START_WITHIN_S)
        except TimeoutError as e:
            raise BadInput(f"no MEDIA_START within {START_WITHIN_S:g} s") from e
        if msg.type != WSMsgType.TEXT:
            raise BadInput("the first message must be the MEDIA_START event (a TEXT frame)")
        self.json_control = msg.data.lstrip().startswith("{")
        start = parse_media_start(msg.data)
        audio = audio_format(start.get("format", ""))
        call_id = self.call_id or start.get("channel_id") or start.get("channel", "")
        if not call_id:
            raise BadInput("call_id: neither the call_id query parameter nor MEDIA_START's channel_id")
        attributes = tuple((k, start[k]) for k in ("connection_id", "channel", "channel_id") if start.get(k))
        settings = StreamSettings(
            recognition=RecognitionSettings(format=audio),
            call=CallInfo(
                call_id=call_id, platform="asterisk", channel_labels=("caller",), attributes=attributes
            ),
        )
        self.reframer = Reframer(1 if audio.encoding in ("MULAW", "ALAW") else 2)
        self.stream = self.door.recognizer.open_stream(settings, door=DOOR, identity=self.caller)

    async def _media(self) -> None:
        assert self.stream is not None and self.reframer is not None
        limit = self.door.config.max_chunk_bytes
        async for msg in self.ws:
            if msg.type == WSMsgType.BINARY:
                if len(msg.data) > limit:
                    raise BadInput(
                        f"a media frame of {len(msg.data)} bytes is over max_chunk_bytes ({limit})", 1009
                    )
                for piece in self.reframer.push_within(msg.data, limit):
                    self.stream.audio(piece)
                await self.stream.pace()
                if not self.stream.takes_audio:
                    return
            # TEXT: Asterisk's other events (MEDIA_XOFF/XON, DTMF_END, STATUS ...) need nothing here

    async def _events(self, stream: Stream) -> None:
        """The stream's events to their end (the core publishes each result to the call's subscribers);
        then the call's transcription is over: hang up and close, which ends the reading too."""
        try:
            async for _ in stream.events():
                pass
        except RecognitionError as e:
            if self._refusal is None:
                self._refusal = (
                    1008 if e.code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE) else 1011,
                    e.message,
                )
        await self._close()

    async def _close(self) -> None:
        if self.ws.closed:
            return
        timeout = self.door.config.ws_send_timeout
        hangup = json.dumps({"command": "HANGUP"}) if self.json_control else "HANGUP"
        await write_within(self.ws.send_str(hangup), self.request, timeout)
        code, reason = self._refusal or (1001 if self.door.recognizer.draining else 1000, "")
        await write_within(self.ws.close(code=code, message=reason.encode()[:120]), self.request, timeout)

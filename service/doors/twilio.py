"""The Twilio Media Streams door: `GET /v1/telephony/twilio` (WebSocket) on the HTTP port.

Twilio dials it from TwiML (`<Start><Stream url="wss://.../v1/telephony/twilio" track="both_tracks">`)
and sends JSON text messages: `connected`, `start` (callSid, tracks, customParameters, mediaFormat),
`media` (20 ms of base64 mu-law at 8 kHz per track: inbound is the caller, outbound what the call plays
to them), `dtmf`, `mark`, `stop`. It reads nothing back on a unidirectional stream: the transcripts go to
the call's subscribers by callSid (service/doors/call_transcripts.py), each leg labelled by its track.

- Who may connect: with an auth token (`--twilio-auth-token-file` or TWILIO_AUTH_TOKEN) the upgrade's
  X-Twilio-Signature is checked with the `twilio` package over the URL as Twilio dialled it
  (`--twilio-public-url` behind a proxy), 403 otherwise; without one, bearer tokens as every door.
- customParameters (TwiML `<Parameter>`): `language`, `keyterms` (comma-separated), `redact`
  (comma-separated: pci, ssn, numbers); anything else is kept as the call's attributes.
- The two tracks are laid side by side by their timestamps into one two-channel stream (a gap in one
  track is silence), so each leg is recognized on its own and its times are the call's.
- `stop`, or the socket closing without it (the call hung up): the last words of each leg are
  transcribed and published. Bad input closes 1008 and a refusal by the core (limits, draining) 1013,
  the reason naming the field or the flag; a drain ends the stream after the finals of what was heard.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web
from twilio.request_validator import RequestValidator

from service.config import ServerConfig
from service.doors.shared.auth import TokenStore, bearer_token, identity, read_secret
from service.doors.shared.http_door import HttpDoor
from service.doors.shared.telephony_socket import TelephonySockets, refusal
from service.doors.shared.ws_deadline import write_within
from service.recognizer.rate_limit import TokenBucket
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.redaction import Kind
from service.vocabulary.types import AudioFormat, CallInfo, Identity, RecognitionSettings, StreamSettings

log = logging.getLogger("service.doors.twilio")

DOOR = "twilio"
PATH = "/v1/telephony/twilio"
AUTH_TOKEN_ENV = "TWILIO_AUTH_TOKEN"
RATE = 8000  # Twilio Media Streams: always mu-law at 8 kHz
MULAW_SILENCE = 0xFF
TRACKS = ("inbound", "outbound")
# one track may run this far ahead of the other before the other's missing audio is taken as silence
MAX_TRACK_SKEW_S = 1.0
# base64 of 10 ms of mu-law: a media message with less is counted against max_text_messages_per_s
MIN_PACED_PAYLOAD = 108
MESSAGE_SLACK_BYTES = 4096  # a media message's JSON around its base64 payload
REDACT = {"pci": {Kind.PCI}, "ssn": {Kind.SSN}, "numbers": {Kind.PCI, Kind.SSN, Kind.NUMBERS}}
OWN_PARAMETERS = ("language", "keyterms", "redact")


class BadMessage(ValueError):
    """A message that is not Twilio's; the text names the field."""


class TrackMixer:
    """Twilio's per-track 20 ms payloads -> interleaved frames of one stream (channel i = tracks[i]).

    Each payload lands where its timestamp (ms from the stream's start) says; a track's gap (packets lost,
    or a track Twilio sends nothing on) is filled with silence once the other track is MAX_TRACK_SKEW_S
    ahead, or at the end."""

    def __init__(self, tracks: tuple[str, ...]) -> None:
        self.tracks = tracks
        self._pending = {t: bytearray() for t in tracks}
        self._position = dict.fromkeys(tracks, 0)  # samples of each track taken so far, silence included

    def push(self, track: str, timestamp_ms: int, payload: bytes) -> bytes:
        """Frames now complete on every track (b"" if none)."""
        buffer = self._pending[track]
        at = timestamp_ms * RATE // 1000
        end = self._position[track] + len(buffer)
        if at > end:  # packets missing: silence in their place
            buffer.extend(bytes([MULAW_SILENCE]) * (at - end))
        buffer.extend(payload)
        if len(self.tracks) > 1:
            ends = [self._position[t] + len(self._pending[t]) for t in self.tracks]
            lead = max(ends) - round(MAX_TRACK_SKEW_S * RATE)
            for t, track_end in zip(self.tracks, ends, strict=True):
                if track_end < lead:
                    self._pending[t].extend(bytes([MULAW_SILENCE]) * (lead - track_end))
        return self._take(min(len(b) for b in self._pending.values()))

    def flush(self) -> bytes:
        """Everything left, the shorter tracks padded with silence."""
        longest = max(len(b) for b in self._pending.values())
        for buffer in self._pending.values():
            buffer.extend(bytes([MULAW_SILENCE]) * (longest - len(buffer)))
        return self._take(longest)

    def _take(self, n: int) -> bytes:
        if n == 0:
            return b""
        columns = [np.frombuffer(bytes(self._pending[t][:n]), dtype=np.uint8) for t in self.tracks]
        for t in self.tracks:
            del self._pending[t][:n]
            self._position[t] += n
        return columns[0].tobytes() if len(columns) == 1 else np.stack(columns, axis=1).tobytes()


def _field(message: dict[str, Any], *path: str) -> Any:
    value: Any = message
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise BadMessage(f"{'.'.join(path)}: missing from the {message.get('event')!r} message")
        value = value[key]
    return value


def stream_settings(start: dict[str, Any]) -> StreamSettings:
    """The `start` message -> the stream's settings; BadMessage naming the field."""
    call_sid = _field(start, "start", "callSid")
    if not isinstance(call_sid, str) or not call_sid:
        raise BadMessage("start.callSid: a non-empty string")
    tracks = _field(start, "start", "tracks")
    if (
        not isinstance(tracks, list)
        or not tracks
        or any(t not in TRACKS for t in tracks)
        or len(set(tracks)) < len(tracks)
    ):
        raise BadMessage(f"start.tracks: inbound, outbound or both (got {tracks!r})")
    media_format = start["start"].get("mediaFormat") or {}
    encoding, rate = media_format.get("encoding", "audio/x-mulaw"), media_format.get("sampleRate", RATE)
    if encoding != "audio/x-mulaw" or rate != RATE:
        raise BadMessage(f"start.mediaFormat: audio/x-mulaw at 8000 Hz (got {encoding!r} at {rate!r})")
    parameters = start["start"].get("customParameters") or {}
    if not isinstance(parameters, dict):
        raise BadMessage("start.customParameters: an object")
    parameters = {str(k): str(v) for k, v in parameters.items()}
    redact: set[Kind] = set()
    for name in filter(None, (p.strip().lower() for p in parameters.get("redact", "").split(","))):
        if name not in REDACT:
            raise BadMessage(f"customParameters.redact: pci, ssn or numbers (got {name!r})")
        redact |= REDACT[name]
    keyterms = tuple(filter(None, (k.strip() for k in parameters.get("keyterms", "").split(","))))
    call = CallInfo(
        call_id=call_sid,
        platform=DOOR,
        channel_labels=tuple(tracks),
        attributes=tuple(
            sorted(
                [(k, v) for k, v in parameters.items() if k not in OWN_PARAMETERS]
                + [("streamSid", str(start["start"].get("streamSid", "")))]
            )
        ),
    )
    return StreamSettings(
        recognition=RecognitionSettings(
            format=AudioFormat("MULAW", RATE, len(tracks)),
            separate_channels=len(tracks) > 1,
            language=parameters.get("language", ""),
            keyterms=keyterms,
            redact=frozenset(redact),
        ),
        call=call,
    )


class TwilioDoor(HttpDoor):
    def __init__(self, config: ServerConfig, recognizer: Recognizer, tokens: TokenStore) -> None:
        super().__init__(config, recognizer, tokens)
        auth_token = read_secret(config.twilio_auth_token_file, AUTH_TOKEN_ENV)
        self.validator = RequestValidator(auth_token) if auth_token else None
        self.sockets = TelephonySockets(PATH)

    def register(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.media_stream)

    def _dialled_url(self, request: web.Request) -> str:
        if self.config.twilio_public_url:
            return self.config.twilio_public_url
        scheme = "wss" if self.config.tls_cert else "ws"
        return f"{scheme}://{request.host}{request.path_qs}"

    def _authenticate(self, request: web.Request) -> tuple[Identity | None, int, str]:
        peer = request.remote or ""
        if self.validator is not None:
            signature = request.headers.get("X-Twilio-Signature", "")
            if not signature:
                return None, 403, "X-Twilio-Signature: missing (Twilio signs every Media Stream)"
            if not self.validator.validate(self._dialled_url(request), {}, signature):
                return (
                    None,
                    403,
                    (
                        "X-Twilio-Signature: does not match the auth token over the dialled URL "
                        "(behind a proxy set --twilio-public-url to the TwiML <Stream url>)"
                    ),
                )
            return Identity("twilio", peer), 0, ""
        if not self.tokens.enabled:
            return identity(None, peer), 0, ""
        token = bearer_token(request.headers.items())
        if not token or not self.tokens.check(token):
            return (
                None,
                401,
                (
                    "this server takes Twilio streams signed with its auth token (set TWILIO_AUTH_TOKEN or "
                    "--twilio-auth-token-file), or with 'Authorization: Bearer <token>'"
                ),
            )
        return identity(token, peer), 0, ""

    async def media_stream(self, request: web.Request) -> web.StreamResponse:
        caller, status, why = self._authenticate(request)
        if caller is None:
            self.recognizer.refused(DOOR, RecognitionError(Code.UNAUTHENTICATED, why))
            return refusal(status, why)
        ws = web.WebSocketResponse(
            heartbeat=self.config.keepalive_time or None,
            max_msg_size=self.config.max_chunk_bytes * 4 // 3 + MESSAGE_SLACK_BYTES,
        )
        upgraded = await self.sockets.upgrade(request, ws)
        if upgraded is ws:
            await self.sockets.run(MediaStream(self, request, ws, caller).run(), "twilio-call")
        return upgraded


class MediaStream:
    """One Twilio Media Stream: messages -> the stream until `stop` or the socket's close, then its
    events to their end (published by the core to the call's subscribers), then the close."""

    def __init__(
        self, door: TwilioDoor, request: web.Request, ws: web.WebSocketResponse, caller: Identity
    ) -> None:
        self.door, self.request, self.ws, self.caller = door, request, ws, caller
        rate = door.config.max_text_messages_per_s
        self._messages = TokenBucket(rate, 2 * rate)
        self.stream: Stream | None = None
        self.mixer: TrackMixer | None = None
        self._refusal: tuple[int, str] | None = None

    async def run(self) -> None:
        writer: asyncio.Task[None] | None = None
        try:
            async for msg in self.ws:
                if msg.type != WSMsgType.TEXT:
                    self._refuse(1003, "Twilio Media Streams send JSON text messages only")
                    break
                try:
                    done = await self._message(msg.data)
                except BadMessage as e:
                    self._refuse(1008, str(e))
                    break
                except RecognitionError as e:  # the core refused the stream: limits, draining, settings
                    code = 1008 if e.code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE) else 1013
                    self._refusal = (code, e.message)
                    break
                if self.stream is not None and writer is None:
                    writer = asyncio.create_task(self._events(self.stream))
                if done:
                    break
            await self._hang_up()
            if writer is not None:
                await writer
        finally:
            if writer is not None:
                writer.cancel()
            if self.stream is not None:
                await self.stream.close()
        await self._close()

    def _refuse(self, code: int, reason: str) -> None:
        self._refusal = (code, reason)
        if self.stream is not None:
            self.stream.fail(RecognitionError(Code.INVALID_ARGUMENT, reason))

    async def _message(self, text: str) -> bool:
        """One message; True at `stop`."""
        try:
            message = json.loads(text)
        except ValueError as e:
            raise BadMessage(f"not JSON: {e}") from e
        if not isinstance(message, dict):
            raise BadMessage("a message is a JSON object")
        event = message.get("event")
        # media carrying real audio is bounded by the stream's pace (--max-audio-lead-seconds); every other
        # message, by count
        audio = (
            event == "media" and len(str(message.get("media", {}).get("payload", ""))) >= MIN_PACED_PAYLOAD
        )
        if not audio and not self._messages.take():
            raise BadMessage(
                f"more than {self._messages.rate:g} messages per second without audio (max_text_messages_per_s)"
            )
        if event == "start":
            if self.stream is not None:
                raise BadMessage("start: a second start on one stream")
            settings = stream_settings(message)
            assert settings.call is not None
            self.mixer = TrackMixer(settings.call.channel_labels)
            self.stream = self.door.recognizer.open_stream(settings, door=DOOR, identity=self.caller)
        elif event == "media":
            if self.stream is None or self.mixer is None:
                raise BadMessage("media: before start")
            track = _field(message, "media", "track")
            if track not in self.mixer.tracks:
                raise BadMessage(
                    f"media.track: one of start.tracks {list(self.mixer.tracks)} (got {track!r})"
                )
            try:
                payload = base64.b64decode(_field(message, "media", "payload"), validate=True)
                timestamp = int(_field(message, "media", "timestamp"))
            except (binascii.Error, TypeError, ValueError) as e:
                raise BadMessage(
                    f"media.payload and media.timestamp: base64 mu-law and milliseconds ({e})"
                ) from e
            if timestamp < 0:
                raise BadMessage("media.timestamp: milliseconds from the stream's start, not negative")
            self._audio(self.mixer.push(track, timestamp, payload))
            await self.stream.pace()
        elif event == "stop":
            return True
        elif event in ("connected", "dtmf", "mark"):
            pass
        else:
            raise BadMessage(f"event: connected, start, media, dtmf, mark or stop (got {event!r})")
        return False

    def _audio(self, frames: bytes) -> None:
        assert self.stream is not None
        step = self.door.config.max_chunk_bytes
        step -= step % 2
        for i in range(0, len(frames), step):
            self.stream.audio(frames[i : i + step])

    async def _hang_up(self) -> None:
        """The call is over (stop, or the socket closed): the last words of each leg are transcribed."""
        if self.stream is None or self.mixer is None:
            return
        if self._refusal is None and self.stream.takes_audio:
            self._audio(self.mixer.flush())
        self.stream.finish()

    async def _events(self, stream: Stream) -> None:
        """The stream's events to their end (the core publishes each result to the call's subscribers),
        then the close, which also ends the reading if Twilio is still sending (an error, a drain)."""
        try:
            async for _ in stream.events():
                pass
        except RecognitionError as e:
            if self._refusal is None:
                code = 1008 if e.code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE) else 1011
                self._refusal = (code, e.message)
        await self._close()

    async def _close(self) -> None:
        code, reason = self._refusal or (1001 if self.door.recognizer.draining else 1000, "")
        if not self.ws.closed:
            await write_within(
                self.ws.close(code=code, message=reason.encode()[:120]),
                self.request,
                self.door.config.ws_send_timeout,
            )

"""The Genesys Cloud AudioHook door: `GET /api/v1/audiohook/ws` (WebSocket) on the HTTP port, for the
AudioHook Monitor and the Transcription Connector alike.

Genesys opens the socket (headers X-API-KEY, Audiohook-Organization-Id, -Session-Id, -Correlation-Id, and
an HTTP message signature made with the integration's client secret), then sends JSON text messages
(`open`, `ping`, `update`, `paused`, `resumed`, `discarded`, `error`, `close`) and binary audio: PCMU or
L16 at 8 kHz, the channels of the media the server chose in `opened`, interleaved (`external` is the
customer, `internal` the agent). The server answers each in kind (`opened`, `pong`, `updated`, `closed`)
and sends every final as a transcript `event` on the same socket, before `closed` (the Transcription
Connector shows them in Genesys); the call's subscribers get them too, by conversationId.

- Who may connect: with `AUDIOHOOK_API_KEY` (environment, or `--audiohook-api-key-file`) X-API-KEY must be
  it, and with `AUDIOHOOK_CLIENT_SECRET` (base64, or `--audiohook-client-secret-file`) the signature must
  verify (`http-message-signatures`, HMAC-SHA256 over the components Genesys signs): else HTTP 401 before
  the upgrade. Without an API key the door takes bearer tokens as every door.
- Times: a transcript's `offset` is the audio position in Genesys' terms: audio Genesys discarded (its
  `resumed` and `discarded` messages say how much) counts, so times after such a gap move on by it. A
  pause, and a language `update`, end the utterance under way (the new language applies from the next).
- Errors: the core's refusal or bad input: `disconnect` (reason `error`, info naming the field or flag);
  Genesys then closes (`close` -> `closed`). A drain: the finals of what was heard, then `reconnect`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import datetime
import json
import logging
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from aiohttp import WSMsgType, web
from http_message_signatures import (
    HTTPMessageVerifier,
    HTTPSignatureKeyResolver,
    InvalidSignature,
    algorithms,
)

from service.config import ServerConfig
from service.doors.shared.auth import TokenStore, bearer_token, read_secret
from service.doors.shared.http_door import HttpDoor
from service.doors.shared.telephony_socket import TelephonySockets, refusal
from service.doors.shared.ws_deadline import write_within
from service.recognizer.framing import Reframer
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    CallInfo,
    EndpointSettings,
    Identity,
    RecognitionSettings,
    Result,
    StreamSettings,
)

log = logging.getLogger("service.doors.audiohook")

DOOR = "audiohook"
PATH = "/api/v1/audiohook/ws"
API_KEY_ENV, CLIENT_SECRET_ENV = "AUDIOHOOK_API_KEY", "AUDIOHOOK_CLIENT_SECRET"
# what Genesys signs (its reference client): the request line's target, the host and its own headers
SIGNED_COMPONENTS = (
    "@request-target",
    "@authority",
    "audiohook-organization-id",
    "audiohook-session-id",
    "audiohook-correlation-id",
    "x-api-key",
)
SIGNATURE_MAX_AGE = datetime.timedelta(seconds=60)
LABELS = {"external": "customer", "internal": "agent"}
FORMATS = {"PCMU": "MULAW", "L16": "LINEAR16"}
OPEN_WITHIN_S = 10.0
MESSAGE_SLACK_BYTES = 64 << 10  # an `open` with participant and customConfig; audio frames are far smaller


def duration(seconds: float) -> str:
    """ISO 8601 seconds, as AudioHook writes positions: PT1.25S."""
    return f"PT{max(seconds, 0.0):.3f}".rstrip("0").rstrip(".") + "S"


def parse_duration(text: object, name: str) -> float:
    if not isinstance(text, str) or not text.startswith("PT") or not text.endswith("S"):
        raise BadMessage(f"{name}: an ISO 8601 duration in seconds (PT1.5S), got {text!r}")
    try:
        value = float(text[2:-1])
    except ValueError as e:
        raise BadMessage(f"{name}: an ISO 8601 duration in seconds (PT1.5S), got {text!r}") from e
    if value < 0:
        raise BadMessage(f"{name}: not negative")
    return value


class BadMessage(ValueError):
    """Not AudioHook's protocol; the text names the field."""


class _OneKey(HTTPSignatureKeyResolver):
    def __init__(self, key_id: str, secret: bytes) -> None:
        self.key_id, self.secret = key_id, secret

    def resolve_public_key(self, key_id: str) -> bytes | None:
        return self.secret if key_id == self.key_id else None

    def resolve_private_key(self, key_id: str) -> bytes:
        raise InvalidSignature("this server only verifies")


@dataclass
class Timeline:
    """Audio positions lost to pauses and discards: the core's time -> Genesys' position."""

    at: list[float] = field(default_factory=list)  # the core's time of each gap
    shift: list[float] = field(default_factory=list)  # seconds lost up to and including that gap

    def gap(self, core_s: float, lost_s: float) -> None:
        self.at.append(core_s)
        self.shift.append((self.shift[-1] if self.shift else 0.0) + lost_s)

    def position(self, core_s: float) -> float:
        i = bisect.bisect_right(self.at, core_s)
        return core_s + (self.shift[i - 1] if i else 0.0)


class AudioHookDoor(HttpDoor):
    def __init__(self, config: ServerConfig, recognizer: Recognizer, tokens: TokenStore) -> None:
        super().__init__(config, recognizer, tokens)
        self.api_key = read_secret(config.audiohook_api_key_file, API_KEY_ENV)
        secret = read_secret(config.audiohook_client_secret_file, CLIENT_SECRET_ENV)
        try:
            self.client_secret = base64.b64decode(secret, validate=True) if secret else b""
        except binascii.Error as e:
            raise ValueError(f"{CLIENT_SECRET_ENV}: the integration's client secret, base64 ({e})") from e
        self.sockets = TelephonySockets(PATH)

    def register(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.session)

    def _refusal(self, request: web.Request) -> str | None:
        """Why the upgrade is refused (401), or None."""
        if not self.api_key:
            if self.tokens.enabled:
                token = bearer_token(request.headers.items())
                if not token or not self.tokens.check(token):
                    return (
                        "credentials: set AUDIOHOOK_API_KEY (and its client secret), or send a bearer token"
                    )
            return None
        if request.headers.get("X-API-KEY", "") != self.api_key:
            return "X-API-KEY: not this integration's API key"
        if not self.client_secret:
            return None
        message = SimpleNamespace(
            method="GET", url=f"http://{request.host}{request.path_qs}", headers=request.headers
        )
        verifier = HTTPMessageVerifier(
            signature_algorithm=algorithms.HMAC_SHA256, key_resolver=_OneKey(self.api_key, self.client_secret)
        )
        try:
            verifier.verify(message, max_age=SIGNATURE_MAX_AGE, require_components=SIGNED_COMPONENTS)
        except InvalidSignature as e:
            return f"Signature: {e}"
        except Exception as e:  # a malformed header the library could not parse
            return f"Signature: {type(e).__name__}: {e}"
        return None

    async def session(self, request: web.Request) -> web.StreamResponse:
        why = self._refusal(request)
        if why is not None:
            self.recognizer.refused(DOOR, RecognitionError(Code.UNAUTHENTICATED, why))
            return refusal(401, why)
        ws = web.WebSocketResponse(
            heartbeat=self.config.keepalive_time or None,
            max_msg_size=self.config.max_chunk_bytes + MESSAGE_SLACK_BYTES,
        )
        upgraded = await self.sockets.upgrade(request, ws)
        if upgraded is ws:
            organization = request.headers.get("Audiohook-Organization-Id", "")[:64]
            caller = Identity("audiohook:" + organization, request.remote or "")
            await self.sockets.run(AudioHookSession(self, request, ws, caller).run(), "audiohook-session")
        return upgraded


class AudioHookSession:
    def __init__(
        self, door: AudioHookDoor, request: web.Request, ws: web.WebSocketResponse, caller: Identity
    ) -> None:
        self.door, self.request, self.ws, self.caller = door, request, ws, caller
        self.session_id = request.headers.get("Audiohook-Session-Id", "") or str(uuid.uuid4())
        self.seq = 0  # the server's last message
        self.clientseq = 0  # the client's last message
        self.stream: Stream | None = None
        self.reframer: Reframer | None = None
        self.channels: list[str] = []
        self.timeline = Timeline()
        self.paused_at: float | None = None
        self._send_lock = asyncio.Lock()
        self._ended = False  # a disconnect or reconnect was sent: only `close` is awaited now
        self._closed_sent = False

    async def send(self, kind: str, parameters: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        async with self._send_lock:
            self.seq += 1
            message = {
                "version": "2",
                "id": self.session_id,
                "type": kind,
                "seq": self.seq,
                "clientseq": self.clientseq,
                "parameters": parameters,
            }
            await write_within(
                self.ws.send_str(json.dumps(message)), self.request, self.door.config.ws_send_timeout
            )

    async def run(self) -> None:
        events: asyncio.Task[None] | None = None
        try:
            try:
                async with asyncio.timeout(OPEN_WITHIN_S):
                    msg = await self.ws.receive()
                if msg.type != WSMsgType.TEXT:
                    raise BadMessage("the first message must be `open`")
                opened = await self._open(self._parse(msg.data))
                if opened is None:
                    return
                assert self.stream is not None
                events = asyncio.create_task(self._events(self.stream))
                await self.send("opened", opened)
                await self._read()
            except TimeoutError:
                await self._disconnect(f"no `open` within {OPEN_WITHIN_S:g} s")
            except BadMessage as e:
                await self._disconnect(str(e))
                if self.stream is not None:
                    self.stream.fail(RecognitionError(Code.INVALID_ARGUMENT, str(e)))
                await self._read_until_close()
            if self.stream is not None:
                self.stream.finish()  # close, or the socket's end: the last words are transcribed
            if events is not None:
                await events
            if not self._closed_sent and not self.ws.closed:
                self._closed_sent = True
                await self.send("closed", {})
        finally:
            if events is not None:
                events.cancel()
            if self.stream is not None:
                await self.stream.close()
            if not self.ws.closed:
                await write_within(self.ws.close(), self.request, self.door.config.ws_send_timeout)

    def _parse(self, text: str) -> dict[str, Any]:
        try:
            message = json.loads(text)
        except ValueError as e:
            raise BadMessage(f"not JSON: {e}") from e
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise BadMessage("a message is a JSON object with a `type`")
        seq = message.get("seq")
        if isinstance(seq, int):
            self.clientseq = seq
        parameters = message.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadMessage(f"{message['type']}.parameters: an object")
        return message

    async def _open(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The `open` message -> the stream, and `opened`'s parameters (None: refused, disconnect sent)."""
        if message["type"] != "open":
            raise BadMessage(f"the first message must be `open`, got `{message['type']}`")
        p = message.get("parameters") or {}
        media = [m for m in p.get("media") or [] if isinstance(m, dict)]
        chosen = next(
            (
                m
                for m in media
                if m.get("type") == "audio"
                and m.get("format") in FORMATS
                and m.get("rate") == 8000
                and isinstance(m.get("channels"), list)
                and 1 <= len(m["channels"]) <= 2
                and all(c in LABELS for c in m["channels"])
            ),
            None,
        )
        if chosen is None:
            raise BadMessage(
                f"open.parameters.media: none offered is audio PCMU or L16 at 8000 Hz (offered {media!r})"
            )
        opened: dict[str, Any] = {"media": [chosen]}
        if p.get("supportedLanguages"):
            opened["supportedLanguages"] = self._languages()
        self.channels = list(chosen["channels"])
        custom: dict[str, Any] = p["customConfig"] if isinstance(p.get("customConfig"), dict) else {}
        keyterms = custom.get("keyterms") or []
        if not isinstance(keyterms, list) or not all(isinstance(k, str) for k in keyterms):
            raise BadMessage("open.parameters.customConfig.keyterms: a list of strings")
        endpointing_ms = custom.get("endpointing_ms", 0)
        if not isinstance(endpointing_ms, int) or isinstance(endpointing_ms, bool) or endpointing_ms < 0:
            raise BadMessage(
                "open.parameters.customConfig.endpointing_ms: milliseconds of silence that end an utterance"
            )
        participant: dict[str, Any] = p["participant"] if isinstance(p.get("participant"), dict) else {}
        conversation = str(p.get("conversationId") or self.session_id)
        attributes = tuple(
            sorted(
                [("organizationId", str(p.get("organizationId", ""))), ("sessionId", self.session_id)]
                + [(f"participant.{k}", str(v)) for k, v in participant.items() if isinstance(v, str | int)]
            )
        )
        encoding = FORMATS[chosen["format"]]
        settings = StreamSettings(
            recognition=RecognitionSettings(
                format=AudioFormat(encoding, 8000, len(self.channels)),
                separate_channels=len(self.channels) > 1,
                language=str(p.get("language") or ""),
                keyterms=tuple(keyterms),
                word_times=True,
                word_confidence=True,
            ),
            endpointing=EndpointSettings.from_overrides(min_silence_s=endpointing_ms / 1000),
            call=CallInfo(
                call_id=conversation,
                platform=DOOR,
                channel_labels=tuple(LABELS[c] for c in self.channels),
                attributes=attributes,
            ),
        )
        try:
            self.stream = self.door.recognizer.open_stream(settings, door=DOOR, identity=self.caller)
        except RecognitionError as e:
            await self._disconnect(e.message)
            await self._read_until_close()
            return None
        self.reframer = Reframer((1 if encoding == "MULAW" else 2) * len(self.channels))
        return opened

    def _languages(self) -> list[str]:
        model = self.door.recognizer.model
        codes = sorted(model.languages) if model is not None else ["en"]
        return ["en-US" if c == "en" else c for c in codes]

    async def _read(self) -> None:
        assert self.stream is not None and self.reframer is not None
        limit = self.door.config.max_chunk_bytes
        async for msg in self.ws:
            if msg.type == WSMsgType.BINARY:
                if self._ended:
                    continue
                self.paused_at = None  # audio again: resumed (Genesys' reference client sends no `resumed`)
                if len(msg.data) > limit:
                    raise BadMessage(
                        f"an audio frame of {len(msg.data)} bytes is over max_chunk_bytes ({limit})"
                    )
                for piece in self.reframer.push_within(msg.data, limit):
                    self.stream.audio(piece)
                await self.stream.pace()
                continue
            if msg.type != WSMsgType.TEXT:
                continue
            message = self._parse(msg.data)
            kind, p = message["type"], message.get("parameters") or {}
            self.stream.keep_alive()  # Genesys pings while paused: the call is still there
            if kind == "ping":
                await self.send("pong", {})
            elif kind == "close":
                return
            elif kind == "update":
                # a new language applies from an utterance's start: the one under way ends here
                self.stream.finalize(hold=True)
                await self.send("updated", {})
            elif kind == "paused":
                self.paused_at = self.stream.heard_s
                self.stream.finalize(hold=True)  # no utterance spans a pause
            elif kind in ("resumed", "discarded"):
                # audio Genesys never sent: later positions move on by that much
                lost = parse_duration(p.get("discarded"), f"{kind}.parameters.discarded")
                self.paused_at = None
                if lost > 0:
                    self.timeline.gap(self.stream.heard_s, lost)
            elif kind == "error":
                log.info("audiohook: the client reported an error: %s", json.dumps(p)[:500])
            elif kind == "open":
                raise BadMessage("open: a second open on one session")

    async def _read_until_close(self) -> None:
        async for msg in self.ws:
            if msg.type == WSMsgType.TEXT:
                try:
                    if self._parse(msg.data)["type"] == "close":
                        return
                except BadMessage:
                    continue

    async def _disconnect(self, info: str) -> None:
        if not self._ended:
            self._ended = True
            await self.send("disconnect", {"reason": "error", "info": info[:1000]})

    async def _events(self, stream: Stream) -> None:
        """Every final as a transcript event (the core publishes it to subscribers too); a drain ends
        with `reconnect`, an error with `disconnect`."""
        try:
            async for event in stream.events():
                if isinstance(event, Result) and event.is_final and event.transcript:
                    await self.send("event", {"entities": [self._transcript(event)]})
        except RecognitionError as e:
            await self._disconnect(e.message)
            return
        if self.door.recognizer.draining and not self._ended:
            self._ended = True
            await self.send("reconnect", {"info": "the server is draining: reconnect to another"})

    def _transcript(self, r: Result) -> dict[str, Any]:
        start, end = self.timeline.position(r.start_s), self.timeline.position(r.end_s)
        tokens = [
            {
                "type": "word",
                "value": w.text,
                "confidence": round(w.confidence if w.confidence is not None else r.confidence, 4),
                "offset": duration(self.timeline.position(w.start_s if w.start_s is not None else r.start_s)),
                "duration": duration((w.end_s or 0.0) - (w.start_s or 0.0)),
            }
            for w in r.words
        ]
        language = r.language and ("en-US" if r.language == "en" else r.language)
        alternative: dict[str, Any] = {
            "confidence": round(min(max(r.confidence, 0.0), 1.0), 4),
            "interpretations": [{"type": "display", "transcript": r.transcript, "tokens": tokens}],
        }
        if language:
            alternative["languages"] = [language]
        return {
            "type": "transcript",
            "data": {
                "id": str(uuid.uuid4()),
                "channelId": max(r.channel - 1, 0),
                "isFinal": True,
                "offset": duration(start),
                "duration": duration(end - start),
                "alternatives": [alternative],
            },
        }

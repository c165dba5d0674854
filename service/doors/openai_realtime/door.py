"""The OpenAI Realtime transcription door: `GET /v1/realtime?intent=transcription`, a WebSocket on the HTTP
port (service/runtime/http_server.py), translated onto one core stream per session
(service/recognizer/recognizer.py). The protocol's shapes and checks: protocol.py beside it.

A session, as OpenAI's server runs it:
- `session.created` as soon as the socket opens (a client may wait for it before its `session.update`);
  `session.update` (type "transcription") answered by `session.updated` with the effective session.
- `input_audio_buffer.append` (base64 audio in the session's format: audio/pcm 16-bit 24 kHz mono, the
  default, or G.711 audio/pcmu, audio/pcma at 8 kHz), `.commit` (ends the turn now: the core's finalize),
  `.clear` (drops what was not committed: the core's clear, answered by `input_audio_buffer.cleared`).
- With `turn_detection` server_vad (the default; semantic_vad is served by it too) the core's endpointing
  cuts turns: `input_audio_buffer.speech_started` / `speech_stopped` (times in ms of the session's audio),
  then `input_audio_buffer.committed`; with `turn_detection: null` the client commits each turn and the
  turn is everything appended since the last commit.
- Each committed item gets `conversation.item.input_audio_transcription.delta` events (increments whose
  concatenation is the start of the turn's transcript: protocol.TurnText), then `.completed` with the
  transcript, `usage` (the item's seconds of audio), `logprobs` when `include` asks (one per word), and,
  an extension the protocol has no place for, `words` with their times in seconds of the session; or
  `.failed` if the stream ends in an error first.
- A bad client event gets an `error` event naming the parameter and the client's event_id, and the session
  goes on; a stream that ends in an error sends `.failed` for its open items, an `error` event, then closes
  with a WebSocket close code for the kind of end (CLOSE_CODES). On drain the finals of what was heard come,
  then an `error` `server_draining` naming audio_end_ms (how much of the session's audio was heard: the
  rest goes to a new session), then close 1012 (service restart), which OpenAI's client treats as
  "reconnect".

The core stream opens at the first append, with the settings the session has then; changing what the
stream was opened with (format, turn detection, language, prompt) afterwards is refused naming the field,
keywords (keyterms) excepted.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web
from prometheus_client import Counter

from service import metrics
from service.doors.openai_realtime import protocol as rt
from service.doors.openai_realtime.protocol import ProtocolError, Session, TurnText
from service.doors.shared.auth import bearer_token, identity
from service.doors.shared.http_door import HttpDoor
from service.doors.shared.ws_deadline import Outbox
from service.recognizer.rate_limit import TokenBucket
from service.recognizer.recognizer import Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    EndpointSettings,
    EndReason,
    Identity,
    RecognitionSettings,
    Reconnect,
    Result,
    SpeechEnded,
    SpeechStarted,
    StreamSettings,
)

DOOR = "openai-realtime"
PATH = "/v1/realtime"
SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL = "openai-insecure-api-key."  # browsers: the key as a subprotocol beside "realtime"
MIN_COMMIT_MS = 100.0  # OpenAI's least audio a commit may hold
EVENT_OVERHEAD_BYTES = 4096  # an append's JSON around its base64 audio

# The core's names of the settings a session carries -> this protocol's parameters.
FIELD_NAMES = {
    "language_code": "session.audio.input.transcription.language",
    "prompt": "session.audio.input.transcription.prompt",
    "keyterms": "session.audio.input.transcription.keywords",
    "endpointing.speech_start_threshold": "session.audio.input.turn_detection.threshold",
    "endpointing.speech_end_threshold": "session.audio.input.turn_detection.threshold",
    "endpointing.min_silence_duration": "session.audio.input.turn_detection.silence_duration_ms",
    "endpointing.speech_pad": "session.audio.input.turn_detection.prefix_padding_ms",
    "audio_content": "audio",
}
# How a stream that ends in an error closes the socket (RFC 6455 §7.4.1; IANA's registry for 1012/1013).
CLOSE_CODES = {
    Code.OK: 1000,
    Code.CANCELLED: 1000,
    Code.INVALID_ARGUMENT: 1008,  # policy violation: what the client sent
    Code.OUT_OF_RANGE: 1008,  # a limit of the stream (length, idle audio)
    Code.UNAUTHENTICATED: 1008,
    Code.PERMISSION_DENIED: 1008,
    Code.RESOURCE_EXHAUSTED: 1013,  # try again later
    Code.UNAVAILABLE: 1012,  # service restart: reconnect (to another replica)
    Code.DEADLINE_EXCEEDED: 1011,
    Code.INTERNAL: 1011,
    Code.UNKNOWN: 1011,
}
CLIENT_EVENTS = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
)
DELTA_REVISIONS = Counter(
    "asr_realtime_delta_revisions_total",
    "OpenAI Realtime turns whose final revised text already sent as deltas (no more deltas went out for "
    "them; their completed transcript is the final's)",
)


def _error_code(code: Code) -> tuple[str, str]:
    """(OpenAI error type, code) for a stream that ended in error."""
    if code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
        return "invalid_request_error", code.name.lower()
    return "server_error", code.name.lower()


class OpenAIRealtimeDoor(HttpDoor):
    """The door's route, registered on the HTTP port's application."""

    def register(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.handle)

    def _refusal(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> web.Response:
        kind = {401: "invalid_request_error", 503: "server_error"}.get(status, "invalid_request_error")
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.json_response(body, status=status, headers=headers)

    def _authenticate(self, request: web.Request) -> tuple[Identity | None, str | None]:
        """(who, None) or (None, why not): `Authorization: Bearer KEY`, or, from a browser, the
        `openai-insecure-api-key.KEY` subprotocol."""
        token = bearer_token(request.headers.items())
        if token is None:
            offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
            keys = [p[len(KEY_SUBPROTOCOL) :] for p in offered if p.startswith(KEY_SUBPROTOCOL)]
            token = keys[0] if keys else None
        if not self.tokens.enabled:
            return identity(None, request.remote or ""), None
        if token is None:
            return None, (
                "missing credentials: send the header 'Authorization: Bearer <key>' (or, from a browser, "
                "the subprotocol 'openai-insecure-api-key.<key>' beside 'realtime')"
            )
        if not token or not self.tokens.check(token):
            return None, "invalid API key"
        return identity(token, request.remote or ""), None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        caller, why = self._authenticate(request)
        if caller is None:
            return self._refusal(401, why or "", code="invalid_api_key")
        if request.query.get("intent") != "transcription":
            message = (
                "this server serves transcription sessions only: connect with ?intent=transcription "
                f"(got intent={request.query.get('intent')!r})"
            )
            self.recognizer.refused(DOOR, RecognitionError(Code.INVALID_ARGUMENT, message, "intent"))
            return self._refusal(400, message, "intent", "invalid_value")
        if "realtime=v1" in request.headers.get("OpenAI-Beta", ""):
            # the beta protocol (openai's client.beta.realtime: transcription_session.update, other
            # session fields and events); its own client says so in this header
            message = (
                "the beta Realtime protocol (OpenAI-Beta: realtime=v1) is not served: connect with the GA "
                "client (client.realtime.connect(extra_query={'intent': 'transcription'})) and session.update"
            )
            self.recognizer.refused(DOOR, RecognitionError(Code.INVALID_ARGUMENT, message))
            return self._refusal(400, message, "OpenAI-Beta", "invalid_value")
        model = self.recognizer.model
        if self.recognizer.draining or model is None:
            message = (
                "server is draining; connect again (to another replica)"
                if self.recognizer.draining
                else "model is still loading; retry shortly"
            )
            self.recognizer.refused(DOOR, RecognitionError(Code.UNAVAILABLE, message))
            return self._refusal(503, message, code="unavailable")
        ws = web.WebSocketResponse(
            protocols=(SUBPROTOCOL,),
            heartbeat=self.config.keepalive_time or None,
            max_msg_size=4 * -(-self.config.max_chunk_bytes // 3) + EVENT_OVERHEAD_BYTES,
        )
        await ws.prepare(request)
        connection = _Connection(self, request, ws, caller, model.name)
        await connection.run()
        return ws


@dataclass
class _Item:
    """A turn: an item of the conversation, from its first audio to its completed (or failed) event."""

    id: str
    start_ms: float  # where its audio begins in the session (the buffer's start, or speech start - padding)
    index: int = -1  # no turn detection: the core's utterance index of the turn
    speech_start_s: float = 0.0  # server VAD: where its speech began in the core's time (routes results)
    end_ms: float | None = None  # where it ends (committed)
    text: TurnText = field(default_factory=TurnText)
    words: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[tuple[str, float]] = field(default_factory=list)
    committed: bool = False
    in_speech: bool = False  # server VAD: speech started and not yet ended
    dropped: bool = False  # cleared before it was committed: nothing more goes out for it
    done: bool = False


class _Connection:
    """One socket: the session, its core stream (once audio came) and the items in flight.

    Items and the core's utterances: with server VAD an item is one speech span, from SpeechStarted to
    SpeechEnded (a span over max_utterance_duration is cut into utterances, each ended_by MAX_LENGTH but
    the last), and results are routed to the span whose speech they begin in; without turn detection an
    item is the audio between two commits, which the core recognizes as one utterance (Stream.finalize),
    and results are routed by its utterance index. The stream has `empty_finals`: every utterance gets a
    final, so every committed item completes, silence too."""

    def __init__(
        self,
        door: OpenAIRealtimeDoor,
        request: web.Request,
        ws: web.WebSocketResponse,
        caller: Identity,
        model: str,
    ) -> None:
        self.door, self.ws, self.caller, self.model = door, ws, caller, model
        self.request = request
        # what this connection says to its client, written in order by its own task: neither the reader
        # nor the pump ever waits on a client that does not read
        self.outbox = Outbox(
            ws, request, door.config.ws_send_timeout, door.config.max_response_backlog_bytes, self._cut_off
        )
        rate = door.config.max_text_messages_per_s
        self.text_messages = TokenBucket(rate, 2 * rate)  # parsed on the loop every stream here shares
        self.config = door.config
        self.session = Session()
        self.session_id = rt.new_id("sess")
        self.stream: Stream | None = None
        self.opened_with: Session | None = None
        self.pump: asyncio.Task[None] | None = None
        self.received_bytes = 0  # audio appended, in the session's format
        self.odd_byte = b""  # half a 16-bit sample carried to the next append
        self.buffer_start_ms = 0.0  # audio before this was committed (or cleared)
        self.pending: _Item | None = None  # the item the buffer's audio belongs to, not yet committed
        self.spans: list[_Item] = []  # server VAD: items by speech start, until their last final
        self.turns: dict[int, _Item] = {}  # no VAD: committed items by utterance index, awaiting their final
        self.next_index = 0  # no VAD: the core's index of the turn in progress
        self.drop_next_speech = False  # server VAD: a clear dropped speech whose start is not pumped yet
        self.last_item_id: str | None = None
        self.last_speech_end_s = 0.0

    @property
    def vad(self) -> bool:
        return self.session.turn_detection is not None

    # --- plumbing ---

    @property
    def heard_ms(self) -> float:
        return self.session.bytes_to_ms(self.received_bytes)

    def send(self, event: dict[str, Any]) -> None:
        self.outbox.send(json.dumps(event, ensure_ascii=False))

    def _cut_off(self) -> None:
        """The client read nothing past --ws-send-timeout or --max-response-backlog-bytes: the connection is
        aborted, and the stream's work stops."""
        if self.stream is not None:
            self.stream.cancel(Code.CANCELLED)

    def error(self, e: ProtocolError) -> None:
        self.send(rt.error_event(e))

    async def run(self) -> None:
        self.send(rt.event("session.created", session=self._session_object()))
        idle = self.config.idle_audio_timeout
        # before the first audio nothing holds a stream place: the first audio is due this long after the
        # session opens, whatever events come before it; the stream's own idle bound applies once it exists
        first_audio_due = time.monotonic() + idle
        try:
            while True:
                timeout = (
                    max(0.0, first_audio_due - time.monotonic()) if self.stream is None and idle else None
                )
                try:
                    msg = await asyncio.wait_for(self.ws.receive(), timeout)
                except TimeoutError:
                    self.error(
                        ProtocolError(
                            "idle_timeout",
                            f"no audio for {idle:g} s (idle_audio_timeout): send input_audio_buffer.append "
                            "events, silence too, while the session lasts",
                        )
                    )
                    await self.outbox.close(1008, b"idle")
                    return
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    self.error(
                        ProtocolError(
                            "invalid_value",
                            "binary frames carry no event here: send JSON text events, audio as base64 in "
                            "input_audio_buffer.append",
                        )
                    )
                else:  # CLOSE, CLOSING, CLOSED, ERROR: the client is gone, or the pump closed the socket
                    return
        except asyncio.CancelledError:
            # the server stops (its grace spent): tell the client to go elsewhere
            await self.outbox.close(1012, b"server stopping")
            raise
        finally:
            await self._end()
            await self.outbox.aclose()

    async def _end(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            pump_done = self.pump is not None and self.pump.done()
            if self.pump is not None and not pump_done:
                self.pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.pump
            # a session ends when the client closes the socket: normally (1000, 1001: finished or left the
            # page) or not (1006: its connection broke)
            ended = Code.OK if self.ws.close_code in (1000, 1001) else Code.CANCELLED
            await stream.close(None if pump_done else ended)

    # --- client events ---

    async def on_text(self, text: str) -> None:
        if not self.text_messages.take():
            metrics.refused("max_text_messages_per_s")
            self.error(
                ProtocolError(
                    "rate_limit_exceeded",
                    f"more than {self.text_messages.rate:g} events per second (max_text_messages_per_s): "
                    "this event was dropped",
                    type="rate_limit_error",
                )
            )
            return
        try:
            message = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
            self.error(ProtocolError("invalid_json", f"the event is not valid JSON: {e}"))
            return
        if not isinstance(message, dict):
            self.error(ProtocolError("invalid_type", "an event is a JSON object with a 'type'"))
            return
        event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
        kind = message.get("type")
        try:
            if kind == "session.update":
                rt.check_event(message)
                await self.on_session_update(message["session"])
            elif kind == "input_audio_buffer.append":
                rt.check_event(message)
                await self.on_append(message["audio"])
            elif kind == "input_audio_buffer.commit":
                rt.check_event(message)
                await self.on_commit()
            elif kind == "input_audio_buffer.clear":
                rt.check_event(message)
                await self.on_clear()
            elif isinstance(kind, str) and kind.startswith(
                ("response.", "conversation.", "output_audio_buffer.")
            ):
                raise ProtocolError(
                    "invalid_value",
                    f"Invalid value: {kind!r}: a transcription session has no conversation or model "
                    f"responses; it takes {', '.join(CLIENT_EVENTS)}.",
                    "type",
                )
            else:
                raise ProtocolError(
                    "invalid_value",
                    f"Invalid value: {kind!r}. Supported values are: {', '.join(map(repr, CLIENT_EVENTS))}.",
                    "type",
                )
        except ProtocolError as e:
            e.event_id = event_id
            self.error(e)

    async def on_session_update(self, update: Any) -> None:
        session = rt.apply_session_update(self.session, update)
        try:
            self.door.recognizer.check(self._stream_settings(session))
        except RecognitionError as e:
            param = FIELD_NAMES.get(e.field or "") or FIELD_NAMES.get((e.field or "").split(".")[0])
            raise ProtocolError("invalid_value", e.message_for(FIELD_NAMES), param) from None
        if self.stream is not None:
            self._check_unchanged(session)
            if session.keyterms != self.session.keyterms:
                try:
                    self.stream.update_keyterms(session.keyterms)
                except RecognitionError as e:
                    limited = e.code is Code.RESOURCE_EXHAUSTED
                    raise ProtocolError(
                        "rate_limit_exceeded" if limited else "invalid_value",
                        e.message_for(FIELD_NAMES),
                        FIELD_NAMES["keyterms"],
                        type="rate_limit_error" if limited else "invalid_request_error",
                    ) from None
        self.session = session
        self.send(rt.event("session.updated", session=self._session_object()))

    def _check_unchanged(self, session: Session) -> None:
        opened = self.opened_with
        assert opened is not None
        for name, param in (
            ("format", "session.audio.input.format"),
            ("turn_detection", "session.audio.input.turn_detection"),
            ("language", "session.audio.input.transcription.language"),
            ("prompt", "session.audio.input.transcription.prompt"),
        ):
            if getattr(session, name) != getattr(opened, name):
                raise ProtocolError(
                    "invalid_value",
                    f"'{param}' can only change before the session's first input_audio_buffer.append: "
                    "the audio is being recognized with it (open a new session for other settings)",
                    param,
                )

    def _stream_settings(self, session: Session) -> StreamSettings:
        td = session.turn_detection
        endpointing = (
            None
            if td is None
            else EndpointSettings(
                speech_start_threshold=td.threshold,
                speech_end_threshold=max(td.threshold - 0.15, 0.01),
                min_silence_s=td.silence_duration_ms / 1000,
                speech_pad_s=td.prefix_padding_ms / 1000,
            )
        )
        recognition = RecognitionSettings(
            format=AudioFormat(session.encoding, session.sample_rate, 1),
            language=session.language,
            prompt=session.prompt,
            keyterms=session.keyterms,
            word_times=True,
            word_confidence=True,
        )
        return StreamSettings(
            recognition=recognition, endpointing=endpointing, interim_results=True, empty_finals=True
        )

    async def on_append(self, audio: str) -> None:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(
                "invalid_value",
                f"Invalid 'audio': expected base64-encoded audio bytes ({self.session.format})",
                "audio",
            ) from None
        limit = self.config.max_chunk_bytes
        if len(data) > limit:
            raise ProtocolError(
                "invalid_value",
                f"audio: {len(data)} bytes in one append, over the limit of {limit} bytes (max_chunk_bytes); "
                "send it in smaller appends",
                "audio",
            )
        if not data:
            return
        stream = self.stream or await self._open_stream()
        if stream is None:
            return
        if not self.vad and self.pending is None:
            self.pending = _Item(rt.new_id("item"), self.heard_ms, index=self.next_index)
        self.received_bytes += len(data)
        if self.session.encoding == "LINEAR16":
            data = self.odd_byte + data
            keep = len(data) - len(data) % 2
            data, self.odd_byte = data[:keep], data[keep:]
        if data:
            stream.audio(data)
            await stream.pace()

    async def _open_stream(self) -> Stream | None:
        try:
            stream = self.door.recognizer.open_stream(
                self._stream_settings(self.session), door=DOOR, identity=self.caller
            )
        except RecognitionError as e:
            kind, code = _error_code(e.code)
            self.error(ProtocolError(code, e.message_for(FIELD_NAMES), type=kind))
            await self.outbox.close(CLOSE_CODES.get(e.code, 1011), e.code.name.encode())
            return None
        self.stream = stream
        self.opened_with = self.session
        self.pump = asyncio.get_running_loop().create_task(self._pump(stream))
        return stream

    async def on_commit(self) -> None:
        buffered = self.heard_ms - self.buffer_start_ms
        if self.stream is None or buffered < MIN_COMMIT_MS:
            raise ProtocolError(
                "input_audio_buffer_commit_empty",
                f"Error committing input audio buffer: buffer too small. Expected at least {MIN_COMMIT_MS:g}ms "
                f"of audio, but buffer only has {max(buffered, 0.0):.2f}ms of audio.",
            )
        try:
            ended = self.stream.finalize()
        except RecognitionError as e:  # --max-finals-in-flight: the buffer stays, uncommitted
            raise ProtocolError("rate_limit_exceeded", e.message, type="rate_limit_error") from None
        if self.vad:
            # speech in progress: the core ended it, and its SpeechEnded (on its way) commits its item;
            # else the buffer holds no speech: an item of silence, transcribed as such
            if not ended:
                silent = _Item(rt.new_id("item"), self.buffer_start_ms)
                await self._commit(silent, self.heard_ms)
                await self._complete(silent)
            return
        turn, self.pending = self.pending, None
        assert turn is not None  # audio came since the last commit or clear
        await self._commit(turn, self.heard_ms)
        if ended:
            self.turns[turn.index] = turn
            self.next_index += 1
        else:  # the stream takes no more audio (it is ending): nothing more will come for it
            await self._complete(turn)

    async def on_clear(self) -> None:
        dropped = self.stream.clear() if self.stream is not None else False
        if self.vad:
            if dropped:
                if self.pending is not None and self.pending.in_speech:
                    self.pending.dropped = True
                    self.pending = None
                else:  # its SpeechStarted is still on its way
                    self.drop_next_speech = True
        else:
            if dropped:
                self.next_index += 1  # the core does not give a dropped turn's index again
            self.pending = None
        self.buffer_start_ms = self.heard_ms
        self.send(rt.event("input_audio_buffer.cleared"))

    # --- core events ---

    async def _pump(self, stream: Stream) -> None:
        code, message = 1000, b""
        heard_ms = 0
        try:
            async for event in stream.events():
                if isinstance(event, SpeechStarted):
                    await self.on_speech_started(event)
                elif isinstance(event, SpeechEnded):
                    await self.on_speech_ended(event)
                elif isinstance(event, Result):
                    await self.on_result(event)
                elif isinstance(event, Reconnect):
                    heard_ms = round(event.offset_s * 1000)
                    code, message = 1012, f"server draining: reconnect; audio_end_ms {heard_ms}".encode()
            if code == 1012:
                # after the finals of what was heard: where the client's next session takes the audio up
                self.error(
                    ProtocolError(
                        "server_draining",
                        f"the server is restarting: this session's audio was heard up to audio_end_ms "
                        f"{heard_ms}, and every turn in it is transcribed above; audio appended since is not. "
                        "Send what follows audio_end_ms to a new session",
                        type="server_error",
                    )
                )
        except RecognitionError as e:
            await self._fail_items(e)
            kind, err = _error_code(e.code)
            self.error(ProtocolError(err, e.message_for(FIELD_NAMES), type=kind))
            code, message = CLOSE_CODES.get(e.code, 1011), e.code.name.encode()
        await self.outbox.close(code, message)

    async def on_speech_started(self, e: SpeechStarted) -> None:
        item = _Item(rt.new_id("item"), 0.0, speech_start_s=e.offset_s, in_speech=True)
        self.spans.append(item)
        if self.drop_next_speech:  # a clear came first: this speech was dropped with the buffer
            self.drop_next_speech = False
            item.dropped = True
            return
        await self._start(item, e.offset_s)

    async def _start(self, item: _Item, offset_s: float) -> None:
        assert self.session.turn_detection is not None
        pad = self.session.turn_detection.prefix_padding_ms
        item.start_ms = max(offset_s * 1000 - pad, self.buffer_start_ms, 0.0)
        self.pending = item
        self.send(
            rt.event(
                "input_audio_buffer.speech_started", audio_start_ms=round(item.start_ms), item_id=item.id
            )
        )

    async def on_speech_ended(self, e: SpeechEnded) -> None:
        item = self.pending
        if item is None:
            # a commit ended speech shorter than the core announces (min_speech_duration)
            item = _Item(rt.new_id("item"), 0.0, speech_start_s=self.last_speech_end_s + 1e-6)
            self.spans.append(item)
            await self._start(item, self.buffer_start_ms / 1000)
        self.pending = None
        item.in_speech = False
        self.last_speech_end_s = e.offset_s
        end_ms = e.offset_s * 1000
        self.send(rt.event("input_audio_buffer.speech_stopped", audio_end_ms=round(end_ms), item_id=item.id))
        await self._commit(item, end_ms)

    async def _commit(self, item: _Item, end_ms: float) -> None:
        item.committed, item.end_ms = True, end_ms
        self.buffer_start_ms = max(self.buffer_start_ms, end_ms)
        self.send(
            rt.event("input_audio_buffer.committed", item_id=item.id, previous_item_id=self.last_item_id)
        )
        self.last_item_id = item.id

    def _owner(self, r: Result) -> _Item | None:
        """The item a result belongs to (None: no item will take it)."""
        if not self.vad:
            if r.utterance_index in self.turns:
                return self.turns[r.utterance_index]
            pending = self.pending
            return pending if pending is not None and pending.index == r.utterance_index else None
        owner = None
        for item in self.spans:  # few: spans leave once their last final is in
            if item.speech_start_s <= r.start_s + 1e-6:
                owner = item
        return owner

    async def on_result(self, r: Result) -> None:
        item = self._owner(r)
        if item is None or item.done:
            return
        last = r.is_final and r.ended_by is not EndReason.MAX_LENGTH
        if last:
            if self.vad:  # spans that a clear dropped before it get no final of their own: they go too
                self.spans = [i for i in self.spans if i.speech_start_s > item.speech_start_s]
            else:
                self.turns.pop(r.utterance_index, None)
        if item.dropped:
            return
        if not r.is_final:
            delta = item.text.interim(r.transcript)
            if delta:
                await self._delta(item, delta)
            return
        delta = item.text.final(r.transcript)
        item.words += [
            {"word": w.text, "start": round(w.start_s or 0.0, 3), "end": round(w.end_s or 0.0, 3)}
            for w in r.words
        ]
        item.logprobs += [
            (w.text, w.confidence if w.confidence is not None else r.confidence) for w in r.words
        ]
        if last and not item.committed:  # the stream's end cut it (drain, a limit): committed now
            if item is self.pending:
                self.pending = None
            await self._commit(item, r.end_s * 1000)
        if delta:
            await self._delta(item, delta)
        if last:
            await self._complete(item)

    async def _delta(self, item: _Item, delta: str) -> None:
        self.send(
            rt.event(
                "conversation.item.input_audio_transcription.delta",
                item_id=item.id,
                content_index=0,
                delta=delta,
            )
        )

    async def _complete(self, item: _Item) -> None:
        if item.done:
            return
        item.done = True
        if item.text.revised:
            DELTA_REVISIONS.inc()
        end = item.end_ms if item.end_ms is not None else self.heard_ms
        fields: dict[str, Any] = {
            "item_id": item.id,
            "content_index": 0,
            "transcript": item.text.transcript,
            "usage": rt.usage(max(end - item.start_ms, 0.0) / 1000),
            "words": item.words,
        }
        if self.session.logprobs:
            fields["logprobs"] = rt.logprobs_of(item.logprobs)
        self.send(rt.event("conversation.item.input_audio_transcription.completed", **fields))

    async def _fail_items(self, e: RecognitionError) -> None:
        kind, code = _error_code(e.code)
        for item in [*self.spans, *self.turns.values()]:
            if not item.committed or item.dropped or item.done:
                continue
            item.done = True
            self.send(
                rt.event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item.id,
                    content_index=0,
                    error={"type": kind, "code": code, "message": e.message_for(FIELD_NAMES), "param": None},
                )
            )

    def _session_object(self) -> dict[str, Any]:
        return rt.session_object(self.session, self.session_id, self.model)

"""The Deepgram door: live `GET /v1/listen` (WebSocket) and pre-recorded `POST /v1/listen`, on the HTTP port.

A translation layer: the query (options.py) -> the core's StreamSettings / RecognitionSettings; binary
frames -> `Stream.audio`, the control messages (messages.py) -> `finalize`, `finish`, `keep_alive`,
`update_keyterms`; the core's events -> `Results`, `SpeechStarted`, `UtteranceEnd` (utterance_end.py),
then `Metadata`; the core's errors -> an HTTP status before the upgrade, or an `Error` message and a close
code after it (docs/operations.md, "The Deepgram door", lists each).

Handshake order: credentials (401), the query (400 naming the option), then the core's admission
(503 loading or draining, 429 at --max-streams) and its checks of the settings (400 naming the option).
A refused handshake carries Deepgram's error body {err_code, err_msg, request_id} and its `dg-error`
header; the SDK raises it as ApiError(status_code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import importlib.metadata
import logging
import uuid

from aiohttp import WSMsgType, web
from deepgram.listen.v1.types import (
    ListenV1CloseStream,
    ListenV1Configure,
    ListenV1Finalize,
    ListenV1KeepAlive,
)
from pydantic import BaseModel

from service import metrics
from service.config import ServerConfig
from service.doors.deepgram import messages
from service.doors.deepgram.options import ListenOptions, OptionError, parse_listen_options
from service.doors.deepgram.utterance_end import UtteranceEndTracker
from service.doors.shared.auth import TOKEN_SYNTAX, TokenStore, identity
from service.doors.shared.http_body import BodyError, BoundedBody
from service.doors.shared.ws_deadline import Outbox
from service.recognizer.framing import Reframer, container_of
from service.recognizer.rate_limit import TokenBucket
from service.recognizer.recognizer import Recognizer, Stream, probe_recording
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    DiarizationSettings,
    EndpointSettings,
    EndReason,
    Formatting,
    Identity,
    RecognitionSettings,
    Reconnect,
    Result,
    SpeechStarted,
    StreamSettings,
)

log = logging.getLogger("service.doors.deepgram")

DOOR = "deepgram"
LISTEN_PATH = "/v1/listen"
SUBPROTOCOL = "token"  # Sec-WebSocket-Protocol: token, KEY (a browser cannot set Authorization)
MIN_RATE, MAX_RATE, MAX_CHANNELS = 8000, 48000, 8  # the core's bounds (AudioFormat)
# aiohttp closes 1009 on its own above this; up to it the door reads the frame and answers in Deepgram's
# terms, naming --max-chunk-bytes.
FRAME_SLACK_BYTES = 1 << 16
CLOSE_REASON = {1000: "", 1001: "server is draining; reconnect"}

# The core's names of the settings this door's options carry, where they differ.
FIELD_NAMES = {
    "sample_rate_hertz": "sample_rate",
    "audio_channel_count": "channels",
    "language_code": "language",
    "keyterms": "keyterm",
    "diarization": "diarize",
}
# The core's code -> the handshake's (and the pre-recorded request's) HTTP status and err_code.
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: (400, "Bad Request"),
    Code.OUT_OF_RANGE: (413, "Payload Too Large"),
    Code.UNAUTHENTICATED: (401, "INVALID_AUTH"),
    Code.RESOURCE_EXHAUSTED: (429, "TOO_MANY_REQUESTS"),
    Code.UNAVAILABLE: (503, "Service Unavailable"),
}
_PACKAGE = "callcenter-asr"


def _version() -> str:
    try:
        return importlib.metadata.version(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# shared/http_body.py's statuses, as Deepgram names them
BODY_ERRORS = {400: "Bad Request", 408: "Request Timeout", 413: "Payload Too Large"}


class DeepgramError(Exception):
    """A refusal before any audio is read: an HTTP status with Deepgram's error body."""

    def __init__(self, status: int, err_code: str, err_msg: str, option: str = "") -> None:
        super().__init__(err_msg)
        self.status, self.err_code, self.err_msg, self.option = status, err_code, err_msg, option

    def response(self, request_id: str) -> web.Response:
        body = {"err_code": self.err_code, "err_msg": self.err_msg, "request_id": request_id}
        # dg-error: Deepgram's handshake refusals say why in a header too (a WebSocket client that only
        # sees the status line can log it)
        printable = "".join(ch if " " <= ch <= "~" else "?" for ch in self.err_msg[:512])
        headers = {"dg-error": printable, "dg-request-id": request_id}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Token"
        return web.json_response(body, status=self.status, headers=headers)

    @classmethod
    def of(cls, e: RecognitionError) -> DeepgramError:
        status, err_code = HTTP_STATUS.get(e.code, (500, "INTERNAL_SERVER_ERROR"))
        field = FIELD_NAMES.get((e.field or "").split(".")[0], e.field or "")
        return cls(status, err_code, e.message_for(FIELD_NAMES), field)


def presented_token(request: web.Request) -> str | None:
    """The token of `Authorization: Token KEY` (Deepgram's API keys) or `Bearer KEY` (its temporary tokens),
    else of `Sec-WebSocket-Protocol: token, KEY`; "" when malformed, None when there is none."""
    header = request.headers.get("Authorization")
    if header is not None:
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        ok = scheme.lower() in ("token", "bearer") and TOKEN_SYNTAX.fullmatch(token)
        return token if ok else ""
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    if len(offered) >= 2 and offered[0].lower() == SUBPROTOCOL:
        return offered[1] if TOKEN_SYNTAX.fullmatch(offered[1]) else ""
    return None


def stream_settings(o: ListenOptions) -> StreamSettings:
    return StreamSettings(
        recognition=recognition_settings(o, AudioFormat(o.encoding, o.sample_rate, o.channels)),
        endpointing=None
        if not o.endpointing
        else dataclasses.replace(
            # `endpointing` is the silence at which the turn is judged (the turn model, where on, may
            # wait longer for an incomplete one); speech_final marks the end of the turn
            EndpointSettings.from_overrides(min_silence_s=(o.endpointing_ms or 0) / 1000),
            turn_model=o.turn_model,
            turn_threshold=o.eot_threshold,
            turn_max_silence_s=o.eot_timeout_ms / 1000,
        ),
        interim_results=o.interim_results,
    )


def recognition_settings(o: ListenOptions, audio_format: AudioFormat) -> RecognitionSettings:
    return RecognitionSettings(
        format=audio_format,
        separate_channels=o.multichannel,
        language=o.language,
        keyterms=o.keyterms,
        word_times=True,  # Deepgram's results always carry words with times and confidence
        word_confidence=True,
        redact=o.redact,
        formatting=Formatting.SMART if o.smart else Formatting.VERBATIM,  # smart_format, numerals
        diarization=DiarizationSettings() if o.diarize else None,  # Deepgram takes no speaker count
    )


def words_of(r: Result, offset: float = 0.0) -> tuple[messages.Word, ...]:
    return tuple(
        messages.Word(
            w.text,
            (w.start_s or 0.0) + offset,
            (w.end_s if w.end_s is not None else (w.start_s or 0.0)) + offset,
            w.confidence if w.confidence is not None else r.confidence,
            w.speaker,
        )
        for w in r.words
    )


def span(r: Result, words: tuple[messages.Word, ...]) -> tuple[float, float]:
    """Deepgram's result spans the audio its words came from; Whisper may time a word inside the padding
    kept around the speech the VAD heard, so the span takes in every word."""
    return min([r.start_s] + [w.start for w in words[:1]]), max([r.end_s] + [w.end for w in words[-1:]])


class DeepgramDoor:
    """The door's routes, registered on the HTTP port's application (runtime/http_server.py)."""

    def __init__(self, config: ServerConfig, recognizer: Recognizer, tokens: TokenStore) -> None:
        self.config = config
        self.recognizer = recognizer
        self.tokens = tokens

    def register(self, app: web.Application) -> None:
        app.router.add_get(LISTEN_PATH, self.listen)
        app.router.add_post(LISTEN_PATH, self.transcribe)

    def model_card(self) -> messages.ModelCard:
        model = self.recognizer.model
        return messages.ModelCard(name=model.name if model is not None else "", version=_version())

    def _authenticate(self, request: web.Request) -> Identity:
        token = presented_token(request)
        if not self.tokens.enabled:
            return identity(None, request.remote or "")
        if token is None:
            reason = "missing credentials: send 'Authorization: Token <key>' (or the 'token' WebSocket subprotocol)"
        elif not token:
            reason = "malformed credentials: expected 'Authorization: Token <key>' or 'Bearer <token>'"
        elif not self.tokens.check(token):
            reason = "Invalid credentials."
        else:
            return identity(token, request.remote or "")
        raise DeepgramError(401, "INVALID_AUTH", reason)

    def _options(self, request: web.Request, live: bool) -> ListenOptions:
        try:
            return parse_listen_options(
                request.query.items(),
                live=live,
                min_rate=MIN_RATE,
                max_rate=MAX_RATE,
                max_channels=MAX_CHANNELS,
            )
        except OptionError as e:
            raise DeepgramError(400, "Bad Request", e.message, e.option) from e

    # --- live ---

    async def listen(self, request: web.Request) -> web.StreamResponse:
        request_id = str(uuid.uuid4())
        stream: Stream | None = None
        try:
            try:
                caller = self._authenticate(request)
                options = self._options(request, live=True)
            except DeepgramError as e:
                code = Code.UNAUTHENTICATED if e.status == 401 else Code.INVALID_ARGUMENT
                self.recognizer.refused(DOOR, RecognitionError(code, e.err_msg))
                raise
            try:
                stream = self.recognizer.open_stream(
                    lambda: stream_settings(options), door=DOOR, identity=caller
                )
            except RecognitionError as e:
                raise DeepgramError.of(e) from e
            ws = web.WebSocketResponse(
                protocols=(SUBPROTOCOL,),
                heartbeat=self.config.keepalive_time or None,
                max_msg_size=self.config.max_chunk_bytes + FRAME_SLACK_BYTES,
            )
            ws.headers["dg-request-id"] = request_id
            if not ws.can_prepare(request).ok:
                raise DeepgramError(
                    426, "Upgrade Required", f"{LISTEN_PATH} is a WebSocket: send an Upgrade request"
                )
        except DeepgramError as e:
            if stream is not None:
                await stream.close(Code.INVALID_ARGUMENT)
            return e.response(request_id)
        assert stream is not None
        try:
            await ws.prepare(request)
            call = LiveCall(self, request, ws, stream, options, request_id, "encoding" not in request.query)
            await call.run()
        finally:
            await stream.close()
        return ws

    # --- pre-recorded ---

    async def transcribe(self, request: web.Request) -> web.Response:
        request_id = str(uuid.uuid4())
        try:
            caller = self._authenticate(request)
            options = self._options(request, live=False)
            if request.content_type == "application/json":
                raise DeepgramError(
                    400,
                    "Bad Request",
                    "url: this server does not fetch audio from a URL; send the audio as the request body",
                    "url",
                )
            data = await self._read_body(request)
            return await self._transcribe(data, options, "encoding" in request.query, request_id, caller)
        except DeepgramError as e:
            response = e.response(request_id)
            if e.status in (408, 413):
                response.force_close()  # the rest of the body is not read
            return response

    async def _read_body(self, request: web.Request) -> bytearray:
        """The body, within the bounds every HTTP door puts on an upload (shared/http_body.py):
        --max-recognize-bytes, --http-read-timeout, --http-min-upload-rate."""
        c = self.config
        limit = c.max_recognize_bytes
        try:
            body = BoundedBody(
                request,
                limit,
                lambda _: f"the audio is over the limit of {limit} bytes (max_recognize_bytes)",
                c.http_read_timeout,
                c.http_min_upload_rate,
            )
            return await body.read_all()
        except BodyError as e:
            raise DeepgramError(e.status, BODY_ERRORS[e.status], e.message) from e

    async def _transcribe(
        self, data: bytearray, options: ListenOptions, encoding_given: bool, request_id: str, caller: Identity
    ) -> web.Response:
        container = container_of(data[:16])
        if container in ("WAV", "FLAC"):
            audio_format = AudioFormat(container)
        elif container is not None:
            raise DeepgramError(
                400, "Bad Request", f"encoding: {container} files are not decoded here; send WAV, FLAC or raw "
                "linear16, mulaw or alaw with encoding and sample_rate", "encoding",
            )  # fmt: skip
        elif encoding_given:
            audio_format = AudioFormat(options.encoding, options.sample_rate, options.channels)
        else:
            raise DeepgramError(
                400,
                "Bad Request",
                "encoding: the audio is no WAV or FLAC file; for raw audio give encoding and sample_rate",
                "encoding",
            )
        settings = recognition_settings(options, audio_format)
        try:
            result = await self.recognizer.recognize(data, settings, door=DOOR, identity=caller)
        except RecognitionError as e:
            raise DeepgramError.of(e) from e
        if audio_format.encoding in ("WAV", "FLAC"):
            channels = probe_recording(data, audio_format.encoding, 0, 0).channels
        else:
            channels = options.channels
        out_channels = channels if options.multichannel else 1
        utterances = []
        for r in result.results:
            words = words_of(r)
            start, end = span(r, words)
            utterances.append(
                messages.Utterance(
                    max(r.channel - 1, 0), start, end, r.transcript, r.confidence, words, r.speaker
                )
            )
        body = messages.prerecorded(
            request_id=request_id,
            created=_now(),
            duration=result.duration_s,
            channels=out_channels,
            sha256=hashlib.sha256(data).hexdigest(),
            model=self.model_card(),
            utterances=utterances,
            punctuated=options.punctuated,
            with_utterances=options.utterances,
            warnings=options.warnings,
            tags=options.tags,
        )
        return web.Response(
            text=messages.dump(body), content_type="application/json", headers={"dg-request-id": request_id}
        )


class LiveCall:
    """One live connection: a reader (client frames -> the stream) and a writer (the stream's events ->
    Deepgram's messages); both queue what they say to the connection's outbox, which writes it in order.
    The call is over when the writer has closed the socket, or at once when the client goes away (nothing
    can reach it any more)."""

    def __init__(
        self,
        door: DeepgramDoor,
        request: web.Request,
        ws: web.WebSocketResponse,
        stream: Stream,
        options: ListenOptions,
        request_id: str,
        no_encoding: bool,
    ) -> None:
        self.door, self.ws, self.stream, self.options = door, ws, stream, options
        self.request = request
        rate = door.config.max_text_messages_per_s
        self._text_messages = TokenBucket(rate, 2 * rate)  # parsed on the loop every stream here shares
        self.request_id = request_id
        self.no_encoding = no_encoding  # raw linear16 assumed: a container's header is refused
        config = door.config
        self._outbox = Outbox(
            ws,
            request,
            config.ws_send_timeout,
            config.max_response_backlog_bytes,
            on_abort=lambda: self.stream.cancel(Code.CANCELLED),
        )
        self._sha = hashlib.sha256()  # of the audio received, as Metadata.sha256 is
        self._first = True
        self._closing = False  # CloseStream received: later audio and controls are not taken
        self._ending = False  # the writer is sending the last messages and the close
        self._draining = False
        self._refusal: tuple[str, str, int] | None = None  # the door's own error: variant, text, close code
        self._reframer = Reframer((2 if options.encoding == "LINEAR16" else 1) * options.channels)
        self._model = door.model_card()
        self._trackers = (
            [UtteranceEndTracker(options.utterance_end_ms / 1000) for _ in range(options.result_channels)]
            if options.utterance_end_ms
            else []
        )

    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        reader = asyncio.create_task(self._read(writer))
        try:
            await asyncio.wait({writer})
        finally:
            for task in (writer, reader):
                task.cancel()
            await asyncio.gather(writer, reader, return_exceptions=True)
            await self._outbox.aclose()

    def send(self, message: BaseModel) -> None:
        self._outbox.send(messages.dump(message))

    # --- client -> stream ---

    async def _read(self, writer: asyncio.Task[None]) -> None:
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.BINARY:
                    self._audio(msg.data)
                    await self.stream.pace()
                    self._utterance_ends()
                elif msg.type == WSMsgType.TEXT:
                    self._control(msg.data)
        except Exception as e:  # a bug of ours: fail this stream only, loudly
            log.exception("deepgram reader failed", extra={"fields": {"stream_id": self.stream.id}})
            self.stream.fail(RecognitionError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
            return
        if not self._ending:  # the client closed or vanished first: free its work at once
            self.stream.cancel(Code.CANCELLED)
            writer.cancel()

    def _audio(self, data: bytes) -> None:
        if self._closing or not self.stream.takes_audio:
            return
        if self._first:
            self._first = False
            container = container_of(data[:16]) if self.no_encoding else None
            if container is not None:
                self._refuse(
                    "DATA-0000",
                    f"the stream starts with a {container} header, and without encoding this server takes raw "
                    "linear16 only: give encoding (linear16, mulaw or alaw) and sample_rate and send the samples "
                    "without a container",
                    1008,
                )
                return
        limit = self.door.config.max_chunk_bytes
        if len(data) > limit:
            self._refuse(
                "DATA-0000",
                f"a binary message of {len(data)} bytes is over the limit of {limit} bytes (max_chunk_bytes); "
                "send smaller messages",
                1009,
            )
            return
        self._sha.update(data)
        for piece in self._reframer.push_within(data, limit):
            self.stream.audio(piece)

    def _refuse(self, variant: str, description: str, close_code: int) -> None:
        self._refusal = (variant, description, close_code)
        self.stream.fail(RecognitionError(Code.INVALID_ARGUMENT, description, "audio_content"))

    def _control(self, text: str) -> None:
        if not self._text_messages.take():
            metrics.refused("max_text_messages_per_s")
            self._refuse(
                "DATA-0000",
                f"more than {self._text_messages.rate:g} text messages per second (max_text_messages_per_s); "
                "send controls as the call needs them",
                1008,
            )
            return
        try:
            control = messages.parse_control(text)
        except messages.SchemaError as e:
            self.send(messages.error("SchemaError", e.description, e.original))
            return
        if isinstance(control, ListenV1KeepAlive):
            self.stream.keep_alive()
        elif self._closing:
            return
        elif isinstance(control, ListenV1Finalize):
            if not self.stream.finalize(hold=True):  # past --max-finals-in-flight it waits its turn
                self._empty_finals()
        elif isinstance(control, ListenV1CloseStream):
            self._closing = True
            self.stream.finish()
        elif isinstance(control, ListenV1Configure):
            self._configure(control)

    def _empty_finals(self) -> None:
        """Finalize with no speech open: Deepgram still answers it, with an empty final per channel."""
        at = self.stream.heard_s
        for channel in range(self.options.result_channels):
            self.send(self._results(channel, at, at, True, False, True, "", 0.0, ()))

    def _configure(self, control: ListenV1Configure) -> None:
        """Keyterms replaced mid-stream (from the next utterance on); `features` are formatting hints and
        are left as the query set them."""
        if control.keyterms is None:
            self.send(messages.configure_success(self.request_id, None))
            return
        try:
            self.stream.update_keyterms(control.keyterms)
        except RecognitionError as e:
            code = (
                "CONFIGURE_RATE_LIMIT_EXCEEDED"
                if e.code is Code.RESOURCE_EXHAUSTED
                else "CONFIGURE_KEYTERM_LIMIT_EXCEEDED"
            )
            self.send(messages.configure_failure(self.request_id, code, e.message_for(FIELD_NAMES)))
            return
        self.send(messages.configure_success(self.request_id, control.keyterms))

    # --- stream -> client ---

    def _index(self, tag: int) -> int:
        """The core's channel tag (0 mixed down, 1..N separate) -> Deepgram's channel_index[0]."""
        return max(tag - 1, 0)

    def _results(
        self,
        channel: int,
        start: float,
        end: float,
        is_final: bool,
        speech_final: bool,
        from_finalize: bool,
        text: str,
        confidence: float,
        words: tuple[messages.Word, ...],
    ) -> BaseModel:
        return messages.results(
            request_id=self.request_id,
            model=self._model,
            channel=channel,
            channels=self.options.result_channels,
            start=start,
            duration=end - start,
            is_final=is_final,
            speech_final=speech_final,
            from_finalize=from_finalize,
            text=text,
            confidence=confidence,
            words=words,
            punctuated=self.options.punctuated,
            extra=self.options.extra,
        )

    def _utterance_ends(self) -> None:
        heard = self.stream.heard_s
        for channel, tracker in enumerate(self._trackers):
            last = tracker.advance(heard)
            if last is not None:
                self.send(messages.utterance_end(channel, len(self._trackers), last))

    async def _write(self) -> None:
        error: RecognitionError | None = None
        try:
            async for event in self.stream.events():
                if isinstance(event, Result):
                    self._result(event)
                elif isinstance(event, SpeechStarted):
                    channel = self._index(event.channel)
                    if self._trackers:
                        self._trackers[channel].on_speech_started(event.offset_s)
                    if self.options.vad_events:
                        self.send(
                            messages.speech_started(channel, self.options.result_channels, event.offset_s)
                        )
                elif isinstance(event, Reconnect):
                    self._draining = True
        except RecognitionError as e:
            error = e
        self._ending = True
        self._utterance_ends()
        self.send(
            messages.metadata(
                request_id=self.request_id,
                created=_now(),
                duration=self.stream.heard_s,
                channels=self.options.channels,
                sha256=self._sha.hexdigest(),
                model=self._model,
                warnings=self.options.warnings,
                tags=self.options.tags,
            )
        )
        if error is None:
            code = 1001 if self._draining else 1000
            await self._outbox.close(code, CLOSE_REASON[code].encode())
            return
        variant, description, close_code = self._error_terms(error)
        self.send(messages.error(variant, description))
        await self._outbox.close(close_code, variant.encode())

    def _result(self, r: Result) -> None:
        channel = self._index(r.channel)
        words = words_of(r)
        start, end = span(r, words)
        self.send(
            self._results(
                channel,
                start,
                end,
                r.is_final,
                r.is_final and r.ended_by is EndReason.SILENCE,
                r.ended_by is EndReason.FINALIZE,
                r.transcript,
                r.confidence,
                words,
            )
        )
        if self._trackers:
            self._trackers[channel].on_result(words[-1].end if words else None, r.is_final)
            self._utterance_ends()

    def _error_terms(self, e: RecognitionError) -> tuple[str, str, int]:
        """The core's error -> Deepgram's Error variant, its description and the close code."""
        if self._refusal is not None:
            return self._refusal
        message = e.message_for(FIELD_NAMES)
        if e.code is Code.OUT_OF_RANGE and "idle_audio_timeout" in e.message:
            return "NET-0001", message, 1011
        if e.code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE):
            return "DATA-0000", message, 1008
        return "NET-0000", message, 1011

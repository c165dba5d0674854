"""The Deepgram door's live half: `GET /v1/listen` upgraded to a WebSocket (see door.py for the
handshake's order and docs/operations.md, "The Deepgram door", for each refusal)."""

from __future__ import annotations

import asyncio
import hashlib
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
from service.doors.deepgram import messages
from service.doors.deepgram.common import (
    CLOSE_REASON,
    DOOR,
    FIELD_NAMES,
    FRAME_SLACK_BYTES,
    LISTEN_PATH,
    SUBPROTOCOL,
    DeepgramError,
    Listen,
    now,
    span,
    stream_settings,
    words_of,
)
from service.doors.deepgram.options import ListenOptions
from service.doors.deepgram.utterance_end import UtteranceEndTracker
from service.doors.shared.ws_deadline import Outbox
from service.recognizer.framing import Reframer, container_of
from service.recognizer.rate_limit import TokenBucket
from service.recognizer.recognizer import Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    EndReason,
    Reconnect,
    Result,
    SpeechStarted,
)

log = logging.getLogger("service.doors.deepgram")


async def listen(door: Listen, request: web.Request) -> web.StreamResponse:
    request_id = str(uuid.uuid4())
    stream: Stream | None = None
    try:
        try:
            caller = door.authenticate(request)
            options = door.options(request, live=True)
        except DeepgramError as e:
            code = Code.UNAUTHENTICATED if e.status == 401 else Code.INVALID_ARGUMENT
            door.recognizer.refused(DOOR, RecognitionError(code, e.err_msg))
            raise
        try:
            stream = door.recognizer.open_stream(lambda: stream_settings(options), door=DOOR, identity=caller)
        except RecognitionError as e:
            raise DeepgramError.of(e) from e
        ws = web.WebSocketResponse(
            protocols=(SUBPROTOCOL,),
            heartbeat=door.config.keepalive_time or None,
            max_msg_size=door.config.max_chunk_bytes + FRAME_SLACK_BYTES,
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
        call = LiveCall(door, request, ws, stream, options, request_id, "encoding" not in request.query)
        await call.run()
    finally:
        await stream.close()
    return ws


class LiveCall:
    """One live connection: a reader (client frames -> the stream) and a writer (the stream's events ->
    Deepgram's messages); both queue what they say to the connection's outbox, which writes it in order.
    The call is over when the writer has closed the socket, or at once when the client goes away (nothing
    can reach it any more)."""

    def __init__(
        self,
        door: Listen,
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
                created=now(),
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

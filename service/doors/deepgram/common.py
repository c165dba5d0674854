"""What the Deepgram door's live and pre-recorded halves share: its name and path, its refusal
(`DeepgramError`, the core's codes as HTTP statuses), the handshake's checks (credentials, the query),
the core's settings from the query, the model card and the words of a result."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata

from aiohttp import web

from service.doors.deepgram import messages
from service.doors.deepgram.options import ListenOptions, OptionError, parse_listen_options
from service.doors.shared.auth import TOKEN_SYNTAX, identity
from service.doors.shared.http_door import HttpDoor
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    DiarizationSettings,
    EndpointSettings,
    Formatting,
    Identity,
    RecognitionSettings,
    Result,
    StreamSettings,
)

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


def now() -> str:
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


class Listen(HttpDoor):
    """The door's state and the checks each request passes first (credentials, then the query)."""

    def model_card(self) -> messages.ModelCard:
        model = self.recognizer.model
        return messages.ModelCard(name=model.name if model is not None else "", version=_version())

    def authenticate(self, request: web.Request) -> Identity:
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

    def options(self, request: web.Request, live: bool) -> ListenOptions:
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

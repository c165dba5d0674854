"""The OpenAI-compatible HTTP door: `POST /v1/audio/transcriptions` (and `GET /v1/models`).

Routes on the HTTP port (service/runtime/http_server.py), in the same event loop as the grpc.aio server,
and a translation onto the core's `recognize()` (service/recognizer/recognizer.py), as gRPC `Recognize` is: the
same bearer tokens (service/doors/shared/auth.py TokenStore), the same limits (the upload may be at most
--max-recognize-bytes; every recording check applies to the audio), the same engine, and the same
metrics (asr_recognize_seconds, asr_utterances_total, asr_audio_seconds_total, asr_door_calls_total
{door="openai-http"}) plus asr_http_requests_total{code}. Refusals use OpenAI's error body, {"error":
{"message", "type", "param", "code"}}, with a message naming the field and the limit.

Form fields (multipart/form-data, as OpenAI's SDKs send them):
- `file`: a WAV or FLAC recording (the header says rate and channels; channels are mixed down).
- `model`: accepted and ignored whatever its value: the server runs one model (`GET /v1/models`
  names it), so clients written for `whisper-1` work unchanged.
- `language` (ISO-639-1 or BCP-47), `prompt`: as RecognitionConfig.language_code / prompt.
- `response_format`: json (default), text, verbose_json (segments; words when asked and available),
  srt, vtt.
- `timestamp_granularities[]`: segment, word (verbose_json only, as in OpenAI's API).
- `stream=true`: server-sent events, `transcript.text.delta` per utterance in time order, then
  `transcript.text.done` with the whole text. Events are sent once the recording is transcribed
  (Recognize answers a recording as a whole).
- `redact` (repeatable or comma-separated: pci, ssn, numbers): as RecognitionConfig.redact.
- `temperature` (0-1): 0 decodes greedily with openai-whisper's temperature fallback (a window whose text
  compresses like a loop or whose mean log-probability is below -1 is decoded again at 0.2, 0.4, ... 1.0);
  above 0 samples at that temperature; absent, the server's --temperatures. verbose_json reports per
  segment the temperature its utterance's decode was kept at. Fields this server does not know are ignored.

`word` granularity and `redact` pass straight into the core's RecognitionSettings (`word_times`, `redact`).
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import BodyPartReader, web
from asr.subtitles import Cue, srt, vtt

from service.doors.shared.auth import bearer_token, identity
from service.doors.shared.http_body import BODY_OVERHEAD_BYTES, BodyError, BoundedBody
from service.doors.shared.http_door import HttpDoor
from service.recognizer.recognizer import whisper_language
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import AudioFormat, Identity, RecognitionSettings, RecognizeResult, Redaction

log = logging.getLogger("service.doors.openai_http")
T = TypeVar("T")

DOOR = "openai-http"

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
MODELS_PATH = "/v1/models"
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
GRANULARITIES = ("segment", "word")
MAX_FIELD_BYTES = 64 << 10  # a text form field (prompt, language, ...): far above any real one
FORM_OVERHEAD_BYTES = BODY_OVERHEAD_BYTES  # multipart boundaries and text fields on top of the file itself
READ_CHUNK_BYTES = 1 << 16

# The core's code -> the HTTP status OpenAI's clients expect for it.
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.OUT_OF_RANGE: 413,  # a recording longer than the recording bound
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
    Code.CANCELLED: 499,
}
# The core's names of the settings this door's form fields carry, where they differ.
FIELD_NAMES = {"language_code": "language"}
_ERROR_TYPE = {
    401: "invalid_request_error",
    408: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
    500: "server_error",
}


class ApiError(Exception):
    """An HTTP refusal in OpenAI's error shape; `param` names the form field to blame."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPE.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        response = web.json_response(body, status=self.status, headers=headers)
        if self.status == 408:
            # Connection: close. aiohttp still reads (and drops) what the client sends for a few seconds
            # after the answer (lingering close), so that a client still sending can read it.
            response.force_close()
        return response


@dataclass
class TranscriptionRequest:
    """The parsed form of one `POST /v1/audio/transcriptions`."""

    audio: bytearray = field(default_factory=bytearray)  # the upload's one copy in memory
    filename: str = ""
    model: str = ""
    language: str = ""
    prompt: str = ""
    response_format: str = "json"
    granularities: set[str] = field(default_factory=set)
    stream: bool = False
    redact: list[str] = field(default_factory=list)
    temperature: float | None = None  # None: not sent (the server's --temperatures)


def _temperature(value: str) -> float:
    try:
        t = float(value.strip())
    except ValueError:
        raise ApiError(
            400, f"temperature must be a number from 0 to 1, got {value!r}", "temperature"
        ) from None
    if not 0 <= t <= 1:  # also refuses nan
        raise ApiError(400, f"temperature must be from 0 to 1, got {value!r}", "temperature")
    return t


def _on_off(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off", ""):
        return False
    raise ApiError(400, f"{name} must be true or false, got {value!r}", name)


async def _read_parts(
    request: web.Request, body: BoundedBody, max_file_bytes: int, limit_note: str
) -> tuple[TranscriptionRequest, bool]:
    """The form's fields, each read within the body's bounds; the file at most `max_file_bytes`."""
    form = TranscriptionRequest()
    seen_file = False
    reader = await body.read(request.multipart())
    while (part := await body.read(reader.next())) is not None:
        if not isinstance(part, BodyPartReader):
            raise ApiError(400, "nested multipart bodies are not accepted")
        name = part.name or ""
        bound = max_file_bytes if name == "file" else MAX_FIELD_BYTES
        data = bytearray()
        while chunk := await body.read(part.read_chunk(READ_CHUNK_BYTES)):
            data += chunk
            if len(data) > bound:
                if name == "file":
                    raise ApiError(413, f"file is over {limit_note}", "file")
                raise ApiError(
                    400, f"{name} is over the limit of {MAX_FIELD_BYTES} bytes for a form field", name
                )
        if name == "file":
            seen_file = True
            form.filename = part.filename or ""
            form.audio = data
            continue
        value = data.decode("utf-8", errors="replace")
        if name == "model":
            form.model = value
        elif name == "language":
            form.language = value
        elif name == "prompt":
            form.prompt = value
        elif name == "response_format":
            form.response_format = value.strip() or "json"
        elif name in ("timestamp_granularities[]", "timestamp_granularities"):
            form.granularities.update(g.strip() for g in value.split(",") if g.strip())
        elif name == "stream":
            form.stream = _on_off("stream", value)
        elif name in ("redact", "redact[]"):
            form.redact.extend(r.strip().lower() for r in value.split(",") if r.strip())
        elif name == "temperature":
            form.temperature = _temperature(value)
        # anything else (include[], chunking_strategy, ...) is ignored, as documented
    return form, seen_file


async def read_form(
    request: web.Request, max_file_bytes: int, read_timeout: float = 30.0, min_rate: int = 0
) -> TranscriptionRequest:
    """Read the multipart form as it streams: an upload over `max_file_bytes` is refused as soon as it is
    (413), a slow one once it is too slow (408), a malformed one at once (400). The file is read into one
    buffer, which the Recognize core reads in place (no copy)."""
    limit_note = f"the limit of {max_file_bytes} bytes (max_recognize_bytes)"

    def too_large(declared: int | None) -> str:
        if declared is not None:
            return f"file: the request of {declared} bytes is over {limit_note}"
        return f"file: the request is over {limit_note} plus {FORM_OVERHEAD_BYTES} bytes for the rest of the form"

    try:
        body = BoundedBody(request, max_file_bytes + FORM_OVERHEAD_BYTES, too_large, read_timeout, min_rate)
        if not request.content_type.startswith("multipart/"):
            raise ApiError(
                400, f"send multipart/form-data with a 'file' field (got Content-Type {request.content_type})"
            )
        form, seen_file = await _read_parts(request, body, max_file_bytes, limit_note)
    except BodyError as e:
        if e.status == 413:
            raise ApiError(413, e.message, "file") from e
        if e.status == 408:
            raise ApiError(408, e.message, code="request_timeout") from e
        raise ApiError(400, f"malformed multipart/form-data body: {e.message}") from e
    if not seen_file or not form.audio:
        raise ApiError(400, "file is required: a WAV or FLAC recording in the 'file' form field", "file")
    if form.response_format not in RESPONSE_FORMATS:
        raise ApiError(
            400,
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {form.response_format!r}",
            "response_format",
        )
    unknown = sorted(form.granularities - set(GRANULARITIES))
    if unknown:
        raise ApiError(
            400,
            f"timestamp_granularities[] must be segment or word, got {', '.join(map(repr, unknown))}",
            "timestamp_granularities[]",
        )
    if form.granularities and form.response_format != "verbose_json":
        raise ApiError(
            400,
            "timestamp_granularities[] needs response_format=verbose_json",
            "timestamp_granularities[]",
        )
    if form.stream and form.response_format not in ("json", "text"):
        raise ApiError(
            400,
            f"stream=true sends text events; it takes response_format json or text, not {form.response_format}",
            "stream",
        )
    return form


def encoding_of(audio: bytes | bytearray) -> str:
    """The file's container from its first bytes (the server reads rate and channels from the header)."""
    if audio[:4] == b"fLaC":
        return "FLAC"
    if audio[:4] == b"RIFF" and audio[8:12] == b"WAVE":
        return "WAV"
    raise ApiError(
        400,
        f"file: unsupported audio format (first bytes {bytes(audio[:4])!r}); send a WAV or FLAC recording",
        "file",
    )


def recognition_settings(form: TranscriptionRequest, language: str) -> RecognitionSettings:
    """The core's settings for this form."""
    redact = set()
    for name in form.redact:
        try:
            redact.add(Redaction[name.upper()])
        except KeyError:
            raise ApiError(400, f"redact must be pci, ssn or numbers, got {name!r}", "redact") from None
    return RecognitionSettings(
        format=AudioFormat(encoding_of(form.audio)),
        language=language,
        prompt=form.prompt,
        # segments for verbose_json and captions; plain text needs none
        segments=form.response_format in ("verbose_json", "srt", "vtt"),
        word_times="word" in form.granularities,
        redact=frozenset(redact),
        temperature=form.temperature,
    )


# --- rendering the core's RecognizeResult ---


def _s(seconds: float) -> float:
    """Seconds as the asr.v1 door's Durations carry them (whole nanoseconds), to the millisecond."""
    return round(round(seconds * 1e9) / 1e9, 3)


def transcript_text(response: RecognizeResult) -> str:
    return " ".join(r.transcript for r in response.results).strip()


def cues(response: RecognizeResult) -> list[Cue]:
    """Whisper's segments where the results carry them, else one cue per utterance."""
    out: list[Cue] = []
    for r in response.results:
        if r.segments:
            out.extend(Cue(_s(s.start_s), _s(s.end_s), s.text) for s in r.segments if s.text)
        else:
            out.append(Cue(_s(r.start_s), _s(r.end_s), r.transcript))
    return out


def _compression_ratio(text: str) -> float:
    data = text.encode()
    return round(len(data) / len(zlib.compress(data)), 3) if data else 0.0


def verbose_json(response: RecognizeResult, with_words: bool) -> dict[str, Any]:
    """OpenAI's verbose_json. Per segment: times, text, the utterance's avg_logprob (Whisper's mean token
    log-probability) and compression_ratio; `tokens` and `no_speech_prob` are left out (the server's VAD,
    not Whisper's no-speech token, decides what is speech)."""
    segments: list[dict[str, Any]] = []
    words: list[dict[str, Any]] = []
    language = ""
    for r in response.results:
        language = language or r.language
        avg_logprob = round(math.log(r.confidence), 4) if r.confidence > 0 else None
        parts = [(s.text, _s(s.start_s), _s(s.end_s)) for s in r.segments] or [
            (r.transcript, _s(r.start_s), _s(r.end_s))
        ]
        for text, start, end in parts:
            segments.append(
                {
                    "id": len(segments),
                    "seek": round(start * 100),  # in 10 ms frames, as Whisper counts
                    "start": start,
                    "end": end,
                    "text": text,
                    "temperature": r.temperature,
                    "avg_logprob": avg_logprob,
                    "compression_ratio": _compression_ratio(text),
                }
            )
        if with_words:
            for w in r.words:
                if w.start_s is not None and w.end_s is not None:
                    words.append({"word": w.text, "start": _s(w.start_s), "end": _s(w.end_s)})
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": language_name(language),
        "duration": _s(response.duration_s),
        "text": transcript_text(response),
        "segments": segments,
        "usage": usage(response),
    }
    if with_words:
        body["words"] = words
    return body


def language_name(code: str) -> str:
    """Whisper's code -> the English name OpenAI's verbose_json gives ("en" -> "english")."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return str(LANGUAGES.get(code, code))


def usage(response: RecognizeResult) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(_s(response.duration_s))}


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


# --- the door ---

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OpenAIHttpDoor(HttpDoor):
    """The door's routes, registered on the HTTP port's application (runtime/http_server.py)."""

    def register(self, app: web.Application) -> None:
        app.router.add_post(TRANSCRIPTIONS_PATH, self._errors(self.transcriptions))
        app.router.add_get(MODELS_PATH, self._errors(self.models))

    def _errors(self, handler: Handler) -> Handler:
        """Refusals in OpenAI's error shape."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as e:
                return e.response()
            except web.HTTPRequestEntityTooLarge as e:
                limit = self.config.max_recognize_bytes
                return ApiError(
                    413, f"file is over the limit of {limit} bytes (max_recognize_bytes) ({e.text})", "file"
                ).response()
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                return ApiError(e.status, f"{request.method} {request.path}: {e.reason}").response()

        return handle

    def _authenticate(self, request: web.Request) -> Identity:
        token = bearer_token(request.headers.items())
        if not self.tokens.enabled:
            return identity(None, request.remote or "")
        if token is None:
            reason = "missing credentials: send the header 'Authorization: Bearer <token>'"
        elif not token:
            reason = "malformed Authorization header: expected 'Bearer <token>'"
        elif not self.tokens.check(token):
            reason = "invalid bearer token"
        else:
            return identity(token, request.remote or "")
        raise ApiError(401, reason, code="invalid_api_key")

    # --- handlers ---

    async def models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        model = self.recognizer.model
        data = [] if model is None else [{"id": model.name, "object": "model", "owned_by": "callcenter-asr"}]
        return web.json_response({"object": "list", "data": data})

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        caller = self._authenticate(request)  # before a byte of the body is read
        c = self.config
        form = await read_form(request, c.max_recognize_bytes, c.http_read_timeout, c.http_min_upload_rate)
        model = self.recognizer.model
        language = form.language.strip()
        if model is not None and language:
            try:
                language = whisper_language(language, model) or ""
            except ValueError as e:
                raise ApiError(400, str(e).replace("language_code", "language", 1), "language") from e
        settings = recognition_settings(form, language)
        try:
            # The core reads the upload where read_form put it: one copy in memory.
            response = await self.recognizer.recognize(form.audio, settings, door=DOOR, identity=caller)
        except RecognitionError as e:
            status = HTTP_STATUS.get(e.code, 500)
            param = FIELD_NAMES.get(e.field or "") or ("file" if status in (400, 413) else None)
            raise ApiError(status, e.message_for(FIELD_NAMES), param) from e
        if form.stream:
            return await self._stream(request, response)
        return self._render(form, response)

    def _render(self, form: TranscriptionRequest, response: RecognizeResult) -> web.Response:
        fmt = form.response_format
        if fmt == "json":
            return web.json_response({"text": transcript_text(response), "usage": usage(response)})
        if fmt == "verbose_json":
            return web.json_response(verbose_json(response, "word" in form.granularities))
        if fmt == "srt":
            return web.Response(text=srt(cues(response)), content_type="application/x-subrip")
        if fmt == "vtt":
            return web.Response(text=vtt(cues(response)), content_type="text/vtt")
        return web.Response(text=transcript_text(response) + "\n", content_type="text/plain")

    async def _stream(self, request: web.Request, response: RecognizeResult) -> web.StreamResponse:
        sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await sse.prepare(request)
        first = True
        for r in response.results:
            text = r.transcript
            if not text:
                continue
            await sse.write(_sse({"type": "transcript.text.delta", "delta": text if first else " " + text}))
            first = False
        await sse.write(_sse({"type": "transcript.text.done", "text": transcript_text(response)}))
        await sse.write_eof()
        return sse

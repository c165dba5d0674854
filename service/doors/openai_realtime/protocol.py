"""OpenAI Realtime, transcription sessions: the protocol side of the `/v1/realtime` door, as plain values.

Client events and the session object are read against the `openai` package's own types
(openai/types/realtime/): a field the type does not have is refused as `unknown_parameter`, a value of the
wrong type or outside the type's literals as `invalid_type` / `invalid_value`, each naming the parameter by
its path (`session.audio.input.format.rate`), as OpenAI's server answers. What this server cannot do, and
whose silent absence would change what a result means, is refused naming it; what is only a hint is
accepted and the effective session (`session.updated`) says what is in force.

Nothing here touches the recognition core or the socket: door.py does.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import string
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from openai.types.realtime import (
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCommitEvent,
    RealtimeTranscriptionSessionCreateRequest,
    SessionUpdateEvent,
)
from pydantic import BaseModel

INCLUDE_LOGPROBS = "item.input_audio_transcription.logprobs"
PCM_RATE = 24000  # audio/pcm is 16-bit little-endian mono at 24 kHz, the only rate the protocol has
FORMATS: Mapping[str, tuple[str, int]] = {  # protocol format -> (core encoding, sample rate)
    "audio/pcm": ("LINEAR16", PCM_RATE),
    "audio/pcmu": ("MULAW", 8000),
    "audio/pcma": ("ALAW", 8000),
}
# Models whose results mean something this server does not produce (speaker labels).
REFUSED_MODELS: Mapping[str, str] = {
    "gpt-4o-transcribe-diarize": "diarization (speaker labels) is not supported; use one session per speaker's "
    "channel, or a transcription model such as gpt-4o-transcribe",
}
# server_vad's defaults, as OpenAI documents them.
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_PADDING_MS = 300
DEFAULT_SILENCE_DURATION_MS = 500
MAX_SILENCE_DURATION_MS = 10_000
MAX_PREFIX_PADDING_MS = 10_000
MAX_KEYWORDS = 100


class ProtocolError(Exception):
    """An `error` event's content: OpenAI's (type, code, message, param), and the client event it answers."""

    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
        event_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.type, self.event_id = code, message, param, type, event_id

    def error(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "event_id": self.event_id,
        }


# --- checking a client's JSON against the vendor's types ---


def _members(annotation: Any) -> list[Any]:
    """The alternatives of an annotation (Optional/Union/Annotated unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _models(annotation: Any) -> list[type[BaseModel]]:
    return [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def _type_literal(model: type[BaseModel]) -> tuple[str, ...]:
    field = model.model_fields.get("type")
    if field is None:
        return ()
    return tuple(
        v for m in _members(field.annotation) if typing.get_origin(m) is Literal for v in typing.get_args(m)
    )


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"


def check_object(model: type[BaseModel], data: Any, path: str) -> None:
    """Raise ProtocolError unless `data` is what `model` (a vendor type) describes, every key a field of it."""
    if not isinstance(data, dict):
        raise ProtocolError(
            "invalid_type",
            f"Invalid type for '{path}': expected an object, but got {_kind(data)} instead.",
            path,
        )
    for key, value in data.items():
        field = model.model_fields.get(key)
        where = f"{path}.{key}"
        if field is None:
            raise ProtocolError("unknown_parameter", f"Unknown parameter: '{where}'.", where)
        _check_value(field.annotation, value, where)
    for name, field in model.model_fields.items():
        if field.is_required() and name not in data:
            raise ProtocolError(
                "missing_required_parameter",
                f"Missing required parameter: '{path}.{name}'.",
                f"{path}.{name}",
            )


CLIENT_EVENT_TYPES: Mapping[str, type[BaseModel]] = {
    "session.update": SessionUpdateEvent,
    "input_audio_buffer.append": InputAudioBufferAppendEvent,
    "input_audio_buffer.commit": InputAudioBufferCommitEvent,
    "input_audio_buffer.clear": InputAudioBufferClearEvent,
}


def check_event(message: dict[str, Any]) -> None:
    """A client event's own fields against the vendor's type for its `type` (one of CLIENT_EVENT_TYPES;
    a session.update's `session` is checked by apply_session_update). Parameters are named as OpenAI
    names them, from the event's top level (`audio`)."""
    model = CLIENT_EVENT_TYPES[message["type"]]
    for key, value in message.items():
        field = model.model_fields.get(key)
        if field is None:
            raise ProtocolError("unknown_parameter", f"Unknown parameter: '{key}'.", key)
        if key not in ("type", "session"):
            _check_value(field.annotation, value, key)
    for name, field in model.model_fields.items():
        if field.is_required() and name not in message:
            raise ProtocolError("missing_required_parameter", f"Missing required parameter: '{name}'.", name)


def _check_value(annotation: Any, value: Any, path: str) -> None:
    models = _models(annotation)
    if models and isinstance(value, dict):
        if len(models) > 1:
            kind = value.get("type")
            chosen = [m for m in models if kind in _type_literal(m)]
            if not chosen:
                supported = ", ".join(repr(v) for m in models for v in _type_literal(m))
                raise ProtocolError(
                    "invalid_value",
                    f"Invalid value for '{path}.type': {kind!r}. Supported values are: {supported}.",
                    f"{path}.type",
                )
            models = chosen
        check_object(models[0], value, path)
        return
    try:
        pydantic.TypeAdapter(annotation).validate_python(value, strict=True)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        code = "invalid_type" if first["type"].endswith(("_type", "_parsing")) else "invalid_value"
        raise ProtocolError(
            code, f"Invalid value for '{path}': {first['msg']} (got {value!r}).", path
        ) from None


# --- the session ---


@dataclass(frozen=True)
class TurnDetection:
    """server_vad, onto the core's endpointing: speech starts above `threshold` (ends below threshold - 0.15,
    as silero-vad does), a turn ends after `silence_duration_ms` of silence, `prefix_padding_ms` of audio
    before the speech is kept."""

    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = DEFAULT_PREFIX_PADDING_MS
    silence_duration_ms: int = DEFAULT_SILENCE_DURATION_MS


@dataclass(frozen=True)
class Session:
    """A transcription session's settings as plain values: what the door opens a core stream with."""

    format: str = "audio/pcm"
    model: str = ""  # the name the client asked for: it selects the model this server serves
    language: str = ""  # as the client spelled it ("" = the model's default or detection)
    prompt: str = ""
    keyterms: tuple[str, ...] = ()
    turn_detection: TurnDetection | None = TurnDetection()  # None: the client commits each turn
    logprobs: bool = False

    @property
    def encoding(self) -> str:
        return FORMATS[self.format][0]

    @property
    def sample_rate(self) -> int:
        return FORMATS[self.format][1]

    def bytes_to_ms(self, n: int) -> float:
        """Milliseconds of audio in `n` bytes of this format."""
        sample_bytes = 2 if self.encoding == "LINEAR16" else 1
        return n / sample_bytes / self.sample_rate * 1000


def _number(value: Any, path: str, low: float, high: float) -> float:
    if not low <= value <= high or (isinstance(value, float) and math.isnan(value)):
        raise ProtocolError(
            "invalid_value",
            f"Invalid value for '{path}': {value!r}; it must be between {low:g} and {high:g}.",
            path,
        )
    return float(value)


def _turn_detection(data: dict[str, Any] | None, current: TurnDetection | None) -> TurnDetection | None:
    path = "session.audio.input.turn_detection"
    if data is None:
        return None
    if data.get("idle_timeout_ms") is not None:
        raise ProtocolError(
            "invalid_value",
            f"'{path}.idle_timeout_ms' is not supported: a transcription session has no model response for the "
            "idle timeout to trigger; leave it null",
            f"{path}.idle_timeout_ms",
        )
    # create_response / interrupt_response concern model responses, which a transcription session has none
    # of; semantic_vad is served by server_vad's endpointing (its eagerness is a hint). Only the fields
    # given change (OpenAI's update rule); a switch from none to VAD starts from the defaults.
    base = current or TurnDetection()
    changes: dict[str, Any] = {}
    if data.get("threshold") is not None:
        changes["threshold"] = _number(data["threshold"], f"{path}.threshold", 0.0, 1.0)
    if data.get("prefix_padding_ms") is not None:
        changes["prefix_padding_ms"] = int(
            _number(data["prefix_padding_ms"], f"{path}.prefix_padding_ms", 0, MAX_PREFIX_PADDING_MS)
        )
    if data.get("silence_duration_ms") is not None:
        changes["silence_duration_ms"] = int(
            _number(data["silence_duration_ms"], f"{path}.silence_duration_ms", 1, MAX_SILENCE_DURATION_MS)
        )
    return dataclasses.replace(base, **changes)


def apply_session_update(current: Session, session: Any) -> Session:
    """The session after a `session.update`'s `session`: checked whole against the vendor's transcription
    session type, then only the fields it carries change (OpenAI's rule; `turn_detection: null` turns
    server endpointing off). Raises ProtocolError naming the parameter; the session is then unchanged."""
    if not isinstance(session, dict):
        raise ProtocolError(
            "invalid_type",
            f"Invalid type for 'session': expected an object, but got {_kind(session)} instead.",
            "session",
        )
    kind = session.get("type")
    if kind != "transcription":
        raise ProtocolError(
            "invalid_value",
            f"Invalid value for 'session.type': {kind!r}. This server serves transcription sessions only "
            "(connect with ?intent=transcription and send session.type 'transcription').",
            "session.type",
        )
    check_object(RealtimeTranscriptionSessionCreateRequest, session, "session")
    changes: dict[str, Any] = {}
    if "include" in session:
        changes["logprobs"] = INCLUDE_LOGPROBS in (session["include"] or ())
    audio_input = (session.get("audio") or {}).get("input") or {}
    fmt = audio_input.get("format")
    if fmt:
        changes["format"] = fmt.get("type") or current.format
    if "transcription" in audio_input:
        changes.update(_transcription(audio_input["transcription"]))
    if "turn_detection" in audio_input:
        changes["turn_detection"] = _turn_detection(audio_input["turn_detection"], current.turn_detection)
    # noise_reduction: a hint (this server applies none; session.updated says so)
    return dataclasses.replace(current, **changes)


def _transcription(data: dict[str, Any] | None) -> dict[str, Any]:
    path = "session.audio.input.transcription"
    if data is None:  # "turn transcription off": this server's sessions exist to transcribe; back to defaults
        return {"model": "", "language": "", "prompt": "", "keyterms": ()}
    changes: dict[str, Any] = {}
    model = data.get("model")
    if model is not None:
        if model in REFUSED_MODELS:
            raise ProtocolError(
                "invalid_value",
                f"Invalid value for '{path}.model': {model!r}: {REFUSED_MODELS[model]}.",
                f"{path}.model",
            )
        changes["model"] = model
    language, languages = data.get("language"), data.get("languages")
    if languages:
        if len(languages) > 1 or (language and languages[0] != language):
            raise ProtocolError(
                "invalid_value",
                f"Invalid value for '{path}.languages': {languages!r}: one language per session is supported "
                "(its transcript is in that language, or the one the model detects when none is given)",
                f"{path}.languages",
            )
        language = languages[0]
    if language is not None:
        changes["language"] = language
    if data.get("prompt") is not None:
        changes["prompt"] = data["prompt"]
    keywords = data.get("keywords")
    if keywords is not None:
        if len(keywords) > MAX_KEYWORDS:
            raise ProtocolError(
                "invalid_value",
                f"Invalid value for '{path}.keywords': {len(keywords)} keywords, over the limit of {MAX_KEYWORDS}.",
                f"{path}.keywords",
            )
        changes["keyterms"] = tuple(k.strip() for k in keywords if k.strip())
    # delay: a latency hint; deltas here follow the interims the core produces
    return changes


def session_object(session: Session, session_id: str, served_model: str) -> dict[str, Any]:
    """The effective session, as `session.created` / `session.updated` carry it: `transcription.model` is
    the model that serves it, `noise_reduction` is null (none is applied), semantic_vad shows as the
    server_vad that serves it."""
    td = session.turn_detection
    turn_detection = (
        None
        if td is None
        else {
            "type": "server_vad",
            "threshold": td.threshold,
            "prefix_padding_ms": td.prefix_padding_ms,
            "silence_duration_ms": td.silence_duration_ms,
            "idle_timeout_ms": None,
            "create_response": False,
            "interrupt_response": False,
        }
    )
    fmt: dict[str, Any] = {"type": session.format}
    if session.format == "audio/pcm":
        fmt["rate"] = PCM_RATE
    transcription: dict[str, Any] = {"model": served_model, "language": session.language or None}
    transcription["prompt"] = session.prompt
    if session.keyterms:
        transcription["keywords"] = list(session.keyterms)
    return {
        "type": "transcription",
        "id": session_id,
        "object": "realtime.transcription_session",
        "audio": {
            "input": {
                "format": fmt,
                "transcription": transcription,
                "noise_reduction": None,
                "turn_detection": turn_detection,
            }
        },
        "include": [INCLUDE_LOGPROBS] if session.logprobs else [],
    }


# --- ids and server events ---

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    """An id shaped like OpenAI's (`event_…`, `item_…`, `sess_…`): the prefix and 21 random characters."""
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(21))


def event(type: str, **fields: Any) -> dict[str, Any]:
    """A server event: every one carries its own `event_id`."""
    return {"type": type, "event_id": new_id("event"), **fields}


def error_event(e: ProtocolError) -> dict[str, Any]:
    return event("error", error=e.error())


def logprobs_of(words: Iterable[tuple[str, float]]) -> list[dict[str, Any]]:
    """(word, confidence) -> OpenAI's log-probability entries, one per word (the core measures a word's
    confidence as its tokens' mean probability): `token` is the word as it reads in the transcript."""
    out = []
    for i, (word, confidence) in enumerate(words):
        token = word if i == 0 else " " + word
        out.append(
            {"token": token, "bytes": list(token.encode()), "logprob": math.log(max(confidence, 1e-12))}
        )
    return out


def usage(seconds: float) -> dict[str, Any]:
    """Usage as OpenAI reports it for models billed by input duration (whisper-1)."""
    return {"type": "duration", "seconds": round(seconds, 3)}


# --- a turn's transcript as increments ---


def stable_words(previous: Sequence[str], current: Sequence[str]) -> list[str]:
    """The words two consecutive hypotheses of one utterance agree on, from its start (LocalAgreement-2, as
    whisper_streaming commits text), never the newest hypothesis's last word: it is cut where the audio
    stopped and the next hypothesis often changes or punctuates it."""
    agreed: list[str] = []
    for a, b in zip(previous, current[:-1], strict=False):
        if a != b:
            break
        agreed.append(b)
    return agreed


class TurnText:
    """One turn's transcript as `delta` increments whose concatenation is the start of its transcript.

    A delta goes out only for text that cannot be taken back: the finals of the turn's utterances, and the
    words two consecutive interims of the current utterance agree on (stable_words). Whenever that stable
    text extends what was sent, the extension is the next delta. If a final revises words already sent
    (the interims agreed on a word the final decode changed) nothing more is sent for the turn: a delta
    cannot take text back, and the completed transcript is the final's text, as every door gives it.
    `revised` says it happened (counted in the door's metrics)."""

    def __init__(self) -> None:
        self.finals: list[str] = []
        self.sent = ""
        self.revised = False
        self._last_interim: list[str] = []

    @property
    def transcript(self) -> str:
        return " ".join(t for t in self.finals if t)

    def _advance(self, stable: str) -> str | None:
        if self.revised:
            return None
        if not stable.startswith(self.sent):
            self.revised = True
            return None
        delta = stable[len(self.sent) :]
        if not delta:
            return None
        self.sent = stable
        return delta

    def interim(self, text: str) -> str | None:
        """An interim hypothesis of the current utterance -> the delta it makes certain, if any."""
        words = text.split()
        agreed = stable_words(self._last_interim, words)
        self._last_interim = words
        if not agreed:
            return None
        return self._advance(" ".join([*(t for t in self.finals if t), " ".join(agreed)]))

    def final(self, text: str) -> str | None:
        """The current utterance's final -> the delta that completes the turn's text so far, if any."""
        self.finals.append(text.strip())
        self._last_interim = []
        return self._advance(self.transcript)

"""Deepgram's messages, built with the deepgram-sdk's own types from plain values, and the client's control
messages read with them.

Server -> client (live): `Results`, `Metadata`, `SpeechStarted`, `UtteranceEnd`, `Error`,
`ConfigureSuccess` / `ConfigureFailure`; pre-recorded: the `ListenV1Response` body. Every message is
validated by its pydantic type before it leaves, so a field the SDK requires cannot be missing.
Client -> server: `KeepAlive`, `Finalize`, `CloseStream`, `Configure` (JSON text frames; audio is binary).

Words: Deepgram's `word` is the bare lowercase word, `punctuated_word` the word as written (with
punctuate or smart_format); the transcript is the punctuated text then, else the bare words joined.
Times are seconds from the stream's start.
"""

from __future__ import annotations

import json
import string
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, Unpack

from deepgram.listen.v1.types import (
    ListenV1CloseStream,
    ListenV1Configure,
    ListenV1ConfigureFailure,
    ListenV1ConfigureSuccess,
    ListenV1Error,
    ListenV1Finalize,
    ListenV1KeepAlive,
    ListenV1Metadata,
    ListenV1Results,
    ListenV1SpeechStarted,
    ListenV1UtteranceEnd,
)
from deepgram.types import ListenV1Response
from pydantic import BaseModel, ValidationError

from service.doors.deepgram.options import OptionWarning
from service.vocabulary.redaction import Kind

MAX_ECHOED_CHARS = 256  # of a client message that could not be read, echoed back in Error.message
_PLACEHOLDERS = frozenset(k.placeholder for k in Kind)
# Kept inside and at the edges of a bare word: "$25", "15%", "3.5", "212-555-0198", "don't".
_STRIP = "".join(c for c in string.punctuation if c not in "$%'") + "¿¡…“”‘’«»"


@dataclass(frozen=True)
class ModelCard:
    """What `model_info` says about the model this server serves, whatever model the client named."""

    name: str
    version: str
    arch: str = "whisper"

    @property
    def uuid(self) -> str:
        """Stable per model name, as Deepgram's model UUIDs are per model."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"callcenter-asr:model:{self.name}"))

    def info(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "arch": self.arch}


@dataclass(frozen=True)
class Word:
    text: str  # as the model (then formatting and redaction) wrote it
    start: float
    end: float
    confidence: float
    speaker: int | None = None  # diarize=true


def bare(text: str) -> str:
    """Deepgram's `word`: lowercase, no punctuation around it; a redaction placeholder stays as it is."""
    word = text.strip()
    for placeholder in _PLACEHOLDERS:
        if placeholder in word:
            return placeholder
    return word.strip(_STRIP).lower() or word.lower()


def transcript_of(text: str, words: Sequence[Word], punctuated: bool) -> str:
    if punctuated:
        return text.strip()
    return " ".join(bare(part) for part in ([w.text for w in words] if words else text.split()))


def _word(w: Word, punctuated: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "word": bare(w.text),
        "start": round(w.start, 3),
        "end": round(w.end, 3),
        "confidence": round(w.confidence, 4),
    }
    if punctuated:
        out["punctuated_word"] = w.text.strip()
    if w.speaker is not None:
        out["speaker"] = w.speaker
    return out


def dump(message: BaseModel) -> str:
    """One message as the text frame (or body) the client reads: every field set or defaulted, no nulls."""
    return message.model_dump_json(by_alias=True, exclude_none=True)


def results(
    *,
    request_id: str,
    model: ModelCard,
    channel: int,
    channels: int,
    start: float,
    duration: float,
    is_final: bool,
    speech_final: bool,
    from_finalize: bool,
    text: str,
    confidence: float,
    words: Sequence[Word],
    punctuated: bool,
    extra: Mapping[str, str] | None = None,
) -> ListenV1Results:
    """A `Results` message: one channel's interim (is_final false) or final transcript of one stretch of
    audio, [start, start + duration) from the stream's start."""
    metadata: dict[str, Any] = {
        "request_id": request_id,
        "model_info": model.info(),
        "model_uuid": model.uuid,
    }
    if extra:
        metadata["extra"] = dict(extra)
    return ListenV1Results.model_validate(
        {
            "type": "Results",
            "channel_index": [channel, channels],
            "duration": round(max(duration, 0.0), 3),
            "start": round(start, 3),
            "is_final": is_final,
            "speech_final": speech_final,
            "from_finalize": from_finalize,
            "channel": {
                "alternatives": [
                    {
                        "transcript": transcript_of(text, words, punctuated),
                        "confidence": round(confidence, 4),
                        "words": [_word(w, punctuated) for w in words],
                    }
                ]
            },
            "metadata": metadata,
        }
    )


def _warnings(warnings: Sequence[OptionWarning]) -> list[dict[str, str]]:
    return [{"parameter": w.parameter, "type": w.type, "message": w.message} for w in warnings]


class MetadataFields(TypedDict):
    """What a live stream's `Metadata` and a pre-recorded answer's `metadata` both say."""

    request_id: str
    created: str
    duration: float
    channels: int
    sha256: str
    model: ModelCard
    warnings: NotRequired[Sequence[OptionWarning]]
    tags: NotRequired[Sequence[str]]


def metadata(**fields: Unpack[MetadataFields]) -> ListenV1Metadata:
    """The `Metadata` a live stream ends with (after CloseStream): the audio it received, the model."""
    return ListenV1Metadata.model_validate({"type": "Metadata", **_metadata_fields(fields)})


def _metadata_fields(fields: MetadataFields) -> dict[str, Any]:
    model, warnings, tags = fields["model"], fields.get("warnings", ()), fields.get("tags", ())
    body: dict[str, Any] = {
        "transaction_key": "deprecated",
        "request_id": fields["request_id"],
        "sha256": fields["sha256"],
        "created": fields["created"],
        "duration": round(fields["duration"], 3),
        "channels": fields["channels"],
        "models": [model.uuid],
        "model_info": {model.uuid: model.info()},
    }
    if warnings:
        body["warnings"] = _warnings(warnings)
    if tags:
        body["tags"] = list(tags)
    return body


def speech_started(channel: int, channels: int, timestamp: float) -> ListenV1SpeechStarted:
    return ListenV1SpeechStarted(
        type="SpeechStarted", channel=[channel, channels], timestamp=round(timestamp, 3)
    )


def utterance_end(channel: int, channels: int, last_word_end: float) -> ListenV1UtteranceEnd:
    return ListenV1UtteranceEnd(
        type="UtteranceEnd", channel=[channel, channels], last_word_end=round(last_word_end, 3)
    )


def error(variant: str, description: str, message: str | None = None) -> ListenV1Error:
    """An `Error` message; the fatal ones are followed by a close frame (docs/operations.md)."""
    if message is None:
        return ListenV1Error(type="Error", variant=variant, description=description)
    return ListenV1Error(type="Error", variant=variant, description=description, message=message)


def configure_success(request_id: str, keyterms: Sequence[str] | None) -> ListenV1ConfigureSuccess:
    if keyterms is None:
        return ListenV1ConfigureSuccess(type="ConfigureSuccess", request_id=request_id)
    return ListenV1ConfigureSuccess(type="ConfigureSuccess", request_id=request_id, keyterms=list(keyterms))


def configure_failure(request_id: str, code: str, description: str) -> ListenV1ConfigureFailure:
    return ListenV1ConfigureFailure(
        type="ConfigureFailure", request_id=request_id, code=code, description=description
    )


# --- client control messages -----------------------------------------------------------------------


class SchemaError(ValueError):
    """A text frame that is no control message Deepgram defines: answered with an `Error` of variant
    SchemaError (the stream goes on)."""

    def __init__(self, description: str, original: str) -> None:
        super().__init__(description)
        self.description = description
        self.original = original[:MAX_ECHOED_CHARS]


Control = ListenV1KeepAlive | ListenV1Finalize | ListenV1CloseStream | ListenV1Configure
_CONTROLS: dict[str, type[Control]] = {
    "KeepAlive": ListenV1KeepAlive,
    "Finalize": ListenV1Finalize,
    "CloseStream": ListenV1CloseStream,
    "Configure": ListenV1Configure,
}


def parse_control(text: str) -> Control:
    """One client text frame -> its control message (raises SchemaError)."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        raise SchemaError(f"the text message is not JSON: {e}", text) from None
    kind = body.get("type") if isinstance(body, dict) else None
    model = _CONTROLS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise SchemaError(
            f"unknown message type {kind!r}; text messages are one of {', '.join(_CONTROLS)} (audio is binary)",
            text,
        )
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise SchemaError(f"{kind}: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}", text) from None


# --- pre-recorded ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Utterance:
    """One final of a recording, for the pre-recorded response."""

    channel: int
    start: float
    end: float
    text: str
    confidence: float
    words: tuple[Word, ...]
    speaker: int | None = None  # diarize=true


def prerecorded(
    *,
    request_id: str,
    created: str,
    duration: float,
    channels: int,
    sha256: str,
    model: ModelCard,
    utterances: Sequence[Utterance],
    punctuated: bool,
    with_utterances: bool,
    warnings: Sequence[OptionWarning] = (),
    tags: Sequence[str] = (),
) -> ListenV1Response:
    """`POST /v1/listen`'s answer: per channel one alternative holding every final of it in time order;
    with `utterances=true` each final on its own too."""
    per_channel: list[list[Utterance]] = [[] for _ in range(channels)]
    for u in sorted(utterances, key=lambda u: (u.channel, u.start)):
        per_channel[u.channel].append(u)

    def alternative(us: Sequence[Utterance]) -> dict[str, Any]:
        words = [w for u in us for w in u.words]
        texts = [transcript_of(u.text, u.words, punctuated) for u in us]
        spoken = sum(len(u.words) for u in us)
        confidence = sum(u.confidence * len(u.words) for u in us) / spoken if spoken else 0.0
        return {
            "transcript": " ".join(t for t in texts if t),
            "confidence": round(confidence, 4),
            "words": [_word(w, punctuated) for w in words],
        }

    metadata = _metadata_fields(
        MetadataFields(
            request_id=request_id,
            created=created,
            duration=duration,
            channels=channels,
            sha256=sha256,
            model=model,
            warnings=warnings,
            tags=tags,
        )
    )
    body: dict[str, Any] = {
        "metadata": metadata,
        "results": {"channels": [{"alternatives": [alternative(us)]} for us in per_channel]},
    }
    if with_utterances:
        body["results"]["utterances"] = [
            {
                "start": round(u.start, 3),
                "end": round(u.end, 3),
                "confidence": round(u.confidence, 4),
                "channel": u.channel,
                "transcript": transcript_of(u.text, u.words, punctuated),
                "words": [_word(w, punctuated) for w in u.words],
                "id": str(uuid.uuid5(uuid.UUID(request_id), f"{u.channel}:{u.start}")),
                **({} if u.speaker is None else {"speaker": u.speaker}),
            }
            for u in sorted(utterances, key=lambda u: (u.start, u.channel))
        ]
    return ListenV1Response.model_validate(body)

"""The one error the core raises: a protocol-neutral code, a message, and the setting to blame.

Each door maps `Code` to its own terms (a gRPC status, an HTTP status, a WebSocket close code and error
event). The codes are the canonical status codes (google.rpc.Code) by name, so the asr.v1 door's
statuses and the metrics' `grpc_code` label read the same as before the core existed.

`field` names the domain setting at fault, spelled as RecognitionSettings / StreamSettings document
it (the names of the project's own asr.v1 protocol: `sample_rate_hertz`, `language_code`, `prompt`,
`keyterms`, `endpointing.min_silence_duration`, `audio_content`, ...), and the message names the same
field in the same spelling. A door whose protocol calls it something else asks for the message in its
own words with `message_for({"language_code": "language"})`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping


class Code(enum.Enum):
    """Why a call was refused or ended (google.rpc.Code's names and numbers)."""

    OK = 0
    CANCELLED = 1  # the client went away
    UNKNOWN = 2  # a bug: an exception nothing expected
    INVALID_ARGUMENT = 3  # the request is wrong whatever the server's state: `field` says where
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8  # a limit of the server (streams, calls, buffers, the engine's queue): retry later
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11  # well formed, past a length limit (stream or recording seconds, idle audio)
    UNIMPLEMENTED = 12
    INTERNAL = 13  # a bug of ours, in this call only
    UNAVAILABLE = 14  # loading, draining or the engine gone: retry on another replica
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# The settings a RecognitionError may name (see the module docstring); a message that begins with one
# of them is about it.
FIELDS = (
    "encoding",
    "sample_rate_hertz",
    "audio_channel_count",
    "language_code",
    "prompt",
    "keyterms",
    "redact",
    "endpointing",
    "speech_start_timeout",
    "speech_end_timeout",
    "audio_content",
    "diarization",
)
_LEADING_NAME = re.compile(r"[a-z_]+(?:\.[a-z_]+)?")


class RecognitionError(Exception):
    """A refusal or the end of a call, in the core's terms."""

    def __init__(self, code: Code, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __repr__(self) -> str:
        return f"RecognitionError({self.code.name}, {self.message!r}, field={self.field!r})"

    @classmethod
    def invalid(cls, e: ValueError) -> RecognitionError:
        """INVALID_ARGUMENT for a ValueError of the pipeline or the engine. Those carry the field they
        blame as `e.field` (AudioFormatError, EndpointingError) or begin their message with it (the
        engine's prompt and keyterm bounds); the message is made to name it either way."""
        message = str(e)
        field = getattr(e, "field", None)
        if field is None:
            leading = _LEADING_NAME.match(message)
            if leading is not None and leading.group().split(".")[0] in FIELDS:
                field = leading.group()
        elif field not in message:
            message = f"{field}: {message}"
        return cls(Code.INVALID_ARGUMENT, message, field)

    def message_for(self, names: Mapping[str, str]) -> str:
        """The message with the field named as a door's protocol names it (`names`: domain name -> the
        door's); unchanged when the door names it the same or no field is blamed."""
        if self.field is None:
            return self.message
        own = names.get(self.field) or names.get(self.field.split(".")[0])
        if own is None:
            return self.message
        name = self.field if self.field in names else self.field.split(".")[0]
        return re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w])", own, self.message)

"""Deepgram's `/v1/listen` query options -> `ListenOptions` (plain values); each refusal names the option.

Deepgram takes every option as a query parameter, live (WebSocket) and pre-recorded (POST) alike: the SDK's
`listen.v1.connect(...)` and `listen.v1.media.transcribe_file(...)` keyword arguments, booleans as
"true"/"false", lists as repeated parameters. Each option is one of three kinds (docs/operations.md, "The
Deepgram door", lists them all):

- mapped onto the core: encoding, sample_rate, channels, multichannel, interim_results, endpointing,
  utterance_end_ms, vad_events, punctuate, smart_format, numerals, redact, keyterm, keywords, language,
  model, extra, tag (pre-recorded also utterances);
- accepted as a hint and ignored (a formatting detail whose absence cannot make a client misread a result,
  or a vendor routing/billing option): listed in `ListenOptions.warnings`, which the door reports in its
  metadata (as Deepgram's responses carry `warnings`: parameter, type, message);
- refused (OptionError naming it): what would change what a result means if it were silently dropped
  (diarization, entity detection, search and replace, a callback, profanity filtering, an encoding we
  cannot decode, a redaction we do not do, a language the model does not serve).

Unknown parameters are ignored as hints too (Deepgram adds options often; a client written for a newer API
keeps working), and reported the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from service.vocabulary.redaction import Kind

# Bounds on what a query may make the server hold or work through (the core bounds keyterms themselves).
MAX_QUERY_VALUES = 512  # parameters in one query, repeats counted (keyterms: the engine takes 100)
MAX_VALUE_CHARS = 1024  # one parameter's value
# extra (keys and values) and tag, each in all: echoed in every result (and on every channel), so a long
# one would turn one Finalize into tens of KB sent back
MAX_ECHOED_CHARS = 2048
MIN_ENDPOINTING_MS = 100  # the VAD scores 32 ms windows: a shorter pause cannot be told from a breath
MAX_ENDPOINTING_MS = 5000  # as asr.v1's min_silence_duration
MAX_UTTERANCE_END_MS = 60_000

STREAM_ENCODINGS = {"linear16": "LINEAR16", "mulaw": "MULAW", "alaw": "ALAW"}
# Deepgram's other encodings; named in the refusal so that a client sees it is known, just not decoded here.
OTHER_ENCODINGS = ("linear32", "flac", "opus", "ogg-opus", "speex", "amr-nb", "amr-wb", "g729")
DEFAULT_ENCODING = "linear16"  # Deepgram's raw default; 16 kHz as every door's default
DEFAULT_SAMPLE_RATE = 16000

# redact values -> what the core masks. Deepgram's `numbers` (or `true`) group takes card numbers and SSNs
# with every other digit run, so it asks for all three kinds (a card then gets the hold-back policy).
REDACT = {
    "pci": frozenset({Kind.PCI}),
    "ssn": frozenset({Kind.SSN}),
    "numbers": frozenset({Kind.PCI, Kind.SSN, Kind.NUMBERS}),
    "true": frozenset({Kind.PCI, Kind.SSN, Kind.NUMBERS}),
    "false": frozenset(),
}
# Deepgram redacts these and we do not: a client asking for them must not get the words in clear.
REDACT_REFUSED = ("aggressive_numbers", "pii", "phi", "name", "location", "and Deepgram's other entity types")

# Known hints, accepted and ignored whatever their value (docs/operations.md lists them; any other unknown
# parameter is treated the same). `model` selects the model this server serves (model_info names it).
HINTS = (
    "model",
    "version",
    "tier",
    "language_hint",
    "mip_opt_out",
    "filler_words",
    "dictation",
    "measurements",
    "alternatives",
    "no_delay",
    "redact_usage",
    "callback_method",
    "utt_split",
)
# Accepted only with a value that asks for nothing we lack ("false"); any other value is refused.
REFUSED_UNLESS_FALSE = {
    "detect_entities": "this server does not detect entities",
    "profanity_filter": "this server does not filter profanity",
    "paragraphs": "this server does not split transcripts into paragraphs",
    "summarize": "this server does not summarize",
    "topics": "this server does not detect topics",
    "intents": "this server does not detect intents",
    "sentiment": "this server does not analyse sentiment",
    "detect_language": "this server does not report a detected language",
    "detect_topics": "this server does not detect topics",
}
# Refused whatever the value: their presence alone asks for something this server does not do.
REFUSED_ANY = {
    "callback": "this server answers on the connection only (no callback requests)",
    "search": "this server does not search transcripts",
    "replace": "this server does not replace terms in transcripts",
    "custom_topic": "this server does not detect topics",
    "custom_intent": "this server does not detect intents",
    "custom_topic_mode": "this server does not detect topics",
    "custom_intent_mode": "this server does not detect intents",
}
DIARIZE_MODELS = ("latest", "v1", "v2")
LIVE_ONLY = frozenset(
    {
        "interim_results",
        "endpointing",
        "utterance_end_ms",
        "vad_events",
        "turn_model",
        "eot_threshold",
        "eot_timeout_ms",
    }
)
# The end-of-turn model (service/pipeline/turn_model.py) per stream: Flux's (`/v2/listen`) names for its
# threshold and its longest wait, and this server's `turn_model=true|false` to ask for it or not.
MIN_EOT_TIMEOUT_MS, MAX_EOT_TIMEOUT_MS = 500, 10_000
RECORDED_ONLY = frozenset({"utterances"})


@dataclass(frozen=True)
class OptionWarning:
    """What the door says, in the metadata's `warnings` (as Deepgram's responses carry them), about an
    option it took other than at its word."""

    parameter: str
    type: str
    message: str


class OptionError(ValueError):
    """A refused query option: Deepgram answers it with HTTP 400 before any audio is read."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option
        self.message = message


@dataclass(frozen=True)
class ListenOptions:
    """A validated `/v1/listen` query, in Deepgram's terms; the door maps it onto the core's settings."""

    encoding: str = "LINEAR16"  # the core's spelling: LINEAR16, MULAW, ALAW
    sample_rate: int = DEFAULT_SAMPLE_RATE
    channels: int = 1
    multichannel: bool = False  # each channel recognized on its own; else mixed down to one
    interim_results: bool = False
    endpointing_ms: int | None = None  # None: the server's default silence
    endpointing: bool = True  # False: utterances end only on Finalize, CloseStream or the length cap
    utterance_end_ms: int | None = None
    turn_model: bool | None = None  # None: the server's --turn-model
    eot_threshold: float = 0.0  # 0: the server's --turn-threshold
    eot_timeout_ms: int = 0  # 0: the server's --turn-max-silence-s
    vad_events: bool = False
    punctuate: bool = False
    smart_format: bool = False
    numerals: bool = False
    redact: frozenset[Kind] = frozenset()
    keyterms: tuple[str, ...] = ()
    language: str = ""  # as sent ("" : the model's default); the door checks it against the model
    model: str = ""
    tags: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)
    utterances: bool = False  # pre-recorded: results.utterances
    # every word (and pre-recorded utterance) carries a 0-based speaker; live: placed at each final
    diarize: bool = False
    warnings: tuple[OptionWarning, ...] = ()  # hint-only and unknown options, a raised endpointing

    @property
    def punctuated(self) -> bool:
        """Deepgram's smart_format punctuates too."""
        return self.punctuate or self.smart_format

    @property
    def smart(self) -> bool:
        """Numbers as digits: smart_format or numerals."""
        return self.smart_format or self.numerals

    @property
    def result_channels(self) -> int:
        """Channels that get results of their own (channel_index's second number)."""
        return self.channels if self.multichannel else 1


def _flag(name: str, values: list[str]) -> bool:
    v = values[-1].strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0", ""):
        return False
    raise OptionError(name, f"{name} must be true or false, got {values[-1]!r}")


def _integer(name: str, value: str, low: int, high: int, unit: str = "") -> int:
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        raise OptionError(name, f"{name} must be an integer, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise OptionError(name, f"{name} must be an integer, got {value!r}")
    n = int(number)
    if not low <= n <= high:
        raise OptionError(name, f"{name} must be between {low} and {high}{unit}, got {n}")
    return n


def _keywords(values: list[str]) -> list[str]:
    """Deepgram's legacy `keywords` ("term" or "term:intensifier") boost terms: the ones boosted
    (intensifier absent or positive) become keyterms. A suppressed one (intensifier 0 or below) is dropped:
    the core can only boost, and boosting what the client wanted suppressed would be the opposite."""
    terms = []
    for value in values:
        term, sep, weight = value.rpartition(":")
        if not sep:
            term, weight = value, ""
        try:
            boost = float(weight) if weight.strip() else 1.0
        except ValueError:
            term, boost = value, 1.0  # a colon inside the term itself
        if boost > 0 and term.strip():
            terms.append(term.strip())
    return terms


def _echoed(option: str, chars: int) -> None:
    if chars > MAX_ECHOED_CHARS:
        raise OptionError(
            option,
            f"{option} holds {chars} characters in all, over the limit of {MAX_ECHOED_CHARS}: it is echoed in "
            "every result",
        )


def parse_listen_options(
    items: Iterable[tuple[str, str]],
    *,
    live: bool,
    min_rate: int,
    max_rate: int,
    max_channels: int,
) -> ListenOptions:
    """Read a `/v1/listen` query (its (name, value) pairs in order, repeats kept). `live`: the WebSocket
    (else the pre-recorded POST). Rate and channel bounds are the core's. Raises OptionError."""
    query: dict[str, list[str]] = {}
    for count, (name, value) in enumerate(items, 1):
        if count > MAX_QUERY_VALUES:
            raise OptionError(
                name, f"the query holds more than {MAX_QUERY_VALUES} parameters (the next one: {name})"
            )
        if len(value) > MAX_VALUE_CHARS:
            raise OptionError(
                name, f"{name} has {len(value)} characters, over the limit of {MAX_VALUE_CHARS}"
            )
        query.setdefault(name, []).append(value)

    def one(name: str) -> str | None:
        values = query.get(name)
        return values[-1] if values else None

    warnings: list[OptionWarning] = []
    for name, values in query.items():
        if name == "diarize_model" and live:  # Deepgram's live streams take diarize alone
            raise OptionError(
                name,
                f"{name}={values[-1]}: diarize_model selects a pre-recorded diarizer (POST /v1/listen); a "
                "live stream takes diarize=true",
            )
        if name == "diarize_model":
            # Deepgram's model versions (batch): any of them selects this server's one diarizer
            if values[-1].strip().lower() not in DIARIZE_MODELS:
                raise OptionError(
                    name, f"{name}={values[-1]!r} is not one of Deepgram's ({', '.join(DIARIZE_MODELS)})"
                )
            warnings.append(
                OptionWarning(
                    name, "unsupported_model", f"{name}={values[-1]!r} selects this server's diarizer"
                )
            )
        if name in REFUSED_ANY:
            raise OptionError(name, f"{name}: {REFUSED_ANY[name]}")
        if name in REFUSED_UNLESS_FALSE:
            if _flag(name, values):
                raise OptionError(name, f"{name}={values[-1]}: {REFUSED_UNLESS_FALSE[name]}")
        elif name == "model":
            warnings.append(
                OptionWarning(name, "unsupported_model", f"model={values[-1]!r} selects this server's model")
            )
        elif name in (RECORDED_ONLY if live else LIVE_ONLY) or name not in _MAPPED:
            warnings.append(OptionWarning(name, "unsupported_parameter", f"{name} is accepted and ignored"))

    encoding_value = one("encoding")
    encoding = (encoding_value or DEFAULT_ENCODING).strip().lower()
    if encoding not in STREAM_ENCODINGS:
        known = "known to Deepgram but not decoded here" if encoding in OTHER_ENCODINGS else "unknown"
        raise OptionError(
            "encoding",
            f"encoding {encoding_value!r} is {known}; this server decodes {', '.join(STREAM_ENCODINGS)}"
            + ("" if live else ", or a WAV or FLAC file with no encoding given"),
        )
    rate_value = one("sample_rate")
    if rate_value is None:
        if encoding_value is not None and live:
            raise OptionError(
                "sample_rate", "sample_rate is required with encoding (as Deepgram requires it)"
            )
        sample_rate = DEFAULT_SAMPLE_RATE
    else:
        sample_rate = _integer("sample_rate", rate_value, min_rate, max_rate, " Hz")
    channels_value = one("channels")
    channels = 1 if channels_value is None else _integer("channels", channels_value, 1, max_channels)

    endpointing, endpointing_ms = True, None
    ep = one("endpointing")
    if live and ep is not None:
        if ep.strip().lower() == "false":
            endpointing = False
        elif ep.strip().lower() != "true":
            asked = _integer("endpointing", ep, 0, MAX_ENDPOINTING_MS, " ms (or false)")
            endpointing_ms = max(MIN_ENDPOINTING_MS, asked)
            if endpointing_ms != asked:
                warnings.append(
                    OptionWarning(
                        "endpointing",
                        "partial_support",
                        f"endpointing={asked} ms is raised to {MIN_ENDPOINTING_MS} ms, the shortest pause the "
                        "server's voice activity detector tells from a breath",
                    )
                )
    ue = one("utterance_end_ms")
    utterance_end_ms = (
        _integer("utterance_end_ms", ue, 1, MAX_UTTERANCE_END_MS, " ms") if live and ue is not None else None
    )

    turn_model: bool | None = None
    eot_threshold, eot_timeout_ms = 0.0, 0
    if live:
        if query.get("turn_model"):
            turn_model = _flag("turn_model", query["turn_model"])
        threshold = one("eot_threshold")
        if threshold is not None:
            try:
                eot_threshold = float(threshold)
            except ValueError:
                eot_threshold = math.nan
            if not 0.5 <= eot_threshold <= 0.9:  # Flux's range
                raise OptionError(
                    "eot_threshold", f"eot_threshold must be between 0.5 and 0.9, got {threshold!r}"
                )
        timeout = one("eot_timeout_ms")
        if timeout is not None:
            eot_timeout_ms = _integer(
                "eot_timeout_ms", timeout, MIN_EOT_TIMEOUT_MS, MAX_EOT_TIMEOUT_MS, " ms"
            )

    redact: set[Kind] = set()
    for value in query.get("redact", []):
        for part in value.split(","):
            key = part.strip().lower()
            if key not in REDACT:
                raise OptionError(
                    "redact",
                    f"redact={part.strip()!r} is not done by this server (it redacts pci, ssn, numbers and "
                    f"true; not {', '.join(REDACT_REFUSED)})",
                )
            redact |= REDACT[key]

    keyterms = [v.strip() for v in query.get("keyterm", []) if v.strip()]
    keyterms += [t for t in _keywords(query.get("keywords", [])) if t not in keyterms]

    extra: dict[str, str] = {}
    for value in query.get("extra", []):
        key, sep, val = value.partition(":")
        if not sep:
            raise OptionError("extra", f"extra must be key:value, got {value!r}")
        extra[key] = val
    _echoed("extra", sum(len(k) + len(v) for k, v in extra.items()))
    _echoed("tag", sum(map(len, query.get("tag", []))))

    def flag(name: str) -> bool:
        values = query.get(name)
        return _flag(name, values) if values else False

    return ListenOptions(
        encoding=STREAM_ENCODINGS[encoding],
        sample_rate=sample_rate,
        channels=channels,
        multichannel=flag("multichannel"),
        interim_results=live and flag("interim_results"),
        endpointing_ms=endpointing_ms,
        endpointing=endpointing,
        utterance_end_ms=utterance_end_ms,
        turn_model=turn_model,
        eot_threshold=eot_threshold,
        eot_timeout_ms=eot_timeout_ms,
        vad_events=live and flag("vad_events"),
        punctuate=flag("punctuate"),
        smart_format=flag("smart_format"),
        numerals=flag("numerals"),
        redact=frozenset(redact),
        keyterms=tuple(keyterms),
        language=(one("language") or "").strip(),
        model=(one("model") or "").strip(),
        tags=tuple(query.get("tag", [])),
        extra=extra,
        utterances=not live and flag("utterances"),
        diarize=flag("diarize") or (not live and "diarize_model" in query),
        warnings=tuple(warnings),
    )


_MAPPED = frozenset(
    {
        "encoding",
        "sample_rate",
        "channels",
        "multichannel",
        "interim_results",
        "endpointing",
        "utterance_end_ms",
        "turn_model",
        "eot_threshold",
        "eot_timeout_ms",
        "vad_events",
        "punctuate",
        "smart_format",
        "numerals",
        "redact",
        "keyterm",
        "keywords",
        "language",
        "extra",
        "tag",
        "utterances",
        "diarize",
        "diarize_model",
    }
)

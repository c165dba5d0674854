"""The core's domain types: what a door hands the recognition core, and what it hands back.

No protocol here (no grpc, aiohttp or generated messages): each door translates its own requests into
these and these into its own responses. Times are seconds (floats) from the start of the stream or
recording; channels are tagged 1..N when recognized separately, else 0 (one mixed-down channel).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from service.vocabulary.call_metrics import CallMetrics, CallMetricsSettings, ChannelMetrics
from service.vocabulary.endpointing import EndpointSettings
from service.vocabulary.redaction import Kind as Redaction

__all__ = [
    "AudioFormat",
    "CallEvent",
    "CallInfo",
    "CallMetrics",
    "CallMetricsReport",
    "CallMetricsSettings",
    "ChannelMetrics",
    "EndOfSingleUtterance",
    "EndReason",
    "EndpointSettings",
    "Formatting",
    "Identity",
    "RecognitionSettings",
    "RecognizeResult",
    "Reconnect",
    "Redaction",
    "Result",
    "Segment",
    "SpeechEnded",
    "SpeechStarted",
    "SpeechTimeout",
    "StreamSettings",
    "Word",
]


# Phrases (keyterm hints) a request may carry, counted before any is read: a door walks them in Python on
# the event loop every call of its frontend shares, and at most MAX_KEYTERMS (100) distinct survive anyway.
MAX_PHRASES_READ = 1000
# and their serialized bytes, weighed (protobuf's ByteSize, in C) before any is read: 1000 short phrases
# are ~50 KB; a few phrases of megabytes each would pass the count
MAX_PHRASE_BYTES = 256 << 10


# --- what a door asks for ---


@dataclass(frozen=True)
class AudioFormat:
    """How the audio is encoded. `encoding`: LINEAR16 (signed 16-bit little-endian PCM), MULAW or ALAW
    (G.711) for streams and recordings; FLAC, WAV or OGG_OPUS for recordings only (their header gives
    rate and channels, so those two fields are ignored). Anything else, "" included, is refused naming
    `encoding`; a rate outside 8000-48000 names `sample_rate_hertz`, channels outside 1-8 (0 means 1)
    `audio_channel_count`."""

    encoding: str = ""
    sample_rate_hertz: int = 0
    channels: int = 1


class Formatting(enum.Enum):
    """How finals are written (service/pipeline/formatting.py)."""

    VERBATIM = "verbatim"  # as the model wrote them
    # spoken numbers, amounts, dates and phone numbers as digits ("four five seven two one" -> "45721"),
    # before redaction, which then sees digits; interims and logs too, so that they read as the final will
    SMART = "smart"


class DiarizationError(ValueError):
    """Bad diarization settings; `field` is the setting to blame (as EndpointingError)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class DiarizationSettings:
    """Speaker labels for a mono channel (service/pipeline/diarization.py): without being told how many
    speakers there are, or within these bounds (0: no bound)."""

    min_speakers: int = 0
    max_speakers: int = 0

    def validate(self, limit: int) -> None:
        """`limit`: the server's --max-diarization-speakers."""
        for name, value in (("min_speakers", self.min_speakers), ("max_speakers", self.max_speakers)):
            if value < 0 or value > limit:
                raise DiarizationError(
                    f"diarization.{name}",
                    f"diarization.{name} {value} is outside 0-{limit} (max_diarization_speakers)",
                )
        if self.max_speakers and self.min_speakers > self.max_speakers:
            raise DiarizationError(
                "diarization.min_speakers",
                f"diarization.min_speakers {self.min_speakers} is over the most speakers asked for, "
                f"{self.max_speakers}",
            )


@dataclass(frozen=True)
class RecognitionSettings:
    """What every recognition (a stream or a recording) is asked for."""

    format: AudioFormat = field(default_factory=AudioFormat)
    # one transcript per channel (channel tags 1..N); else the channels are mixed down (tag 0)
    separate_channels: bool = False
    # BCP-47 ("en-US") or Whisper's code ("en"); "" the model's own (English-only) or detection
    language: str = ""
    prompt: str = (
        ""  # previous text for Whisper: names, products, jargon (bounded: engine/decoding/prompt.py)
    )
    # names and jargon the caller may say, boosted in decoding (bounded: engine/scheduling/request.py)
    keyterms: tuple[str, ...] = ()
    # a stream's channels carry their earlier finals into their next utterances (pipeline/context.py);
    # None: the server's --context-carry
    context_carry: bool | None = None
    # beams for this call's finals or this recording (interims stay greedy); None: the server's
    # --beam-size-final, --beam-size-recorded or --beam-size-keyterms
    beam_size: int | None = None
    segments: bool = False  # results carry Whisper's timed segments
    word_times: bool = False  # results carry words with start and end times
    word_confidence: bool = False  # results carry words with their confidence
    redact: frozenset[Redaction] = frozenset()  # masked in everything that leaves (pipeline/redaction.py)
    formatting: Formatting = Formatting.VERBATIM
    # thresholds of the call metrics (pipeline/call_metrics.py): non-talk silences, interruption overlaps
    call_metrics: CallMetricsSettings = field(default_factory=CallMetricsSettings)
    # speaker labels on a mono recording's words and results (None: off); a separate-channel recording
    # keeps its channels as its speakers
    diarization: DiarizationSettings | None = None
    # Decoding temperature, as OpenAI's transcription API takes it: None the server's (--temperatures);
    # 0 greedy with openai-whisper's temperature fallback; above 0 sampled at that temperature (up to 1)
    temperature: float | None = None


@dataclass(frozen=True)
class CallInfo:
    """The telephony call a stream carries, as its platform names it: subscribers follow a call by
    `call_id`, and its legs by their labels. `call_id` is the platform's own (Twilio callSid, the
    AudioSocket UUID, the SIPREC session's Call-ID, Genesys' conversationId); `channel_labels` names
    each channel in order ("customer", "agent"; Twilio's "inbound"/"outbound"), empty where the platform
    names none; `platform` the door's name ("twilio", "audiohook", "asterisk", "siprec");
    `attributes` what the platform said of the call (customParameters, participant AORs)."""

    call_id: str
    platform: str = ""
    channel_labels: tuple[str, ...] = ()
    attributes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StreamSettings:
    """A live stream: its recognition, how it is cut into utterances, and what comes back as it runs."""

    recognition: RecognitionSettings = field(default_factory=RecognitionSettings)
    # None: no endpointing; the client ends each utterance with Stream.finalize (OpenAI Realtime without
    # turn detection), the stream's end ends the last one, and no speech events come
    endpointing: EndpointSettings | None = field(default_factory=EndpointSettings)
    interim_results: bool = False  # re-transcriptions of the utterance in progress, superseded by its final
    single_utterance: bool = False  # the stream stops taking audio after its first utterance
    # Voice activity timeouts, in seconds of audio (endpointing only): no speech within the first
    # speech_start_timeout_s, or none again within speech_end_timeout_s of the last speech's end, and the
    # stream emits SpeechTimeout and takes no more audio (the finals of what ended still follow)
    speech_start_timeout_s: float | None = None
    speech_end_timeout_s: float | None = None
    # every utterance gets its final, with an empty transcript when nothing was recognized in it (a door
    # whose protocol answers each turn the client ends, as OpenAI Realtime completes every committed item)
    empty_finals: bool = False
    # CallMetricsReport events: the last one after every final once the input ended (a door that asks
    # gets them; one that does not never sees the event)
    call_metrics: bool = False
    # and one with the metrics so far every this many seconds of call audio (0: only the last)
    call_metrics_interval_s: float = 0.0
    # the telephony call this stream carries (telephony doors): its results are published by call id
    call: CallInfo | None = None


@dataclass(frozen=True)
class Identity:
    """Who a call is for, as the door authenticated it (doors/shared/auth.py `identity`), and where it came
    from. Both are safe to log: `principal` is never a token."""

    principal: str = "anonymous"
    peer: str = ""  # the client's address as the door's transport names it


# --- what comes back ---


class EndReason(enum.Enum):
    """What ended a final's utterance."""

    SILENCE = "silence"  # the endpointer heard min_silence_duration of silence (the speaker stopped)
    MAX_LENGTH = "max_length"  # cut at max_utterance_duration while speech went on (the next continues it)
    FINALIZE = "finalize"  # the client asked (Stream.finalize)
    END_OF_AUDIO = "end_of_audio"  # the audio ended (half-close, drain, a limit, the end of a recording)


@dataclass(frozen=True)
class Word:
    """A word of a result. Times and confidence are None unless the settings asked for them."""

    text: str
    start_s: float | None = None
    end_s: float | None = None
    confidence: float | None = None
    speaker: int | None = None  # 0-based, when diarization is asked for (RecognitionSettings.diarization)


@dataclass(frozen=True)
class Segment:
    """One of Whisper's timed segments (RecognitionSettings.segments)."""

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Result:
    """A transcript of one utterance of one channel: a final (one per utterance, in order per channel) or
    an interim (is_final False: the utterance so far, always superseded by its final)."""

    channel: int
    utterance_index: int  # per channel, from 0
    is_final: bool
    transcript: str  # redacted as the settings ask
    confidence: float  # Whisper's mean token probability (finals and interims alike)
    start_s: float  # speech start (interims: where the utterance began)
    end_s: float  # speech end (interims: the audio heard so far)
    language: str = ""  # Whisper's code of the language it heard
    stability: float = 0.0  # interims only: 0.5 for a fresh guess up to 0.9 as it repeats the last one
    words: tuple[Word, ...] = ()  # finals, when the settings ask for word times or confidence
    segments: tuple[Segment, ...] = ()  # finals, when the settings ask for segments
    ended_by: EndReason | None = None  # finals only
    speaker: int | None = None  # finals, when diarized: the speaker of most of its words
    temperature: float = 0.0  # finals: the highest temperature whose decode was kept (0: greedy or beams)


@dataclass(frozen=True)
class SpeechStarted:
    channel: int
    offset_s: float


@dataclass(frozen=True)
class SpeechEnded:
    channel: int
    offset_s: float


@dataclass(frozen=True)
class EndOfSingleUtterance:
    """single_utterance: the first utterance ended; the stream takes no more audio, its final follows."""

    channel: int
    offset_s: float


@dataclass(frozen=True)
class SpeechTimeout:
    """A voice activity timeout (StreamSettings.speech_*_timeout_s) ran out at `offset_s`: the stream
    takes no more audio; finals of the utterances that ended follow, then `events()` ends."""

    offset_s: float


@dataclass(frozen=True)
class Reconnect:
    """The server is draining: finals for what was heard still follow, then the stream ends normally.
    `offset_s` is how much audio was heard (all of it is transcribed): continue the call on a new stream
    from there, losing nothing and repeating nothing."""

    offset_s: float


@dataclass(frozen=True)
class CallMetricsReport:
    """The call's metrics (StreamSettings.call_metrics): so far, every call_metrics_interval_s of audio
    while it runs (`last` False), and for the whole call after every final (`last` True)."""

    metrics: CallMetrics
    last: bool


CallEvent = (
    Result
    | SpeechStarted
    | SpeechEnded
    | EndOfSingleUtterance
    | SpeechTimeout
    | Reconnect
    | CallMetricsReport
)


@dataclass(frozen=True)
class RecognizeResult:
    """A whole recording: its finals in time order (then by channel), and how much audio it held."""

    results: tuple[Result, ...]
    duration_s: float
    call_metrics: CallMetrics | None = None  # the recording's (service/pipeline/call_metrics.py)

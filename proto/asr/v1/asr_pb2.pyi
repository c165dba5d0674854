import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    LINEAR16: _ClassVar[AudioEncoding]
    FLAC: _ClassVar[AudioEncoding]
    MULAW: _ClassVar[AudioEncoding]
    ALAW: _ClassVar[AudioEncoding]
    WAV: _ClassVar[AudioEncoding]

class Formatting(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORMATTING_UNSPECIFIED: _ClassVar[Formatting]
    VERBATIM: _ClassVar[Formatting]
    SMART: _ClassVar[Formatting]

class Redaction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDACTION_UNSPECIFIED: _ClassVar[Redaction]
    PCI: _ClassVar[Redaction]
    SSN: _ClassVar[Redaction]
    NUMBERS: _ClassVar[Redaction]
ENCODING_UNSPECIFIED: AudioEncoding
LINEAR16: AudioEncoding
FLAC: AudioEncoding
MULAW: AudioEncoding
ALAW: AudioEncoding
WAV: AudioEncoding
FORMATTING_UNSPECIFIED: Formatting
VERBATIM: Formatting
SMART: Formatting
REDACTION_UNSPECIFIED: Redaction
PCI: Redaction
SSN: Redaction
NUMBERS: Redaction

class FollowCallsRequest(_message.Message):
    __slots__ = ("call_id",)
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    def __init__(self, call_id: _Optional[str] = ...) -> None: ...

class CallEvent(_message.Message):
    __slots__ = ("call_id", "started", "transcript", "ended")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    started: CallStarted
    transcript: CallTranscript
    ended: CallEnded
    def __init__(self, call_id: _Optional[str] = ..., started: _Optional[_Union[CallStarted, _Mapping]] = ..., transcript: _Optional[_Union[CallTranscript, _Mapping]] = ..., ended: _Optional[_Union[CallEnded, _Mapping]] = ...) -> None: ...

class CallStarted(_message.Message):
    __slots__ = ("platform", "stream_id", "channels", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    platform: str
    stream_id: str
    channels: _containers.RepeatedScalarFieldContainer[str]
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, platform: _Optional[str] = ..., stream_id: _Optional[str] = ..., channels: _Optional[_Iterable[str]] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CallTranscript(_message.Message):
    __slots__ = ("channel", "is_final", "text", "start_offset", "end_offset")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    channel: str
    is_final: bool
    text: str
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    def __init__(self, channel: _Optional[str] = ..., is_final: _Optional[bool] = ..., text: _Optional[str] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CallEnded(_message.Message):
    __slots__ = ("status", "metrics")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    status: str
    metrics: CallMetrics
    def __init__(self, status: _Optional[str] = ..., metrics: _Optional[_Union[CallMetrics, _Mapping]] = ...) -> None: ...

class RecognitionConfig(_message.Message):
    __slots__ = ("encoding", "sample_rate_hertz", "audio_channel_count", "enable_separate_recognition_per_channel", "language_code", "prompt", "enable_segment_time_offsets", "enable_word_time_offsets", "enable_word_confidence", "redact", "keyterms", "formatting", "call_metrics", "context_carry", "diarization", "beam_size")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HERTZ_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CHANNEL_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_SEPARATE_RECOGNITION_PER_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_SEGMENT_TIME_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_WORD_TIME_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_WORD_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    REDACT_FIELD_NUMBER: _ClassVar[int]
    KEYTERMS_FIELD_NUMBER: _ClassVar[int]
    FORMATTING_FIELD_NUMBER: _ClassVar[int]
    CALL_METRICS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_CARRY_FIELD_NUMBER: _ClassVar[int]
    DIARIZATION_FIELD_NUMBER: _ClassVar[int]
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    encoding: AudioEncoding
    sample_rate_hertz: int
    audio_channel_count: int
    enable_separate_recognition_per_channel: bool
    language_code: str
    prompt: str
    enable_segment_time_offsets: bool
    enable_word_time_offsets: bool
    enable_word_confidence: bool
    redact: _containers.RepeatedScalarFieldContainer[Redaction]
    keyterms: _containers.RepeatedScalarFieldContainer[str]
    formatting: Formatting
    call_metrics: CallMetricsConfig
    context_carry: bool
    diarization: DiarizationConfig
    beam_size: int
    def __init__(self, encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hertz: _Optional[int] = ..., audio_channel_count: _Optional[int] = ..., enable_separate_recognition_per_channel: _Optional[bool] = ..., language_code: _Optional[str] = ..., prompt: _Optional[str] = ..., enable_segment_time_offsets: _Optional[bool] = ..., enable_word_time_offsets: _Optional[bool] = ..., enable_word_confidence: _Optional[bool] = ..., redact: _Optional[_Iterable[_Union[Redaction, str]]] = ..., keyterms: _Optional[_Iterable[str]] = ..., formatting: _Optional[_Union[Formatting, str]] = ..., call_metrics: _Optional[_Union[CallMetricsConfig, _Mapping]] = ..., context_carry: _Optional[bool] = ..., diarization: _Optional[_Union[DiarizationConfig, _Mapping]] = ..., beam_size: _Optional[int] = ...) -> None: ...

class DiarizationConfig(_message.Message):
    __slots__ = ("enable", "min_speakers", "max_speakers")
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    MIN_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    enable: bool
    min_speakers: int
    max_speakers: int
    def __init__(self, enable: _Optional[bool] = ..., min_speakers: _Optional[int] = ..., max_speakers: _Optional[int] = ...) -> None: ...

class CallMetricsConfig(_message.Message):
    __slots__ = ("min_non_talk_duration", "min_interruption_overlap")
    MIN_NON_TALK_DURATION_FIELD_NUMBER: _ClassVar[int]
    MIN_INTERRUPTION_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    min_non_talk_duration: _duration_pb2.Duration
    min_interruption_overlap: _duration_pb2.Duration
    def __init__(self, min_non_talk_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., min_interruption_overlap: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class EndpointingConfig(_message.Message):
    __slots__ = ("speech_start_threshold", "speech_end_threshold", "min_silence_duration", "max_utterance_duration", "min_speech_duration")
    SPEECH_START_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SPEECH_END_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_SILENCE_DURATION_FIELD_NUMBER: _ClassVar[int]
    MAX_UTTERANCE_DURATION_FIELD_NUMBER: _ClassVar[int]
    MIN_SPEECH_DURATION_FIELD_NUMBER: _ClassVar[int]
    speech_start_threshold: float
    speech_end_threshold: float
    min_silence_duration: _duration_pb2.Duration
    max_utterance_duration: _duration_pb2.Duration
    min_speech_duration: _duration_pb2.Duration
    def __init__(self, speech_start_threshold: _Optional[float] = ..., speech_end_threshold: _Optional[float] = ..., min_silence_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_utterance_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., min_speech_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StreamingRecognitionConfig(_message.Message):
    __slots__ = ("config", "single_utterance", "interim_results", "endpointing", "call_metrics_interval")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SINGLE_UTTERANCE_FIELD_NUMBER: _ClassVar[int]
    INTERIM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTING_FIELD_NUMBER: _ClassVar[int]
    CALL_METRICS_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    config: RecognitionConfig
    single_utterance: bool
    interim_results: bool
    endpointing: EndpointingConfig
    call_metrics_interval: _duration_pb2.Duration
    def __init__(self, config: _Optional[_Union[RecognitionConfig, _Mapping]] = ..., single_utterance: _Optional[bool] = ..., interim_results: _Optional[bool] = ..., endpointing: _Optional[_Union[EndpointingConfig, _Mapping]] = ..., call_metrics_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class KeytermsUpdate(_message.Message):
    __slots__ = ("keyterms",)
    KEYTERMS_FIELD_NUMBER: _ClassVar[int]
    keyterms: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keyterms: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamingRecognizeRequest(_message.Message):
    __slots__ = ("streaming_config", "audio_content", "keyterms_update")
    STREAMING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CONTENT_FIELD_NUMBER: _ClassVar[int]
    KEYTERMS_UPDATE_FIELD_NUMBER: _ClassVar[int]
    streaming_config: StreamingRecognitionConfig
    audio_content: bytes
    keyterms_update: KeytermsUpdate
    def __init__(self, streaming_config: _Optional[_Union[StreamingRecognitionConfig, _Mapping]] = ..., audio_content: _Optional[bytes] = ..., keyterms_update: _Optional[_Union[KeytermsUpdate, _Mapping]] = ...) -> None: ...

class WordOrSegment(_message.Message):
    __slots__ = ("text", "start_offset", "end_offset")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    text: str
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    def __init__(self, text: _Optional[str] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class SpeechRecognitionAlternative(_message.Message):
    __slots__ = ("transcript", "confidence", "segments", "words")
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    transcript: str
    confidence: float
    segments: _containers.RepeatedCompositeFieldContainer[WordOrSegment]
    words: _containers.RepeatedCompositeFieldContainer[WordInfo]
    def __init__(self, transcript: _Optional[str] = ..., confidence: _Optional[float] = ..., segments: _Optional[_Iterable[_Union[WordOrSegment, _Mapping]]] = ..., words: _Optional[_Iterable[_Union[WordInfo, _Mapping]]] = ...) -> None: ...

class WordInfo(_message.Message):
    __slots__ = ("word", "start_offset", "end_offset", "confidence", "speaker")
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    word: str
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    confidence: float
    speaker: int
    def __init__(self, word: _Optional[str] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., confidence: _Optional[float] = ..., speaker: _Optional[int] = ...) -> None: ...

class StreamingRecognitionResult(_message.Message):
    __slots__ = ("alternatives", "is_final", "stability", "start_offset", "end_offset", "channel_tag", "language_code", "utterance_index", "speaker")
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    STABILITY_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_TAG_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    alternatives: _containers.RepeatedCompositeFieldContainer[SpeechRecognitionAlternative]
    is_final: bool
    stability: float
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    channel_tag: int
    language_code: str
    utterance_index: int
    speaker: int
    def __init__(self, alternatives: _Optional[_Iterable[_Union[SpeechRecognitionAlternative, _Mapping]]] = ..., is_final: _Optional[bool] = ..., stability: _Optional[float] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., channel_tag: _Optional[int] = ..., language_code: _Optional[str] = ..., utterance_index: _Optional[int] = ..., speaker: _Optional[int] = ...) -> None: ...

class StreamingRecognizeResponse(_message.Message):
    __slots__ = ("results", "speech_event_type", "speech_event_offset", "speech_event_channel_tag", "call_metrics")
    class SpeechEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SPEECH_EVENT_UNSPECIFIED: _ClassVar[StreamingRecognizeResponse.SpeechEventType]
        SPEECH_ACTIVITY_BEGIN: _ClassVar[StreamingRecognizeResponse.SpeechEventType]
        SPEECH_ACTIVITY_END: _ClassVar[StreamingRecognizeResponse.SpeechEventType]
        END_OF_SINGLE_UTTERANCE: _ClassVar[StreamingRecognizeResponse.SpeechEventType]
        RECONNECT: _ClassVar[StreamingRecognizeResponse.SpeechEventType]
    SPEECH_EVENT_UNSPECIFIED: StreamingRecognizeResponse.SpeechEventType
    SPEECH_ACTIVITY_BEGIN: StreamingRecognizeResponse.SpeechEventType
    SPEECH_ACTIVITY_END: StreamingRecognizeResponse.SpeechEventType
    END_OF_SINGLE_UTTERANCE: StreamingRecognizeResponse.SpeechEventType
    RECONNECT: StreamingRecognizeResponse.SpeechEventType
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SPEECH_EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SPEECH_EVENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SPEECH_EVENT_CHANNEL_TAG_FIELD_NUMBER: _ClassVar[int]
    CALL_METRICS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StreamingRecognitionResult]
    speech_event_type: StreamingRecognizeResponse.SpeechEventType
    speech_event_offset: _duration_pb2.Duration
    speech_event_channel_tag: int
    call_metrics: CallMetrics
    def __init__(self, results: _Optional[_Iterable[_Union[StreamingRecognitionResult, _Mapping]]] = ..., speech_event_type: _Optional[_Union[StreamingRecognizeResponse.SpeechEventType, str]] = ..., speech_event_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., speech_event_channel_tag: _Optional[int] = ..., call_metrics: _Optional[_Union[CallMetrics, _Mapping]] = ...) -> None: ...

class RecognizeRequest(_message.Message):
    __slots__ = ("config", "audio_content")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CONTENT_FIELD_NUMBER: _ClassVar[int]
    config: RecognitionConfig
    audio_content: bytes
    def __init__(self, config: _Optional[_Union[RecognitionConfig, _Mapping]] = ..., audio_content: _Optional[bytes] = ...) -> None: ...

class SpeechRecognitionResult(_message.Message):
    __slots__ = ("alternatives", "channel_tag", "start_offset", "end_offset", "language_code", "speaker")
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_TAG_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    alternatives: _containers.RepeatedCompositeFieldContainer[SpeechRecognitionAlternative]
    channel_tag: int
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    language_code: str
    speaker: int
    def __init__(self, alternatives: _Optional[_Iterable[_Union[SpeechRecognitionAlternative, _Mapping]]] = ..., channel_tag: _Optional[int] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., language_code: _Optional[str] = ..., speaker: _Optional[int] = ...) -> None: ...

class RecognizeResponse(_message.Message):
    __slots__ = ("results", "total_audio_duration", "call_metrics")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_AUDIO_DURATION_FIELD_NUMBER: _ClassVar[int]
    CALL_METRICS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SpeechRecognitionResult]
    total_audio_duration: _duration_pb2.Duration
    call_metrics: CallMetrics
    def __init__(self, results: _Optional[_Iterable[_Union[SpeechRecognitionResult, _Mapping]]] = ..., total_audio_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., call_metrics: _Optional[_Union[CallMetrics, _Mapping]] = ...) -> None: ...

class CallMetrics(_message.Message):
    __slots__ = ("channels", "non_talk_time", "overlap_time", "total_time", "speakers")
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NON_TALK_TIME_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_TIME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_FIELD_NUMBER: _ClassVar[int]
    SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    channels: _containers.RepeatedCompositeFieldContainer[ChannelMetrics]
    non_talk_time: _duration_pb2.Duration
    overlap_time: _duration_pb2.Duration
    total_time: _duration_pb2.Duration
    speakers: _containers.RepeatedCompositeFieldContainer[ChannelMetrics]
    def __init__(self, channels: _Optional[_Iterable[_Union[ChannelMetrics, _Mapping]]] = ..., non_talk_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., overlap_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., total_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., speakers: _Optional[_Iterable[_Union[ChannelMetrics, _Mapping]]] = ...) -> None: ...

class ChannelMetrics(_message.Message):
    __slots__ = ("channel_tag", "talk_time", "interruptions", "words_per_minute", "mean_loudness_dbfs")
    CHANNEL_TAG_FIELD_NUMBER: _ClassVar[int]
    TALK_TIME_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTIONS_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOUDNESS_DBFS_FIELD_NUMBER: _ClassVar[int]
    channel_tag: int
    talk_time: _duration_pb2.Duration
    interruptions: int
    words_per_minute: float
    mean_loudness_dbfs: float
    def __init__(self, channel_tag: _Optional[int] = ..., talk_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., interruptions: _Optional[int] = ..., words_per_minute: _Optional[float] = ..., mean_loudness_dbfs: _Optional[float] = ...) -> None: ...

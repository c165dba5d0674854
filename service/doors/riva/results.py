"""The core's results as Riva's messages (times in ms, channel tags from 1, BCP-47 languages), and the
model card GetRivaSpeechRecognitionConfig answers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_common_pb2

from service.doors.riva.settings import DEFAULT_RATE
from service.vocabulary.types import (
    Result,
    Word,
)


@dataclass(frozen=True)
class RivaWord:
    text: str
    start_s: float
    end_s: float
    confidence: float | None = None
    speaker: int | None = None  # 0-based, diarized


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def alternative(
    transcript: str, confidence: float, words: Iterable[RivaWord], language: str = ""
) -> rasr.SpeechRecognitionAlternative:
    """One alternative; WordInfo times are ms from the start of the audio (of the stream, per channel)."""
    return rasr.SpeechRecognitionAlternative(
        transcript=transcript,
        confidence=confidence,
        words=[
            rasr.WordInfo(
                word=w.text,
                start_time=_ms(w.start_s),
                end_time=_ms(w.end_s),
                confidence=w.confidence or 0.0,
                language_code=language,
                speaker_tag=0 if w.speaker is None else w.speaker + 1,  # 0: unset (proto3), tags from 1
            )
            for w in words
        ],
        language_code=[language] if language else [],
    )


def streaming_response(
    transcript: str,
    *,
    is_final: bool,
    channel_tag: int,
    audio_processed_s: float,
    confidence: float = 0.0,
    stability: float = 0.0,
    words: Iterable[RivaWord] = (),
    language: str = "",
) -> rasr.StreamingRecognizeResponse:
    """One result per response, as Riva sends them; stability on interims only, confidence and words
    on finals only (the proto's rules)."""
    return rasr.StreamingRecognizeResponse(
        results=[
            rasr.StreamingRecognitionResult(
                alternatives=[
                    alternative(
                        transcript, confidence if is_final else 0.0, words if is_final else (), language
                    )
                ],
                is_final=is_final,
                stability=0.0 if is_final else stability,
                channel_tag=channel_tag,
                audio_processed=audio_processed_s,
            )
        ]
    )


def recognition_result(
    transcript: str,
    *,
    channel_tag: int,
    audio_processed_s: float,
    confidence: float,
    words: Iterable[RivaWord] = (),
    language: str = "",
) -> rasr.SpeechRecognitionResult:
    return rasr.SpeechRecognitionResult(
        alternatives=[alternative(transcript, confidence, words, language)],
        channel_tag=channel_tag,
        audio_processed=audio_processed_s,
    )


def riva_language(whisper_code: str) -> str:
    """A Whisper language code as Riva's clients list languages (BCP-47; en is en-US, as Riva's)."""
    return "en-US" if whisper_code == "en" else whisper_code


def config_response(model_name: str, languages: Iterable[str]) -> rasr.RivaSpeechRecognitionConfigResponse:
    """GetRivaSpeechRecognitionConfig: the one model this server serves, once per mode (`type` online
    for StreamingRecognize, offline for Recognize) and language, with the parameters Riva's clients
    read (`type`, `language_code`: riva.client's transcribe scripts, pipecat, LiveKit). Whatever model a
    request names, this one answers it."""
    langs = sorted(languages)
    language = riva_language(langs[0]) if len(langs) == 1 else "multi"
    return rasr.RivaSpeechRecognitionConfigResponse(
        model_config=[
            rasr.RivaSpeechRecognitionConfigResponse.Config(
                model_name=model_name,
                parameters={
                    "type": kind,
                    "streaming": "true" if kind == "online" else "false",
                    "language_code": language,
                    "sample_rate": str(DEFAULT_RATE),
                    "model_family": "whisper",
                },
            )
            for kind in ("online", "offline")
        ]
    )


def riva_word(w: Word) -> RivaWord:
    return RivaWord(w.text, w.start_s or 0.0, w.end_s or 0.0, w.confidence, w.speaker)


def channel_tag(channel: int) -> int:
    """The core tags one mixed-down or mono channel 0; Riva's first channel is 1."""
    return channel or 1


def result_response(r: Result, heard_s: float, request_id: str | None) -> rasr.StreamingRecognizeResponse:
    response = streaming_response(
        r.transcript,
        is_final=r.is_final,
        channel_tag=channel_tag(r.channel),
        audio_processed_s=max(heard_s, r.end_s),
        confidence=r.confidence,
        stability=r.stability,
        words=[riva_word(w) for w in r.words],
        language=riva_language(r.language),
    )
    if request_id is not None:
        response.id.value = request_id
    return response


def request_id_field(value: str | None) -> dict[str, riva_common_pb2.RequestId]:
    return {} if value is None else {"id": riva_common_pb2.RequestId(value=value)}

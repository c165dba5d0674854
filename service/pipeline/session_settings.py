"""The server flags a live stream reads (service/config.py), taken from ServerConfig once per stream."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from service.config import ServerConfig
from service.pipeline.endpointing import TurnJudging
from service.vocabulary.endpointing import EndpointSettings


@dataclass(frozen=True)
class SessionSettings:
    """Each field is the ServerConfig flag of the same name (its --help says what it does)."""

    # one stream's limits (session.py, intake.py, finals.py, outbox.py)
    max_chunk_bytes: int
    max_stream_seconds: float
    max_buffer_seconds: float
    idle_audio_timeout: float
    max_finals_in_flight: int
    max_response_backlog_bytes: int
    # endpointing (intake.py)
    speculative_endpointing: bool
    vad_gate_db: float
    turn_model: bool
    turn_threshold: float
    turn_max_silence_s: float
    # each channel's recognition (channel.py, finals.py)
    interim_interval_s: float
    context_carry: bool
    context_carry_tokens: int
    max_diarization_speakers: int
    live_diarization_wait_s: float
    log_transcripts: bool

    @classmethod
    def from_config(cls, config: ServerConfig) -> SessionSettings:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def turn_judging(ep: EndpointSettings, settings: SessionSettings) -> TurnJudging | None:
    """The stream's own turn-model setting, else the server's (--turn-model, --turn-threshold,
    --turn-max-silence-s); None: silence alone ends its turns."""
    if not (settings.turn_model if ep.turn_model is None else ep.turn_model):
        return None
    return TurnJudging(
        threshold=ep.turn_threshold or settings.turn_threshold,
        max_silence_s=max(ep.turn_max_silence_s or settings.turn_max_silence_s, ep.min_silence_s),
    )

"""Whisper inference engine: weights, features, model, KV cache, model runner, scheduler, core loop.

Knows nothing of gRPC. The service talks to it only through `engine.api`.
"""

from engine.api import Engine, UtteranceHandle
from engine.config import EngineConfig
from engine.constants import CHUNK_SECONDS, N_SAMPLES, SAMPLE_RATE
from engine.errors import EngineOverloaded, EngineStopped, ModelInfo
from engine.outputs import Segment, Transcript, WordTiming
from engine.parameters import DecodeOptions

__all__ = [
    "CHUNK_SECONDS",
    "N_SAMPLES",
    "SAMPLE_RATE",
    "DecodeOptions",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "EngineStopped",
    "ModelInfo",
    "Segment",
    "Transcript",
    "UtteranceHandle",
    "WordTiming",
]

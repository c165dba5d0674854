"""Whisper inference engine: weights, features, model, KV cache, scheduler.

Knows nothing of gRPC. The service talks to it only through `engine.api`.
"""

from engine.api import Engine, EngineOverloaded, UtteranceHandle
from engine.config import EngineConfig
from engine.request import DecodeOptions, Segment, Transcript, WordTiming

__all__ = [
    "DecodeOptions",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "Segment",
    "Transcript",
    "UtteranceHandle",
    "WordTiming",
]

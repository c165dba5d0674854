"""Whisper inference engine: weights, features, model, KV cache, model runner, scheduler, core loop.

Knows nothing of gRPC. The service talks to it only through `engine.api`.
"""

# the package's names are engine.api's (one list: api.__all__), and the framing and the parts of a
# transcript that in-process callers (tests, benchmarks, embedding) read
from engine import api
from engine.api import *  # noqa: F403
from engine.constants import CHUNK_SECONDS, N_SAMPLES
from engine.outputs import Segment, WordTiming

__all__ = [*api.__all__, "CHUNK_SECONDS", "N_SAMPLES", "Segment", "WordTiming"]

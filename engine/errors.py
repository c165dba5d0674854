"""The engine's public exceptions and model description: a leaf module (no engine imports), so that
engine.api, engine.scheduling.scheduler and engine.core all use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.decoding.prompt import PromptEncoder


class EngineOverloaded(Exception):
    """The admission queue is full: the caller should answer RESOURCE_EXHAUSTED."""


class EngineStopped(Exception):
    """The engine is stopped or its loop died."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    device: str
    dtype: str
    multilingual: bool
    languages: frozenset[str]
    kv_cache_bytes: int
    # Tokenizes and bounds prompts exactly as the engine does (pickles as its tokenizer's JSON), so that a
    # frontend refuses a prompt too long in tokens before it reaches the engine. None: not known.
    prompts: PromptEncoder | None = field(default=None, repr=False, compare=False)
    # The most beams a request may ask for and the flag that bounds it (engine/scheduling/request.py validate_beam_size).
    max_beam_size: tuple[int, str] = (1, "--max-beam-size")

"""Engine fixtures. Weights convert once into the default cache and are reused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from tests.support.engine import random_whisper_folder


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_whisper_folder(tmp_path_factory.mktemp("random"))


@pytest.fixture(scope="session")
def tiny_engine(service_engine: Engine) -> Engine:
    """The real bundled tiny.en with default settings (the one behind the test servers)."""
    return service_engine


@pytest.fixture(scope="session")
def full_context_engine() -> Iterator[Engine]:
    """tiny.en with Whisper's full 30 s encoder context in fp32: what transformers' generate runs."""
    engine = Engine(
        EngineConfig(model="tiny.en", threads=2, encoder_context="full", kv_slots=8, quantize="off")
    )
    engine.start()
    yield engine
    engine.stop()

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
def tiny_engine() -> Iterator[Engine]:
    """The real bundled tiny.en with default settings, shared by tests that only submit."""
    engine = Engine(EngineConfig(model="tiny.en", threads=2))
    engine.start()
    yield engine
    engine.stop()

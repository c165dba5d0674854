"""Engine fixtures. Weights convert once into the default cache and are reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine
from tests.support.engine import random_whisper_folder


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_whisper_folder(tmp_path_factory.mktemp("random"))


@pytest.fixture(scope="session")
def tiny_engine(service_engine: Engine) -> Engine:
    """The real bundled tiny.en with default settings (the one behind the test servers)."""
    return service_engine

"""Shared tiny checkpoints for the engine front tests (built locally, never downloaded)."""

from __future__ import annotations

import pytest

from engine_backend.demo import build_demo_model
from tests.support.tiny_model import tiny_spec

TINY_SPEC = tiny_spec(seed=7)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_demo_model(str(tmp_path_factory.mktemp("models")), TINY_SPEC)

"""Shared tiny checkpoints for the engine front tests (built locally, never downloaded)."""

from __future__ import annotations

import pytest

from engine_backend.demo import RandomModelSpec, build_demo_model

TINY_SPEC = RandomModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
    seed=7,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_demo_model(str(tmp_path_factory.mktemp("models")), TINY_SPEC)

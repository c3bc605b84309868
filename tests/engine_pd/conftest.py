"""Tiny random checkpoints for the PD tests (written here, never downloaded)."""

from __future__ import annotations

import pytest

from engine_backend.demo import RandomModelSpec, write_random_model

PD_SPEC = RandomModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
    seed=11,
)


@pytest.fixture(scope="session")
def pd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("pd-model")
    write_random_model(str(path), PD_SPEC)
    return str(path)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same shape with other weights: its KV must never be taken for PD_SPEC's."""
    path = tmp_path_factory.mktemp("pd-other-model")
    write_random_model(str(path), RandomModelSpec(**{**vars(PD_SPEC), "seed": 12}))
    return str(path)

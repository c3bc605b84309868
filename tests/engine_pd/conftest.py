"""Tiny random checkpoints for the PD tests (written here, never downloaded)."""

from __future__ import annotations

import pytest

from tests.support.tiny_model import tiny_spec, write_tiny_model

PD_SPEC = tiny_spec(seed=11)


@pytest.fixture(scope="session")
def pd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory, "pd-model", PD_SPEC)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same shape with other weights: its KV must never be taken for PD_SPEC's."""
    return write_tiny_model(tmp_path_factory, "pd-other-model", tiny_spec(seed=12))

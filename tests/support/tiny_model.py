"""The tiny random Llama checkpoint the engine tests run on (written locally, never downloaded).

One shape for every folder, so that a change to it (or to `RandomModelSpec`) is made once. Each
folder keeps its own seed, which makes its weights (and so its model fingerprint) its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine_backend.demo import RandomModelSpec, write_random_model

TINY_SPEC = RandomModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
)


def tiny_spec(**changes: Any) -> RandomModelSpec:
    """`TINY_SPEC` with `changes` (a seed, a longer context, a smaller tokenizer)."""
    return dataclasses.replace(TINY_SPEC, **changes)


def write_tiny_model(
    factory: pytest.TempPathFactory, name: str, spec: RandomModelSpec = TINY_SPEC
) -> str:
    """Write `spec` as a Hugging Face model folder under a fresh temporary `name`; its path."""
    path = factory.mktemp(name)
    write_random_model(str(path), spec)
    return str(path)

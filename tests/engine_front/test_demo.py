"""The built-in demo model folder: fast, cached, deterministic, loadable by transformers."""

from __future__ import annotations

import json
import os
import time

import pytest
from safetensors.torch import load_file

from engine_backend.demo import RandomModelSpec, build_demo_model

from .conftest import TINY_SPEC


def test_default_demo_builds_fast_and_is_cached(tmp_path) -> None:
    started = time.perf_counter()
    path = build_demo_model(str(tmp_path))
    built_in = time.perf_counter() - started
    assert built_in < 3.0, f"demo build took {built_in:.2f} s"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert os.path.isfile(os.path.join(path, name)), name
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert build_demo_model(str(tmp_path)) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert [p for p in os.listdir(tmp_path) if p.startswith(".demo-")] == []


def test_weights_are_deterministic_and_keyed_by_spec(tmp_path) -> None:
    a = build_demo_model(str(tmp_path / "a"), TINY_SPEC)
    b = build_demo_model(str(tmp_path / "b"), TINY_SPEC)
    other = build_demo_model(
        str(tmp_path / "a"), RandomModelSpec(**{**TINY_SPEC.__dict__, "seed": 8})
    )
    assert os.path.basename(a) == os.path.basename(b) != os.path.basename(other)
    wa, wb, wo = (load_file(os.path.join(p, "model.safetensors")) for p in (a, b, other))
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa)
    assert not (wa["lm_head.weight"] == wo["lm_head.weight"]).all()


def test_vocab_size_can_exceed_the_tokenizer(tmp_path) -> None:
    spec = RandomModelSpec(**{**TINY_SPEC.__dict__, "vocab_size": 1000})
    path = build_demo_model(str(tmp_path), spec)
    weights = load_file(os.path.join(path, "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (1000, 64)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_demo_model(str(tmp_path), RandomModelSpec(**{**TINY_SPEC.__dict__, "vocab_size": 10}))


def test_transformers_loads_the_demo_folder(tiny_model_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    generation = transformers.GenerationConfig.from_pretrained(tiny_model_dir)
    assert tok.convert_tokens_to_ids("<|im_end|>") in generation.eos_token_id

"""Loading model folders and resolving the engine configuration."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_backend import config as config_module
from engine_backend.checkpoint import load_eos_token_ids, safetensors_files
from engine_backend.config import EngineConfig, cpu_has_native_bf16
from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams
from tests.engine.engines import LogitsCapturingEngine, generate


def test_config_resolution_on_cpu(checkpoint):
    folder, _ = checkpoint("llama")
    engine = LLMEngine(
        EngineConfig(model=str(folder), device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
    )
    assert engine.device == torch.device("cpu") and engine.dtype == torch.float32
    # 2 layers * 2 (k, v) * 2 kv heads * 16 dims * 4 bytes = 512 bytes per token.
    assert engine.config.num_blocks == (1 << 20) // (512 * 16)
    assert engine.config.max_model_len == 1024  # max_position_embeddings, within the pool
    assert engine.config.dtype == "float32" and engine.config.device == "cpu"
    assert engine.hf_config["num_hidden_layers"] == 2


def test_auto_dtype_is_bf16_exactly_where_the_cpu_has_it(monkeypatch, tmp_path):
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert EngineConfig(model="x").resolve_dtype(cpu) == expected
    assert EngineConfig(model="x", dtype="auto").resolve_dtype(cpu) == expected
    assert EngineConfig(model="x", dtype="float32").resolve_dtype(cpu) == torch.float32
    # Without torch's probe, /proc/cpuinfo's flags decide.
    monkeypatch.delattr(torch._C._cpu, "_get_cpu_capability", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(config_module, "CPUINFO", cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n")
    assert cpu_has_native_bf16()
    assert EngineConfig(model="x").resolve_dtype(cpu) == torch.bfloat16
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert not cpu_has_native_bf16()
    assert EngineConfig(model="x", dtype="auto").resolve_dtype(cpu) == torch.float32
    cpuinfo.unlink()
    assert not cpu_has_native_bf16()


def test_bfloat16_runs_close_to_float32(checkpoint, helpers):
    folder, _ = checkpoint("qwen3")
    prompt = helpers.random_prompt(20, seed=80)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = LogitsCapturingEngine(
            EngineConfig(model=str(folder), dtype=dtype, num_blocks=32, block_size=4)
        )
        assert engine.model_runner.kv_cache.dtype == getattr(torch, dtype)
        generate(engine, [prompt], SamplingParams(max_tokens=1, temperature=0))
        logits[dtype] = next(iter(engine.captured_logits.values()))[0][1]
    assert torch.allclose(logits["float32"], logits["bfloat16"], atol=0.25)


def test_eos_ids_fall_back_to_config_json(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_eos_token_ids(tmp_path, {"eos_token_id": 3}) == [7, 9]
    (tmp_path / "generation_config.json").unlink()
    assert load_eos_token_ids(tmp_path, {"eos_token_id": 3}) == [3]
    assert load_eos_token_ids(tmp_path, {}) == []


def test_shard_index_lists_the_files(checkpoint):
    folder, _ = checkpoint("llama3", sharded=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert {p.name for p in safetensors_files(folder)} == set(index["weight_map"].values())


def test_errors_name_the_problem(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    folder, _ = checkpoint("llama")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported"):
        LLMEngine(EngineConfig(model=str(broken), num_blocks=8))
    config["architectures"] = ["LlamaForCausalLM"]
    config["num_hidden_layers"] = 3  # the weights have only two layers
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing weights: layers\.2"):
        LLMEngine(EngineConfig(model=str(broken), num_blocks=8))


def test_config_validation():
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(model="x", schedule_policy="random")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="x", dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="x", block_size=0)


def test_sliding_window_caps_the_context(checkpoint, tmp_path):
    folder, _ = checkpoint("mistral")
    windowed = tmp_path / "windowed"
    shutil.copytree(folder, windowed)
    config = json.loads((windowed / "config.json").read_text())
    config["sliding_window"] = 40
    (windowed / "config.json").write_text(json.dumps(config))
    assert (
        LLMEngine(EngineConfig(model=str(windowed), num_blocks=64, block_size=4)).max_model_len
        == 40
    )

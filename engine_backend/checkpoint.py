"""Reading Hugging Face model folders: config.json, safetensors weights and eos ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine_backend.models import CausalLM, build_model

INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json (is it a Hugging Face model folder?)"
        )
    return json.loads(path.read_text())


def _as_id_list(value: object) -> list[int]:
    """An `eos_token_id` as config files write it: absent, one id, or a list of ids."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    raise ValueError(f"eos_token_id must be an integer or a list of integers, not {value!r}")


def load_eos_token_ids(model_dir: str | Path, hf_config: dict) -> list[int]:
    """End-of-sequence ids: generation_config.json wins (it lists chat end tokens
    such as <|eot_id|>), config.json is the fallback."""
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        ids = _as_id_list(json.loads(path.read_text()).get("eos_token_id"))
        if ids:
            return ids
    return _as_id_list(hf_config.get("eos_token_id"))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: those named by the shard index when there is one, else all
    *.safetensors in the folder."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def weight_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time so peak host memory stays near one tensor."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_model(
    model_dir: str | Path,
    hf_config: dict,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> CausalLM:
    files = safetensors_files(model_dir)
    has_lm_head = "lm_head.weight" in weight_names(files)
    model = build_model(hf_config, device, dtype, max_positions, has_lm_head=has_lm_head)
    model.load_weights(iter_weights(files))
    model.pack_for_cpu()
    return model

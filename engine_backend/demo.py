"""The built-in demo model: a small Llama-shaped checkpoint with random weights.

It lets anyone run the whole pipeline (gateway -> engine -> streaming, prefix-cache hits
in usage) on a fresh machine with no keys and no downloads. Its output is noise by
design. The same writer makes the random checkpoints of realistic shape the benchmark
uses, so both are ordinary Hugging Face folders that `transformers` can load too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEMO_MODEL_NAME = "firsttoken-demo-random"
DEMO_DESCRIPTION = (
    "Built-in demo model with RANDOM weights: its output is meaningless noise. "
    "It exists to try the firsttoken pipeline (streaming, prefix-cache hits in usage) "
    "without downloads or keys. Serve a real model with --model PATH."
)
# Bump when the files written below change, so old caches are not reused.
FORMAT_VERSION = 1

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A small built-in text to learn byte-pair merges from, so common English words become
# single tokens and prompts are not one token per byte. No data is downloaded.
_TRAINING_TEXT = """
The first token of an answer arrives after the model has read the whole prompt. Reading
the prompt is called prefill, and its cost grows with the number of prompt tokens. A
prefix cache keeps the keys and values of prompts the engine has already seen, so a new
request that starts with the same system prompt, the same tools and the same documents
skips that work and answers sooner. Chunked prefill splits a long prompt into pieces under
a token budget per step, so the streams that are already decoding keep a steady pace.
The gateway sits between an application and its model provider. It slims the prompt,
keeps the prefix stable so provider caches hit, streams every event without buffering and
records the time to first token for each tenant and route. This demo model has random
weights; what it writes is noise, but the timings, the streaming and the cache hits are
real. Hello, world! How are you today? What is the weather like? Please write a short
poem about the sea, the sky and the mountains. Thank you for your help with this request.
def main(): return 0 if __name__ == "__main__" else 1  # code, numbers 0123456789 {}[]()
"""


@dataclass(frozen=True)
class RandomModelSpec:
    """Shape of a random Llama checkpoint. vocab_size None: exactly the tokenizer's size."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768
    vocab_size: int | None = None
    max_position_embeddings: int = 4096
    tokenizer_vocab_size: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0


# SmolLM2-135M(-Instruct)'s exact shape (its config.json: tied embeddings, rope_theta
# 100000), for benchmarks: a forward's time depends on the shape, not on the values.
SMOLLM2_135M_SHAPE = RandomModelSpec(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    seed=3,
)


def build_byte_level_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer: every byte is a token, so any text encodes,
    plus merges learned from the built-in text and the chat special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.split("\n"), trainer)
    return tokenizer


def _random_llama_weights(config: dict, spec: RandomModelSpec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    hidden, inter, vocab = spec.hidden_size, spec.intermediate_size, config["vocab_size"]
    head_dim = config["head_dim"]
    q_out = spec.num_attention_heads * head_dim
    kv_out = spec.num_key_value_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)

    weights = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=dtype),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def write_random_model(path: str, spec: RandomModelSpec = RandomModelSpec()) -> None:
    """Write a complete Hugging Face model folder (config, weights, tokenizer, template)."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_byte_level_tokenizer(spec.tokenizer_vocab_size)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    token_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = spec.vocab_size or token_vocab
    if vocab_size < token_vocab:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {token_vocab}")
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "torch_dtype": spec.dtype,
    }
    tokenizer_config = {
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    generation_config = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[IM_END]]}
    write_model_files(
        path, config, tokenizer_config, generation_config, _random_llama_weights(config, spec)
    )


def write_model_files(
    path: str,
    config: dict,
    tokenizer_config: dict,
    generation_config: dict,
    weights: dict[str, torch.Tensor],
) -> None:
    """The JSON files and the safetensors weights of a Hugging Face model folder (its
    tokenizer.json is the caller's)."""
    for name, content in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ):
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def default_cache_dir() -> str:
    root = os.environ.get("FIRSTTOKEN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "firsttoken")
    return root


def cached_model_folder(
    root: str, prefix: str, spec: dict[str, Any], write: Callable[[str], None]
) -> str:
    """The folder `root/prefix-<hash of spec>`, made by `write` on first use.

    The name is a hash of everything that shapes the model, so a change never reuses a stale
    folder; it is written to a temporary sibling and renamed, so a crash or a second process
    never leaves a half-written model behind.
    """
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(root, f"{prefix}-{key}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{prefix}-", dir=root)
    try:
        write(staging)
        try:
            os.replace(staging, path)
        except OSError:
            if not os.path.exists(os.path.join(path, "model.safetensors")):
                raise
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return path


def build_demo_model(
    cache_dir: str | None = None, spec: RandomModelSpec = RandomModelSpec()
) -> str:
    """Return the path of the demo model folder, writing it on first use (see
    `cached_model_folder`)."""
    return cached_model_folder(
        cache_dir or default_cache_dir(),
        "demo",
        {"v": FORMAT_VERSION, **asdict(spec)},
        lambda staging: write_random_model(staging, spec),
    )

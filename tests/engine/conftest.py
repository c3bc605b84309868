"""Tiny random checkpoints of each supported architecture, built with `transformers`.

Weights are drawn wider than transformers' default init so that logits are spread
out and greedy choices are decisive; a comparison that passes therefore says the
engine computes the same function, not that every logit is near zero.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="device the engine runs on in tests/engine (cpu, cuda, cuda:1); the references "
        "(transformers) stay on the CPU",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Point the shared test options at the requested device (read when tests/engine is
    named on the command line; any other run keeps the CPU)."""
    from tests.engine.engines import TEST_OPTIONS

    device = str(config.getoption("--device", default="cpu"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: this machine has no CUDA device")
    TEST_OPTIONS["device"] = device


VOCAB = 256
EOS_ID = 2

ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def make_hf_model(arch: str, tie: bool, seed: int = 0, hidden: int = 64, layers: int = 2):
    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        eos_token_id=EOS_ID,
        bos_token_id=1,
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5 * 1.5)
    return model.eval()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, object]]:
    """checkpoint(arch, tie=False, sharded=False) -> (folder, transformers model), cached."""
    built: dict[tuple, tuple[Path, object]] = {}

    def build(
        arch: str = "llama", tie: bool = False, sharded: bool = False, **kwargs
    ) -> tuple[Path, object]:
        key = (arch, tie, sharded, tuple(sorted(kwargs.items())))
        if key not in built:
            model = make_hf_model(arch, tie, **kwargs)
            folder = tmp_path_factory.mktemp(f"{arch}-{'tied' if tie else 'untied'}")
            model.save_pretrained(folder, max_shard_size="40KB" if sharded else "5GB")
            model.generation_config.save_pretrained(folder)
            built[key] = (folder, model)
        return built[key]

    return build


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `token_ids`, [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def captured_by_position(engine, request_id: str) -> dict[int, torch.Tensor]:
    """The engine's captured logits for a request, keyed by position (latest wins)."""
    rows: dict[int, torch.Tensor] = {}
    for first, logits in engine.captured_logits[request_id]:
        for offset in range(logits.shape[0]):
            rows[first + offset] = logits[offset]
    return rows


@pytest.fixture
def helpers():
    """The module-level helpers, for tests (conftest modules are not importable by name)."""

    class Helpers:
        reference_logits = staticmethod(reference_logits)
        reference_greedy = staticmethod(reference_greedy)
        random_prompt = staticmethod(random_prompt)
        captured_by_position = staticmethod(captured_by_position)
        make_hf_model = staticmethod(make_hf_model)

    return Helpers

"""Sampling parameters and the sampler that turns a step's logits into next tokens.

Greedy rows take the argmax; the others are filtered (temperature, top-k, top-p) in
one batched pass and drawn with either the engine's generator or, when a request
carries a seed, its own generator so that its output does not depend on who else
shares the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Bounds that keep every value inside the tensors and generators it ends up in.
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's convention)
MAX_TOP_K = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # The engine's own guard (the OpenAI front checks the same and names the field): a
        # value that passed here can no longer break a step it shares with other requests.
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}]")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it)")
        if self.seed is not None and (
            not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}]")

    @property
    def greedy(self) -> bool:
        # Dividing float32 logits by a temperature this small overflows to inf and NaN.
        return self.temperature < GREEDY_BELOW


def filter_logits(
    logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Scale by temperature and mask everything outside top-k / top-p with -inf.

    `logits` is [rows, vocab] float32; the other tensors are per-row. A top_k of 0
    and a top_p of 1 leave a row untouched.
    """
    logits = logits / temperatures.unsqueeze(1)
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


class Sampler:
    """Picks one token per row of logits, honouring each row's SamplingParams."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_request_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """Return the next token for each row (one host sync for the whole batch)."""
        logits = logits.float()
        tokens = logits.argmax(dim=1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = [params[i] for i in random_rows]
            filtered = filter_logits(
                logits.index_select(0, rows),
                torch.tensor([p.temperature for p in chosen], device=logits.device),
                torch.tensor([p.top_k for p in chosen], device=logits.device),
                torch.tensor([p.top_p for p in chosen], device=logits.device),
            )
            probs = filtered.softmax(dim=1)
            drawn = torch.empty(len(random_rows), dtype=torch.long, device=logits.device)
            shared = [j for j, i in enumerate(random_rows) if generators[i] is None]
            if shared:
                idx = torch.tensor(shared, device=logits.device)
                picks = torch.multinomial(probs.index_select(0, idx), 1, generator=self.generator)
                drawn.index_copy_(0, idx, picks.squeeze(1))
            for j, i in enumerate(random_rows):
                if generators[i] is not None:
                    drawn[j] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
            tokens.index_copy_(0, rows, drawn)
        return tokens.tolist()

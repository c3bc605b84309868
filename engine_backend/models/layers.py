"""Building blocks shared by the decoder architectures: RMSNorm and rotary embeddings."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference checkpoints expect.

    Three passes over the activations (one reduction, two multiplies) where the textbook
    form takes five: on a CPU each pass over a prefill's [tokens, hidden] costs about as
    much as a small matmul. In bf16 the rounding points are transformers' (normalise in
    float32, round, then multiply by the weight)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        wide = x.float()
        # mean(x^2) as |x|^2 / n: one reduction, no [tokens, hidden] temporary.
        scale = torch.linalg.vector_norm(wide, dim=-1, keepdim=True).square_()
        scale = scale.div_(x.shape[-1]).add_(self.eps).rsqrt_()
        out = (wide * scale).to(dtype)
        return out.mul_(self.weight)


def rope_inverse_frequencies(head_dim: int, rope: dict) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama-3 style or linear scaling applied.

    `rope` holds `rope_theta` and optionally `rope_type` ("default", "linear",
    "llama3") and that type's parameters, as in config.json.
    """
    theta = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low_freq_factor = float(rope["low_freq_factor"])
        high_freq_factor = float(rope["high_freq_factor"])
        old_context = float(rope["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by position (half-split layout). cos and sin are
    tabulated once up to the longest position the engine will serve, already in the full
    head width and with the sign of the rotation folded into sin, so a layer's rotation
    is two multiplies and an add over its query and key heads together."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: dict) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos_table", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_table", torch.cat((-sin, sin), dim=-1), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin per position, [tokens, 1, head_dim], to broadcast over heads;
        built once per step and shared by every layer."""
        cos = self.cos_table.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x is [tokens, heads, head_dim] (any row stride); its two halves form the rotated
    pairs: x * cos + (second half, first half) * signed sin, rounded where transformers'
    `q * cos + rotate_half(q) * sin` rounds (each product, then the sum).

    Each half's product goes through one half-width buffer and is added in place: no
    concatenated copy of the swapped halves, which on a prefill's strided q/k view cost
    several times the multiplies themselves."""
    half = x.shape[-1] // 2
    out = x * cos
    product = x[..., half:] * sin[..., :half]
    out[..., :half] += product
    torch.mul(x[..., :half], sin[..., half:], out=product)
    out[..., half:] += product
    return out

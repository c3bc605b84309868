"""Model construction: pick the architecture from config.json, place it, load weights."""

from __future__ import annotations

import torch

from engine_backend.models.layers import RotaryEmbedding
from engine_backend.models.llama import SUPPORTED_ARCHITECTURES, CausalLM, DecoderArgs

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "DecoderArgs", "build_model"]


def build_model(
    hf_config: dict,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    has_lm_head: bool = True,
) -> CausalLM:
    """An uninitialised model of the right shape on `device` (weights still to load).

    Construction happens on the meta device so a large model costs no random
    initialisation; a checkpoint without `lm_head.weight` is treated as tied.
    """
    args = DecoderArgs.from_hf(hf_config)
    if not has_lm_head:
        args.tie_word_embeddings = True
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to(dtype=dtype).to_empty(device=device)
    rope_positions = max(max_positions, args.max_position_embeddings)
    model.rotary = RotaryEmbedding(args.head_dim, rope_positions, args.rope).to(device)
    return model.eval()

"""The Llama family decoder (Llama incl. Llama-3 RoPE scaling, Mistral, Qwen2, Qwen3).

They differ only in small switches read from config.json: biases on q/k/v (Qwen2),
RMSNorm on query and key heads (Qwen3), tied or separate output embeddings, and
the RoPE variant. Projections are fused (q/k/v into one matmul, gate/up into one)
so each layer runs four matmuls over all tokens of the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_backend.models.attention import AttentionMetadata, paged_attention
from engine_backend.models.cpu_linear import PackedLinear, pack_linears, packing_available
from engine_backend.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def _rope_parameters(hf: dict) -> dict:
    """transformers 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params:
        if "rope_theta" not in params and "full_attention" in params:
            params = params["full_attention"]
        return dict(params)
    return {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}


@dataclass
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict) -> DecoderArgs:
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        activation = hf.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"hidden_act {activation!r} is not supported (only silu)")
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope=_rope_parameters(hf),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size]
            q = apply_rotary(self.q_norm(q.view(tokens, heads, self.head_dim)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(tokens, -1, self.head_dim)), cos, sin)
        else:
            # Query and key heads side by side in one tensor: one rotation for both.
            qk = apply_rotary(qkv[:, :qk_size].view(tokens, -1, self.head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(
            args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias
        )
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # In place in the projection's output: no [tokens, intermediate] temporaries.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # The residual stream is updated in place (each layer's input is its own to change).
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class CausalLM(nn.Module):
    """Decoder stack. `forward` returns final hidden states before the norm, so the
    caller can run `compute_logits` on just the rows it samples from."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (
            None
            if args.tie_word_embeddings
            else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        )
        self.rotary: RotaryEmbedding | None = None  # set by build_model once the device is known
        # The tied output projection as a module of its own, where the CPU packs it
        # (pack_for_cpu); None: logits multiply by the embedding table directly.
        self.tied_head: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions are [tokens]; kv_cache is [2, layers, slots, kv_heads, dim]."""
        assert self.rotary is not None, "build_model sets the rotary tables"
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[0, i], kv_cache[1, i], meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.tied_head is not None:
            return self.tied_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    def pack_for_cpu(self) -> bool:
        """Once the weights are loaded: every projection and the logits through oneDNN with
        packed weights, where that applies (float32 on the CPU; see models/cpu_linear.py)."""
        weight = self.embed_tokens.weight
        if not packing_available(weight.device, weight.dtype):
            return False
        pack_linears(self)
        if self.lm_head is None:
            self.tied_head = PackedLinear(weight, None)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v and gate/up as they arrive.

        Raises ValueError naming any parameter the checkpoint did not provide."""
        args = self.args
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, args.intermediate_size),
            "up_proj": ("gate_up_proj", args.intermediate_size, args.intermediate_size),
        }
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)  # a fused parameter fills up in row slices
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            target = name
            rows: slice | None = None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, offset, size = fused[parts[-2]]
                target = ".".join([*parts[:-2], fused_name, parts[-1]])
                rows = slice(offset, offset + size)
            if target == "lm_head.weight" and self.lm_head is None:
                continue
            param = params.get(target)
            if param is None:
                continue
            with torch.no_grad():
                destination = param if rows is None else param[rows]
                if destination.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} "
                        f"!= model shape {tuple(destination.shape)}"
                    )
                destination.copy_(tensor)
            rows_loaded[target] += destination.shape[0]
        missing = sorted(
            name for name, param in params.items() if rows_loaded[name] < param.shape[0]
        )
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")

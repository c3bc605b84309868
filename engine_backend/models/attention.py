"""Attention over the paged KV cache for a flattened batch of mixed sequences.

A step's tokens are laid out decodes first (one token each), then prefill chunks.
Each layer writes its new keys and values into the cache slots of those tokens,
then attends:

- all decodes together, in one padded SDPA call over keys gathered from their
  block tables (the padding is masked out);
- each prefill chunk on its own: a chunk that starts a sequence attends to its own
  fresh keys with a causal mask; a later chunk, or one after a prefix-cache hit,
  gathers the earlier keys from the cache. On CPU that case runs as two fused
  kernels, one over the earlier keys (no mask) and one causal over the chunk itself,
  merged by their log-sum-exp: exact, and about 40% faster than one call with an
  explicit mask, which falls back to the unfused path.

The gather indices and masks are built once per step in `AttentionMetadata` and
shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    """One sequence's chunk inside the flattened batch."""

    token_start: int  # first row of the chunk in the flattened batch
    num_tokens: int
    # Cache slots of positions [0, start + n), or None for a chunk that starts its sequence.
    context_slots: torch.Tensor | None
    prefix_len: int = 0  # positions before the chunk (cached or computed in earlier steps)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self) -> torch.Tensor:
        """[n, prefix + n] bool, True where attending is allowed; built once per step."""
        if self._mask is None:
            n = self.num_tokens
            device = None if self.context_slots is None else self.context_slots.device
            self._mask = torch.ones(n, self.prefix_len + n, dtype=torch.bool, device=device).tril(
                self.prefix_len
            )
        return self._mask


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each one may attend to."""

    slot_mapping: torch.Tensor  # [tokens] cache slot of each new token
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [decodes, max_context] slots to gather
    # [decodes, 1, 1, max_context] bool, or None when no decode is padded.
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)


# Fused CPU attention that also returns the log-sum-exp (a private ATen op; absent -> fallback).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_then_causal(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Attention of a chunk over [earlier positions | the chunk itself], as two fused kernels
    merged by log-sum-exp. queries [1, heads, n, dim]; keys/values [1, kv_heads, prefix + n,
    dim]. Only where `_FLASH_CPU` exists (callers check)."""
    flash = _FLASH_CPU
    assert flash is not None, "prefix_then_causal needs the fused CPU kernel"
    _, heads, n, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # Over the earlier positions no mask is needed, so the heads that share a kv head can be
    # stacked as extra query rows instead of repeating the (long) keys.
    stacked = queries.reshape(1, kv_heads, group * n, dim)
    out_prefix, lse_prefix = flash(
        stacked, keys[:, :, :prefix_len], values[:, :, :prefix_len], 0.0, False, scale=scale
    )
    out_prefix = out_prefix.reshape(1, heads, n, dim)
    lse_prefix = lse_prefix.reshape(1, heads, n)
    own_keys, own_values = keys[:, :, prefix_len:], values[:, :, prefix_len:]
    if group > 1:
        own_keys = own_keys.repeat_interleave(group, dim=1)
        own_values = own_values.repeat_interleave(group, dim=1)
    out_own, lse_own = flash(queries, own_keys, own_values, 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_prefix, lse_own)
    return (
        out_prefix * (lse_prefix - lse).exp().unsqueeze(-1)
        + out_own * (lse_own - lse).exp().unsqueeze(-1)
    ).to(queries.dtype)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of the cache at `slots`, contiguous (index_select is about twice as fast
    as advanced indexing on CPU)."""
    return cache.index_select(0, slots)


def gqa_of(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether query heads share key/value heads ([tokens, heads, dim] each)."""
    return q.shape[1] != k.shape[1]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q is [tokens, heads, dim], k/v [tokens, kv_heads, dim]; the caches are
    [slots, kv_heads, dim]. Returns [tokens, heads, dim]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if not meta.num_decodes and len(meta.prefills) == 1 and meta.prefills[0].context_slots is None:
        # One fresh prompt (the cold-TTFT case): its own keys, causal, and SDPA's output
        # as it is, with no copy into a step-wide buffer.
        queries = q.transpose(0, 1).unsqueeze(0)
        keys = k.transpose(0, 1).unsqueeze(0)
        values = v.transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=q.shape[0] > 1, scale=scale, enable_gqa=gqa_of(q, k)
        )
        return attended[0].transpose(0, 1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    gqa = gqa_of(q, k)
    if meta.num_decodes:
        n = meta.num_decodes
        decode_slots = meta.decode_slots
        assert decode_slots is not None, "decodes come with their slots"
        context = decode_slots.shape[1]
        slots = decode_slots.flatten()
        # [decodes, kv_heads, context, dim]
        keys = gather(k_cache, slots).view(n, context, num_kv_heads, head_dim).transpose(1, 2)
        values = gather(v_cache, slots).view(n, context, num_kv_heads, head_dim).transpose(1, 2)
        # With one query per sequence, the heads sharing a kv head can stand in for
        # query positions: [decodes, kv_heads, group, dim] needs no kv repetition.
        queries = q[:n].view(n, num_kv_heads, -1, head_dim)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.decode_mask, scale=scale
        )
        out[:n] = attended.reshape(n, -1, head_dim)
    for seg in meta.prefills:
        rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
        # SDPA's fused CPU kernels want 4-D inputs: [1, heads, tokens, dim].
        queries = q[rows].transpose(0, 1).unsqueeze(0)
        if seg.context_slots is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=seg.num_tokens > 1, scale=scale, enable_gqa=gqa
            )
        else:
            keys = gather(k_cache, seg.context_slots).transpose(0, 1).unsqueeze(0)
            values = gather(v_cache, seg.context_slots).transpose(0, 1).unsqueeze(0)
            if _FLASH_CPU is not None and queries.device.type == "cpu" and seg.prefix_len > 0:
                attended = prefix_then_causal(queries, keys, values, seg.prefix_len, scale)
            else:
                attended = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=seg.mask(), scale=scale, enable_gqa=gqa
                )
        out[rows] = attended[0].transpose(0, 1)
    return out

"""Copying whole KV blocks out of the paged cache and into it.

The cache is one tensor [2 (K, V), layers, slots, kv_heads, head_dim] (ModelRunner.kv_cache);
block b owns slots [b * block_size, (b + 1) * block_size). On the wire and in between, blocks
travel block-major, [blocks, 2, layers, block_size, kv_heads, head_dim] on the CPU, so each
block is one contiguous run of bytes. These functions run on the engine thread, between steps:
the engine thread is the only one that touches the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVBlocks:
    """Consecutive full blocks of one prompt: their tokens and their K/V, block-major."""

    token_ids: list[int]  # num_blocks * block_size ids
    kv: torch.Tensor  # [num_blocks, 2, layers, block_size, kv_heads, head_dim], on the CPU

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[0])


def _slots(block_ids: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long)
    slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    return slots.to(device)


@torch.inference_mode()
def read_blocks(kv_cache: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """The blocks' K/V as a CPU tensor [blocks, 2, layers, block_size, kv_heads, head_dim] in the
    cache's dtype (one gather on the cache's device, one copy to the host)."""
    two, layers, _, heads, dim = kv_cache.shape
    gathered = kv_cache.index_select(2, _slots(block_ids, block_size, kv_cache.device))
    blocks = gathered.view(two, layers, len(block_ids), block_size, heads, dim)
    return blocks.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def block_shape(kv_cache: torch.Tensor, block_size: int) -> tuple[int, ...]:
    """The shape of one block's K/V in transit: [2, layers, block_size, kv_heads, head_dim]."""
    two, layers, _, heads, dim = kv_cache.shape
    return (two, layers, block_size, heads, dim)


@torch.inference_mode()
def write_block(kv_cache: torch.Tensor, block_id: int, block_size: int, kv: torch.Tensor) -> None:
    """Write one block's K/V (`block_shape`) into its slots: a single copy, converting device
    and dtype on the way, so that an import can go a few blocks at a time between steps."""
    if tuple(kv.shape) != block_shape(kv_cache, block_size):
        raise ValueError(
            f"a KV block has shape {tuple(kv.shape)}, the cache needs "
            f"{block_shape(kv_cache, block_size)}"
        )
    start = block_id * block_size
    kv_cache[:, :, start : start + block_size].copy_(kv)

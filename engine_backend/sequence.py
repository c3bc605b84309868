"""One request's state as it moves through the engine: tokens, progress and KV blocks."""

from __future__ import annotations

import enum
import itertools

import torch

from engine_backend.sampling import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    IMPORTING = "importing"  # pulled KV still being copied into its pinned blocks
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens, how many of them have KV in the cache, and where.

    `num_computed_tokens` counts tokens whose keys and values sit in this sequence's
    blocks (cache hits included). A sequence needs a forward pass for the tokens
    after that point; when it has computed all but its newest token it is decoding.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.generator = generator
        self.arrival = next(_arrival_counter)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # Hash of each full block of token_ids, filled lazily by the block manager.
        self.block_hashes: list[bytes] = []
        # Leading blocks of block_table already offered to the prefix cache.
        self.num_registered_blocks = 0
        # Blocks held for this sequence before admission (KV pulled from a prefill server),
        # so that nothing evicts them while it waits; released once it is admitted.
        self.pinned_blocks: list[int] = []
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.value})"
        )

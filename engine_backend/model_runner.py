"""Runs one forward pass over everything a step scheduled and returns logits.

The batch is flattened: first one token per decoding sequence, then each prefill
chunk's tokens. Matmuls run once over all rows; only attention looks at sequence
boundaries (see models/attention.py). Logits are computed only for rows that
will be sampled (a decode, or the last token of a prompt), unless the caller asks
for every row (tests compare those with a reference implementation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_backend.models import CausalLM
from engine_backend.models.attention import AttentionMetadata, PrefillSegment
from engine_backend.sequence import Sequence


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    args = model.args
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * element_size


@dataclass
class StepLogits:
    """What a forward produced: logits of the rows to sample, in `sampled` order, and
    optionally every row's logits grouped by sequence as (first position, logits)."""

    sampled: list[Sequence]
    logits: torch.Tensor
    all_rows: list[tuple[Sequence, int, torch.Tensor]] | None = None


class ModelRunner:
    """Owns the model and the paged KV cache; turns scheduled sequences into tensors."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        args = model.args
        # Zeroed, not empty: padded decode gathers read slot 0, and NaN there would
        # survive the mask through softmax @ V.
        self.kv_cache = torch.zeros(
            2,
            args.num_layers,
            num_blocks * block_size,
            args.num_kv_heads,
            args.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._offsets = torch.arange(block_size)

    def _slots(self, block_table: list[int], num_positions: int) -> torch.Tensor:
        blocks = torch.tensor(block_table[: -(-num_positions // self.block_size)])
        return (blocks.unsqueeze(1) * self.block_size + self._offsets).flatten()[:num_positions]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def prepare(
        self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        """Flatten the step into input ids, positions, attention metadata and the rows to sample."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=len(decodes))

        if decodes:
            lengths = torch.tensor([len(seq) for seq in decodes])
            max_blocks = max(len(seq.block_table) for seq in decodes)
            table = torch.tensor(
                [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in decodes]
            )
            max_context = int(lengths.max())
            context_slots = (table.unsqueeze(2) * size + self._offsets).flatten(1)[:, :max_context]
            last = lengths - 1
            input_ids.extend(seq.token_ids[-1] for seq in decodes)
            positions.append(last)
            slot_mapping.append(context_slots.gather(1, last.unsqueeze(1)).squeeze(1))
            meta.decode_slots = self._to_device(context_slots)
            if int(lengths.min()) != max_context:
                mask = torch.arange(max_context).unsqueeze(0) < lengths.unsqueeze(1)
                meta.decode_mask = self._to_device(mask[:, None, None, :])
            sample_rows.extend(range(len(decodes)))
            sampled.extend(decodes)

        row = len(decodes)
        for seq, num_new in prefills:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            seq_positions = torch.arange(start, end)
            positions.append(seq_positions)
            context_slots = self._slots(seq.block_table, end)
            slot_mapping.append(context_slots[start:])
            if start == 0:
                segment = PrefillSegment(row, num_new, None)
            else:
                segment = PrefillSegment(row, num_new, self._to_device(context_slots), start)
            meta.prefills.append(segment)
            row += num_new
            if end == len(seq):
                sample_rows.append(row - 1)
                sampled.append(seq)

        meta.slot_mapping = self._to_device(torch.cat(slot_mapping))
        ids = self._to_device(torch.tensor(input_ids))
        pos = self._to_device(torch.cat(positions))
        return ids, pos, meta, sample_rows, sampled

    @torch.inference_mode()
    def execute(
        self,
        decodes: list[Sequence],
        prefills: list[tuple[Sequence, int]],
        return_all_logits: bool = False,
    ) -> StepLogits:
        """One forward for the whole step. Does not advance the sequences' progress."""
        ids, pos, meta, sample_rows, sampled = self.prepare(decodes, prefills)
        hidden = self.model(ids, pos, self.kv_cache, meta)
        if not return_all_logits:
            rows = self._to_device(torch.tensor(sample_rows, dtype=torch.long))
            return StepLogits(sampled, self.model.compute_logits(hidden.index_select(0, rows)))
        all_logits = self.model.compute_logits(hidden)
        per_seq: list[tuple[Sequence, int, torch.Tensor]] = [
            (seq, len(seq) - 1, all_logits[i : i + 1]) for i, seq in enumerate(decodes)
        ]
        row = len(decodes)
        for seq, num_new in prefills:
            per_seq.append((seq, seq.num_computed_tokens, all_logits[row : row + num_new]))
            row += num_new
        rows = torch.tensor(sample_rows, dtype=torch.long, device=all_logits.device)
        return StepLogits(sampled, all_logits.index_select(0, rows), per_seq)

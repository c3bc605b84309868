"""Continuous batching under a per-step token budget, with chunked prefill.

Each step spends at most `max_num_batched_tokens` tokens:

1. running sequences that decode (one token each) go first, so streams already
   talking never wait behind a long prompt;
2. running sequences still prefilling get the next chunk of their prompt;
3. waiting sequences are admitted (FCFS, or longest cached prefix first) while
   budget, sequence slots and blocks last; their cached prefix costs nothing.

A sequence whose prompt KV was pulled from a prefill server first sits in
`importing`, its blocks pinned, while the engine copies that KV in a slice per step;
it is in no batch until `admit_imported` queues it, where its blocks are all hits.

When a running sequence needs a block and none is free, the newest running
sequence is preempted: its blocks are released (full ones stay in the prefix
cache) and it goes back to the front of the queue, to be recomputed later.

The scheduler is the one writer of a request's progress: its status, how many of
its tokens are computed (and how many of those came from the prefix cache), the
tokens it generated and why it finished. The block manager only hands out blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine_backend.block_manager import BlockManager
from engine_backend.sequence import Sequence, SequenceStatus

# How many waiting sequences the longest-prefix-match policy compares per pick.
LPM_WINDOW = 128


@dataclass
class SchedulerOutput:
    """One step's work: sequences computing a single sampled token, then prompt chunks."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: str = "fcfs",
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.importing: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_importing(self, seq: Sequence) -> None:
        """Hold `seq` back while its pinned blocks are being filled with pulled KV."""
        seq.status = SequenceStatus.IMPORTING
        self.importing.append(seq)

    def admit_imported(self, seq: Sequence) -> None:
        """Its import is complete (or abandoned): queue it like any other request."""
        self.importing.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.importing)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        bm = self.block_manager

        by_priority = sorted(self.running, key=lambda s: s.num_uncomputed_tokens != 1)
        for seq in by_priority:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, num_new):
                if self._release_pins():
                    continue
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                scheduled[seq] = num_new
                budget -= num_new

        # Admitting after a preemption would only evict someone again.
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq, hits = self._pick_waiting()
            num_new = min(len(seq) - len(hits) * bm.block_size, budget)
            if not bm.can_allocate(seq, num_new, hits):
                break
            self.waiting.remove(seq)
            bm.allocate(seq, num_new, hits)
            if seq.pinned_blocks:  # its hits now hold their own references
                bm.unpin(seq.pinned_blocks)
                seq.pinned_blocks = []
            seq.num_computed_tokens = len(hits) * bm.block_size
            if seq.num_output_tokens == 0:  # a preempted request keeps its first count
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq] = num_new
            budget -= num_new

        out = SchedulerOutput(preempted=preempted)
        for seq, num_new in scheduled.items():
            if num_new == 1 and seq.num_uncomputed_tokens == 1:
                out.decodes.append(seq)
            else:
                out.prefills.append((seq, num_new))
        return out

    def _pick_waiting(self) -> tuple[Sequence, list[int]]:
        bm = self.block_manager
        if self.policy != "lpm" or len(self.waiting) == 1:
            seq = self.waiting[0]
            return seq, bm.find_cached_prefix(seq)
        best: tuple[Sequence, list[int]] | None = None
        for i, seq in enumerate(self.waiting):
            if i == LPM_WINDOW:
                break
            hits = bm.find_cached_prefix(seq)
            if best is None or len(hits) > len(best[1]):
                best = (seq, hits)
        assert best is not None
        return best

    def _release_pins(self) -> bool:
        """Pulled KV pinned for waiting sequences yields to a running sequence that needs room:
        the blocks stay cached (evictable), and a waiting sequence that loses them computes
        its prompt itself. An import in progress stops (the blocks it filled stay cached and
        named; the others were never named) and its sequence is queued as an ordinary one.
        Returns whether any pin was dropped."""
        released = False
        for seq in list(self.importing):
            self.admit_imported(seq)
        for seq in self.waiting:
            if seq.pinned_blocks:
                self.block_manager.unpin(seq.pinned_blocks)
                seq.pinned_blocks = []
                released = True
        return released

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step's forward pass computed its tokens; publish full blocks."""
        for seq in out.decodes:
            seq.num_computed_tokens += 1
            self.block_manager.register_full_blocks(seq)
        for seq, num_new in out.prefills:
            seq.num_computed_tokens += num_new
            self.block_manager.register_full_blocks(seq)

    def append_token(self, seq: Sequence, token: int) -> None:
        """Record a sampled token; it is computed by the next step that schedules `seq`."""
        seq.token_ids.append(token)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release a sequence that is done (finished, aborted or failed), wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.IMPORTING:
            self.importing.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

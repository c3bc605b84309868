"""The synchronous engine: requests in, one scheduled step at a time, tokens out.

`step()` copies a bounded slice of any pulled KV into the pool, schedules (decodes
first, then prompt chunks), runs one forward over all of it, samples, and reports
per request. A request whose row cannot be sampled fails
alone (its output carries the error); the others in the step go on. It is
single-threaded by design; the async front owns the thread that calls it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_backend.block_manager import BlockManager
from engine_backend.checkpoint import load_eos_token_ids, load_hf_config, load_model
from engine_backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine_backend.model_runner import ModelRunner, kv_bytes_per_block
from engine_backend.pd.holds import KVHolds, num_transfer_blocks
from engine_backend.pd.kv_blocks import KVBlocks, block_shape, read_blocks, write_block
from engine_backend.sampling import Sampler, SamplingParams
from engine_backend.scheduler import Scheduler
from engine_backend.sequence import Sequence, SequenceStatus

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
logger = logging.getLogger(__name__)

# Pulled KV is copied into the pool at most this many bytes per step (at least one block),
# before the step's batch runs: a long prompt's handover (a 4,096-token prompt of the bench's
# model is 64 MiB, ~90 ms to copy on one CPU core) then delays each step of the requests
# already decoding by one slice (~1-2 ms per MiB on a CPU core, far less on a GPU) instead
# of stalling one step for the whole copy.
IMPORT_BYTES_PER_STEP = 4 * 1024 * 1024


def _model_context_length(hf_config: dict) -> int:
    """max_position_embeddings, or the sliding window when the model uses one: the
    engine attends to the full context, which matches the model only within it."""
    length = int(hf_config.get("max_position_embeddings", 4096))
    window = hf_config.get("sliding_window")
    architecture = (hf_config.get("architectures") or [""])[0]
    if window and (architecture == "MistralForCausalLM" or hf_config.get("use_sliding_window")):
        length = min(length, int(window))
    return length


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # set when this request failed alone (finish_reason "error")
    # Prefill role: the blocks pinned for a decode server when the request finished.
    held_block_ids: list[int] | None = None


@dataclass
class _Import:
    """Pulled KV on its way into a sequence's pinned blocks, a slice per step."""

    seq: Sequence
    kv: torch.Tensor  # [blocks, 2, layers, block_size, kv_heads, head_dim], on the CPU
    fresh: deque[tuple[int, int]]  # (block index, block id) still to copy, in prompt order


class LLMEngine:
    """Loads a model folder and serves token-level requests with continuous batching.

    `engine.config` is a copy of the given config with every `None` resolved
    (device, dtype, num_blocks, max_model_len). `config.model` must be a local
    folder (engine_backend.hub resolves Hugging Face ids to one beforehand).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.model_dir = Path(config.model).expanduser()
        self.hf_config = load_hf_config(self.model_dir)
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.hf_config)
        model_len = _model_context_length(self.hf_config)
        model = load_model(
            self.model_dir,
            self.hf_config,
            self.device,
            self.dtype,
            config.max_model_len or model_len,
        )
        num_blocks = config.num_blocks or self._blocks_that_fit(
            config, kv_bytes_per_block(model, config.block_size, self.dtype)
        )
        max_model_len = min(config.max_model_len or model_len, num_blocks * config.block_size)
        self.config = dataclasses.replace(
            config,
            device=str(self.device),
            dtype=_DTYPE_NAMES[self.dtype],
            num_blocks=num_blocks,
            max_model_len=max_model_len,
        )
        self.max_model_len = max_model_len
        self.vocab_size = model.args.vocab_size
        self.model_runner = ModelRunner(model, num_blocks, config.block_size)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.schedule_policy,
        )
        self.sampler = Sampler(self.device, config.seed)
        self.requests: dict[str, Sequence] = {}
        self._pending: list[StepOutput] = []
        # Prefill/decode separation (engine_backend.pd): KV held for decode servers to pull,
        # bounded by half the pool unless configured; the transfer id of each request asking.
        self.kv_holds = KVHolds(self.block_manager, max(1, num_blocks // 2), hold_s=30.0)
        self._kv_hold_ids: dict[str, str] = {}
        # Decode role: imports in progress, oldest first (their sequences are `importing`).
        self._imports: dict[str, _Import] = {}

    def _blocks_that_fit(self, config: EngineConfig, block_bytes: int) -> int:
        if config.kv_cache_bytes is not None:
            budget = config.kv_cache_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * config.kv_cache_memory_fraction) - (total - free)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: budget {budget} bytes, one block needs {block_bytes}"
            )
        return num_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        kv_hold_id: str | None = None,
        kv_import: KVBlocks | None = None,
    ) -> int:
        """Queue a request. Raises ValueError for an empty or too long prompt, a token
        outside the vocabulary, or a request id already in flight.

        `kv_hold_id` (prefill role): when the request finishes, pin its prompt's full blocks
        under that transfer id (KVHoldLimitError now if that would pass the bound).
        `kv_import` (decode role): KV pulled from a prefill server for the prompt's leading
        blocks; when they match the prompt's tokens, blocks are pinned for them now and the
        KV is copied in over the next steps (IMPORT_BYTES_PER_STEP each), each block entering
        the prefix cache once filled; the request is queued when the copy is complete, and
        its admission then finds them all as hits.
        Returns how many prompt tokens' KV is imported (0 when it could not be used).
        """
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"= {total} exceeds max_model_len {self.max_model_len}"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        generator = (
            None if params.seed is None else self.sampler.make_request_generator(params.seed)
        )
        seq = Sequence(request_id, prompt_token_ids, params, cache_salt, generator)
        if kv_hold_id is not None:
            blocks = num_transfer_blocks(len(prompt_token_ids), self.config.block_size)
            self.kv_holds.reserve(kv_hold_id, blocks)
            self._kv_hold_ids[request_id] = kv_hold_id
        imported = self._start_import(seq, kv_import) if kv_import is not None else 0
        self.requests[request_id] = seq
        if seq.status is not SequenceStatus.IMPORTING:
            self.scheduler.add(seq)
        return imported

    def _start_import(self, seq: Sequence, kv: KVBlocks) -> int:
        """Pin blocks for pulled KV under `seq`'s own hash chain and queue the copy. Only
        blocks whose tokens equal the prompt's are used, so no sender can place KV under
        other tokens."""
        size = self.config.block_size
        count = min(kv.num_blocks, num_transfer_blocks(len(seq), size))
        if count <= 0 or kv.token_ids[: count * size] != seq.token_ids[: count * size]:
            return 0
        expected = block_shape(self.model_runner.kv_cache, size)
        if tuple(kv.kv.shape[1:]) != expected or kv.kv.device.type != "cpu":
            logger.warning(
                "pulled KV for %s has shape %s, not [n, %s] on the CPU",
                seq.request_id,
                tuple(kv.kv.shape),
                expected,
            )
            return 0
        claim = self.block_manager.claim_prefix(seq, count)
        if claim is None:
            logger.info("no room to import %d KV blocks for %s", count, seq.request_id)
            return 0
        seq.pinned_blocks, fresh = claim
        if fresh:
            self.scheduler.add_importing(seq)
            self._imports[seq.request_id] = _Import(seq, kv.kv, deque(fresh))
        return count * size

    def _advance_imports(self) -> None:
        """Copy up to IMPORT_BYTES_PER_STEP of pending imports (at least one block), oldest
        first; queue each sequence whose copy is complete. A copy that fails (logged) ends
        its import: the blocks filled so far stay cached, and the request computes the rest.
        An import whose sequence left `importing` (aborted, or its pins yielded to a running
        sequence) is dropped without another copy."""
        budget = IMPORT_BYTES_PER_STEP
        cache = self.model_runner.kv_cache
        size = self.config.block_size
        for request_id, work in list(self._imports.items()):
            seq = work.seq
            if seq.status is not SequenceStatus.IMPORTING:
                del self._imports[request_id]
                continue
            block_bytes = work.kv[0].numel() * work.kv.element_size()
            try:
                while work.fresh and (budget >= block_bytes or budget == IMPORT_BYTES_PER_STEP):
                    index, block_id = work.fresh[0]
                    write_block(cache, block_id, size, work.kv[index])
                    self.block_manager.name_block(seq, index, block_id)
                    work.fresh.popleft()
                    budget -= block_bytes
            except Exception:  # a shape or device problem: compute the prompt here instead
                logger.exception("importing KV blocks for %s failed", request_id)
                work.fresh.clear()
            if work.fresh:
                return  # the budget is spent; the rest waits for the next step
            del self._imports[request_id]
            self.scheduler.admit_imported(seq)

    def export_kv(self, transfer_id: str) -> tuple[list[int], KVBlocks] | None:
        """End a hold and return its block ids and a CPU copy of its blocks (None when no
        such hold exists: never made, already pulled, or expired)."""
        hold = self.kv_holds.take(transfer_id)
        if hold is None:
            return None
        try:
            kv = read_blocks(self.model_runner.kv_cache, hold.block_ids, self.config.block_size)
        finally:
            self.kv_holds.release(hold)
        return hold.block_ids, KVBlocks(hold.token_ids, kv)

    def expire_kv_holds(self) -> int:
        """Free holds past their deadline; the engine thread calls this between steps."""
        return self.kv_holds.expire()

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks now; its final StepOutput comes with the next step().
        Unknown or already finished ids are ignored (the client may race the finish)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self._drop_hold_id(seq)
        self._imports.pop(request_id, None)  # its pins go with finish()
        self.scheduler.finish(seq, "abort")
        self._pending.append(self._output(seq, []))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Run one scheduled step. Reports requests that got a token or finished;
        a request whose prompt chunk did not reach its end yet is not reported."""
        outputs, self._pending = self._pending, []
        if self._imports:
            self._advance_imports()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        result = self.model_runner.execute(batch.decodes, batch.prefills)
        self.scheduler.advance(batch)
        for seq, token in zip(
            result.sampled, self._sample(result.sampled, result.logits), strict=True
        ):
            if isinstance(token, Exception):
                outputs.append(self._fail(seq, f"sampling failed ({type(token).__name__})"))
                continue
            self.scheduler.append_token(seq, token)
            reason = self._finish_reason(seq, token)
            held: list[int] | None = None
            if reason is not None:
                transfer_id = self._kv_hold_ids.pop(seq.request_id, None)
                if transfer_id is not None:  # pinned before finish() frees the blocks
                    hold = self.kv_holds.hold(transfer_id, seq)
                    held = hold.block_ids if hold is not None else []
                self.scheduler.finish(seq, reason)
                del self.requests[seq.request_id]
            output = self._output(seq, [token])
            output.held_block_ids = held
            outputs.append(output)
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        """One batched draw; if it fails, row by row, so that a row that cannot be sampled
        (a value no check foresaw, NaN logits) fails its own request and no other."""
        params = [seq.params for seq in seqs]
        generators = [seq.generator for seq in seqs]
        try:
            return list(self.sampler.sample(logits, params, generators))
        except Exception:  # noqa: BLE001 -- any failure here is retried row by row just below
            logger.warning("batched sampling failed; sampling %d rows one by one", len(seqs))
        picked: list[int | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                picked.append(
                    self.sampler.sample(
                        logits[row : row + 1], params[row : row + 1], generators[row : row + 1]
                    )[0]
                )
            except Exception as exc:  # fails this request alone; its output says so
                logger.exception("sampling request %s failed", seq.request_id)
                picked.append(exc)
        return picked

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        """End one request with an error; its blocks are freed and every other goes on."""
        self._drop_hold_id(seq)
        self.scheduler.finish(seq, "error")
        self.requests.pop(seq.request_id, None)
        return self._output(seq, [], error)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _drop_hold_id(self, seq: Sequence) -> None:
        transfer_id = self._kv_hold_ids.pop(seq.request_id, None)
        if transfer_id is not None:
            self.kv_holds.unreserve(transfer_id)

    @staticmethod
    def _output(seq: Sequence, new_token_ids: list[int], error: str | None = None) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

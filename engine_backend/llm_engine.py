"""The synchronous engine: requests in, one scheduled step at a time, tokens out.

`step()` schedules (decodes first, then prompt chunks), runs one forward over all
of it, samples, and reports per request. A request whose row cannot be sampled fails
alone (its output carries the error); the others in the step go on. It is
single-threaded by design; the async front owns the thread that calls it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_backend.block_manager import BlockManager
from engine_backend.checkpoint import load_eos_token_ids, load_hf_config, load_model
from engine_backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine_backend.model_runner import ModelRunner, kv_bytes_per_block
from engine_backend.sampling import Sampler, SamplingParams
from engine_backend.scheduler import Scheduler
from engine_backend.sequence import Sequence

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_generate_ids = itertools.count()
logger = logging.getLogger(__name__)


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


class LLMEngine:
    """Loads a model folder and serves token-level requests with continuous batching.

    `engine.config` is a copy of the given config with every `None` resolved
    (device, dtype, num_blocks, max_model_len). `config.model` must be a local
    folder (engine_backend.hub resolves Hugging Face ids to one beforehand).

    Test hook: after `enable_logits_capture()`, every step stores each scheduled
    request's logits for all tokens it computed in `captured_logits[request_id]`
    as (first position, float32 CPU tensor [tokens, vocab]) pairs.
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
        self.captured_logits: dict[str, list[tuple[int, torch.Tensor]]] | None = None

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

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len  # type: ignore[return-value]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for an empty or too long prompt, a token
        outside the vocabulary, or a request id already in flight."""
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
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks now; its final StepOutput comes with the next step().
        Unknown or already finished ids are ignored (the client may race the finish)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        self._pending.append(self._output(seq, []))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Run one scheduled step. Reports requests that got a token or finished;
        a request whose prompt chunk did not reach its end yet is not reported."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        capture = self.captured_logits is not None
        result = self.model_runner.execute(batch.decodes, batch.prefills, return_all_logits=capture)
        if capture and result.all_rows is not None:
            for seq, first_position, logits in result.all_rows:
                self.captured_logits.setdefault(seq.request_id, []).append(
                    (first_position, logits.float().cpu())
                )
        self.scheduler.advance(batch)
        for seq, token in zip(
            result.sampled, self._sample(result.sampled, result.logits), strict=False
        ):
            if isinstance(token, Exception):
                outputs.append(self._fail(seq, f"sampling failed ({type(token).__name__})"))
                continue
            seq.token_ids.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
            outputs.append(self._output(seq, [token]))
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        """One batched draw; if it fails, row by row, so that a row that cannot be sampled
        (a value no check foresaw, NaN logits) fails its own request and no other."""
        params = [seq.params for seq in seqs]
        generators = [seq.generator for seq in seqs]
        try:
            return list(self.sampler.sample(logits, params, generators))
        except Exception:
            logger.warning("batched sampling failed; sampling %d rows one by one", len(seqs))
        picked: list[int | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                picked.append(
                    self.sampler.sample(
                        logits[row : row + 1], params[row : row + 1], generators[row : row + 1]
                    )[0]
                )
            except Exception as exc:
                logger.exception("sampling request %s failed", seq.request_id)
                picked.append(exc)
        return picked

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        """End one request with an error; its blocks are freed and every other goes on."""
        seq.finish_reason = "error"
        self.scheduler.finish(seq)
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

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion and return their generated ids (a stop token included)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [f"generate-{next(_generate_ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=False):
                self.add_request(request_id, prompt, p)
        except ValueError:
            for request_id in ids:
                self.abort_request(request_id)
            self._pending = [out for out in self._pending if out.request_id not in ids]
            raise
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        remaining = set(ids)
        errors: list[str] = []
        # Every step computes at least one token: a working engine never reaches this bound.
        max_steps = (
            sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=False)) * 16 + 1000
        )
        for _ in range(max_steps):
            if not remaining:
                break
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.error is not None:
                        errors.append(f"prompt {ids.index(out.request_id)}: {out.error}")
                    if out.finished:
                        remaining.discard(out.request_id)
        if remaining:
            raise RuntimeError(f"generate made no progress on {len(remaining)} request(s)")
        if errors:
            raise RuntimeError("generate failed on " + "; ".join(errors))
        return [results[request_id] for request_id in ids]

    def enable_logits_capture(self) -> None:
        """Start recording all computed rows' logits (slower; for tests)."""
        self.captured_logits = {}

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

"""The synchronous engine: requests in, one scheduled step at a time, tokens out.

`step()` schedules (decodes first, then prompt chunks), runs one forward over all
of it, samples, and reports per request. A request whose row cannot be sampled fails
alone (its output carries the error); the others in the step go on. It is
single-threaded by design; the async front owns the thread that calls it.
"""

from __future__ import annotations

import dataclasses
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
        self.scheduler.finish(seq, "abort")
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
            if reason is not None:
                self.scheduler.finish(seq, reason)
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

"""One way to build and drive an LLMEngine for tests, shared by tests/engine and
tests/engine_front.

Small blocks (4 tokens) make block boundaries, prefix hits and preemption show up in
prompts of a few dozen tokens; the pool and the token budget are large enough that a
test meets them only when it asks for less.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from engine_backend.config import EngineConfig
from engine_backend.llm_engine import LLMEngine
from engine_backend.model_runner import StepLogits
from engine_backend.sampling import SamplingParams
from engine_backend.sequence import Sequence

# float32: the exactness tests compare with transformers' float32 at a tight tolerance, so
# they pin it rather than take the machine's auto choice (bf16 where the CPU has it). The
# device is the run's (`--device`, tests/engine/conftest.py).
TEST_OPTIONS: dict[str, Any] = {
    "num_blocks": 256,
    "block_size": 4,
    "max_num_batched_tokens": 512,
    "dtype": "float32",
    "device": "cpu",
}

_request_ids = itertools.count()


class LogitsCapturingEngine(LLMEngine):
    """An LLMEngine that records, at every step, each scheduled request's logits for all the
    tokens it computed: `captured_logits[request_id]` is a list of (first position, float32
    CPU tensor [tokens, vocab]) pairs. Its runner computes every row's logits (slower), so
    tests can compare each position with a reference implementation."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.captured_logits: dict[str, list[tuple[int, torch.Tensor]]] = {}
        execute = self.model_runner.execute

        def execute_and_capture(
            decodes: list[Sequence], prefills: list[tuple[Sequence, int]]
        ) -> StepLogits:
            result = execute(decodes, prefills, return_all_logits=True)
            for seq, first_position, logits in result.all_rows or ():
                self.captured_logits.setdefault(seq.request_id, []).append(
                    (first_position, logits.float().cpu())
                )
            return result

        # A spy on this one runner instance; the class keeps its own method.
        self.model_runner.execute = execute_and_capture  # type: ignore[method-assign]


def make_llm(model_dir: str | Path, *, capture_logits: bool = False, **overrides: Any) -> LLMEngine:
    """An engine over `model_dir` with TEST_OPTIONS, `overrides` replacing any of them;
    `capture_logits` gives a LogitsCapturingEngine."""
    engine_class = LogitsCapturingEngine if capture_logits else LLMEngine
    return engine_class(EngineConfig(model=str(model_dir), **{**TEST_OPTIONS, **overrides}))


def generate(
    llm: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Run prompts to completion through `add_request`/`step` and return their generated ids
    (a stop token included). A prompt the engine refuses raises its ValueError, after the
    prompts already queued are aborted; a request that fails in a step raises RuntimeError
    naming its prompt."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError("need one SamplingParams per prompt")
    ids = [f"generate-{next(_request_ids)}" for _ in prompts]
    try:
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            llm.add_request(request_id, prompt, p)
    except ValueError:
        for request_id in ids:
            llm.abort_request(request_id)
        raise
    results: dict[str, list[int]] = {request_id: [] for request_id in ids}
    remaining = set(ids)
    errors: list[str] = []
    # Every step computes at least one token: a working engine never reaches this bound.
    max_steps = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True)) * 16
    for _ in range(max_steps + 1000):
        if not remaining:
            break
        for out in llm.step():
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

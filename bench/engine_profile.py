"""Where an uncached prefill's time goes: one long prompt through the engine, under a profiler.

    python bench/engine_profile.py                      # SmolLM2-135M shape, 1,500 tokens
    python bench/engine_profile.py --tokens 512 --dtype bfloat16 --top 15

The model has SmolLM2-135M's exact shape with random weights (written locally; nothing is
downloaded): the time of a forward depends on the shape, not on the values. Prints the
operators that take the time (torch.profiler, self CPU time) and the wall time of the
same prefill without a profiler (best of --repeats).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine_backend.config import EngineConfig
from engine_backend.demo import SMOLLM2_135M_SHAPE as SMOLLM2_135M
from engine_backend.demo import build_demo_model
from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the engine's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="operators to list")
    p.add_argument("--cache-dir", default=None, help="where the random checkpoint is written")
    return p.parse_args(argv)


# Where an operator's time is counted in the summary; anything else is "other".
CATEGORIES = {
    "matmuls": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::matmul",
        "aten::linear",
        "mkldnn::_linear_pointwise",
    ),
    "attention kernels": ("aten::_scaled_dot_product", "aten::_flash_attention"),
    "KV cache write": ("aten::index_copy", "aten::index_put"),
    "KV gather": ("aten::index_select", "aten::gather"),
    "norms": ("aten::linalg_vector_norm", "aten::pow", "aten::mean", "aten::sum", "aten::rsqrt"),
    "elementwise": ("aten::mul", "aten::add", "aten::sub", "aten::silu", "aten::cat"),
    "copies and casts": ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous"),
    "embedding": ("aten::embedding",),
}


def category(name: str) -> str:
    for label, prefixes in CATEGORIES.items():
        if name.startswith(prefixes):
            return label
    return "other"


def summarise(prof: profile) -> list[tuple[str, float, int]]:
    """(category, self CPU seconds, calls), largest first."""
    totals: dict[str, list[float]] = {}
    for event in prof.key_averages():
        entry = totals.setdefault(category(event.key), [0.0, 0])
        entry[0] += event.self_cpu_time_total / 1e6
        entry[1] += event.count
    return sorted(((k, v[0], int(v[1])) for k, v in totals.items()), key=lambda r: -r[1])


def make_engine(model_dir: str, dtype: str | None, tokens: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            device="cpu",
            dtype=dtype,
            num_blocks=(tokens + 64) // 16 + 8,
            max_num_batched_tokens=max(2048, tokens + 16),
        )
    )


def prefill_once(engine: LLMEngine, ids: list[int], request_id: str) -> tuple[float, float]:
    """Wall and process CPU seconds to the first token of a lone, uncached prompt (on a
    shared machine the CPU time is the steadier of the two)."""
    engine.reset_prefix_cache()
    started, cpu_started = time.perf_counter(), time.process_time()
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started, time.process_time() - cpu_started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = build_demo_model(args.cache_dir, SMOLLM2_135M)
    engine = make_engine(model_dir, args.dtype, args.tokens)
    rng = random.Random(0)
    ids = [rng.randrange(SMOLLM2_135M.vocab_size or 512) for _ in range(args.tokens)]
    prefill_once(engine, ids[:64], "warm-up")
    timed = [prefill_once(engine, ids, f"timed-{i}") for i in range(args.repeats)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled, _ = prefill_once(engine, ids, "profiled")
    print(
        f"{args.tokens}-token cold prefill, dtype {engine.config.dtype}, "
        f"{torch.get_num_threads()} threads: best {min(t[0] for t in timed):.3f} s wall, "
        f"{min(t[1] for t in timed):.3f} s CPU (under the profiler {profiled:.3f} s wall)"
    )
    rows = summarise(prof)
    total = sum(r[1] for r in rows)
    print(f"{'where':<20} {'self CPU s':>10} {'share':>7} {'calls':>7}")
    for label, seconds, calls in rows:
        print(f"{label:<20} {seconds:>10.3f} {seconds / total:>7.1%} {calls:>7}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

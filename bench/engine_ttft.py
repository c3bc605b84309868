"""Engine TTFT benchmark: prefix-cache hits, transformers baseline, chunked prefill, batching.

    python bench/engine_ttft.py                 # CPU, ~58M-parameter random Llama
    python bench/engine_ttft.py --device cuda   # ~0.9B random Llama in bf16 (bench/gpu_check.sh)
    python bench/engine_ttft.py --quick         # tiny smoke run (< 60 s)

`--device cuda` on a machine without CUDA says so and runs the tiny sizes on the CPU.

Four parts, each printed as a table, all written to bench/results/engine_ttft.json:
  1. TTFT cold vs warm (50% / 94% shared prefix) and the ideal warm TTFT
     (cold x uncached share);
  2. the same prompts through transformers' generate (no cross-request cache);
  3. inter-token gaps of 8 decoding streams alone and while a long prompt arrives,
     at several chunk budgets and unchunked, with the long prompt's TTFT;
  4. decode tokens/s at 1, 4 and 16 concurrent streams (1 and 32 on a GPU);
on a GPU also prefill tokens/s and TFLOP/s against the device's bf16 peak (MFU).
Timings are the best of `--repeats` runs: on a shared machine, noise only adds time.
The engine is driven synchronously (no HTTP, no thread) so the numbers are the engine's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from engine_backend.config import EngineConfig
from engine_backend.demo import RandomModelSpec, build_demo_model
from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams

SPECS = {
    "cpu": RandomModelSpec(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=32000,
        max_position_embeddings=8192,
        seed=1,
    ),
    "cuda": RandomModelSpec(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=5632,
        vocab_size=32000,
        max_position_embeddings=8192,
        dtype="bfloat16",
        seed=1,
    ),
    "quick": RandomModelSpec(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=2048,
        seed=1,
    ),
}
SHARES = (0.5, 0.94)
NUM_DECODERS = 8
STEP_LIMIT = 20_000  # no loop below runs more steps than this
TIME_LIMIT_S = 300.0  # nor longer than this


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny model and sizes, for a smoke test")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--long", type=int, default=None, help="long prompt of part 3")
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="chunk budgets of part 3")
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is steadier on a busy machine",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="device bf16 dense peak for the prefill share (default: H100/H200 989)",
    )
    p.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "engine_ttft.json"
        ),
    )
    p.add_argument("--cache-dir", default=None, help="where the random checkpoint is written")
    p.add_argument("--dtype", default=None, help="engine and transformers dtype (default: auto)")
    p.add_argument("--streams", type=int, nargs="+", default=None, help="decode batches of part 4")
    p.add_argument("--time-limit", type=float, default=None, help="seconds; the run stops past it")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda requested but not available: running on cpu (tiny sizes)", file=sys.stderr)
        args.device, args.quick = "cpu", True
    quick = args.quick
    on_gpu = args.device.startswith("cuda")
    args.streams = args.streams or ([1, 32] if on_gpu else [1, 4, 16])
    args.time_limit = args.time_limit or (TIME_LIMIT_S if quick else 4 * TIME_LIMIT_S)
    args.lengths = args.lengths or ([64, 128] if quick else [512, 1024, 2048, 4096])
    args.long = args.long or (256 if quick else 4096)
    args.budgets = args.budgets or ([16, 64] if quick else [64, 256, 1024])
    args.decode_tokens = args.decode_tokens or (8 if quick else 64)
    args.repeats = args.repeats or (1 if quick else 2)
    return args


class Bench:
    """Holds the checkpoint and a random source; builds engines on demand."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.spec = SPECS["quick" if args.quick else self.device.type]
        self.model_dir = build_demo_model(args.cache_dir, self.spec)
        self.rng = random.Random(0)
        self.vocab = self.spec.vocab_size or 512
        self.deadline = time.monotonic() + args.time_limit
        block_bytes_per_token = (
            2
            * self.spec.num_hidden_layers
            * self.spec.num_key_value_heads
            * (self.spec.hidden_size // self.spec.num_attention_heads)
            * 4
        )
        # Room for a few long prompts and the decoders, not the default 1 GiB on CPU.
        self.num_blocks = max(64, (4 * max([*args.lengths, args.long]) + 64 * 64) // 16)
        self.kv_mib = self.num_blocks * 16 * block_bytes_per_token / 2**20

    def engine(self, budget: int) -> LLMEngine:
        gc.collect()
        return LLMEngine(
            EngineConfig(
                model=self.model_dir,
                device=self.args.device,
                dtype=self.args.dtype,
                num_blocks=self.num_blocks,
                max_num_batched_tokens=budget,
                max_num_seqs=64,
            )
        )

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError("benchmark exceeded its time limit")


def log(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def run_until_first_token(bench: Bench, engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token of a lone request, and its cache hits."""
    request_id = f"ttft-{bench.rng.random()}"
    started = time.perf_counter()
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0))
    for _ in range(STEP_LIMIT):
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                elapsed = time.perf_counter() - started
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.num_cached_tokens
    raise RuntimeError("no first token within the step limit")


def transformers_ttft(model: Any, ids: list[int], device: torch.device) -> float:
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started


def part_ttft(bench: Bench, engine: LLMEngine, hf_model: Any) -> list[dict]:
    """Parts 1 and 2: one base prompt per repeat is timed cold (it also fills the cache);
    prompts sharing 50% / 94% of it are then timed warm."""
    rows = []
    for length in bench.args.lengths:
        log(f"TTFT at {length} tokens")
        cold, hf = [], []
        warm: dict[float, list[tuple[float, int]]] = {s: [] for s in SHARES}
        for _ in range(bench.args.repeats):
            bench.check_time()
            engine.reset_prefix_cache()
            base = bench.ids(length)
            cold.append(run_until_first_token(bench, engine, base)[0])
            for share in SHARES:
                shared = int(length * share)
                warm[share].append(
                    run_until_first_token(bench, engine, base[:shared] + bench.ids(length - shared))
                )
            hf.append(transformers_ttft(hf_model, bench.ids(length), bench.device))
        row = {"prompt_tokens": length, "cold_s": min(cold), "transformers_s": min(hf)}
        for share in SHARES:
            seconds, cached = min(warm[share])
            uncached = (length - cached) / length
            # The issue's ideal scales cold TTFT by the uncached share of tokens; the FLOP ideal
            # also counts the new tokens' attention over the cached prefix, which a cache hit
            # cannot remove.
            flop_share = prefill_flops(bench.spec, cached, length) / prefill_flops(
                bench.spec, 0, length
            )
            row[f"warm{int(share * 100)}"] = {
                "warm_s": seconds,
                "cached_tokens": cached,
                "ideal_s": row["cold_s"] * uncached,
                "vs_ideal": seconds / (row["cold_s"] * uncached),
                "flop_ideal_s": row["cold_s"] * flop_share,
                "vs_flop_ideal": seconds / (row["cold_s"] * flop_share),
                "vs_cold": seconds / row["cold_s"],
            }
        rows.append(row)
    return rows


def decode_window(bench: Bench, budget: int, long_ids: list[int] | None) -> dict:
    """Part 3, one case: gaps of NUM_DECODERS streams while `long_ids` (if any) prefills."""
    engine = bench.engine(budget)
    params = SamplingParams(
        max_tokens=engine.max_model_len - 64 - 1, temperature=0.0, ignore_eos=True
    )
    decoders = [f"dec-{i}" for i in range(NUM_DECODERS)]
    for request_id in decoders:
        engine.add_request(request_id, bench.ids(32), params)
    last_seen: dict[str, float] = {}
    gaps: list[float] = []
    window_open = False
    long_ttft = None
    steps_after = 0
    quiet_steps = 40 if long_ids is None else 0
    started = 0.0
    for step in range(STEP_LIMIT):
        bench.check_time()
        if long_ids is not None and not window_open and len(last_seen) == NUM_DECODERS and step > 5:
            engine.add_request("long", long_ids, SamplingParams(max_tokens=1, temperature=0.0))
            started, window_open = time.perf_counter(), True
        elif long_ids is None and not window_open and len(last_seen) == NUM_DECODERS:
            window_open = step > 5
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == "long" and out.new_token_ids:
                long_ttft = now - started
            elif out.request_id in decoders and out.new_token_ids:
                if window_open and out.request_id in last_seen:
                    gaps.append(now - last_seen[out.request_id])
                last_seen[out.request_id] = now
        if window_open and (long_ttft is not None or long_ids is None):
            steps_after += 1
            if steps_after > (2 if long_ids is not None else quiet_steps):
                break
    for request_id in decoders:
        engine.abort_request(request_id)
    engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    gaps.sort()

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))]

    return {
        "budget": budget,
        "num_gaps": len(gaps),
        "gap_p50_ms": pct(0.5) * 1e3,
        "gap_p99_ms": pct(0.99) * 1e3,
        "long_ttft_s": long_ttft,
    }


def part_gaps(bench: Bench) -> list[dict]:
    long_len = bench.args.long
    unchunked = long_len + NUM_DECODERS + 64
    alone = decode_window(bench, unchunked, None)
    rows = [{"case": "decoders alone", **alone}]
    for budget in [*bench.args.budgets, unchunked]:
        name = f"budget {budget}" if budget != unchunked else "unchunked"
        log(f"decoders while a {long_len}-token prompt arrives, {name}")
        rows.append({"case": name, **decode_window(bench, budget, bench.ids(long_len))})
    return rows


def part_throughput(bench: Bench, engine: LLMEngine) -> list[dict]:
    rows = []
    tokens = bench.args.decode_tokens
    for streams in bench.args.streams:
        log(f"decode throughput, {streams} streams")
        bench.check_time()
        params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
        for i in range(streams):
            engine.add_request(f"tp-{streams}-{i}", bench.ids(32), params)
        first_done: set[str] = set()
        started = None
        decoded = 0
        for _ in range(STEP_LIMIT):
            if not engine.has_unfinished():
                break
            outputs = engine.step()
            for out in outputs:
                if out.request_id in first_done:
                    decoded += len(out.new_token_ids)
                first_done.add(out.request_id)
            if started is None and len(first_done) == streams:
                started = time.perf_counter()
        elapsed = time.perf_counter() - started
        rows.append(
            {
                "streams": streams,
                "tokens": decoded,
                "seconds": elapsed,
                "tokens_per_s": decoded / elapsed,
            }
        )
    return rows


def judge(results: dict) -> list[dict]:
    """The issue's targets, each with its measured value and PASS/FAIL."""
    checks = []

    def check(name: str, value: float, limit: float, at_most: bool = True) -> None:
        ok = value <= limit if at_most else value >= limit
        checks.append({"target": name, "value": round(value, 3), "limit": limit, "pass": ok})

    step_s = one_step_seconds(results)
    for row in results["ttft"]:
        n = row["prompt_tokens"]
        if n >= 2048 or results["quick"]:
            for share in SHARES:
                key = f"warm{int(share * 100)}"
                check(f"{n} tok, {key}: warm / ideal", row[key]["vs_ideal"], 1.5)
                # The shared TTFT notes define the ideal as cold x uncached share "plus a fixed
                # per-step cost"; reported beside the strict form, not instead of it.
                check(
                    f"{n} tok, {key}: warm / (ideal + one decode step) [info]",
                    row[key]["warm_s"] / (row[key]["ideal_s"] + step_s),
                    1.5,
                )
            check(f"{n} tok, warm94: warm / cold", row["warm94"]["vs_cold"], 0.15)
        check(f"{n} tok: cold / transformers", row["cold_s"] / row["transformers_s"], 1.25)
        check(
            f"{n} tok: transformers / warm94 speed-up",
            row["transformers_s"] / row["warm94"]["warm_s"],
            5.0,
            at_most=False,
        )
    gaps = {r["case"]: r for r in results["gaps"]}
    smallest = gaps[f"budget {min(results['budgets'])}"]
    check(
        "p99 gap, smallest budget / unchunked",
        smallest["gap_p99_ms"] / gaps["unchunked"]["gap_p99_ms"],
        0.1,
    )
    check(
        "long TTFT, smallest budget / unchunked",
        smallest["long_ttft_s"] / gaps["unchunked"]["long_ttft_s"],
        1.3,
    )
    tps = {r["streams"]: r["tokens_per_s"] for r in results["throughput"]}
    if 16 in tps and 1 in tps:
        check("decode tokens/s, 16 streams / 1", tps[16] / tps[1], 3.0, at_most=False)
    return checks


def one_step_seconds(results: dict) -> float:
    """A step's fixed cost: one forward for a single decoding stream (on CPU mostly the time to
    read every weight once), from the decode-throughput part."""
    tps = {r["streams"]: r["tokens_per_s"] for r in results["throughput"]}
    return 1.0 / tps[1]


def prefill_flops(s: Any, cached: int, total: int) -> float:
    """FLOPs to prefill tokens [cached, total) of a prompt: projections and MLP per new token,
    plus each new token's attention (QK and AV) over every earlier position."""
    head_dim = s.hidden_size // s.num_attention_heads
    per_layer = (
        s.hidden_size * head_dim * (2 * s.num_attention_heads + 2 * s.num_key_value_heads)
        + 3 * s.hidden_size * s.intermediate_size
    )
    new = total - cached
    keys_attended = new * cached + new * (new + 1) / 2
    return s.num_hidden_layers * (
        2 * per_layer * new + 4 * keys_attended * s.num_attention_heads * head_dim
    )


def prefill_share_of_peak(bench: Bench, rows: list[dict], peak_tflops: float | None) -> list[dict]:
    """GPU only: achieved prefill TFLOP/s of the cold runs against the device's bf16 peak."""
    out = []
    for row in rows:
        n = row["prompt_tokens"]
        tflops = prefill_flops(bench.spec, 0, n) / row["cold_s"] / 1e12
        out.append(
            {
                "prompt_tokens": n,
                "prefill_tokens_per_s": n / row["cold_s"],
                "tflops": tflops,
                "share_of_peak": tflops / peak_tflops if peak_tflops else None,
            }
        )
    return out


def print_tables(results: dict) -> None:
    print(
        f"\nmodel: {results['params_m']:.1f}M params, device {results['device']}, "
        f"dtype {results['dtype']}, torch threads {results['torch_threads']}"
    )
    print(
        "\n[1+2] TTFT (s): cold, warm at 50% / 94% shared prefix (ideal = cold x uncached "
        "share), transformers generate"
    )
    print(
        f"{'tokens':>7} {'cold':>8} {'warm50':>8} {'ideal50':>8} {'warm94':>8} {'ideal94':>8} "
        f"{'flopid94':>8} {'94/cold':>8} {'hf':>8} {'cold/hf':>8} {'hf/w94':>8}"
    )
    for r in results["ttft"]:
        w50, w94 = r["warm50"], r["warm94"]
        print(
            f"{r['prompt_tokens']:>7} {r['cold_s']:>8.3f} {w50['warm_s']:>8.3f} "
            f"{w50['ideal_s']:>8.3f} {w94['warm_s']:>8.3f} {w94['ideal_s']:>8.3f} "
            f"{w94['flop_ideal_s']:>8.3f} {w94['vs_cold']:>8.3f} {r['transformers_s']:>8.3f} "
            f"{r['cold_s'] / r['transformers_s']:>8.2f} "
            f"{r['transformers_s'] / w94['warm_s']:>8.1f}"
        )
    print(f"one decode step (1 stream): {one_step_seconds(results) * 1000:.1f} ms")
    print(
        f"\n[3] {NUM_DECODERS} decoding streams, a {results['long_tokens']}-token prompt arriving"
    )
    print(f"{'case':>16} {'gaps':>6} {'p50 ms':>9} {'p99 ms':>9} {'long TTFT s':>12}")
    for r in results["gaps"]:
        long = f"{r['long_ttft_s']:.3f}" if r["long_ttft_s"] is not None else "-"
        print(
            f"{r['case']:>16} {r['num_gaps']:>6} {r['gap_p50_ms']:>9.1f} "
            f"{r['gap_p99_ms']:>9.1f} {long:>12}"
        )
    print("\n[4] decode throughput")
    print(f"{'streams':>8} {'tokens':>7} {'tokens/s':>10}")
    for r in results["throughput"]:
        print(f"{r['streams']:>8} {r['tokens']:>7} {r['tokens_per_s']:>10.1f}")
    if results.get("prefill_peak"):
        print("\nprefill throughput vs bf16 peak")
        for r in results["prefill_peak"]:
            share = f"{r['share_of_peak']:.1%}" if r["share_of_peak"] is not None else "?"
            print(
                f"{r['prompt_tokens']:>7} tokens: {r['prefill_tokens_per_s']:,.0f} tokens/s, "
                f"{r['tflops']:.1f} TFLOP/s (MFU {share})"
            )
    print("\ntargets")
    for c in results["targets"]:
        print(
            f"  {'PASS' if c['pass'] else 'FAIL'}  {c['target']}: {c['value']} "
            f"({'>=' if 'speed-up' in c['target'] or 'streams' in c['target'] else '<='} "
            f"{c['limit']})"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    bench = Bench(args)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    engine = bench.engine(max(8192, max(args.lengths) + 64))
    dtype = getattr(torch, engine.config.dtype)
    hf_model = (
        transformers.AutoModelForCausalLM.from_pretrained(bench.model_dir, dtype=dtype)
        .to(bench.device)
        .eval()
    )
    params_m = sum(p.numel() for p in hf_model.parameters()) / 1e6
    # Warm both up: first calls pay for allocator growth and kernel selection.
    run_until_first_token(bench, engine, bench.ids(64))
    transformers_ttft(hf_model, bench.ids(64), bench.device)

    results: dict[str, Any] = {
        "device": str(bench.device),
        "dtype": engine.config.dtype,
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "params_m": params_m,
        "spec": asdict(bench.spec),
        "repeats": args.repeats,
        "budgets": args.budgets,
        "long_tokens": args.long,
        "kv_cache_mib": bench.kv_mib,
    }
    results["ttft"] = part_ttft(bench, engine, hf_model)
    del hf_model
    results["throughput"] = part_throughput(bench, engine)
    del engine
    results["gaps"] = part_gaps(bench)
    if bench.device.type == "cuda":
        peak = args.peak_tflops
        name = torch.cuda.get_device_name(bench.device)
        if peak is None and ("H100" in name or "H200" in name):
            peak = 989.0
        results["gpu"] = name
        results["prefill_peak"] = prefill_share_of_peak(bench, results["ttft"], peak)
    results["targets"] = judge(results)
    results["elapsed_s"] = time.monotonic() - started
    print_tables(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out} in {results['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

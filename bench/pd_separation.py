"""PD separation bench: decoding streams while long prompts arrive, colocated vs disaggregated.

    python bench/pd_separation.py                 # CPU, 2 cores, ~58M-parameter random Llama
    python bench/pd_separation.py --device cuda   # ~0.9B random Llama in bf16
    python bench/pd_separation.py --quick         # tiny model, short windows (smoke run)

8 streams decode while 4,096-token prompts arrive every 4 s (3 of them), through a real
gateway (`firsttoken serve`) in front of real `engine_backend.server` processes, in three
deployments given the same cores:

  colocated, unchunked     one engine (--role both), 2 torch threads, pinned to cores 0-1;
  colocated, chunked       the same with a token budget per step (64/128/256 tried; the best
                           by decoders' gap p99 among those whose long prompts kept up with
                           the arrivals is the one the targets compare with);
  disaggregated            a --role prefill engine pinned to core 0 and a --role decode engine
                           pinned to core 1, 1 torch thread each, behind the gateway's `pd`
                           route (prefill, KV handoff over the side channel, decode stream).

Before the long prompts, each deployment runs a quiet window with the decoders alone: the
"no long prompts" baselines. Printed per deployment: the decoders' inter-token gap p50/p99
(client side, from SSE event arrival), the long prompts' TTFT, decode tokens/s and total
tokens/s (decoded tokens plus the long prompts' tokens, over the window); the JSON adds each
window's longest gaps with their times beside the long prompts' arrivals and first tokens
(`stalls`, `long_sent_at_s`, `long_first_at_s`), to say what the decoders waited for. Targets:
disaggregated gap p99 <= 1.5x its own no-long-prompt gap p99 (the deployment's decode
server alone; the ratio to the colocated no-long-prompt gap is printed beside it), and
disaggregated total tokens/s >= 0.8x the best colocated chunked.

Model and measurement are those of `bench/engine_ttft.py` part 3 (the issue's "25 ms ->
76 ms at budget 64, 1,540 ms unchunked"): the same random Llama (hidden 512, 8 layers,
vocab 32,000), where a 4,096-token prefill takes ~2.8 s on one core and ~1.4 s on two,
and one step of 8 decoders ~39 ms on one core and ~18 ms on two. One change: the
checkpoint's output rows past the tokenizer's printable tokens are zeroed, so greedy
decoding only picks tokens that detokenize to text and every token is one SSE event the
client can time. The compute (and so every timing) is the same as the unmasked model's.

What 2 CPU cores can show, honestly:
- Isolation, yes: a decode server on its own core never waits for a prefill, so its gaps
  barely move when long prompts arrive, while a colocated engine's stall for the prefill
  (unchunked) or a slice of it every step (chunked).
- Not the throughput story of a GPU fleet. Splitting 2 cores 1+1 halves the cores each phase
  gets: the decode server's step is ~2x the colocated engine's, so its gaps are higher in
  absolute terms than colocated gaps with no long prompts, and decode tokens/s is lower.
  Total tokens/s is dominated by the long prompts' tokens (which every deployment processes
  alike while it keeps up), so the 0.8x target is easier to meet than its name suggests;
  decode tokens/s is printed beside it for that reason.
- The gateway and this client are not pinned: they share both cores with the engines in
  every deployment (a few percent of a core for ~300 events/s), and add the same HTTP path
  to every measurement.
- Other processes on a shared machine only add time; the numbers are one run, not a best-of.
On a GPU machine (`--device cuda`) the disaggregated deployment puts prefill and decode on
cuda:0 and cuda:1 when there are two GPUs; with one GPU both processes share it (time-sliced
contexts), which shows the protocol's cost, not isolation. Pinning and thread counts apply
to CPU runs only.

Results go to bench/results/pd_separation.json (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_ttft import SPECS
from bench.pd_procs import (
    EngineSpec,
    Proc,
    colocated_route,
    pd_route,
    start_engine,
    start_gateway,
    stop_all,
    wait_quiet,
)
from engine_backend.demo import RandomModelSpec, default_cache_dir, write_random_model

NUM_DECODERS = 8
DECODER_PROMPT = 32
TIME_LIMIT_S = 290.0  # the whole run, CPU (a GPU run gets the same)
TTFT_LIMIT_S = 60.0  # no long prompt waits longer than this for its first token


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="tiny model and windows, a smoke run")
    p.add_argument("--long", type=int, default=None, help="tokens of each long prompt")
    p.add_argument("--num-long", type=int, default=None, help="long prompts per window")
    p.add_argument("--period", type=float, default=None, help="seconds between long prompts")
    p.add_argument("--quiet", type=float, default=None, help="seconds of the no-long window")
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="chunk budgets")
    p.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "pd_separation.json"
        ),
    )
    p.add_argument("--cache-dir", default=None, help="where the random checkpoint is written")
    args = p.parse_args(argv)
    quick, gpu = args.quick, args.device == "cuda"
    args.long = args.long or (512 if quick else 4096)
    args.num_long = args.num_long or (2 if quick else 3)
    args.period = args.period or (1.5 if quick else 4.0)
    args.quiet = args.quiet or (1.5 if quick else 4.0)
    args.budgets = args.budgets or ([32] if quick else [256, 512, 1024] if gpu else [64, 128, 256])
    return args


# -- the checkpoint ---------------------------------------------------------------------------


def printable_ids(model_dir: str) -> list[int]:
    """Token ids whose text stands alone: not special, not a partial UTF-8 byte."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    keep = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if text and "\ufffd" not in text:
            keep.append(i)
    return keep


def bench_model(spec: RandomModelSpec, cache_dir: str | None) -> str:
    """The random checkpoint with every lm_head row outside `printable_ids` zeroed: random
    rows give the printable tokens logits far above 0, so greedy never picks a zeroed one.
    Written once under the cache dir (a hash of the spec names it), renamed into place."""
    root = cache_dir or default_cache_dir()
    key = hashlib.sha256(
        json.dumps({"v": 1, "printable": True, **asdict(spec)}, sort_keys=True).encode()
    ).hexdigest()[:16]
    path = os.path.join(root, f"pd-bench-{key}")
    weights = os.path.join(path, "model.safetensors")
    if os.path.exists(weights):
        return path
    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".pd-bench-", dir=root)
    try:
        write_random_model(staging, spec)
        staged = os.path.join(staging, "model.safetensors")
        tensors = load_file(staged)
        head = tensors["lm_head.weight"]
        mask = torch.zeros(head.shape[0], dtype=torch.bool)
        mask[printable_ids(staging)] = True
        head[~mask] = 0
        save_file(tensors, staged, metadata={"format": "pt"})
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return path


# -- deployments ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    name: str
    mode: str  # colocated | disaggregated
    engines: tuple[EngineSpec, ...]
    budget: int | None  # colocated chunk budget; None: unchunked


def deployments(args: argparse.Namespace) -> list[Deployment]:
    unchunked = args.long + NUM_DECODERS + 64  # one step takes a whole long prompt
    gpu = args.device == "cuda"
    both = "0,1" if not gpu else None
    blocks = 4096 if gpu else 2048  # a GPU's decoders run further within the same windows
    out = []
    for budget in [None, *args.budgets]:
        spec = EngineSpec(
            "engine", "both", both, 2, budget or unchunked, "cuda:0" if gpu else "cpu", blocks
        )
        name = f"colocated, budget {budget}" if budget else "colocated, unchunked"
        out.append(Deployment(name, "colocated", (spec,), budget))
    prefill_device = decode_device = "cpu"
    if gpu:
        import torch

        prefill_device = "cuda:0"
        decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    pd = (
        EngineSpec(
            "prefill", "prefill", None if gpu else "0", 1, unchunked, prefill_device, blocks
        ),
        EngineSpec("decode", "decode", None if gpu else "1", 1, unchunked, decode_device, blocks),
    )
    out.append(Deployment("disaggregated", "disaggregated", pd, None))
    return out


# -- the client -------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streaming request's text-event arrival times (perf_counter)."""

    sent: float = 0.0
    events: list[float] = field(default_factory=list)
    error: str | None = None


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, out: Stream
) -> None:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out.sent = time.perf_counter()
    headers = {"authorization": "Bearer bench", "content-type": "application/json"}
    async with session.post(url + "/completions", data=orjson.dumps(body), headers=headers) as r:
        if r.status != 200:
            out.error = f"HTTP {r.status}: {(await r.text())[:300]}"
            return
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                out.error = str(chunk["error"])[:300]
                return
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                out.events.append(time.perf_counter())


def timed_gaps(streams: list[Stream], start: float, end: float) -> list[tuple[float, float]]:
    """(arrival, gap) of each stream's consecutive tokens, for tokens arriving in (start, end]."""
    out = []
    for s in streams:
        for before, now in zip(s.events, s.events[1:], strict=False):
            if start < now <= end:
                out.append((now, now - before))
    return out


def gaps_in(streams: list[Stream], start: float, end: float) -> list[float]:
    return sorted(gap for _, gap in timed_gaps(streams, start, end))


def stalls(streams: list[Stream], start: float, end: float, count: int = 12) -> list[list[float]]:
    """The longest gaps as [seconds into the window, gap ms]: when, against the long prompts'
    arrivals and first tokens, the decoders waited."""
    longest = sorted(timed_gaps(streams, start, end), key=lambda x: -x[1])[:count]
    return [[round(t - start, 3), round(g * 1e3, 1)] for t, g in sorted(longest)]


def tokens_in(streams: list[Stream], start: float, end: float) -> int:
    return sum(1 for s in streams for t in s.events if start < t <= end)


def pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def window_row(
    name: str, decoders: list[Stream], start: float, end: float, longs: list[Stream], long: int
) -> dict[str, Any]:
    gaps = gaps_in(decoders, start, end)
    decoded = tokens_in(decoders, start, end)
    ttfts = [s.events[0] - s.sent for s in longs if s.events]
    seconds = end - start
    p50, p99 = pct(gaps, 0.5), pct(gaps, 0.99)
    return {
        "case": name,
        "seconds": seconds,
        "num_gaps": len(gaps),
        "gap_p50_ms": p50 * 1e3 if p50 is not None else None,
        "gap_p99_ms": p99 * 1e3 if p99 is not None else None,
        "gap_max_ms": gaps[-1] * 1e3 if gaps else None,
        "long_ttft_s": ttfts,
        "long_ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "long_sent_at_s": [round(s.sent - start, 3) for s in longs],
        "long_first_at_s": [round(s.events[0] - start, 3) for s in longs if s.events],
        "stalls": stalls(decoders, start, end),
        "decode_tokens_per_s": decoded / seconds,
        # each long prompt counts its prompt and its one output token once its first token came
        "total_tokens_per_s": (decoded + len(ttfts) * (long + 1)) / seconds,
    }


async def run_windows(url: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Warm up, start the decoders, time a quiet window, then a window with long prompts."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    timeout = aiohttp.ClientTimeout(total=None, sock_read=TTFT_LIMIT_S + 30)
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # Allocator growth, first-call paths and a whole long prompt's path (in PD: its hold,
        # transfer and import), so the windows time a steady state, not first calls.
        for n in (16, args.long):
            warm = Stream()
            await stream_completion(session, url, ids(n), 8, warm)
            if warm.error:
                raise RuntimeError(f"warm-up failed: {warm.error}")
            if len(warm.events) != 8:  # the gaps below assume one event per token
                raise RuntimeError(f"8 tokens came as {len(warm.events)} text events")
        decoders = [Stream() for _ in range(NUM_DECODERS)]
        tasks = [
            asyncio.ensure_future(
                stream_completion(session, url, ids(DECODER_PROMPT), args.decoder_tokens, d)
            )
            for d in decoders
        ]
        try:
            async with asyncio.timeout(TTFT_LIMIT_S):
                while any(len(d.events) < 3 for d in decoders):
                    if any(d.error for d in decoders):
                        raise RuntimeError(f"a decoder failed: {[d.error for d in decoders]}")
                    await asyncio.sleep(0.02)
            quiet_start = time.perf_counter()
            await asyncio.sleep(args.quiet)
            quiet_end = time.perf_counter()
            longs = [Stream() for _ in range(args.num_long)]

            async def arrive(i: int) -> None:
                await asyncio.sleep(max(0.0, quiet_end + i * args.period - time.perf_counter()))
                async with asyncio.timeout(TTFT_LIMIT_S):
                    await stream_completion(session, url, ids(args.long), 1, longs[i])

            await asyncio.gather(*(arrive(i) for i in range(args.num_long)))
            errors = [s.error for s in [*longs, *decoders] if s.error]
            if errors:
                raise RuntimeError(f"requests failed: {errors[:3]}")
            last_first = max(s.events[0] for s in longs)
            end = max(quiet_end + args.num_long * args.period, last_first + 0.5)
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "quiet": window_row("no long prompts", decoders, quiet_start, quiet_end, [], args.long),
        "loaded": window_row("long prompts", decoders, quiet_end, end, longs, args.long),
    }


def pd_counters(engines: list[Proc]) -> dict[str, Any]:
    """The decode server's pulls: every long prompt should have been pulled, none computed."""
    import urllib.request

    out = {}
    for proc in engines:
        with urllib.request.urlopen(proc.url + "/pd/status", timeout=5) as r:
            status = json.loads(r.read())
        out[proc.name] = {
            k: status[k] for k in ("role", "served_transfers", "pulls", "expired_holds")
        }
    return out


def run_deployment(
    dep: Deployment, model_dir: str, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    log(f"{dep.name}: starting {len(dep.engines)} engine(s) and a gateway")
    procs: list[Proc] = []
    try:
        engines = [start_engine(model_dir, spec) for spec in dep.engines]
        procs.extend(engines)
        route = colocated_route(engines[0]) if len(engines) == 1 else pd_route(*engines)
        procs.append(start_gateway(route))
        log(f"{dep.name}: decoders, {args.quiet:.0f} s quiet, then {args.num_long} long prompts")
        windows = asyncio.run(run_windows(procs[-1].url, args, random.Random(seed)))
        result = {
            "deployment": dep.name,
            "mode": dep.mode,
            "budget": dep.budget,
            "engines": [asdict(e) for e in dep.engines],
            **windows,
        }
        if dep.mode == "disaggregated":
            result["pd"] = pd_counters(engines)
        return result
    finally:
        stop_all(procs)
        wait_quiet()


# -- verdict and table ------------------------------------------------------------------------


def best_chunked(rows: list[dict], period: float) -> dict | None:
    """Lowest gap p99 among chunked deployments whose long prompts each got a first token
    within one arrival period (a budget that falls behind the arrivals is not a setting one
    would run); if none kept up, the lowest gap p99 of all."""
    chunked = [r for r in rows if r["mode"] == "colocated" and r["budget"] is not None]
    kept_up = [r for r in chunked if max(r["loaded"]["long_ttft_s"]) <= period]
    pool = kept_up or chunked
    return min(pool, key=lambda r: r["loaded"]["gap_p99_ms"]) if pool else None


def judge(rows: list[dict], period: float) -> list[dict]:
    checks: list[dict] = []

    def check(name: str, value: float, limit: float, at_most: bool, gate: bool = True) -> None:
        ok = value <= limit if at_most else value >= limit
        checks.append(
            {
                "target": name,
                "value": round(value, 3),
                "limit": limit,
                "at_most": at_most,
                "pass": ok,
                "gate": gate,
            }
        )

    pd = next(r for r in rows if r["mode"] == "disaggregated")
    best = best_chunked(rows, period)
    check(
        "disaggregated gap p99 / its gap p99 with no long prompts",
        pd["loaded"]["gap_p99_ms"] / pd["quiet"]["gap_p99_ms"],
        1.5,
        True,
    )
    if best is not None:
        check(
            "disaggregated gap p99 / colocated gap p99 with no long prompts [info]",
            pd["loaded"]["gap_p99_ms"] / best["quiet"]["gap_p99_ms"],
            1.5,
            True,
            gate=False,
        )
        check(
            f"disaggregated total tokens/s / {best['deployment']}",
            pd["loaded"]["total_tokens_per_s"] / best["loaded"]["total_tokens_per_s"],
            0.8,
            False,
        )
        check(
            f"disaggregated decode tokens/s / {best['deployment']} [info]",
            pd["loaded"]["decode_tokens_per_s"] / best["loaded"]["decode_tokens_per_s"],
            0.8,
            False,
            gate=False,
        )
    return checks


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def print_table(results: dict) -> None:
    print(
        f"\nmodel: {results['params_m']:.1f}M params ({results['spec']['hidden_size']} hidden, "
        f"{results['spec']['num_hidden_layers']} layers), device {results['device']}; "
        f"{NUM_DECODERS} decoders, {results['num_long']} x {results['long_tokens']}-token "
        f"prompts every {results['period_s']:.1f} s; load average before the run "
        f"{results['load_before']} on {results['cpu_count']} cores"
    )
    header = (
        f"{'deployment':<24} {'window':<16} {'gaps':>6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'long TTFT s':>18} {'decode t/s':>10} {'total t/s':>10}"
    )
    print(header)
    for r in results["deployments"]:
        for w in (r["quiet"], r["loaded"]):
            ttft = " ".join(f"{t:.2f}" for t in w["long_ttft_s"]) or "-"
            print(
                f"{r['deployment']:<24} {w['case']:<16} {w['num_gaps']:>6} "
                f"{_ms(w['gap_p50_ms']):>8} {_ms(w['gap_p99_ms']):>8} {_ms(w['gap_max_ms']):>8} "
                f"{ttft:>18} {w['decode_tokens_per_s']:>10.1f} {w['total_tokens_per_s']:>10.1f}"
            )
    print(f"best chunked: {results['best_chunked']}")
    pd = next(r for r in results["deployments"] if r["mode"] == "disaggregated")
    print(f"disaggregated PD counters: {json.dumps(pd.get('pd'))}")
    print("\ntargets")
    for c in results["targets"]:
        verdict = ("PASS" if c["pass"] else "FAIL") if c["gate"] else "info"
        sign = "<=" if c["at_most"] else ">="
        print(f"  {verdict}  {c['target']}: {c['value']} ({sign} {c['limit']})")


def log(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    spec = SPECS["quick" if args.quick else args.device]  # bench/engine_ttft.py's models
    model_dir = bench_model(spec, args.cache_dir)
    args.vocab = spec.vocab_size or 512
    # Decoders outlast both windows even at a GPU's pace; their KV stays small next to a pool
    # that holds several long prompts.
    args.decoder_tokens = min(3000, spec.max_position_embeddings - DECODER_PROMPT - 1)
    params_m = _params_m(spec)
    # Load from others before any of ours starts: a busy shared machine inflates every gap.
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = []
    for i, dep in enumerate(deployments(args)):
        if time.monotonic() - started > TIME_LIMIT_S:
            raise TimeoutError(f"the bench ran past {TIME_LIMIT_S:.0f} s before {dep.name}")
        rows.append(run_deployment(dep, model_dir, args, seed=i))
    best = best_chunked(rows, args.period)
    results: dict[str, Any] = {
        "device": args.device,
        "quick": args.quick,
        "params_m": params_m,
        "spec": asdict(spec),
        "model_dir": model_dir,
        "num_decoders": NUM_DECODERS,
        "long_tokens": args.long,
        "num_long": args.num_long,
        "period_s": args.period,
        "quiet_s": args.quiet,
        "budgets": args.budgets,
        "cpu_count": os.cpu_count(),
        "load_before": load_before,
        "deployments": rows,
        "best_chunked": best["deployment"] if best else None,
        "targets": judge(rows, args.period),
    }
    results["elapsed_s"] = time.monotonic() - started
    print_table(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out} in {results['elapsed_s']:.0f} s")
    return 0


def _params_m(s: RandomModelSpec) -> float:
    vocab = s.vocab_size or 512
    head_dim = s.hidden_size // s.num_attention_heads
    per_layer = (
        s.hidden_size * head_dim * (2 * s.num_attention_heads + 2 * s.num_key_value_heads)
        + 3 * s.hidden_size * s.intermediate_size
        + 2 * s.hidden_size
    )
    return (s.num_hidden_layers * per_layer + 2 * vocab * s.hidden_size + s.hidden_size) / 1e6


if __name__ == "__main__":
    sys.exit(main())

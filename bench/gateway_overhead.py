"""How much the gateway adds to TTFT and takes from throughput, against a direct baseline.

    python bench/gateway_overhead.py [--seconds 6] [--concurrency 1 16 64] [--baseline DIR]

A mock OpenAI upstream (first token after 50 ms, 20 chunks 5 ms apart, usage, [DONE]) runs on
loopback; the same closed-loop load runs directly, through `firsttoken serve`, and through a
bare aiohttp relay (`minimal_passthrough.py`, the floor for any Python proxy here), interleaved.
`--baseline DIR` also serves the gateway from another checkout (`git worktree add DIR REV`) in
the same rounds, so that a change is compared with its parent on the same noise.
Prints a table, writes bench/results/gateway_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (
    ROOT,
    interleaved,
    peak_rss_mb,
    pin_self,
    start_gateway,
    start_minimal_passthrough,
    start_mock,
    stop,
)

TARGETS = {
    "added_p50_ms": {1: 1.0, 16: 3.0},
    "throughput_ratio": {16: 0.95, 64: 0.90},
    "rss_mb": 100.0,
    "ready_s": 1.5,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="load time per target and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "results", "gateway_overhead.json")
    )
    parser.add_argument("--baseline", help="a checkout whose gateway runs in the same rounds")
    args = parser.parse_args()
    pin_self()
    mock, upstream = start_mock()
    gateway, through, ready_s = start_gateway(upstream)
    floor_proc, floor = start_minimal_passthrough(upstream)
    targets = {"direct": upstream, "gateway": through, "floor": floor}
    baseline_proc = None
    if args.baseline:
        baseline_proc, targets["baseline"], _ = start_gateway(upstream, root=args.baseline)
    rows = []
    try:
        for c in args.concurrency:
            res = interleaved(targets, c, args.seconds)
            d, g, f = res["direct"], res["gateway"], res["floor"]
            rows.append(
                {
                    "concurrency": c,
                    "direct_ttft_p50_ms": d.pct(50),
                    "direct_ttft_p99_ms": d.pct(99),
                    "gateway_ttft_p50_ms": g.pct(50),
                    "gateway_ttft_p99_ms": g.pct(99),
                    "added_ttft_p50_ms": g.pct(50) - d.pct(50),
                    "floor_added_ttft_p50_ms": f.pct(50) - d.pct(50),
                    "floor_rps": f.rps,
                    "direct_rps": d.rps,
                    "gateway_rps": g.rps,
                    "throughput_ratio": g.rps / d.rps if d.rps else float("nan"),
                    "errors": d.errors + g.errors + f.errors,
                }
            )
            if "baseline" in res:
                b = res["baseline"]
                rows[-1].update(
                    baseline_added_ttft_p50_ms=b.pct(50) - d.pct(50),
                    baseline_throughput_ratio=b.rps / d.rps if d.rps else float("nan"),
                )
        rss = peak_rss_mb(gateway.pid)
    finally:
        stop(gateway)
        stop(floor_proc)
        if baseline_proc is not None:
            stop(baseline_proc)
        stop(mock)

    print(
        f"{'conc':>4} {'direct p50':>10} {'p99':>7} {'gw p50':>8} {'p99':>7} {'added p50':>9} "
        f"{'floor added':>11} {'direct rps':>10} {'gw rps':>8} {'ratio':>6} {'err':>4}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['direct_ttft_p50_ms']:>10.2f} "
            f"{r['direct_ttft_p99_ms']:>7.2f} "
            f"{r['gateway_ttft_p50_ms']:>8.2f} {r['gateway_ttft_p99_ms']:>7.2f} "
            f"{r['added_ttft_p50_ms']:>9.2f} {r['floor_added_ttft_p50_ms']:>11.2f} "
            f"{r['direct_rps']:>10.1f} {r['gateway_rps']:>8.1f} "
            f"{r['throughput_ratio']:>6.3f} {r['errors']:>4}"
        )
    print("floor added = TTFT added by a bare aiohttp relay (bench/minimal_passthrough.py)")
    if args.baseline:
        print(
            f"{'conc':>4} {'added p50':>9} {'baseline':>8} {'change':>7} {'ratio':>6} "
            f"{'baseline':>8}   (baseline: {args.baseline})"
        )
        for r in rows:
            print(
                f"{r['concurrency']:>4} {r['added_ttft_p50_ms']:>9.2f} "
                f"{r['baseline_added_ttft_p50_ms']:>8.2f} "
                f"{r['added_ttft_p50_ms'] - r['baseline_added_ttft_p50_ms']:>+7.2f} "
                f"{r['throughput_ratio']:>6.3f} {r['baseline_throughput_ratio']:>8.3f}"
            )
    print(f"gateway peak RSS {rss:.1f} MB, ready in {ready_s:.2f} s")

    verdicts = []
    for r in rows:
        c = r["concurrency"]
        if c in TARGETS["added_p50_ms"]:
            ok = r["added_ttft_p50_ms"] <= TARGETS["added_p50_ms"][c]
            verdicts.append((f"added TTFT p50 at c={c} <= {TARGETS['added_p50_ms'][c]} ms", ok))
        if c in TARGETS["throughput_ratio"]:
            ok = r["throughput_ratio"] >= TARGETS["throughput_ratio"][c]
            verdicts.append((f"throughput ratio at c={c} >= {TARGETS['throughput_ratio'][c]}", ok))
    verdicts.append((f"peak RSS < {TARGETS['rss_mb']} MB", rss < TARGETS["rss_mb"]))
    verdicts.append((f"ready within {TARGETS['ready_s']} s", ready_s <= TARGETS["ready_s"]))
    for label, ok in verdicts:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(
            orjson.dumps(
                {
                    "rows": rows,
                    "peak_rss_mb": rss,
                    "ready_s": ready_s,
                    "seconds_per_level": args.seconds,
                    "verdicts": {label: ok for label, ok in verdicts},
                },
                option=orjson.OPT_INDENT_2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

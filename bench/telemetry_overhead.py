"""What recording TTFT costs: the gateway overhead bench with telemetry off, with the embedded
store, and with Redis, side by side in one run.

    python bench/telemetry_overhead.py [--seconds 6] [--redis-url redis://127.0.0.1:6379/15]

Each variant is a separate gateway process on core 0; the load alternates between them in
short rounds. Prints a table, writes bench/results/telemetry_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import ROOT, interleaved, pin_self, start_gateway, start_mock, stop

TARGET_ADDED_P50_MS = 0.2
TARGET_THROUGHPUT_LOSS = 0.05


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "results", "telemetry_overhead.json")
    )
    args = parser.parse_args()
    pin_self()
    prefix = "ftbench-" + uuid.uuid4().hex[:8]
    variants = {
        "off": {"FIRSTTOKEN_TELEMETRY": "false"},
        "embedded": {},
        "redis": {"FIRSTTOKEN_REDIS_URL": args.redis_url, "FIRSTTOKEN_METRICS_KEY_PREFIX": prefix},
    }
    mock, upstream = start_mock()
    gateways = {name: start_gateway(upstream, env) for name, env in variants.items()}
    rows = []
    try:
        for c in args.concurrency:
            res = interleaved({name: g[1] for name, g in gateways.items()}, c, args.seconds)
            base = res["off"]
            for name, r in res.items():
                rows.append(
                    {
                        "concurrency": c,
                        "variant": name,
                        "ttft_p50_ms": r.pct(50),
                        "ttft_p99_ms": r.pct(99),
                        "rps": r.rps,
                        "errors": r.errors,
                        "added_p50_ms": r.pct(50) - base.pct(50),
                        "throughput_vs_off": r.rps / base.rps if base.rps else float("nan"),
                    }
                )
    finally:
        for proc, _, _ in gateways.values():
            stop(proc)
        stop(mock)
        _cleanup(args.redis_url, prefix)

    print(
        f"{'conc':>4} {'variant':>9} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>9} {'rps':>7} "
        f"{'vs off':>7} {'err':>4}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['variant']:>9} "
            f"{r['ttft_p50_ms']:>8.2f} {r['ttft_p99_ms']:>8.2f} "
            f"{r['added_p50_ms']:>9.2f} {r['rps']:>7.1f} "
            f"{r['throughput_vs_off']:>7.3f} {r['errors']:>4}"
        )
    verdicts = {}
    for r in rows:
        if r["variant"] == "off":
            continue
        verdicts[
            f"{r['variant']} c={r['concurrency']}: added TTFT p50 < {TARGET_ADDED_P50_MS} ms"
        ] = r["added_p50_ms"] < TARGET_ADDED_P50_MS
        if r["concurrency"] == max(args.concurrency):
            verdicts[f"{r['variant']} c={r['concurrency']}: throughput loss < 5%"] = (
                r["throughput_vs_off"] > 1 - TARGET_THROUGHPUT_LOSS
            )
    for label, ok in verdicts.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {label}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(
            orjson.dumps(
                {"rows": rows, "verdicts": verdicts, "seconds": args.seconds},
                option=orjson.OPT_INDENT_2,
            )
        )
    return 0


def _cleanup(url: str, prefix: str) -> None:
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    except Exception:  # noqa: BLE001  # best-effort cleanup: must not hide the bench's result
        pass


if __name__ == "__main__":
    raise SystemExit(main())

"""How much the gateway adds to TTFT and takes from throughput, against a direct baseline.

    python bench/gateway_overhead.py [--seconds 6] [--concurrency 1 16 64] [--baseline DIR]
                                     [--apis chat responses messages messages>chat]

A mock upstream (first token after 50 ms; chat: 20 chunks 5 ms apart, usage, [DONE]) runs on
loopback; the same closed-loop load runs directly, through `firsttoken serve`, and through a
bare aiohttp relay (`minimal_passthrough.py`, the floor for any Python proxy here), interleaved.
Each client API is measured against the same upstream endpoint called directly:

- chat: `/v1/chat/completions` to an `openai` route;
- responses: `/v1/responses` to an `openai` route (native: policies, events read for TTFT);
- messages: `/v1/messages` to an `anthropic` route (native);
- messages>chat: `/v1/messages` to an `openai` route, translated (its direct baseline is chat).

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
    CHAT,
    ROOT,
    Api,
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
    "api_vs_chat_p50_ms": 0.3,  # responses and messages add at most this much more than chat
}
SAY_HELLO = [{"role": "user", "content": "Say hello."}]
ANTHROPIC_HEADERS = (("anthropic-version", "2023-06-01"),)
RESPONSES = Api(
    "/responses",
    orjson.dumps({"model": "mock-model", "stream": True, "input": "Say hello."}),
    b"response.output_text.delta",
)


def messages_api(model: str) -> Api:
    body = {"model": model, "max_tokens": 64, "stream": True, "messages": SAY_HELLO}
    return Api("/messages", orjson.dumps(body), b"content_block_delta", ANTHROPIC_HEADERS)


# name: (the API through the gateway, the same upstream endpoint called directly)
APIS: dict[str, tuple[Api, Api]] = {
    "chat": (CHAT, CHAT),
    "responses": (RESPONSES, RESPONSES),
    "messages": (messages_api("claude-mock"), messages_api("claude-mock")),
    "messages>chat": (messages_api("mock-model"), CHAT),
}
ROUTES = [
    {"name": "claude", "models": ["claude-*"], "kind": "anthropic", "base_url": "{upstream}"},
    {"name": "mock", "models": ["*"], "kind": "openai", "base_url": "{upstream}"},
]


def routes_env(upstream: str) -> dict[str, str]:
    routes = [{**r, "base_url": upstream} for r in ROUTES]
    return {"FIRSTTOKEN_ROUTES": orjson.dumps(routes).decode()}


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
    parser.add_argument("--apis", nargs="+", default=list(APIS), choices=list(APIS))
    args = parser.parse_args()
    pin_self()
    mock, upstream = start_mock()
    gateway, through, ready_s = start_gateway(upstream, routes_env(upstream))
    floor_proc, floor = start_minimal_passthrough(upstream)
    targets: dict[str, tuple[str, Api]] = {}
    for name in args.apis:
        via_gateway, direct = APIS[name]
        targets[f"direct {name}"] = (upstream, direct)
        targets[f"gateway {name}"] = (through, via_gateway)
    targets["floor chat"] = (floor, CHAT)
    baseline_proc = None
    if args.baseline:
        baseline_proc, base_url, _ = start_gateway(
            upstream, routes_env(upstream), root=args.baseline
        )
        for name in args.apis:
            targets[f"baseline {name}"] = (base_url, APIS[name][0])
    rows = []
    try:
        for c in args.concurrency:
            res = interleaved(targets, c, args.seconds)
            f = res["floor chat"]
            for name in args.apis:
                d, g = res[f"direct {name}"], res[f"gateway {name}"]
                rows.append(
                    {
                        "api": name,
                        "concurrency": c,
                        "direct_ttft_p50_ms": d.pct(50),
                        "direct_ttft_p99_ms": d.pct(99),
                        "gateway_ttft_p50_ms": g.pct(50),
                        "gateway_ttft_p99_ms": g.pct(99),
                        "added_ttft_p50_ms": g.pct(50) - d.pct(50),
                        "floor_added_ttft_p50_ms": f.pct(50) - res["direct chat"].pct(50)
                        if "direct chat" in res
                        else float("nan"),
                        "floor_rps": f.rps,
                        "direct_rps": d.rps,
                        "gateway_rps": g.rps,
                        "throughput_ratio": g.rps / d.rps if d.rps else float("nan"),
                        "errors": d.errors + g.errors,
                    }
                )
                if f"baseline {name}" in res:
                    b = res[f"baseline {name}"]
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
        f"{'api':<13} {'conc':>4} {'direct p50':>10} {'p99':>7} {'gw p50':>8} {'p99':>7} "
        f"{'added p50':>9} {'floor added':>11} {'direct rps':>10} {'gw rps':>8} {'ratio':>6} "
        f"{'err':>4}"
    )
    for r in rows:
        print(
            f"{r['api']:<13} {r['concurrency']:>4} {r['direct_ttft_p50_ms']:>10.2f} "
            f"{r['direct_ttft_p99_ms']:>7.2f} "
            f"{r['gateway_ttft_p50_ms']:>8.2f} {r['gateway_ttft_p99_ms']:>7.2f} "
            f"{r['added_ttft_p50_ms']:>9.2f} {r['floor_added_ttft_p50_ms']:>11.2f} "
            f"{r['direct_rps']:>10.1f} {r['gateway_rps']:>8.1f} "
            f"{r['throughput_ratio']:>6.3f} {r['errors']:>4}"
        )
    print("floor added = TTFT added by a bare aiohttp relay (bench/minimal_passthrough.py)")
    if args.baseline:
        print(
            f"{'api':<13} {'conc':>4} {'added p50':>9} {'baseline':>8} {'change':>7} "
            f"{'ratio':>6} {'baseline':>8}   (baseline: {args.baseline})"
        )
        for r in rows:
            print(
                f"{r['api']:<13} {r['concurrency']:>4} {r['added_ttft_p50_ms']:>9.2f} "
                f"{r['baseline_added_ttft_p50_ms']:>8.2f} "
                f"{r['added_ttft_p50_ms'] - r['baseline_added_ttft_p50_ms']:>+7.2f} "
                f"{r['throughput_ratio']:>6.3f} {r['baseline_throughput_ratio']:>8.3f}"
            )
    print(f"gateway peak RSS {rss:.1f} MB, ready in {ready_s:.2f} s")

    verdicts = []
    chat_added = {r["concurrency"]: r["added_ttft_p50_ms"] for r in rows if r["api"] == "chat"}
    limit = TARGETS["api_vs_chat_p50_ms"]
    for r in rows:
        c = r["concurrency"]
        if r["api"] in ("responses", "messages") and c == 1 and c in chat_added:
            more = r["added_ttft_p50_ms"] - chat_added[c]
            r["added_vs_chat_p50_ms"] = more
            verdicts.append(
                (f"{r['api']} adds <= chat + {limit} ms at c=1 ({more:+.2f})", more <= limit)
            )
        if r["api"] != "chat":
            continue
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

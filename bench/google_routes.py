"""What a `gemini` route adds to TTFT and costs in CPU: chat through the gateway (translated to
`streamGenerateContent` and back) against Gemini's own streaming call on the same mock.

    python bench/google_routes.py [--seconds 6] [--concurrency 1 16]

`bench.mock_google` serves the Gemini API on loopback (first token after 50 ms, 20 chunks 5 ms
apart, CRLF-framed SSE, usage on each chunk). The same closed-loop load runs, interleaved:

- direct: `POST /v1beta/models/gemini-bench:streamGenerateContent?alt=sse` on the mock, in
  Gemini's own body, with `x-goog-api-key`;
- gateway: `POST /v1/chat/completions` (model `gemini-bench`, stream) through `firsttoken serve`
  with one `gemini` route to the mock.

TTFT is the time to the first content byte (`tok0`) on both; the gateway's CPU per request is
its process tree's, over its own windows (`bench.harness.metered`). Prints a table, writes
JSON to `bench/results/google_routes.json`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (
    ROOT,
    Api,
    drain_log,
    free_port,
    interleaved,
    pin_self,
    start_gateway,
    start_upstream,
    stop,
    stop_tree,
)

KEY_ENV, KEY = "BENCH_GEMINI_KEY", "bench-gemini-key"
MODEL = "gemini-bench"
PROMPT = "Say something short."
DIRECT = Api(
    f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse",
    orjson.dumps({"contents": [{"role": "user", "parts": [{"text": PROMPT}]}]}),
    b"tok0",
    (("x-goog-api-key", KEY),),
)
THROUGH = Api(
    "/chat/completions",
    orjson.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    ),
    b"tok0",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="load per level and target")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "results", "google_routes.json")
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    pin_self()
    rows = []
    log_tail: collections.deque = collections.deque(maxlen=50)
    with contextlib.ExitStack() as stack:
        port = free_port()
        mock, base = start_upstream(
            [sys.executable, "-m", "bench.mock_google", "--port", str(port), "--api-key", KEY], port
        )
        stack.callback(stop, mock)
        origin = base.removesuffix("/v1")
        route = {
            "name": "gemini",
            "models": [MODEL],
            "kind": "gemini",
            "base_url": origin,
            "api_key_env": KEY_ENV,
        }
        env = {"FIRSTTOKEN_ROUTES": orjson.dumps([route]).decode(), KEY_ENV: KEY}
        gateway, gateway_base, ready_s = start_gateway(origin, env)
        stack.callback(stop_tree, gateway)
        drain_log(gateway, log_tail)
        for concurrency in args.concurrency:
            results = interleaved(
                {"direct": (origin, DIRECT), "gateway": (gateway_base, THROUGH)},
                concurrency,
                args.seconds,
                cpu_pids={"gateway": gateway.pid},
            )
            direct, through = results["direct"], results["gateway"]
            rows.append(
                {
                    "concurrency": concurrency,
                    "direct_p50_ms": direct.pct(50),
                    "gateway_p50_ms": through.pct(50),
                    "added_p50_ms": through.pct(50) - direct.pct(50),
                    "direct_p95_ms": direct.pct(95),
                    "gateway_p95_ms": through.pct(95),
                    "gateway_cpu_ms_per_request": through.cpu_ms_per_request,
                    "requests": [direct.completed, through.completed],
                    "errors": [direct.errors, through.errors],
                }
            )
    print("gemini route: TTFT to the first content byte (ms), direct vs through the gateway")
    print(
        f"{'c':>4} {'direct p50':>11} {'gw p50':>8} {'added':>7} {'direct p95':>11} "
        f"{'gw p95':>8} {'gw CPU ms/req':>14} {'requests':>12} {'errors':>8}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['direct_p50_ms']:>11.2f} {r['gateway_p50_ms']:>8.2f} "
            f"{r['added_p50_ms']:>7.2f} {r['direct_p95_ms']:>11.2f} {r['gateway_p95_ms']:>8.2f} "
            f"{r['gateway_cpu_ms_per_request']:>14.2f} {r['requests']!s:>12} "
            f"{r['errors']!s:>8}"
        )
    print(f"gateway ready in {ready_s:.2f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(
            orjson.dumps(
                {"rows": rows, "seconds_per_level": args.seconds}, option=orjson.OPT_INDENT_2
            )
        )
    if any(sum(r["errors"]) for r in rows):
        print("--- gateway log (last lines)", *log_tail, sep="\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much the gateway adds to TTFT and costs in CPU, against a direct baseline and a revision.

    python bench/gateway_overhead.py [--seconds 6] [--concurrency 1 16 64]
                                     [--baseline DIR | --baseline-rev REV]
                                     [--apis chat responses messages messages>chat]

A mock upstream (first token after 50 ms; chat: 20 chunks 5 ms apart, usage, [DONE]) runs on
loopback; the same closed-loop load runs directly, through `firsttoken serve` (started as
`python -m gateway.cli serve`), and through a bare relay (`minimal_passthrough.py`, the floor
for any Python proxy here) twice, with aiohttp's client and with the gateway's own
(`gateway/upstreams/http1.py`), all interleaved. Each client API is measured against the same
upstream endpoint called directly:

- chat: `/v1/chat/completions` to an `openai` route;
- responses: `/v1/responses` to an `openai` route (native: policies, events read for TTFT);
- messages: `/v1/messages` to an `anthropic` route (native);
- messages>chat: `/v1/messages` to an `openai` route, translated (its direct baseline is chat).

A baseline gateway from another revision runs in the same rounds, so that a change is compared
with its parent on the same noise:

- `--baseline DIR`: a checkout that exists (`git worktree add DIR REV`);
- `--baseline-rev REV`: the bench makes a detached worktree of REV (`HEAD~3`, a hash) in a temp
  dir and removes it again at the end, error or interrupt included.

Either runs with this python (this venv) from the checkout (its working directory, first on
PYTHONPATH; checked before it starts).

CPU per request: for the gateway, the baseline gateway and the floor, the user + system CPU of
the serving process's tree is sampled just before each of that target's own load windows and
0.1 s after it (work finished after the last response counts), and the deltas are summed over
its windows only (the rounds are interleaved) and divided by the requests completed in them.
Counted: the process itself, all its threads (exited ones too), read from the kernel's
per-process CPU clock in ns (/proc/<pid>/stat's utime + stime in 10 ms ticks where that
clock is unreadable); its live descendants (big-body worker processes, a multiprocessing
resource tracker), found by their parent links in /proc, the same way; and every child they
reaped (cutime + cstime). Not counted: time between windows (idle timers, start-up: the bench
waits for each gateway to go quiet after start-up first), and a descendant re-parented away.

Acceptance (chat): added TTFT p50 at c=1 <= 0.8 ms; with a baseline, the gateway's CPU per
request at c=64 at most 0.85 x the baseline's. Prints tables and PASS/FAIL lines, writes
bench/results/gateway_overhead.json. Only loopback addresses; every load loop is bounded in
time and count; every process started is stopped by its pid at the end, also on error.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (
    CHAT,
    ROOT,
    Api,
    LoadResult,
    commit_of,
    drain_log,
    git_worktree,
    interleaved,
    peak_rss_mb,
    pin_self,
    process_tree,
    start_gateway,
    start_minimal_passthrough,
    start_mock,
    stop,
    stop_tree,
    wait_quiet,
)

TARGETS = {
    "added_p50_ms": {1: 0.8, 16: 3.0},
    "throughput_ratio": {16: 0.95, 64: 0.90},
    "cpu_vs_baseline": {64: 0.85},  # gateway CPU per request / the baseline's, at most
    "rss_mb": 100.0,
    "ready_s": 1.5,
    "api_vs_chat_p50_ms": 0.3,  # responses and messages add at most this much more than chat
}
CPU_COUNTED = (
    "user+system CPU of the serving process tree (the process and its live descendants: own "
    "time from the kernel's process CPU clock, else /proc/<pid>/stat utime+stime; plus reaped "
    "children's cutime+cstime), summed over that target's own load windows (from just before "
    "each to 0.1 s after), per completed request"
)
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


@dataclass(frozen=True)
class Baseline:
    """The revision the gateway is compared with: where its checkout is, what was asked for."""

    root: str
    source: str  # `--baseline DIR` or `--baseline-rev REV` as given
    commit: str


@dataclass
class Served:
    """Every process of one run, where each listens, and the tails of the gateways' logs."""

    upstream: str
    gateway: subprocess.Popen
    through: str
    ready_s: float
    floor: subprocess.Popen
    floor_url: str
    floor_http1: subprocess.Popen
    floor_http1_url: str
    baseline: subprocess.Popen | None = None
    baseline_url: str = ""
    logs: dict[str, collections.deque] = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="load time per target and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "results", "gateway_overhead.json")
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--baseline", help="a checkout whose gateway runs in the same rounds")
    which.add_argument(
        "--baseline-rev", help="a git revision of this repo to check out (temporarily) and run"
    )
    parser.add_argument("--apis", nargs="+", default=list(APIS), choices=list(APIS))
    args = parser.parse_args()
    if args.seconds <= 0 or args.seconds > 600 or any(c < 1 or c > 1024 for c in args.concurrency):
        parser.error("--seconds must be in (0, 600], each --concurrency in [1, 1024]")
    return args


@contextlib.contextmanager
def baseline_checkout(args: argparse.Namespace) -> Iterator[Baseline | None]:
    """The baseline's checkout for the whole run: a temporary worktree for `--baseline-rev`
    (gone again afterwards), the given directory for `--baseline`, else none."""
    if args.baseline_rev:
        with git_worktree(args.baseline_rev) as path:
            yield Baseline(path, f"--baseline-rev {args.baseline_rev}", commit_of(path))
    elif args.baseline:
        root = os.path.abspath(args.baseline)
        yield Baseline(root, f"--baseline {args.baseline}", commit_of(root))
    else:
        yield None


def start_gateway_logged(
    stack: contextlib.ExitStack, upstream: str, name: str, logs: dict, root: str | None = None
) -> tuple[subprocess.Popen, str, float]:
    """A gateway whose stop (with any children) is on `stack` and whose log is drained."""
    proc, url, ready_s = start_gateway(upstream, routes_env(upstream), root=root)
    stack.callback(stop_tree, proc)
    logs[name] = collections.deque(maxlen=20)
    drain_log(proc, logs[name])
    return proc, url, ready_s


def start_all(stack: contextlib.ExitStack, baseline: Baseline | None) -> Served:
    """Start the mock, the gateway, the floor and the baseline, each stopped by `stack`; then
    wait for the gateways to go quiet (a baseline may start worker processes after ready)."""
    mock, upstream = start_mock()
    stack.callback(stop, mock)
    logs: dict[str, collections.deque] = {}
    gateway, through, ready_s = start_gateway_logged(stack, upstream, "gateway", logs)
    floor, floor_url = start_minimal_passthrough(upstream)
    stack.callback(stop, floor)
    floor_http1, floor_http1_url = start_minimal_passthrough(upstream, "http1")
    stack.callback(stop, floor_http1)
    served = Served(
        upstream,
        gateway,
        through,
        ready_s,
        floor,
        floor_url,
        floor_http1,
        floor_http1_url,
        logs=logs,
    )
    if baseline is not None:
        served.baseline, served.baseline_url, _ = start_gateway_logged(
            stack, upstream, "baseline", logs, root=baseline.root
        )
    gateways = [p.pid for p in (served.gateway, served.baseline) if p is not None]
    if not wait_quiet(gateways):
        print("warning: a gateway was still busy after start-up", file=sys.stderr)
    return served


def targets_of(
    served: Served, apis: list[str]
) -> tuple[dict[str, tuple[str, Api]], dict[str, int]]:
    """The interleaved targets, and for the proxies among them the process whose CPU counts."""
    targets: dict[str, tuple[str, Api]] = {}
    cpu_pids: dict[str, int] = {
        "floor chat": served.floor.pid,
        "floor http1 chat": served.floor_http1.pid,
    }
    for name in apis:
        via_gateway, direct = APIS[name]
        targets[f"direct {name}"] = (served.upstream, direct)
        targets[f"gateway {name}"] = (served.through, via_gateway)
        cpu_pids[f"gateway {name}"] = served.gateway.pid
    targets["floor chat"] = (served.floor_url, CHAT)
    targets["floor http1 chat"] = (served.floor_http1_url, CHAT)
    if served.baseline is not None:
        for name in apis:
            targets[f"baseline {name}"] = (served.baseline_url, APIS[name][0])
            cpu_pids[f"baseline {name}"] = served.baseline.pid
    return targets, cpu_pids


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def row_of(name: str, c: int, res: dict[str, LoadResult]) -> dict[str, Any]:
    """One API at one concurrency: latency, throughput and CPU against the direct run."""
    d, g, f = res[f"direct {name}"], res[f"gateway {name}"], res["floor chat"]
    f1 = res["floor http1 chat"]
    direct_chat = res["direct chat"].pct(50) if "direct chat" in res else float("nan")
    row = {
        "api": name,
        "concurrency": c,
        "direct_ttft_p50_ms": d.pct(50),
        "direct_ttft_p99_ms": d.pct(99),
        "gateway_ttft_p50_ms": g.pct(50),
        "gateway_ttft_p99_ms": g.pct(99),
        "added_ttft_p50_ms": g.pct(50) - d.pct(50),
        "floor_added_ttft_p50_ms": f.pct(50) - direct_chat,
        "floor_http1_added_ttft_p50_ms": f1.pct(50) - direct_chat,
        "floor_rps": f.rps,
        "direct_rps": d.rps,
        "gateway_rps": g.rps,
        "throughput_ratio": ratio(g.rps, d.rps),
        "errors": d.errors + g.errors,
        "gateway_completed": g.completed,
        "gateway_cpu_s": g.cpu_s,
        "gateway_cpu_ms_per_request": g.cpu_ms_per_request,
        "floor_completed": f.completed,
        "floor_cpu_ms_per_request": f.cpu_ms_per_request,
        "floor_http1_completed": f1.completed,
        "floor_http1_cpu_ms_per_request": f1.cpu_ms_per_request,
    }
    if f"baseline {name}" in res:
        b = res[f"baseline {name}"]
        row.update(
            baseline_added_ttft_p50_ms=b.pct(50) - d.pct(50),
            baseline_throughput_ratio=ratio(b.rps, d.rps),
            baseline_errors=b.errors,
            baseline_completed=b.completed,
            baseline_cpu_s=b.cpu_s,
            baseline_cpu_ms_per_request=b.cpu_ms_per_request,
            cpu_vs_baseline=ratio(g.cpu_ms_per_request, b.cpu_ms_per_request),
        )
    return row


def tree_sizes(served: Served) -> dict[str, int]:
    """How many processes each CPU-counted tree holds (1: the server alone, no workers)."""
    procs = {
        "gateway": served.gateway,
        "floor": served.floor,
        "floor http1": served.floor_http1,
        "baseline": served.baseline,
    }
    return {name: len(process_tree(p.pid)) for name, p in procs.items() if p is not None}


def measure(args: argparse.Namespace, served: Served) -> list[dict[str, Any]]:
    targets, cpu_pids = targets_of(served, args.apis)
    rows = []
    for c in args.concurrency:
        res = interleaved(targets, c, args.seconds, cpu_pids=cpu_pids)
        rows += [row_of(name, c, res) for name in args.apis]
    return rows


def print_latency(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'api':<13} {'conc':>4} {'direct p50':>10} {'p99':>7} {'gw p50':>8} {'p99':>7} "
        f"{'added p50':>9} {'floor added':>11} {'http1 floor':>11} {'direct rps':>10} "
        f"{'gw rps':>8} {'ratio':>6} {'err':>4}"
    )
    for r in rows:
        print(
            f"{r['api']:<13} {r['concurrency']:>4} {r['direct_ttft_p50_ms']:>10.2f} "
            f"{r['direct_ttft_p99_ms']:>7.2f} "
            f"{r['gateway_ttft_p50_ms']:>8.2f} {r['gateway_ttft_p99_ms']:>7.2f} "
            f"{r['added_ttft_p50_ms']:>9.2f} {r['floor_added_ttft_p50_ms']:>11.2f} "
            f"{r['floor_http1_added_ttft_p50_ms']:>11.2f} "
            f"{r['direct_rps']:>10.1f} {r['gateway_rps']:>8.1f} "
            f"{r['throughput_ratio']:>6.3f} {r['errors']:>4}"
        )
    print(
        "floor added = TTFT added by a bare relay (bench/minimal_passthrough.py) with aiohttp's "
        "client; http1 floor: with the gateway's own (gateway/upstreams/http1.py)"
    )


def print_baseline(rows: list[dict[str, Any]], baseline: Baseline) -> None:
    print(
        f"{'api':<13} {'conc':>4} {'added p50':>9} {'baseline':>8} {'change':>7} "
        f"{'ratio':>6} {'baseline':>8} {'b err':>5}   "
        f"(baseline: {baseline.source}, commit {baseline.commit})"
    )
    for r in rows:
        print(
            f"{r['api']:<13} {r['concurrency']:>4} {r['added_ttft_p50_ms']:>9.2f} "
            f"{r['baseline_added_ttft_p50_ms']:>8.2f} "
            f"{r['added_ttft_p50_ms'] - r['baseline_added_ttft_p50_ms']:>+7.2f} "
            f"{r['throughput_ratio']:>6.3f} {r['baseline_throughput_ratio']:>8.3f} "
            f"{r['baseline_errors']:>5}"
        )


def print_cpu(rows: list[dict[str, Any]], baseline: Baseline | None) -> None:
    """CPU ms per completed request, with the requests it is over."""
    head = f"{'api':<13} {'conc':>4} {'gw cpu/req':>10} {'gw n':>6}"
    head += f" {'floor cpu/req':>13} {'floor n':>7} {'http1 floor':>11} {'n':>6}"
    if baseline is not None:
        head += f" {'base cpu/req':>12} {'base n':>6} {'new/base':>8}"
    print(head + "   (CPU ms per completed request, serving process tree, own windows)")
    for r in rows:
        line = (
            f"{r['api']:<13} {r['concurrency']:>4} {r['gateway_cpu_ms_per_request']:>10.3f} "
            f"{r['gateway_completed']:>6} "
            f"{r['floor_cpu_ms_per_request']:>13.3f} {r['floor_completed']:>7}"
            f" {r['floor_http1_cpu_ms_per_request']:>11.3f} {r['floor_http1_completed']:>6}"
        )
        if baseline is not None:
            line += (
                f" {r['baseline_cpu_ms_per_request']:>12.3f} {r['baseline_completed']:>6} "
                f"{r['cpu_vs_baseline']:>8.3f}"
            )
        print(line)


def acceptance(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The two figures the team's acceptance is judged on (chat), where they were measured."""
    chat = {r["concurrency"]: r for r in rows if r["api"] == "chat"}
    out: dict[str, float] = {}
    if 1 in chat:
        out["added_ttft_p50_ms_c1"] = chat[1]["added_ttft_p50_ms"]
        if "baseline_added_ttft_p50_ms" in chat[1]:
            out["baseline_added_ttft_p50_ms_c1"] = chat[1]["baseline_added_ttft_p50_ms"]
    if 64 in chat:
        out["gateway_cpu_ms_per_request_c64"] = chat[64]["gateway_cpu_ms_per_request"]
        if "cpu_vs_baseline" in chat[64]:
            out["baseline_cpu_ms_per_request_c64"] = chat[64]["baseline_cpu_ms_per_request"]
            out["cpu_vs_baseline_c64"] = chat[64]["cpu_vs_baseline"]
    return out


def verdicts_of(
    rows: list[dict[str, Any]], rss: float, ready_s: float
) -> list[tuple[str, bool, str]]:
    """(label, passed, figures) for each target that this run measured."""
    verdicts: list[tuple[str, bool, str]] = []
    chat_added = {r["concurrency"]: r["added_ttft_p50_ms"] for r in rows if r["api"] == "chat"}
    limit = TARGETS["api_vs_chat_p50_ms"]
    for r in rows:
        c = r["concurrency"]
        if r["api"] in ("responses", "messages") and c == 1 and c in chat_added:
            more = r["added_ttft_p50_ms"] - chat_added[c]
            r["added_vs_chat_p50_ms"] = more
            verdicts.append(
                (f"{r['api']} adds <= chat + {limit} ms at c=1", more <= limit, f"{more:+.2f} ms")
            )
        if r["api"] != "chat":
            continue
        if c in TARGETS["added_p50_ms"]:
            added, target = r["added_ttft_p50_ms"], TARGETS["added_p50_ms"][c]
            figures = f"gateway {added:.2f} ms"
            if "baseline_added_ttft_p50_ms" in r:
                figures += f", baseline {r['baseline_added_ttft_p50_ms']:.2f} ms"
            verdicts.append((f"added TTFT p50 at c={c} <= {target} ms", added <= target, figures))
        if c in TARGETS["throughput_ratio"]:
            ok = r["throughput_ratio"] >= TARGETS["throughput_ratio"][c]
            verdicts.append(
                (
                    f"throughput ratio at c={c} >= {TARGETS['throughput_ratio'][c]}",
                    ok,
                    f"{r['throughput_ratio']:.3f}",
                )
            )
        if c in TARGETS["cpu_vs_baseline"] and "cpu_vs_baseline" in r:
            target, share = TARGETS["cpu_vs_baseline"][c], r["cpu_vs_baseline"]
            figures = (
                f"gateway {r['gateway_cpu_ms_per_request']:.3f} ms, baseline "
                f"{r['baseline_cpu_ms_per_request']:.3f} ms, ratio {share:.3f}"
            )
            verdicts.append(
                (f"CPU per request at c={c} <= {target} x baseline", share <= target, figures)
            )
    verdicts.append(
        (f"peak RSS < {TARGETS['rss_mb']} MB", rss < TARGETS["rss_mb"], f"{rss:.1f} MB")
    )
    verdicts.append(
        (f"ready within {TARGETS['ready_s']} s", ready_s <= TARGETS["ready_s"], f"{ready_s:.2f} s")
    )
    return verdicts


def write_json(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def exit_on_sigterm() -> None:
    """A SIGTERM unwinds like Ctrl-C, so the `finally` paths stop every process we started."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main() -> int:
    args = parse_args()
    pin_self()
    exit_on_sigterm()
    with contextlib.ExitStack() as stack:
        baseline = stack.enter_context(baseline_checkout(args))
        served = start_all(stack, baseline)
        rows = measure(args, served)
        rss = peak_rss_mb(served.gateway.pid)
        trees = tree_sizes(served)
    # Every process is stopped and the worktree is gone from here on.

    print_latency(rows)
    if baseline is not None:
        print_baseline(rows, baseline)
    print_cpu(rows, baseline)
    print(f"gateway peak RSS {rss:.1f} MB, ready in {served.ready_s:.2f} s")
    print("processes in each CPU-counted tree at the end:", trees)
    if any(r["errors"] or r.get("baseline_errors") for r in rows):
        for name, tail in served.logs.items():
            print(f"--- {name} log (last lines)", *tail, sep="\n")
    verdicts = verdicts_of(rows, rss, served.ready_s)
    for label, ok, figures in verdicts:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}   ({figures})")

    write_json(
        args.out,
        {
            "rows": rows,
            "acceptance": acceptance(rows),
            "baseline": None
            if baseline is None
            else {"source": baseline.source, "commit": baseline.commit},
            "cpu_counted": CPU_COUNTED,
            "cpu_tree_processes": trees,
            "peak_rss_mb": rss,
            "ready_s": served.ready_s,
            "seconds_per_level": args.seconds,
            "verdicts": {label: ok for label, ok, _ in verdicts},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

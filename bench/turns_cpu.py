"""Gateway CPU per streamed request by turn of a conversation: does it grow with the prompt?

    python bench/turns_cpu.py [--sessions 8] [--turns 8] [--system-words 4000] [--prompts 2]
                              [--baseline-rev REV | --compiled] [--pairs N]

A mock upstream streams each answer (first token after 5 ms, 20 chunks 1 ms apart); the
gateway (`firsttoken serve`, default settings: default policies, prefix-break diagnostics and
the shadow cache advisor on, telemetry in process) relays it. The workload: `--sessions`
conversations, each with a `--system-words` system prompt (`--prompts` distinct ones, shared
round robin by the sessions) and a few tools; every round sends each session's next turn (the
last answer and a new question appended, as a chat client resends its whole history), the
sessions' requests at once, streamed, read to the end.

CPU per request: the user + system CPU of the gateway's process tree (the kernel's process CPU
clock, as `bench/gateway_overhead.py` counts it) from just before a round to when the gateway
has gone quiet after it (its background work, the advisor's included, counts), less what the
idle gateway spends in that time (measured for a second before the first round), divided by
the round's requests. With `--baseline-rev`, a temporary worktree of that revision serves the
same workload afterwards (fresh sessions from the same seed); with `--pairs N` as well, each
tree serves it N times, interleaved (ABBA...), the table shows the mean per turn and a line
compares each pair's means (their median ratio is the figure to quote on a busy machine). With
`--compiled` instead, the new tree is a copy of this checkout with `policies` compiled by mypyc
(`setup.py` with `FIRSTTOKEN_MYPYC=1`, about 30 s; needs a C compiler) and the baseline is this
checkout, interpreted: what the compiled build saves. CPU time, not wall time, so a loaded
machine slows the bench more than it moves the figures.

Targets (issue 21): at most 2.5 ms per request over the workload, and the last turn within
1.5x of the first. `--groups N` runs N sets of sessions (other seeds) in each round, for
steadier figures per turn. Prints a table and PASS/FAIL lines, writes
bench/results/turns_cpu.json. Loopback only; every process started is stopped by its pid; the
run is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cache_hit import paragraph, sentence
from bench.harness import (
    ROOT,
    commit_of,
    compiled_copy,
    drain_log,
    git_worktree,
    pin_self,
    start_gateway,
    start_mock,
    stop,
    stop_tree,
    tree_cpu_s,
    wait_quiet,
)

TARGET_MS = 2.5
TARGET_GROWTH = 1.5
TIME_LIMIT_S = 300.0
TOOLS = 4


def tool(rng: random.Random, index: int) -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{index}",
            "description": sentence(rng, 20),
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }


class Session:
    """One conversation: its system prompt, tools, and the turns so far."""

    def __init__(self, rng: random.Random, system: str, tools: list[dict]) -> None:
        self.rng = rng
        self.messages: list[dict] = [{"role": "system", "content": system}]
        self.tools = tools

    def next_body(self) -> bytes:
        if len(self.messages) > 1:
            self.messages.append({"role": "assistant", "content": paragraph(self.rng, 120)})
        self.messages.append({"role": "user", "content": paragraph(self.rng, 40)})
        body = {
            "model": "mock-model",
            "stream": True,
            "messages": self.messages,
            "tools": self.tools,
        }
        return orjson.dumps(body)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=4000)
    parser.add_argument(
        "--prompts",
        type=int,
        default=2,
        help="distinct system prompts (an agent's sessions share one)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--groups", type=int, default=1, help="sets of sessions per round")
    parser.add_argument(
        "--baseline-rev", help="a git revision to run the same workload through afterwards"
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="the new tree is a copy of this checkout with `policies` compiled by mypyc "
        "(setup.py, FIRSTTOKEN_MYPYC=1), the baseline this checkout interpreted",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="with --baseline-rev or --compiled: run both trees this many times each, "
        "interleaved (ABBA...), and compare per pair; a noisy machine needs several",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "turns_cpu.json"))
    args = parser.parse_args()
    if not 1 <= args.pairs <= 10:
        parser.error("--pairs in [1, 10]")
    if args.compiled and args.baseline_rev:
        parser.error("--compiled compares with this checkout: no --baseline-rev with it")
    if not 1 <= args.groups <= 16:
        parser.error("--groups in [1, 16]")
    if not (1 <= args.sessions <= 64 and 1 <= args.turns <= 32 and 1 <= args.prompts):
        parser.error("--sessions in [1, 64], --turns in [1, 32], --prompts at least 1")
    if not 1 <= args.system_words <= 50_000:
        parser.error("--system-words in [1, 50000]")
    return args


def stream_one(client: httpx.Client, url: str, body: bytes) -> None:
    with client.stream(
        "POST", url, content=body, headers={"content-type": "application/json"}
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"gateway answered {response.status_code}: {response.read()!r}")
        for _ in response.iter_raw():
            pass


def idle_rate(pid: int, seconds: float = 1.0) -> float:
    """CPU seconds per second the quiet gateway spends anyway (timers, the telemetry writer):
    subtracted from each round, whose quiet tail would otherwise count it."""
    before, started = tree_cpu_s(pid), time.perf_counter()
    time.sleep(seconds)
    return (tree_cpu_s(pid) - before) / (time.perf_counter() - started)


def build_sessions(args: argparse.Namespace, group: int) -> list[Session]:
    rng = random.Random(args.seed + 7919 * group)
    prompts = [paragraph(rng, args.system_words) for _ in range(args.prompts)]
    tools = [tool(rng, index) for index in range(TOOLS)]
    return [
        Session(
            random.Random((args.seed + 7919 * group) * 1000 + s), prompts[s % args.prompts], tools
        )
        for s in range(args.sessions)
    ]


def run_turns(args: argparse.Namespace, upstream: str, root: str | None, deadline: float) -> list:
    """The workload through one gateway (this checkout's, or `root`'s): a row per turn."""
    groups = [build_sessions(args, group) for group in range(args.groups)]
    rows = []
    with contextlib.ExitStack() as stack:
        gateway, base, _ = start_gateway(upstream, root=root)
        stack.callback(stop_tree, gateway)
        drain_log(gateway, collections.deque(maxlen=20))
        wait_quiet([gateway.pid])
        idle_per_s = idle_rate(gateway.pid)
        url = base + "/chat/completions"
        limits = httpx.Limits(max_connections=args.sessions)
        client = stack.enter_context(httpx.Client(timeout=60, limits=limits))
        pool = stack.enter_context(ThreadPoolExecutor(args.sessions))
        for turn in range(1, args.turns + 1):
            if time.perf_counter() > deadline:
                raise TimeoutError("turns_cpu ran past its time limit")
            spent, sent = 0.0, []
            for sessions in groups:
                bodies = [session.next_body() for session in sessions]
                before, started = tree_cpu_s(gateway.pid), time.perf_counter()
                # A group's turns are sent together, as concurrent users would.
                list(pool.map(lambda body: stream_one(client, url, body), bodies))
                wait_quiet([gateway.pid], timeout=5.0, busy=0.02)
                idle = idle_per_s * (time.perf_counter() - started)
                spent += max(0.0, tree_cpu_s(gateway.pid) - before - idle)
                sent += bodies
            bodies = sent
            rows.append(
                {
                    "turn": turn,
                    "requests": len(bodies),
                    "body_kb": round(sum(map(len, bodies)) / len(bodies) / 1024, 1),
                    "cpu_ms_per_request": round(spent * 1000 / len(bodies), 3),
                }
            )
    return rows


def interleaved(pairs: int) -> list[str]:
    """The order the two trees run in: ABBA... (each pair's first run alternates), so that a
    machine growing busier or quieter over the runs weighs on both alike."""
    order: list[str] = []
    for pair in range(pairs):
        order += ["gateway", "baseline"] if pair % 2 == 0 else ["baseline", "gateway"]
    return order


def mean_rows(runs: list[list[dict]]) -> list[dict]:
    """Per turn, the mean CPU per request over the runs (the other columns are the same)."""
    return [
        {
            **rows[0],
            "cpu_ms_per_request": round(sum(r["cpu_ms_per_request"] for r in rows) / len(rows), 3),
        }
        for rows in zip(*runs, strict=True)
    ]


def run_mean(rows: list[dict]) -> float:
    return sum(row["cpu_ms_per_request"] for row in rows) / len(rows)


def main() -> int:
    args = parse_args()
    pin_self()
    paired = bool(args.baseline_rev or args.compiled)
    runs_per_tree = args.pairs if paired else 1
    deadline = time.perf_counter() + TIME_LIMIT_S * runs_per_tree * (2 if paired else 1)
    runs: dict[str, list[list[dict]]] = {"gateway": [], "baseline": []}
    with contextlib.ExitStack() as stack:
        mock, upstream = start_mock(first_ms=5, chunks=20, gap_ms=1)
        stack.callback(stop, mock)
        base_root = new_root = None
        if args.baseline_rev:
            base_root = stack.enter_context(git_worktree(args.baseline_rev))
        if args.compiled:
            built = stack.enter_context(tempfile.TemporaryDirectory(prefix="turns-compiled-"))
            base_root, new_root = ROOT, compiled_copy(built)
        for tree in interleaved(runs_per_tree) if base_root else ["gateway"]:
            root = base_root if tree == "baseline" else new_root
            runs[tree].append(run_turns(args, upstream, root, deadline))
    rows = mean_rows(runs["gateway"])
    base = mean_rows(runs["baseline"]) if runs["baseline"] else None
    pairs = [
        {"gateway": round(run_mean(new), 3), "baseline": round(run_mean(old), 3)}
        for new, old in zip(runs["gateway"], runs["baseline"], strict=False)
    ]
    print(f"{'turn':>4} {'requests':>8} {'body KB':>8} {'CPU ms/req':>10}", end="")
    print(f" {'baseline':>9} {'new/base':>8}" if base else "")
    for index, row in enumerate(rows):
        line = (
            f"{row['turn']:>4} {row['requests']:>8} {row['body_kb']:>8.1f}"
            f" {row['cpu_ms_per_request']:>10.3f}"
        )
        if base:
            old = base[index]["cpu_ms_per_request"]
            line += f" {old:>9.3f} {row['cpu_ms_per_request'] / old if old else 0:>8.2f}"
        print(line)
    if base:
        if args.compiled:
            print(
                f"new: {commit_of(ROOT)} with `policies` compiled; baseline: the same, interpreted"
            )
        else:
            print(
                f"baseline: --baseline-rev {args.baseline_rev} ({commit_of(ROOT)} is this tree's "
                "HEAD)"
            )
        ratios = sorted(pair["gateway"] / pair["baseline"] for pair in pairs)
        print(
            f"{len(pairs)} interleaved pair(s), mean CPU per request new/base: "
            + " ".join(f"{ratio:.2f}" for ratio in ratios)
            + f"; median {statistics.median(ratios):.2f}"
        )
    per_turn = [row["cpu_ms_per_request"] for row in rows]
    growth = per_turn[-1] / per_turn[0] if per_turn[0] > 0 else float("inf")
    mean = sum(per_turn) / len(per_turn)  # every turn has as many requests
    checks = [
        (
            f"CPU per request <= {TARGET_MS} ms over the workload",
            mean <= TARGET_MS,
            f"mean {mean:.3f} ms, turns {min(per_turn):.3f}-{max(per_turn):.3f}",
        ),
        (
            f"last turn within {TARGET_GROWTH}x of the first",
            growth <= TARGET_GROWTH,
            f"{growth:.2f}x",
        ),
    ]
    for name, ok, detail in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}   ({detail})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "wb") as out:
        out.write(
            orjson.dumps(
                {
                    "settings": vars(args),
                    "cpu_counted": "gateway process tree user+system CPU per request, idle "
                    "subtracted, background work included",
                    "rows": rows,
                    "baseline_rows": base,
                    "pairs": pairs,
                    "growth_last_over_first": round(growth, 3),
                    "checks": [{"name": n, "pass": ok, "detail": d} for n, ok, d in checks],
                },
                option=orjson.OPT_INDENT_2,
            )
        )
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

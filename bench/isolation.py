"""Can one tenant slow another? A victim tenant's streaming TTFT alone and while an attacker
tenant sends the heaviest inputs the gateway's limits allow, side by side in one run.

    python bench/isolation.py [--seconds 8] [--victim-concurrency 4] [--victim-interval-ms 100]
                              [--attacker-connections 2] [--phases biggest messages deep ...]

The gateway runs in tenant mode (tenants `victim` and `attacker`) with default policies, pinned
to core 0 like `gateway_overhead.py`. Each tenant's model goes to its own mock OpenAI upstream
(first token after 50 ms, 5 chunks): the bench mock parses every body on its event loop, so a
shared one would slow the victim's upstream, not the gateway; the attacker's never parses one.
The victim: `--victim-concurrency` users, each starting a small streaming chat every
`--victim-interval-ms` whether or not its last one finished (open loop, so a stalled gateway
shows in every request it delays); TTFT is measured at the client from the scheduled start.
Attack phases (biggest, messages, deep, headers, mixed), each alone with the victim, send the
heaviest inputs the gateway's limits allow and a few just over them; `metrics` reads the
attacker's own figures at the longest window on four connections in a loop (`--redis-url` puts
the gateway's telemetry in that Redis, under a key prefix of the run's own, as in production);
`bench/isolation_inputs.py` builds them from `gateway.config.settings.Settings` and says what
each phase sends.

The attacker is a separate process (this file with --attacker) sending back to back from
`--attacker-connections` raw sockets; on a machine with 4+ cores it and its mock get cores 2
and 3, on 2 cores they share the harness core at nice 10 so the victim's client wakes first.
Phases interleave with "alone" rounds (alone, attack, alone, attack, ..., alone) because the
machine is noisy; after each attack the bench waits until the gateway's CPU is quiet. Target
per phase: victim p99 <= 1.5x the pooled alone p99 and no victim errors. Prints a table,
writes bench/results/isolation.json; exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (
    HARNESS_CORE,
    ROOT,
    LoadResult,
    drain_log,
    free_port,
    merge,
    pin_self,
    start_gateway,
    start_mock,
    start_upstream,
    stop,
)
from bench.isolation_inputs import (
    ATTACKER_KEY,
    GRACE_S,
    METRICS_CONNECTIONS,
    PHASES,
    REQUEST_TIMEOUT_S,
    Limits,
    attack,
    limit_env,
    probes_for,
)

TARGET_RATIO = 1.5
VICTIM_KEY = "sk-isolation-victim"
VICTIM_MODEL = "mock-model"
VICTIM_BODY = orjson.dumps(
    {
        "model": VICTIM_MODEL,
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Say hello in five words."},
        ],
    }
)
VICTIM_HEADERS = {"content-type": "application/json", "authorization": f"Bearer {VICTIM_KEY}"}
MAX_VICTIM_IN_FLIGHT = 512  # past it a scheduled victim request counts as an error
READY_TIMEOUT_S = 120.0  # the attacker builds its bodies before it says "ready"
SETTLE_MAX_S = 30.0  # the gateway may still chew on a cut 16 MB body
WARM_S = 1.0


# -- attacker process ---------------------------------------------------------------------------


def attacker_main(args: argparse.Namespace) -> int:
    limits = Limits(**orjson.loads(args.limits))
    started = time.perf_counter()
    probes = probes_for(args.attacker, limits)
    build_s = time.perf_counter() - started
    print("ready", flush=True)
    result = asyncio.run(attack(args.url, probes, args.seconds, args.attacker_connections))
    result["build_s"] = build_s
    result["probe_bytes"] = {p.kind: len(p.template) for p in probes}
    print(orjson.dumps(result).decode(), flush=True)
    return 0


# -- victim -------------------------------------------------------------------------------------


async def open_loop(url: str, users: int, interval_s: float, seconds: float) -> LoadResult:
    """Each of `users` starts a streaming chat every `interval_s` (staggered) whether or not its
    last one finished; TTFT counts from the scheduled start. A closed loop (bench.harness.load)
    stops sending while the gateway stalls, so the stall would never show in its TTFTs."""
    ttfts: list[float] = []
    errors = 0
    in_flight: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=MAX_VICTIM_IN_FLIGHT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(scheduled: float) -> None:
            nonlocal errors
            first = None
            try:
                async with session.post(
                    url + "/chat/completions", data=VICTIM_BODY, headers=VICTIM_HEADERS
                ) as resp:
                    async for chunk in resp.content.iter_any():
                        if first is None and resp.status == 200 and b"tok0" in chunk:
                            first = time.perf_counter()
            except (TimeoutError, aiohttp.ClientError):
                pass
            if first is None:
                errors += 1
            else:
                ttfts.append((first - scheduled) * 1000)

        start = time.perf_counter()
        for k in range(int(seconds / interval_s * users)):
            scheduled = start + k * interval_s / users
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            if len(in_flight) >= MAX_VICTIM_IN_FLIGHT:
                errors += 1
                continue
            task = asyncio.create_task(one(scheduled))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await asyncio.gather(*in_flight)
    return LoadResult(ttfts, len(ttfts), errors, time.perf_counter() - start)


def victim_load(url: str, args: argparse.Namespace, seconds: float) -> LoadResult:
    return asyncio.run(
        open_loop(url, args.victim_concurrency, args.victim_interval_ms / 1000, seconds)
    )


# -- processes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Cores for the attacker and its mock; `shared`: they share the harness core, at nice 10
    so the victim's client wakes first (SCHED_IDLE starves them on a busy machine)."""

    attacker_core: str | None
    mock_core: str | None
    shared: bool

    @classmethod
    def for_machine(cls) -> Placement:
        cpus = os.cpu_count() or 1
        if cpus >= 4:
            return cls("2", "3", False)
        if cpus == 3:
            return cls("2", "2", False)
        return cls(HARNESS_CORE if cpus == 2 else None, HARNESS_CORE if cpus == 2 else None, True)

    def prefix(self, core: str | None) -> list[str]:
        out = ["taskset", "-c", core] if core is not None and shutil.which("taskset") else []
        return out + (["nice", "-n", "10"] if self.shared and shutil.which("nice") else [])


def start_attacker_mock(place: Placement) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return start_upstream(
        [
            *place.prefix(place.mock_core),
            sys.executable,
            os.path.abspath(__file__),
            "--upstream-port",
            str(port),
        ],
        port,
    )


def upstream_main(port: int) -> int:
    """The attacker's upstream: streams like the bench mock (first token after 50 ms, 5 chunks
    5 ms apart) but never parses or keeps a body, so a 16 MB one cannot stall it."""
    from aiohttp import web

    def event(delta: dict, finish: str | None = None) -> bytes:
        return (
            b"data: "
            + orjson.dumps(
                {
                    "id": "chatcmpl-atk",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "attacker",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            )
            + b"\n\n"
        )

    async def chat(request: web.Request) -> web.StreamResponse:
        async for _ in request.content.iter_chunked(1 << 16):
            pass
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.05)
        await resp.write(event({"role": "assistant", "content": ""}))
        for i in range(5):
            await resp.write(event({"content": f"tok{i} "}))
            await asyncio.sleep(0.005)
        await resp.write(event({}, "stop") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
    return 0


def gateway_env(
    victim_upstream: str, attacker_upstream: str, redis_url: str | None = None
) -> dict[str, str]:
    routes = [
        {"name": "victim", "models": [VICTIM_MODEL], "kind": "openai", "base_url": victim_upstream},
        {"name": "attacker", "models": ["*"], "kind": "openai", "base_url": attacker_upstream},
    ]
    return {
        "FIRSTTOKEN_ROUTES": orjson.dumps(routes).decode(),
        "FIRSTTOKEN_TENANT_KEYS": f"victim:{VICTIM_KEY},attacker:{ATTACKER_KEY}",
        **limit_env(),
        **(
            {
                "FIRSTTOKEN_REDIS_URL": redis_url,
                "FIRSTTOKEN_METRICS_KEY_PREFIX": run_key_prefix(),
            }
            if redis_url
            else {}
        ),
    }


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int) -> tuple[float, bool]:
    """Wait (at most SETTLE_MAX_S) until the gateway burns < 10% CPU; (seconds, went quiet)."""
    start = time.perf_counter()
    try:
        last = cpu_seconds(pid)
        while time.perf_counter() - start < SETTLE_MAX_S:
            time.sleep(0.2)
            now = cpu_seconds(pid)
            if now - last < 0.02:
                return time.perf_counter() - start, True
            last = now
    except OSError:
        pass
    return time.perf_counter() - start, False


def spawn_attacker(
    phase: str, url: str, limits: Limits, args: argparse.Namespace, place: Placement
) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *place.prefix(place.attacker_core),
            sys.executable,
            os.path.abspath(__file__),
            "--attacker",
            phase,
            "--url",
            url,
            "--limits",
            orjson.dumps(asdict(limits)).decode(),
            "--seconds",
            str(args.seconds + 0.3),
            "--attacker-connections",
            str(
                max(METRICS_CONNECTIONS, args.attacker_connections)
                if phase == "metrics"
                else args.attacker_connections
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )


def wait_ready(proc: subprocess.Popen) -> None:
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        raise RuntimeError(f"attacker not ready within {READY_TIMEOUT_S}s (exit {proc.poll()})")


def run_attack(
    phase: str, url: str, limits: Limits, args: argparse.Namespace, place: Placement
) -> tuple[LoadResult, dict]:
    """The victim's load while the attacker runs `phase`; (victim result, attacker report)."""
    proc = spawn_attacker(phase, url, limits, args, place)
    try:
        wait_ready(proc)
        victim = victim_load(url, args, args.seconds)
        out, _ = proc.communicate(timeout=GRACE_S + REQUEST_TIMEOUT_S)
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"attacker for {phase!r} failed (exit {proc.returncode})")
        return victim, orjson.loads(out.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            stop(proc)


# -- report -------------------------------------------------------------------------------------


@dataclass
class AloneRound:
    result: LoadResult
    quiet: bool  # the gateway was idle when it began (not still chewing an attacker's body)


def baseline(rounds: list[AloneRound]) -> LoadResult:
    """The pooled alone rounds that began on a quiet gateway (all of them if none did)."""
    return merge([r.result for r in rounds if r.quiet] or [r.result for r in rounds])


def phase_row(phase: str, victim: LoadResult, alone_p99: float, attacker: dict) -> dict:
    ratio = victim.pct(99) / alone_p99 if alone_p99 else float("nan")
    return {
        "phase": phase,
        "victim_requests": victim.completed,
        "victim_errors": victim.errors,
        "victim_ttft_p50_ms": victim.pct(50),
        "victim_ttft_p99_ms": victim.pct(99),
        "p99_ratio": ratio,
        "attacker": attacker,
        "pass": victim.completed > 0 and victim.errors == 0 and ratio <= TARGET_RATIO,
    }


def print_table(alone: LoadResult, rounds: list[AloneRound], rows: list[dict]) -> None:
    print(
        f"{'phase':<9} {'victim n':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99/alone':>9} {'err':>4} "
        f"{'atk done':>8} {'cut':>4} {'settle s':>8}  attacker statuses"
    )
    print(
        f"{'alone':<9} {alone.completed:>8} {alone.pct(50):>8.2f} {alone.pct(99):>8.2f} "
        f"{1.0:>9.2f} {alone.errors:>4} {'-':>8} {'-':>4} {'-':>8}  p99 per round: "
        + " ".join(f"{r.result.pct(99):.1f}{'' if r.quiet else '*'}" for r in rounds)
    )
    for r in rows:
        a = r["attacker"]
        statuses = " ".join(f"{s}:{n}" for s, n in sorted(a["statuses"].items()))
        print(
            f"{r['phase']:<9} {r['victim_requests']:>8} {r['victim_ttft_p50_ms']:>8.2f} "
            f"{r['victim_ttft_p99_ms']:>8.2f} {r['p99_ratio']:>9.2f} {r['victim_errors']:>4} "
            f"{a['requests']:>8} {a['cancelled_in_flight']:>4} {a['settle_s']:>8.1f}  {statuses}"
        )
    print(
        "atk done: attacker requests answered; cut: in flight when the phase ended; settle: "
        "seconds until the gateway's CPU went quiet afterwards (at most "
        f"{SETTLE_MAX_S:g}); *: alone round begun on a busy gateway, left out of 'alone'"
    )
    for r in rows:
        for kind, counts in r["attacker"]["unexpected"].items():
            print(f"  note: {r['phase']}/{kind}: unexpected statuses {counts}")
    for r in rows:
        print(
            f"  {'PASS' if r['pass'] else 'FAIL'}  {r['phase']}: victim p99 <= {TARGET_RATIO}x "
            f"alone, no victim errors"
        )


# -- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each round")
    parser.add_argument(
        "--victim-concurrency",
        type=int,
        default=4,
        help="victim users, each starting a stream every --victim-interval-ms",
    )
    parser.add_argument("--victim-interval-ms", type=float, default=100.0)
    parser.add_argument("--attacker-connections", type=int, default=2)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument(
        "--redis-url", help="the gateway's telemetry store (default: in process), for `metrics`"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "isolation.json"))
    parser.add_argument("--attacker", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--limits", help=argparse.SUPPRESS)
    parser.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def measure(
    args: argparse.Namespace, url: str, gateway_pid: int, limits: Limits, place: Placement
) -> tuple[list[AloneRound], list[dict]]:
    """alone, attack, alone, attack, ..., alone; (alone rounds, raw attack results)."""
    _, quiet = settle(gateway_pid)  # start-up work
    victim_load(url, args, WARM_S)  # unmeasured
    alone, attacks = [], []
    for phase in args.phases:
        progress("alone")
        alone.append(AloneRound(victim_load(url, args, args.seconds), quiet))
        progress(f"attack: {phase}")
        victim, report = run_attack(phase, url, limits, args, place)
        report["settle_s"], quiet = settle(gateway_pid)
        attacks.append({"phase": phase, "victim": victim, "attacker": report})
    progress("alone")
    alone.append(AloneRound(victim_load(url, args, args.seconds), quiet))
    return alone, attacks


def progress(step: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {step}", file=sys.stderr, flush=True)


def run(
    args: argparse.Namespace, limits: Limits, place: Placement
) -> tuple[list[AloneRound], list[dict], list[str]]:
    """Start the upstreams and the gateway, measure, and stop every process we started."""
    procs: list[subprocess.Popen] = []
    log_tail: collections.deque = collections.deque(maxlen=20)
    try:
        mock, victim_upstream = start_mock(first_ms=50, chunks=5, gap_ms=5)
        procs.append(mock)
        attacker_mock, attacker_upstream = start_attacker_mock(place)
        procs.append(attacker_mock)
        gateway, url, _ = start_gateway(
            victim_upstream, gateway_env(victim_upstream, attacker_upstream, args.redis_url)
        )
        procs.append(gateway)
        drain_log(gateway, log_tail)
        alone_rounds, attacks = measure(args, url, gateway.pid, limits, place)
    finally:
        for proc in reversed(procs):
            stop(proc)
        if args.redis_url:
            forget_run_keys(args.redis_url)
    return alone_rounds, attacks, list(log_tail)


def forget_run_keys(redis_url: str) -> None:
    """Delete what this run's gateway wrote to a shared Redis (its own key prefix only)."""
    import redis

    with redis.Redis.from_url(redis_url) as client:
        keys = list(client.scan_iter(match=f"{run_key_prefix()}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])


def run_key_prefix() -> str:
    return f"iso{os.getpid()}"


def report(
    args: argparse.Namespace,
    limits: Limits,
    place: Placement,
    alone_rounds: list[AloneRound],
    attacks: list[dict],
    log_tail: list[str],
) -> bool:
    """Print the table, write the JSON; True when every phase passed."""
    alone = baseline(alone_rounds)
    rows = [phase_row(a["phase"], a["victim"], alone.pct(99), a["attacker"]) for a in attacks]
    print(f"limits: {asdict(limits)}")
    print(
        f"placement: {asdict(place)}, victim: {args.victim_concurrency} users every "
        f"{args.victim_interval_ms:g} ms, {args.seconds:g} s per round"
    )
    print_table(alone, alone_rounds, rows)
    if log_tail:
        print(f"gateway log (last {len(log_tail)} lines):")
        for line in log_tail:
            print("  " + line[:200])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(
            orjson.dumps(
                {
                    "limits": asdict(limits),
                    "placement": asdict(place),
                    "seconds": args.seconds,
                    "victim_users": args.victim_concurrency,
                    "victim_interval_ms": args.victim_interval_ms,
                    "target_ratio": TARGET_RATIO,
                    "alone": {
                        "requests": alone.completed,
                        "errors": alone.errors,
                        "ttft_p50_ms": alone.pct(50),
                        "ttft_p99_ms": alone.pct(99),
                        "round_p99_ms": [r.result.pct(99) for r in alone_rounds],
                        "round_quiet": [r.quiet for r in alone_rounds],
                    },
                    "phases": rows,
                    "gateway_log_tail": log_tail,
                },
                option=orjson.OPT_INDENT_2,
            )
        )
    return all(r["pass"] for r in rows)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # also inside asyncio.run, whose own SIGINT handler can be swallowed


def main() -> int:
    args = parse_args()
    if args.upstream_port:
        return upstream_main(args.upstream_port)
    try:
        if args.attacker:
            return attacker_main(args)
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        limits, place = Limits.from_settings(), Placement.for_machine()
        pin_self()
        alone_rounds, attacks, log_tail = run(args, limits, place)
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        return 130
    return 0 if report(args, limits, place, alone_rounds, attacks, log_tail) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Replica routing over HTTP: firsttoken's balance modes, and sglang-router's `cache_aware`, in
front of the same prefix-caching engines under the same seeded workload.

    python bench/fleet_http.py [--quick] [--seconds 90] [--replicas 4] [--rate 3.0] [--seed 7]
                               [--only NAMES] [--cpu-breakdown] [--hand-over-ab N] [--compiled]
                               [--answer-tokens 16]

Engines: `bench/fleet_engine.py`, one process each (16-token block chains, an LRU smaller than
the working set, `--slots` at once and a queue, TTFT = 20 ms + 0.25 ms per uncached token,
vLLM's `/metrics`). Workload (seeded, open loop): `--tenants` tenants with long system prompts
(`--system-words`, scaled down from the issue's 2,000-6,000 words to fit a shared 2-core
machine), conversations arriving as a Poisson process of `--rate` per second, 3-8 turns each
with a think time after every answer; at 60% of the run engine e0 turns 300 ms slower (held
slot included). The variants run one after another on the same engines, reset in between:
round robin, least loaded and prefix affinity (the gateway, one real process, with
`load_metrics: vllm`), a bare Python relay (`bench/minimal_passthrough.py` with the gateway's
HTTP client, taking the engines in turn: no parsing, policies, telemetry or choice, the floor
for the CPU figure of any Python router on this machine), nginx relaying the same way if it is
installed (`bench/native_relay.py`: the floor for a router that is not Python), then
sglang-router `cache_aware` if `sglang_router` is installed (each skipped with a message
otherwise).

Figures: cached share of prompt tokens (the engines' own counts, over the run), and the share
the same turns would have had on caches that never evict, on the engines the router chose and
with every tenant on one engine (the workload's ceiling: between the three, what the router's
placement costs and what evictions cost), and the first two again before and after the slowdown
(what shedding the slow replica costs the cache shows in the second phase); TTFT p99 after
warm-up (35% of the run) and before the slowdown, and each router's TTFT minus sglang-router's
on the same turns there (their median: what the router adds under load); added TTFT at low load
(median of sequential short requests through the router minus straight to an engine);
TTFT p99 after the slowdown, and the mean first turn of the conversations that began after it
(each p99 with the 90% interval its sample allows, whatever the distribution: a p99 over a few
hundred turns rests on the few slowest, and a comparison with sglang-router's whose intervals
overlap says so);
added TTFT on a cold long prompt (`--cold-prompts` never-seen system prompts of the tenants'
lengths, one at a time: the median of each prompt's TTFT through the router minus the same
prompt's straight to an engine; the p99 after warm-up is such first turns, so this is what
decides it between routers); e0's share of
conversations that began in the 20 s after it; follow-up turns after the slowdown served by another
replica than their previous turn; router CPU per 1,000 requests (user and system time of its
process tree over the workload, idle time included), that figure over the bare relay's in the
same invocation (the machine moves both), and while idle (read for 3 s before the workload, 1 s
with `--quick`). After the prefix affinity run, one tenant sends 12 requests that
fail (400s, 500s its own bodies cause) and `/readyz` must still show every replica healthy. With
`--cpu-breakdown`, prefix affinity runs three more times after the others, with settings that
switch parts of the gateway off (`FIRSTTOKEN_POLICIES=none`; `FIRSTTOKEN_TELEMETRY=false`, which
also stops the prefix-break diagnostics and the shadow cache advisor; both): what is left with both
off is the request path itself (admission, the choice of a replica, the relay), to set beside the
bare relay's figure. `--answer-tokens 1` answers every turn with one content chunk instead of 16
chunks 40 ms apart: the CPU per request without the events, so that a run with each splits every
router's figure into a part per request and a part per event. With `--hand-over-ab N`, only prefix
affinity runs, N times with prefix hand-over (the default with `load_metrics`) and N times without,
in turn: what handing a slow replica's prefixes over does to the first turns after the slowdown and
to the cached share, in one invocation. With `--compiled`, prefix affinity also runs, last, from a
copy of this checkout with `policies` compiled by mypyc (`setup.py` with `FIRSTTOKEN_MYPYC=1`; needs
a C compiler): the same routing from the compiled build, and its CPU beside the interpreted one's
(one run each, so a noisy machine moves the pair; `bench/turns_cpu.py --compiled --pairs N` compares
in pairs). Writes bench/results/fleet_http.json, with what explains the figures: the cached share
before and after the slowdown per engine (and the part lost to system prompts recomputed), how many
engines each tenant's conversations began on, the follow-ups that moved (when, from, to), the
slowest turns after the slowdown, the gateway's prefix hand-overs and the requests it held until
another's first token computed their prefix (`prefix_waits`), with `--watch-costs` the
gateway's cost terms each second after it, and with `--turns` every turn of the workload (when it
began, its TTFT, the engine that answered, its tenant)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.fleet_engine import BLOCK_TOKENS, answer_chunks, block_chain, held_prefix, prompt_text
from bench.harness import (
    ROOT,
    compiled_copy,
    drain_log,
    free_port,
    start_gateway,
    start_minimal_passthrough,
    stop,
    stop_tree,
    tree_cpu_s,
    wait_http,
)
from bench.native_relay import nginx_path, start_nginx
from gateway.upstreams.replicas.prefix_index import BLOCK_CHARS, ENTRY_BYTES

SLOW_EXTRA_MS = 300.0
NEW_SESSION_WINDOW_S = 20.0
COMPILED = "PA compiled"  # prefix affinity from a copy with `policies` compiled (--compiled)
NATIVE = "nginx relay"  # bench/native_relay.py, where nginx is installed
IDLE_S = 3.0  # the router's CPU is read this long while idle, before the workload
# Issue 21's acceptance on this bench (prefix affinity, beside sglang-router where it ran).
TARGET_CACHED_SHARE = 0.90
TARGET_SLOW_SHARE = 0.10
TARGET_WARM_MOVED = 2
TARGET_CPU_S_PER_1000 = 2.5
WORDS = [f"w{i}" for i in range(5000)]
INTERVAL_LEVEL = 0.9  # of the p99s' intervals
ANSWER_TOKENS = 16  # each turn's max_tokens: the engines answer that many content chunks


@dataclass
class Turn:
    session: int
    index: int
    started: float  # seconds since the run began
    ttft_ms: float | None
    engine: str | None
    tenant: int = -1


@dataclass
class Workload:
    systems: list[str]
    sessions: list[tuple[float, int, list[str]]]  # (arrival s, tenant, user turns)
    think_s: list[list[float]]
    answer_tokens: int = ANSWER_TOKENS  # each turn's max_tokens, the content chunks of its answer


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    lo, hi = args.system_words
    systems = [
        f"tenant{t} " + " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))
        for t in range(args.tenants)
    ]
    sessions, thinks, t = [], [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.seconds:
            break
        turns = [
            f"s{len(sessions)} q{i} " + " ".join(rng.choices(WORDS, k=rng.randint(20, 60)))
            for i in range(rng.randint(3, 8))
        ]
        sessions.append((t, rng.randrange(args.tenants), turns))
        thinks.append([rng.expovariate(1.0 / args.think_s) for _ in turns])
    return Workload(systems, sessions, thinks, args.answer_tokens)


async def stream_chat(
    http: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int = ANSWER_TOKENS
) -> tuple[float | None, str | None, str]:
    """(TTFT ms, the engine that answered, the answer) of one streamed chat request."""
    sent = time.perf_counter()
    ttft, engine, parts = None, None, []
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": max_tokens}
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return None, None, ""
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = 1000 * (time.perf_counter() - sent)
                        engine = content.split()[0]
                    parts.append(content)
    return ttft, engine, "".join(parts)


async def run_workload(
    url: str, workload: Workload, engines: list[str], args, costs: list | None = None
) -> tuple[list[Turn], list[dict]]:
    """Every turn of the workload through `url`, and the engines' `/stats` when e0 slowed; with
    `costs`, the gateway's cost terms are appended to it each second after the slowdown."""
    turns: list[Turn] = []
    at_slowdown: list[dict] = []
    costs_url = None if costs is None else url.rsplit("/v1/", 1)[0] + "/v1/metrics/ttft"
    costs = [] if costs is None else costs
    began = time.perf_counter()
    deadline = began + args.seconds  # no turn starts later (nor is one measured)
    slowed = asyncio.Event()

    async def slow_down() -> None:
        await asyncio.sleep(args.seconds * 0.6)
        at_slowdown.extend(get_json(e + "/stats") for e in engines)
        control(engines[0], {"extra_ms": SLOW_EXTRA_MS})
        slowed.set()

    async def session(i: int, arrival: float, tenant: int, users: list[str]) -> None:
        await asyncio.sleep(max(0.0, began + arrival - time.perf_counter()))
        messages = [{"role": "system", "content": workload.systems[tenant]}]
        for k, user in enumerate(users):
            if time.perf_counter() > deadline:
                return
            messages.append({"role": "user", "content": user})
            started = time.perf_counter() - began
            try:
                ttft, engine, answer = await stream_chat(
                    http, url, messages, workload.answer_tokens
                )
            except (aiohttp.ClientError, TimeoutError):
                ttft, engine, answer = None, None, ""
            turns.append(Turn(i, k, started, ttft, engine, tenant))
            messages.append({"role": "assistant", "content": answer or "ok"})
            # past the deadline the next turn would not start: no need to wait for it
            think = min(workload.think_s[i][k], deadline - time.perf_counter())
            await asyncio.sleep(max(0.0, think))

    async def watch_costs() -> None:  # the gateway's cost terms each second after the slowdown
        await slowed.wait()
        while time.perf_counter() < deadline:
            try:
                async with http.get(costs_url) as resp:
                    fleet = (await resp.json())["replicas"]["fleet"]
                costs.append(
                    (round(time.perf_counter() - began, 1), fleet["cost"], fleet["replicas"])
                )
            except (aiohttp.ClientError, KeyError, TimeoutError):
                pass
            await asyncio.sleep(1.0)

    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        slower = asyncio.ensure_future(slow_down())
        watcher = asyncio.ensure_future(watch_costs()) if costs_url else None
        await asyncio.gather(
            *(session(i, *s) for i, s in enumerate(workload.sessions)), return_exceptions=True
        )
        slower.cancel()
        if watcher is not None:
            watcher.cancel()
    return turns, at_slowdown


async def low_load_ttft(url: str, n: int) -> float:
    """Median TTFT of `n` sequential short requests (no prefix to speak of)."""
    values = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for i in range(n):
            messages = [{"role": "user", "content": f"ping {i % 4} " + "w1 " * 8}]
            ttft, _, _ = await stream_chat(http, url, messages)
            if ttft is not None:
                values.append(ttft)
    values.sort()
    return values[len(values) // 2] if values else float("nan")


def cold_texts(args: argparse.Namespace) -> list[str]:
    """`--cold-prompts` system prompts of the tenants' lengths, none of them a tenant's."""
    rng = random.Random(args.seed + 1)
    lo, hi = args.system_words
    return [" ".join(rng.choices(WORDS, k=rng.randint(lo, hi))) for _ in range(args.cold_prompts)]


async def cold_prompt_ttfts(url: str, texts: list[str], tag: str) -> list[float | None]:
    """TTFT of each of `texts` as a never-seen system prompt, one request at a time; `tag`
    starts each prompt, so that a text another target computed is not cached for this one."""
    out: list[float | None] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for i, text in enumerate(texts):
            messages = [
                {"role": "system", "content": f"{tag}{i:03d} {text}"},
                {"role": "user", "content": "w1 " * 8},
            ]
            ttft, _, _ = await stream_chat(http, url, messages)
            out.append(ttft)
    return out


def added_on_cold_prompts(direct: list[float | None], routed: list[float | None]) -> float:
    """Median of what the router added to each cold prompt's TTFT over the same prompt's TTFT
    straight to an engine (the engine's own time is the same for both: the same length, all
    of it uncached)."""
    added = sorted(r - d for d, r in zip(direct, routed, strict=True) if d is not None and r)
    return added[len(added) // 2] if added else float("nan")


def control(engine: str, body: dict) -> None:
    req = urllib.request.Request(
        engine + "/control", data=orjson.dumps(body), headers={"content-type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=5).read()


def get_json(url: str) -> dict:
    return orjson.loads(urllib.request.urlopen(url, timeout=5).read())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def quantile_interval(
    values: list[float], q: float, level: float = INTERVAL_LEVEL
) -> tuple[float, float]:
    """The order statistics that bracket the true `q`-quantile of what `values` were drawn
    from with probability at least `level`, whatever its distribution: how many samples fall
    below the quantile is binomial (n, q). A p99 over a few hundred turns rests on its few
    slowest, and two routers' p99s compare only where these intervals do not overlap; the
    upper end is infinite where there are too few samples to bound it."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2
    log_q, log_p, log_n_factorial = math.log(q), math.log1p(-q), math.lgamma(n + 1)
    below = 0.0  # P(fewer than k samples below the quantile)
    lower, upper = -math.inf, math.inf
    for k in range(n + 1):
        if below <= tail and k >= 1:
            lower = xs[k - 1]  # x_(k) is below the quantile unless fewer than k samples are
        log_choose = log_n_factorial - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        below += math.exp(log_choose + k * log_q + (n - k) * log_p)
        if below >= 1.0 - tail:
            upper = xs[k] if k < n else math.inf  # x_(k+1) is above it unless more than k are
            break
    return lower, upper


@dataclass
class Variant:
    name: str
    kind: str  # "gateway", "floor" (bench/minimal_passthrough.py), "native" (nginx) or "sglang"
    balance: str = ""
    env: dict[str, str] = field(default_factory=dict)  # gateway settings beside the route
    result: dict = field(default_factory=dict)
    route: dict = field(default_factory=dict)  # route fields over the bench's own
    root: str | None = None  # the checkout the gateway runs from (a compiled copy), else this


def start_engines(args) -> tuple[list[subprocess.Popen], list[str]]:
    """`--replicas` fleet engines, each answering; if one never does, every one is stopped."""
    procs, bases = [], []
    for i in range(args.replicas):
        port = free_port()
        argv = [sys.executable, "-m", "bench.fleet_engine", "--port", str(port), "--name", f"e{i}"]
        argv += ["--slots", str(args.slots), "--cache-blocks", str(args.cache_blocks)]
        argv += ["--chunks", str(max(ANSWER_TOKENS, args.answer_tokens))]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(proc)
        bases.append(f"http://127.0.0.1:{port}")
    try:
        for proc, base in zip(procs, bases, strict=True):
            wait_http(base + "/v1/models", proc=proc)
    except BaseException:
        for proc in procs:
            stop(proc)
        raise
    return procs, bases


def start_router(variant: Variant, engines: list[str], args) -> tuple[subprocess.Popen, str]:
    if variant.kind == "gateway":
        route = {
            "name": "fleet",
            "models": ["*"],
            "kind": "openai",
            "replicas": [{"name": f"e{i}", "base_url": b + "/v1"} for i, b in enumerate(engines)],
            "balance": variant.balance,
            "load_metrics": "vllm",
            "load_interval_s": 0.5,
            # sized near what an engine holds, as the README advises: 16-token blocks of
            # ~6-character words, in 256-character index blocks of ENTRY_BYTES each
            "affinity_index_bytes": max(
                64 * 1024, args.cache_blocks * 16 * 6 // BLOCK_CHARS * ENTRY_BYTES
            ),
            **variant.route,
        }
        env = {"FIRSTTOKEN_ROUTES": orjson.dumps([route]).decode(), **variant.env}
        proc, base, _ = start_gateway(engines[0] + "/v1", env, root=variant.root)
        drain_log(proc, collections.deque(maxlen=50))  # a chatty log must never block it
        return proc, base + "/chat/completions"
    if variant.kind == "floor":
        upstreams = ",".join(e + "/v1" for e in engines)
        proc, base = start_minimal_passthrough(upstreams, "http1")
        return proc, base + "/chat/completions"
    if variant.kind == "native":
        return start_nginx(engines, args.scratch)
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--policy", "cache_aware", "--worker-urls", *engines]
    argv += ["--log-level", "error"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60, proc=proc)
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


def tenant_failures(gateway_chat_url: str) -> dict:
    """One tenant's 12 failing requests (400s, and 500s only its bodies cause); then every
    replica must still be healthy in /readyz."""
    statuses = []
    for i in range(12):
        messages = [] if i % 2 else [{"role": "user", "content": f"POISON {i}"}]
        body = orjson.dumps({"model": "m", "messages": messages, "stream": True})
        req = urllib.request.Request(
            gateway_chat_url, data=body, headers={"content-type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=10).read()
            statuses.append(200)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
    origin = gateway_chat_url.rsplit("/v1/", 1)[0]
    try:
        ready = get_json(origin + "/readyz")
    except urllib.error.HTTPError as exc:
        ready = orjson.loads(exc.read())
    states = ready.get("replicas", {}).get("fleet", {})
    return {
        "statuses": sorted(set(statuses)),
        "replica_states": states,
        "all_healthy": bool(states) and all(s == "healthy" for s in states.values()),
    }


def measure(variant: Variant, workload: Workload, engines: list[str], args) -> dict:
    """One variant's run on `engines`, reset first (empty caches, no slowdown)."""
    for e in engines:
        control(e, {"reset": True, "extra_ms": 0.0})
    router = None
    try:
        router, url = start_router(variant, engines, args)
        direct = asyncio.run(low_load_ttft(engines[1] + "/v1/chat/completions", args.probes))
        routed = asyncio.run(low_load_ttft(url, args.probes))
        cold = cold_texts(args)
        cold_direct = asyncio.run(cold_prompt_ttfts(engines[1] + "/v1/chat/completions", cold, "d"))
        cold_routed = asyncio.run(cold_prompt_ttfts(url, cold, "r"))
        for e in engines:
            control(e, {"reset": True})
        idle_s = 1.0 if args.quick else IDLE_S
        idle_before = tree_cpu_s(router.pid)
        time.sleep(idle_s)
        idle = (tree_cpu_s(router.pid) - idle_before) / idle_s
        cpu_before = tree_cpu_s(router.pid)
        costs: list | None = [] if variant.kind == "gateway" and args.watch_costs else None
        turns, at_slowdown = asyncio.run(run_workload(url, workload, engines, args, costs))
        cpu = tree_cpu_s(router.pid) - cpu_before
        stats = [get_json(e + "/stats") for e in engines]
        fleet_view = fleet_view_of(url) if variant.kind == "gateway" else {}
        failures = (
            tenant_failures(url)
            if variant.balance == "prefix_affinity" and not variant.env
            else None
        )
    finally:
        if router is not None:
            stop_tree(router)
    result = summarize(turns, stats, direct, routed, cpu, failures, args)
    result["added_ttft_cold_prompt_ms"] = added_on_cold_prompts(cold_direct, cold_routed)
    result["router_cpu_idle_ms_per_s"] = 1000 * idle
    result["cached_share_by_phase"] = cached_by_phase(stats, at_slowdown)
    ceilings = cache_ceilings(turns, workload, slow_at=0.6 * args.seconds)
    result["cached_share_unbounded_placement"] = ceilings.pop("placement")
    result["cached_share_ceiling"] = ceilings.pop("one_engine_per_tenant")
    result["cached_share_unbounded_placement_by_phase"] = ceilings
    # the same by phase, for the table: what shedding the slow replica's tenants costs shows
    # after the slowdown, in what the placement allows as much as in what the caches kept
    phases = result["cached_share_by_phase"].get("all", {})
    result["cached_share_before_slowdown"] = phases.get("before")
    result["cached_share_unbounded_placement_before_slowdown"] = ceilings.get("placement_before")
    result["cached_share_after_slowdown"] = phases.get("after")
    result["cached_share_unbounded_placement_after_slowdown"] = ceilings.get("placement_after")
    result["engines_per_tenant"] = engines_per_tenant(turns, args)
    result["costs_after_slowdown"] = costs
    result["hand_overs"] = fleet_view.get("hand_overs")
    result["prefix_waits"] = fleet_view.get("prefix_waits")
    if args.turns:
        result["turns"] = [asdict(turn) for turn in turns]
    return result


def fleet_view_of(chat_url: str) -> dict:
    """The gateway's own view of the fleet: among others, the prefixes it handed over from the
    slow replica (`hand_overs`: `sent`, `failed`) and the requests that waited for a prefix
    another request was computing on their replica (`prefix_waits`)."""
    view = get_json(chat_url.rsplit("/v1/", 1)[0] + "/v1/metrics/ttft")
    return view["replicas"]["fleet"]


def engines_per_tenant(turns: list[Turn], args) -> dict:
    """How many engines served each tenant's first turns, on average, before e0 slowed and
    after (1.0: every tenant's system prompt computed on one engine only)."""
    slow = 0.6 * args.seconds
    out = {}
    for phase, keep in (("before", lambda t: t < slow), ("after", lambda t: t >= slow)):
        seen: dict[int, set[str]] = {}
        for t in turns:
            if t.index == 0 and t.engine and keep(t.started):
                seen.setdefault(t.tenant, set()).add(t.engine)
        out[phase] = round(sum(map(len, seen.values())) / len(seen), 2) if seen else None
    return out


def cache_ceilings(
    turns: list[Turn], workload: Workload, slow_at: float = float("inf")
) -> dict[str, float | None]:
    """The cached share this run's turns would have had if no engine ever evicted a block:
    `placement`, on the engines the router sent each turn to (what its placement alone allows:
    the rest of the gap to the measured share is evictions, with the few turns that came while
    their prefix was still being computed), also before and after `slow_at` (s);
    `one_engine_per_tenant`, with every conversation of a tenant on one engine (the workload's
    own ceiling, a prompt's first sight the only miss: the same for every router, but for which
    turns started before the deadline). Each turn replayed as the engine read it
    (`fleet_engine.prompt_text`, earlier answers as the engine that gave them wrote them), in
    the order the turns started; a failed turn is left out, and so are requests that are not
    the workload's turns (prefix hand-overs)."""
    answers = {(t.session, t.index): t.engine for t in turns}
    ordered = sorted((t for t in turns if t.engine), key=lambda t: t.started)
    held: dict[str, set[int]] = collections.defaultdict(set)
    seen: set[int] = set()
    # per phase: [prompt tokens, cached with this placement, cached with a tenant per engine]
    sums = {"before": [0, 0, 0], "after": [0, 0, 0]}
    for t in ordered:
        _, tenant, users = workload.sessions[t.session]
        messages = [{"role": "system", "content": workload.systems[tenant]}]
        for k in range(t.index):
            engine = answers.get((t.session, k))
            answer = "".join(answer_chunks(engine, workload.answer_tokens)) if engine else "ok"
            messages += [
                {"role": "user", "content": users[k]},
                {"role": "assistant", "content": answer},
            ]
        messages.append({"role": "user", "content": users[t.index]})
        words = prompt_text(messages).split()
        blocks = block_chain(words)
        phase = sums["before" if t.started < slow_at else "after"]
        phase[0] += len(words)
        phase[1] += held_prefix(blocks, held[t.engine]) * BLOCK_TOKENS
        phase[2] += held_prefix(blocks, seen) * BLOCK_TOKENS
        held[t.engine].update(blocks)
        seen.update(blocks)
    prompt, placed, ceiling = (a + b for a, b in zip(sums["before"], sums["after"], strict=True))
    return {
        "placement": placed / prompt if prompt else None,
        "one_engine_per_tenant": ceiling / prompt if prompt else None,
        **{
            f"placement_{name}": cached / tokens if tokens else None
            for name, (tokens, cached, _) in sums.items()
        },
    }


def cached_by_phase(stats: list[dict], at_slowdown: list[dict]) -> dict:
    """Cached share of prompt tokens before e0 slowed and after, overall and per engine."""

    def share(cached: float, prompt: float) -> float | None:
        return round(cached / prompt, 4) if prompt else None

    out: dict = {}
    if len(at_slowdown) != len(stats):
        return out
    for i, (end, mid) in enumerate(zip(stats, at_slowdown, strict=True)):
        after_prompt = end["prompt_tokens"] - mid["prompt_tokens"]
        system = end.get("uncached_system_tokens", 0) - mid.get("uncached_system_tokens", 0)
        out[f"e{i}"] = {
            "before": share(mid["cached_tokens"], mid["prompt_tokens"]),
            "after": share(end["cached_tokens"] - mid["cached_tokens"], after_prompt),
            # the share of prompt tokens after the slowdown lost to system prompts recomputed
            "after_system_misses": share(system, after_prompt),
            "prompt_tokens": end["prompt_tokens"],
        }
    mid_c, mid_p = (sum(s[k] for s in at_slowdown) for k in ("cached_tokens", "prompt_tokens"))
    end_c, end_p = (sum(s[k] for s in stats) for k in ("cached_tokens", "prompt_tokens"))
    out["all"] = {"before": share(mid_c, mid_p), "after": share(end_c - mid_c, end_p - mid_p)}
    return out


def summarize(turns, stats, direct, routed, cpu, failures, args) -> dict:
    warm, slow = 0.35 * args.seconds, 0.6 * args.seconds
    ok = [t for t in turns if t.ttft_ms is not None]
    steady = [t.ttft_ms for t in ok if warm <= t.started < slow]
    after = [t.ttft_ms for t in ok if slow <= t.started < args.seconds]
    window = min(NEW_SESSION_WINDOW_S, args.seconds - slow)
    new = [t for t in ok if t.index == 0 and slow <= t.started < slow + window]
    previous: dict[int, str | None] = {}
    moved = 0
    moves = []  # (started s, turn, from, to, ttft ms)
    slowest = []
    for t in sorted(turns, key=lambda t: (t.session, t.index)):
        before = previous.get(t.session)
        if t.index > 0 and t.started >= slow and t.engine and before and t.engine != before:
            moved += 1
            moves.append((round(t.started, 1), t.index, before, t.engine, round(t.ttft_ms or 0)))
        if t.started >= slow and t.ttft_ms is not None:
            slowest.append((round(t.ttft_ms), t.engine, before, t.index, round(t.started, 1)))
        previous[t.session] = t.engine
    prompt = sum(s["prompt_tokens"] for s in stats)
    cached = sum(s["cached_tokens"] for s in stats)
    return {
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "cached_share": cached / prompt if prompt else 0.0,
        "ttft_p99_warm_ms": percentile(steady, 0.99),
        "ttft_p99_warm_interval_ms": quantile_interval(steady, 0.99),
        "ttft_p50_warm_ms": percentile(steady, 0.5),
        "added_ttft_low_load_ms": routed - direct,
        "ttft_p99_after_slowdown_ms": percentile(after, 0.99),
        "ttft_p99_after_slowdown_interval_ms": quantile_interval(after, 0.99),
        # new conversations after the slowdown: where a moved tenant recomputes its prefix
        "ttft_mean_first_turns_after_slowdown_ms": _mean(
            [t.ttft_ms for t in ok if t.index == 0 and slow <= t.started < args.seconds]
        ),
        "slow_share_of_new_sessions": (
            sum(1 for t in new if t.engine == "e0") / len(new) if new else float("nan")
        ),
        "new_sessions_in_window": len(new),
        "warm_follow_ups_moved": moved,
        "router_cpu_s_per_1000": 1000 * cpu / max(1, len(turns)),
        "served": {s_name: sum(1 for t in ok if t.engine == s_name) for s_name in _names(args)},
        "tenant_failures": failures,
        "moves_after_slowdown": moves[:40],
        # (conversation, turn, TTFT ms) of the turns the p99 after warm-up is taken over
        "warm_turns": [
            (t.session, t.index, round(t.ttft_ms, 2)) for t in ok if warm <= t.started < slow
        ],
        "slowest_after_slowdown": sorted(slowest, key=lambda x: -x[0])[
            :12
        ],  # ttft, on, was on, turn
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _names(args) -> list[str]:
    return [f"e{i}" for i in range(args.replicas)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about 2 minutes)")
    parser.add_argument("--seconds", type=float, default=None, help="workload length per variant")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=None, help="per engine, 16 tokens each")
    parser.add_argument("--tenants", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="new conversations per second")
    parser.add_argument("--think-s", type=float, default=1.5)
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=ANSWER_TOKENS,
        help="content chunks per answer, 40 ms apart (1: CPU per request without the events)",
    )
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument(
        "--cold-prompts", type=int, default=12, help="never-seen long prompts, one at a time"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", default="", help="comma-separated variant names to run")
    parser.add_argument(
        "--cpu-breakdown",
        action="store_true",
        help="also run prefix affinity with policies, telemetry, or both switched off",
    )
    parser.add_argument(
        "--compiled",
        dest="compiled_build",
        action="store_true",
        help="also run prefix affinity from a copy of this checkout with `policies` compiled by "
        "mypyc (setup.py, FIRSTTOKEN_MYPYC=1; needs a C compiler)",
    )
    parser.add_argument(
        "--hand-over-ab",
        type=int,
        default=0,
        metavar="N",
        help="instead of the usual variants, prefix affinity with and without prefix hand-over, "
        "N pairs in turn",
    )
    parser.add_argument(
        "--watch-costs",
        action="store_true",
        help="read the gateway's cost terms each second after the slowdown into the JSON "
        "(its CPU figure then includes those reads)",
    )
    parser.add_argument(
        "--turns",
        action="store_true",
        help="write every turn (conversation, turn, start s, TTFT ms, engine, tenant) into the "
        "JSON: where a tail came from, turn by turn",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fleet_http.json"))
    args = parser.parse_args(argv)
    if args.answer_tokens < 1:
        parser.error("--answer-tokens must be at least 1")
    args.compiled = None  # the compiled copy's path, once built (--compiled)
    quick = {"seconds": 22.0, "tenants": 12, "rate": 2.5, "cache_blocks": 600}
    full = {"seconds": 55.0, "tenants": 40, "rate": 4.0, "cache_blocks": 2000}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.system_words = (300, 900) if args.quick else (1000, 3000)
    if args.quick:
        args.probes = min(args.probes, 8)
        args.cold_prompts = min(args.cold_prompts, 6)
    return args


def variants(args) -> list[Variant]:
    out = [
        Variant("round robin", "gateway", "round_robin"),
        Variant("least loaded", "gateway", "least_loaded"),
        Variant("prefix affinity", "gateway", "prefix_affinity"),
        Variant("bare Python relay", "floor"),
    ]
    if nginx_path() is None:
        print("nginx is not installed (apt-get install nginx-light): the native relay skipped")
    else:
        out.append(Variant(NATIVE, "native"))
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        print("sglang-router is not installed (pip install sglang-router): cache_aware skipped")
    else:
        out.append(Variant("sglang cache_aware", "sglang"))
    if args.compiled:
        out.append(Variant(COMPILED, "gateway", "prefix_affinity", root=args.compiled))
    if args.cpu_breakdown:
        out += [Variant(name, "gateway", "prefix_affinity", env) for name, env in BREAKDOWN.items()]
    if args.hand_over_ab:
        off = {"prefix_hand_over": False}
        out = []
        for i in range(1, args.hand_over_ab + 1):
            out.append(Variant(f"PA hand-over {i}", "gateway", "prefix_affinity"))
            out.append(Variant(f"PA no hand-over {i}", "gateway", "prefix_affinity", route=off))
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        out = [v for v in out if v.name in wanted or v.balance in wanted or v.kind in wanted]
    return out


# Prefix affinity with parts of the gateway switched off by its own settings (--cpu-breakdown).
# Telemetry off also stops the prefix-break diagnostics and the shadow cache advisor, which
# read and write its store.
BREAKDOWN = {
    "PA no policies": {"FIRSTTOKEN_POLICIES": "none"},
    "PA no telemetry": {"FIRSTTOKEN_TELEMETRY": "false"},
    "PA neither": {"FIRSTTOKEN_POLICIES": "none", "FIRSTTOKEN_TELEMETRY": "false"},
}


INTERVAL = "{0[0]:,.0f}-{0[1]:,.0f}"  # a (low, high) pair
ROWS = (
    ("cached share of prompt tokens", "cached_share", "{:.1%}"),
    ("  if no cache evicted, this placement", "cached_share_unbounded_placement", "{:.1%}"),
    ("  if no cache evicted, a tenant per engine", "cached_share_ceiling", "{:.1%}"),
    ("  before the slowdown", "cached_share_before_slowdown", "{:.1%}"),
    (
        "    if no cache evicted, this placement",
        "cached_share_unbounded_placement_before_slowdown",
        "{:.1%}",
    ),
    ("  after the slowdown", "cached_share_after_slowdown", "{:.1%}"),
    (
        "    if no cache evicted, this placement",
        "cached_share_unbounded_placement_after_slowdown",
        "{:.1%}",
    ),
    ("TTFT p99 after warm-up, ms", "ttft_p99_warm_ms", "{:,.0f}"),
    (f"  {INTERVAL_LEVEL:.0%} interval, ms", "ttft_p99_warm_interval_ms", INTERVAL),
    ("  vs sglang-router, same turns, median ms", "warm_ttft_minus_sglang_ms", "{:+.2f}"),
    ("added TTFT at low load, ms", "added_ttft_low_load_ms", "{:+.1f}"),
    ("added TTFT on a cold long prompt, ms", "added_ttft_cold_prompt_ms", "{:+.2f}"),
    ("TTFT p99 after e0 turns 300 ms slower, ms", "ttft_p99_after_slowdown_ms", "{:,.0f}"),
    (f"  {INTERVAL_LEVEL:.0%} interval, ms", "ttft_p99_after_slowdown_interval_ms", INTERVAL),
    (
        "  mean of new conversations' first turns, ms",
        "ttft_mean_first_turns_after_slowdown_ms",
        "{:,.0f}",
    ),
    ("e0's share of new sessions, 20 s after", "slow_share_of_new_sessions", "{:.1%}"),
    ("warm follow-ups moved off their replica", "warm_follow_ups_moved", "{}"),
    ("router CPU per 1,000 requests, s", "router_cpu_s_per_1000", "{:.2f}"),
    ("  times the bare relay's", "router_cpu_vs_bare_relay", "{:.2f}x"),
    ("router CPU while idle, ms per s", "router_cpu_idle_ms_per_s", "{:.1f}"),
    ("requests (errors)", "requests", "{}"),
)


def targets(done: list[Variant]) -> list[tuple[str, bool | None, str]]:
    """Issue 21's acceptance on this run: (target, met, the figures); met is None where the
    comparison did not run (no prefix affinity variant, or sglang-router not installed)."""
    ours = next(
        (v.result for v in done if v.balance == "prefix_affinity" and not v.env and v.root is None),
        None,
    )
    theirs = next((v.result for v in done if v.kind == "sglang"), None)
    if ours is None:
        return []
    out: list[tuple[str, bool | None, str]] = []

    def against(
        name: str, key: str, fmt: str, higher_is_better: bool, interval: str | None = None
    ) -> None:
        mine = ours[key]
        if theirs is None:
            out.append((f"{name} vs sglang-router", None, fmt.format(mine) + ", no sglang run"))
            return
        other = theirs[key]
        met = mine >= other if higher_is_better else mine <= other
        figures = f"{fmt.format(mine)} vs {fmt.format(other)}"
        if interval is not None and overlap(ours.get(interval), theirs.get(interval)):
            figures += f" ({INTERVAL_LEVEL:.0%} intervals overlap: a tie within this run's noise)"
        out.append((f"{name} vs sglang-router", met, figures))

    share = ours["cached_share"]
    out.append(
        (f"cached share >= {TARGET_CACHED_SHARE:.0%}", share >= TARGET_CACHED_SHARE, f"{share:.1%}")
    )
    against("cached share", "cached_share", "{:.1%}", higher_is_better=True)
    against(
        "TTFT p99 after warm-up",
        "ttft_p99_warm_ms",
        "{:,.0f} ms",
        higher_is_better=False,
        interval="ttft_p99_warm_interval_ms",
    )
    against(
        "TTFT p99 after the slowdown",
        "ttft_p99_after_slowdown_ms",
        "{:,.0f} ms",
        higher_is_better=False,
        interval="ttft_p99_after_slowdown_interval_ms",
    )
    slow = ours["slow_share_of_new_sessions"]
    out.append(
        (
            f"e0's share of new sessions <= {TARGET_SLOW_SHARE:.0%}",
            slow <= TARGET_SLOW_SHARE,
            f"{slow:.1%}",
        )
    )
    moved = ours["warm_follow_ups_moved"]
    out.append(
        (f"warm follow-ups moved <= {TARGET_WARM_MOVED}", moved <= TARGET_WARM_MOVED, str(moved))
    )
    failures = ours.get("tenant_failures")
    if failures is not None:
        states = ", ".join(f"{k} {v}" for k, v in sorted(failures["replica_states"].items()))
        out.append(
            ("one tenant's failures leave every replica healthy", failures["all_healthy"], states)
        )
    cpu = ours["router_cpu_s_per_1000"]
    ratio = ours.get("router_cpu_vs_bare_relay")
    out.append(
        (
            f"router CPU <= {TARGET_CPU_S_PER_1000:g} ms per request",
            cpu <= TARGET_CPU_S_PER_1000,
            f"{cpu:.2f} ms" + ("" if ratio is None else f" ({ratio:.2f}x the bare relay's)"),
        )
    )
    compiled = next((v.result for v in done if v.name == COMPILED), None)
    if compiled is not None:
        cpu = compiled["router_cpu_s_per_1000"]
        out.append(
            (
                f"router CPU <= {TARGET_CPU_S_PER_1000:g} ms per request, compiled policies",
                cpu <= TARGET_CPU_S_PER_1000,
                f"{cpu:.2f} ms ({cpu / ours['router_cpu_s_per_1000']:.2f}x interpreted)",
            )
        )
    return out


def overlap(a: Sequence[float | None] | None, b: Sequence[float | None] | None) -> bool:
    """Whether two (low, high) intervals share a point; False where either is missing. An
    end read back from JSON as None is unbounded (JSON has no infinity)."""
    if not a or not b:
        return False
    low_a, high_a = _bounds(a)
    low_b, high_b = _bounds(b)
    return low_a <= high_b and low_b <= high_a


def _bounds(pair: Sequence[float | None]) -> tuple[float, float]:
    low, high = pair
    return (-math.inf if low is None else low), (math.inf if high is None else high)


def relative_to_floor(done: list[Variant]) -> None:
    """Each router's CPU per request over the bare relay's in the same invocation. Both move
    with the machine, together: over the full runs of 3-6 December the floor read 1.4-2.9 ms
    per request and prefix affinity 3.2-6.1, their ratio 2.1-2.6 (sglang-router's 1.0-1.4),
    so runs at different times compare by it."""
    floor = next((v.result["router_cpu_s_per_1000"] for v in done if v.kind == "floor"), None)
    for v in done:
        cpu = v.result["router_cpu_s_per_1000"]
        v.result["router_cpu_vs_bare_relay"] = cpu / floor if floor else None


def against_sglang_turns(done: list[Variant]) -> None:
    """Each router's TTFT minus sglang-router's on the same turns after warm-up (the workload is
    seeded: the same conversation's same turn), the median: what the router itself adds under
    load, beside the p99, which a handful of cold first turns decide. None without a sglang run."""
    theirs = next((v.result for v in done if v.kind == "sglang"), None)
    other = {(s, i): ttft for s, i, ttft in theirs["warm_turns"]} if theirs else {}
    for v in done:
        diffs = [ttft - other[s, i] for s, i, ttft in v.result["warm_turns"] if (s, i) in other]
        mine = diffs and v.kind != "sglang"
        v.result["warm_ttft_minus_sglang_ms"] = statistics.median(diffs) if mine else None


def print_table(done: list[Variant]) -> None:
    width = 44
    print(f"{'':<{width}}" + "".join(f"{v.name:>20}" for v in done))
    for label, key, fmt in ROWS:
        cells = []
        for v in done:
            value = v.result.get(key)
            cell = "-" if value is None else fmt.format(value)
            if key == "requests":
                cell += f" ({v.result['errors']})"
            cells.append(f"{cell:>20}")
        print(f"{label:<{width}}" + "".join(cells))


def main() -> int:
    args = parse_args()
    workload = make_workload(args)
    requests = sum(len(s[2]) for s in workload.sessions)
    print(
        f"{args.replicas} engines x {args.slots} slots, "
        f"LRU {args.cache_blocks * 16:,} tokens each; "
        f"{args.tenants} tenants ({args.system_words[0]}-{args.system_words[1]}-word system "
        f"prompts), {len(workload.sessions)} conversations, {requests} requests over "
        f"{args.seconds:g} s; e0 +{SLOW_EXTRA_MS:g} ms from {0.6 * args.seconds:g} s"
    )
    began = time.perf_counter()
    done = []
    built = tempfile.TemporaryDirectory(prefix="fleet-compiled-") if args.compiled_build else None
    if built is not None:
        t0 = time.perf_counter()
        args.compiled = compiled_copy(built.name)
        print(
            f"  compiled policies (setup.py, FIRSTTOKEN_MYPYC=1): {time.perf_counter() - t0:.0f} s"
        )
    scratch = tempfile.TemporaryDirectory(prefix="fleet-scratch-")
    args.scratch = scratch.name  # what a router writes while it runs (nginx's files)
    engine_procs, engines = start_engines(args)
    try:
        for variant in variants(args):
            t0 = time.perf_counter()
            variant.result = measure(variant, workload, engines, args)
            done.append(variant)
            print(f"  {variant.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        for proc in engine_procs:
            stop(proc)
        if built is not None:
            built.cleanup()
        scratch.cleanup()
    relative_to_floor(done)
    against_sglang_turns(done)
    print_table(done)
    affinity = next(
        (v for v in done if v.balance == "prefix_affinity" and not v.env and v.root is None), None
    )
    if affinity is not None and affinity.result["tenant_failures"] is not None:
        f = affinity.result["tenant_failures"]
        print(
            f"one tenant's 12 failing requests (answered {f['statuses']}): replicas "
            f"{f['replica_states']} -> {'all healthy' if f['all_healthy'] else 'NOT all healthy'}"
        )
    met = targets(done)
    for name, ok, figures in met:
        print(f"  {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {name}: {figures}")
    print(f"elapsed {time.perf_counter() - began:.0f} s (measured on a shared machine: noisy)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    report = {
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "compiled", "scratch")},
        "variants": {v.name: v.result for v in done},
        "targets": [{"target": n, "met": ok, "figures": f} for n, ok, f in met],
        "sglang_router": shutil.which("sglang-router") is not None,
    }
    with open(args.out, "wb") as fh:
        fh.write(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return 0


if __name__ == "__main__":
    sys.exit(main())

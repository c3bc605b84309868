"""Where the gateway's CPU goes, per request, measured inside the gateway while it serves.

    python bench/cpu_probe.py [--variant prefix_affinity] [--quick] [--tasks] [--answer-tokens N]
                              [--out PATH]

Runs `bench/fleet_http.py`'s workload through one gateway variant (a balance mode, or one of
its `--cpu-breakdown` settings) with `bench/probe_site` on the gateway's PYTHONPATH: its
`sitecustomize` calls `install`, which wraps the request path's stages (`STAGES`) in a clock of
the calling thread's CPU time (`time.thread_time`) and writes what they have spent, with the
process's CPU time, to a file every second. The table is per request over the window in which
requests flowed: calls and milliseconds of CPU per stage, beside the process's total.

Sampling profilers were no use for this: py-spy pauses the process to sample it and so charges
system calls (a read of the process clock, a socket write) far more than they cost, and
cProfile does not follow coroutines that uvloop resumes (without uvloop, its own overhead
swamps stages of a few microseconds). A thread CPU clock around a synchronous stage is exact,
costs about a microsecond per call, and is read where the gateway serves its real workload.

With `--tasks`, every asyncio task's steps are clocked too, under the name of the coroutine the
task runs (the request's ASGI task, the policy report, the telemetry writer, the advisor, the
replicas' load reads): the rest of the process's CPU then runs outside any task (protocol
callbacks, timers, the event loop itself). The task steps need asyncio's pure-Python `Task`,
which is slower than the C one, so the total rises: read the shares, not the total.

The stages overlap where one calls another (`PolicyResult.measure` counts the tokens, so
`count_request_tokens` is inside it): the table is not meant to be summed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_SITE = os.path.join(ROOT, "bench", "probe_site")
ENV_FILE = "FIRSTTOKEN_CPU_PROBE"  # where the gateway writes its snapshots
ENV_TASKS = "FIRSTTOKEN_CPU_PROBE_TASKS"  # "1": clock every task's steps too
PER_REQUEST = "ChatPipeline.record_for"  # called once per chat request: the request count
PER_REQUEST_KEY = "chat." + PER_REQUEST  # its name in the ledger
SNAPSHOT_S = 1.0

# (module, qualified name): the request path's synchronous stages, in the order a request
# meets them.
STAGES: tuple[tuple[str, str], ...] = (
    ("gateway.run.server", "FrontDoorProtocol.data_received"),
    ("gateway.boundary.body", "parse_request"),
    ("gateway.pipeline.chat", "ChatPipeline.record_for"),
    ("gateway.pipeline.prepare", "PolicyBodies.for_route"),
    ("policies.chain", "PolicyChain.transform"),
    ("gateway.upstreams.replicas.balancer", "Balancer.choose"),
    ("gateway.upstreams.replicas.prefix_index", "BlockChains.blocks"),
    ("gateway.upstreams.http1", "request_head"),
    ("gateway.upstreams.http1", "Http1Response.feed"),
    ("gateway.upstreams.base", "OutEvent.resolve"),
    ("gateway.pipeline.answer", "ChatFormat.events"),
    ("policies.chain", "PolicyResult.measure"),
    ("policies.tokens", "count_request_tokens"),
    ("policies.diagnostics", "PrefixFingerprints.from_body"),
    ("gateway.pipeline.policies", "_compare"),
    ("policies.prefix_breaks", "family_break"),
    ("policies.prefix_breaks", "encode_history"),
    ("gateway.advisor.shadow", "CacheAdvisor.observe"),
    ("gateway.advisor.variants", "ShadowChains.fingerprints"),
    ("gateway.advisor.shadow", "CacheAdvisor.account"),
    ("gateway.telemetry.record", "RequestRecord.finish"),
    ("gateway.upstreams.replicas.server_load", "parse_server_load"),
)

Ledger = dict[str, list[float]]  # name -> [calls, CPU seconds]


def clock(ledger: Ledger, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, with each call's calling-thread CPU time added to `ledger[name]`."""
    entry = ledger.setdefault(name, [0, 0.0])
    thread_time = time.thread_time

    @functools.wraps(fn)
    def clocked(*args: Any, **kwargs: Any) -> Any:
        started = thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            entry[0] += 1
            entry[1] += thread_time() - started

    return clocked


def wrap(ledger: Ledger, module_name: str, qualname: str) -> None:
    """Clock `module_name.qualname` (a function, or a method, static method or class method of
    a class there). A module-level function is replaced in every loaded module that imported it
    by name too, so wrap before the gateway's modules are imported for the rest to see it."""
    owner: Any = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    kind = type(raw) if isinstance(raw, staticmethod | classmethod) else None
    fn = raw.__func__ if kind is not None else raw
    name = f"{module_name.rsplit('.', 1)[-1]}.{qualname}"
    clocked = clock(ledger, name, fn)
    setattr(owner, attr, kind(clocked) if kind is not None else clocked)
    if not path:
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", None) or {}
            for key, value in list(names.items()):
                if value is fn:
                    names[key] = clocked


def task_factory(ledger: Ledger) -> Callable[..., asyncio.Task]:
    """A task factory whose tasks add each step's CPU time to `ledger["task:" + the coroutine's
    qualified name]` (asyncio's pure-Python Task, the one whose step can be wrapped)."""
    step_of = asyncio.tasks._PyTask._Task__step  # type: ignore[attr-defined]

    class ClockedTask(asyncio.tasks._PyTask):  # type: ignore[name-defined]
        def _Task__step(self, *args: Any) -> None:
            started = time.thread_time()
            try:
                step_of(self, *args)
            finally:
                entry = self._probe_entry
                entry[0] += 1
                entry[1] += time.thread_time() - started

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
        task = ClockedTask(coro, loop=loop, **kwargs)  # its first step is only scheduled here
        name = "task:" + getattr(coro, "__qualname__", type(coro).__name__)
        task._probe_entry = ledger.setdefault(name, [0, 0.0])
        return task

    return factory


def install(path: str, tasks: bool = False) -> None:
    """In the gateway (from `bench/probe_site/sitecustomize.py`): clock `STAGES` (and, with
    `tasks`, every task's steps, from when the server starts), and append a snapshot of the
    ledger and the process's CPU time to `path` every second, as a JSON line."""
    ledger: Ledger = {}
    for module_name, qualname in STAGES:
        try:
            wrap(ledger, module_name, qualname)
        except (ImportError, AttributeError, KeyError) as exc:  # a tree without that stage
            print(f"cpu_probe: {module_name}.{qualname} not clocked: {exc!r}", file=sys.stderr)
    if tasks:
        import uvicorn.server

        serve = uvicorn.server.Server.serve

        async def serve_with_clocked_tasks(self: Any, *args: Any, **kwargs: Any) -> None:
            asyncio.get_running_loop().set_task_factory(task_factory(ledger))
            await serve(self, *args, **kwargs)

        uvicorn.server.Server.serve = serve_with_clocked_tasks  # type: ignore[method-assign]

    def snapshots() -> None:
        while True:
            time.sleep(SNAPSHOT_S)
            line: dict[str, Any] = {name: list(entry) for name, entry in ledger.items()}
            line["_process_cpu_s"] = time.process_time()
            with open(path, "a") as out:
                out.write(json.dumps(line) + "\n")

    threading.Thread(target=snapshots, name="cpu-probe", daemon=True).start()


def per_request(lines: Iterable[dict]) -> dict:
    """Per request, over the window in which requests flowed (from the last snapshot before the
    first request to the last snapshot): the process's CPU and each stage's calls and CPU."""
    snaps = [s for s in lines if PER_REQUEST_KEY in s]
    if len(snaps) < 2:
        raise ValueError("fewer than two snapshots with requests: nothing to attribute")
    counts = [s[PER_REQUEST_KEY][0] for s in snaps]
    first = next((i for i, c in enumerate(counts) if c > counts[0]), None)
    if first is None:
        raise ValueError("no requests between the snapshots")
    start, end = snaps[max(0, first - 1)], snaps[-1]
    requests = end[PER_REQUEST_KEY][0] - start[PER_REQUEST_KEY][0]
    stages = {}
    for name, entry in end.items():
        if name.startswith("_"):
            continue
        calls, seconds = entry
        calls0, seconds0 = start.get(name, (0, 0.0))
        stages[name] = {
            "calls_per_request": (calls - calls0) / requests,
            "cpu_ms_per_request": 1000 * (seconds - seconds0) / requests,
        }
    return {
        "requests": requests,
        "process_cpu_ms_per_request": 1000
        * (end["_process_cpu_s"] - start["_process_cpu_s"])
        / requests,
        "stages": dict(sorted(stages.items(), key=lambda kv: -kv[1]["cpu_ms_per_request"])),
    }


def print_table(result: dict) -> None:
    print(
        f"{result['requests']} requests; the gateway process's CPU: "
        f"{result['process_cpu_ms_per_request']:.3f} ms per request"
    )
    print(f"{'stage':52} {'calls/req':>9} {'CPU ms/req':>10} {'us/call':>8}")
    for name, row in result["stages"].items():
        calls, ms = row["calls_per_request"], row["cpu_ms_per_request"]
        if calls == 0:
            continue
        print(f"{name:52} {calls:9.2f} {ms:10.3f} {1000 * ms / calls:8.1f}")


def fleet_argv(args: argparse.Namespace) -> list[str]:
    """`bench/fleet_http.py`'s arguments for this probe's workload."""
    argv = ["--cpu-breakdown", "--answer-tokens", str(args.answer_tokens)]
    return [*argv, "--quick"] if args.quick else argv


def run(args: argparse.Namespace) -> dict:
    from bench import fleet_http
    from bench.harness import stop

    # fleet_http's own list of variants, its --cpu-breakdown settings included
    fleet_args = fleet_http.parse_args(fleet_argv(args))
    chosen = [v for v in fleet_http.variants(fleet_args) if v.kind == "gateway"]
    variant = next((v for v in chosen if args.variant in (v.name, v.balance)), None)
    if variant is None:
        raise SystemExit(f"no gateway variant {args.variant!r}: {[v.name for v in chosen]}")
    workload = fleet_http.make_workload(fleet_args)
    with tempfile.TemporaryDirectory() as scratch:
        ledger = os.path.join(scratch, "ledger.jsonl")
        variant.env = {
            **variant.env,
            ENV_FILE: ledger,
            ENV_TASKS: "1" if args.tasks else "",
            "PYTHONPATH": os.pathsep.join(
                p for p in (PROBE_SITE, ROOT, os.environ.get("PYTHONPATH")) if p
            ),
        }
        procs, engines = fleet_http.start_engines(fleet_args)
        try:
            measured = fleet_http.measure(variant, workload, engines, fleet_args)
        finally:
            for proc in procs:
                stop(proc)
        with open(ledger) as lines:
            result = per_request(json.loads(line) for line in lines)
    result["variant"] = variant.name
    result["tasks_clocked"] = args.tasks
    result["bench_router_cpu_ms_per_request"] = measured["router_cpu_s_per_1000"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="prefix_affinity", help="a gateway variant's name")
    parser.add_argument("--quick", action="store_true", help="fleet_http's short workload")
    parser.add_argument("--tasks", action="store_true", help="clock every task's steps too")
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=16,
        help="content chunks per answer (1: the work done once per request, nearly alone)",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_probe.json"))
    args = parser.parse_args()
    result = run(args)
    print_table(result)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

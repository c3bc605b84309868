"""Processes of the PD separation bench: engine servers pinned to cores with a fixed number of
torch threads, and a gateway in front of them (an ordinary route or a `pd` route).

Kept apart from `bench/pd_separation.py` so that the bench reads as the experiment and this
module as the plumbing. Every process is started with its own stderr in a temporary file, so a
server that fails to start says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO

import orjson

from bench.harness import ROOT, free_port, wait_http

START_TIMEOUT_S = 120.0


def can_pin() -> bool:
    """taskset needs Linux and more than one core to mean anything."""
    return sys.platform.startswith("linux") and (os.cpu_count() or 1) > 1


@dataclass
class Proc:
    """A started process, its base URL and where its stderr goes."""

    name: str
    proc: subprocess.Popen
    url: str
    log: IO[bytes] = field(repr=False)

    def tail(self, chars: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def _start(name: str, argv: list[str], env: dict[str, str], ready_url: str, port: int) -> Proc:
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    started = Proc(name, proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            wait_http(ready_url, timeout=1.0)
            return started
        except RuntimeError:
            continue
    why = started.tail()
    started.stop()
    raise RuntimeError(f"{name} did not start (exit {proc.poll()}):\n{why}")


@dataclass(frozen=True)
class EngineSpec:
    """One `python -m engine_backend.server` process of a deployment."""

    name: str
    role: str  # both | prefill | decode
    cores: str | None  # taskset list ("0", "0,1"); None: not pinned
    threads: int  # torch intra-op threads (OMP/MKL env)
    budget: int  # --max-num-batched-tokens
    device: str = "cpu"
    num_blocks: int = 2048


def start_engine(model_dir: str, spec: EngineSpec) -> Proc:
    """The engine reads no thread flag: torch sizes its pool from OMP_NUM_THREADS (and MKL
    from MKL_NUM_THREADS), so the count is set in the environment, before torch loads."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": str(spec.threads),
        "MKL_NUM_THREADS": str(spec.threads),
    }
    if spec.device.startswith("cuda:"):  # one visible GPU per process, addressed as cuda
        env["CUDA_VISIBLE_DEVICES"] = spec.device.split(":", 1)[1]
    pin = ["taskset", "-c", spec.cores] if spec.cores and can_pin() else []
    argv = [
        *pin,
        sys.executable,
        "-m",
        "engine_backend.server",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--device",
        "cuda" if spec.device.startswith("cuda") else spec.device,
        "--role",
        spec.role,
        "--max-num-batched-tokens",
        str(spec.budget),
        "--num-blocks",
        str(spec.num_blocks),
        "--log-level",
        "warning",
    ]
    return _start(spec.name, argv, env, f"http://127.0.0.1:{port}/healthz", port)


def colocated_route(engine: Proc) -> dict:
    return {"name": "engine", "models": ["*"], "kind": "openai", "base_url": engine.url + "/v1"}


def pd_route(prefill: Proc, decode: Proc) -> dict:
    """The gateway's `pd` route over one prefill and one decode server. The prefill timeout is
    raised well past a long prompt's prefill on one core, so a slow step is never mistaken
    for a failed one (that would send it colocated and measure something else)."""
    return {
        "name": "pd",
        "models": ["*"],
        "kind": "openai",
        "pd": {
            "prefill": [{"name": "p0", "base_url": prefill.url + "/v1"}],
            "decode": [{"name": "d0", "base_url": decode.url + "/v1"}],
            "prefill_timeout_s": 120.0,
        },
    }


def start_gateway(route: dict, cores: str | None = None) -> Proc:
    """`firsttoken serve` with one route and nothing else configured."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIRSTTOKEN_")}
    env.update(
        {
            "PYTHONPATH": ROOT,
            "FIRSTTOKEN_ROUTES": orjson.dumps([route]).decode(),
            "FIRSTTOKEN_LOG_LEVEL": "warning",
        }
    )
    pin = ["taskset", "-c", cores] if cores and can_pin() else []
    argv = [*pin, sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    gateway = _start("gateway", argv, env, f"http://127.0.0.1:{port}/readyz", port)
    gateway.url += "/v1"
    return gateway


def stop_all(procs: list[Proc]) -> None:
    for proc in reversed(procs):
        proc.stop()


def wait_quiet(seconds: float = 0.5) -> None:
    """Let the previous deployment's processes leave the cores before timing the next."""
    time.sleep(seconds)

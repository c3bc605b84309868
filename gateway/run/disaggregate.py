"""`firsttoken engine --disaggregate`: prefill/decode separation on one machine, one command.

A long prompt's prefill steals the step from every stream decoding next to it. Here the prompt
is computed by its own process (`--role prefill`) and the streams by others (`--role decode`,
`--decoders N`), each with its own cores (`--threads`, default: the cores split evenly) or its
own accelerator (`--devices`). In front of them, on `--port`, runs the gateway's `pd` route in
this process: the same router that fronts vLLM or SGLang P/D pools, so this deployment is the
bundled engine speaking vLLM's protocol, not a second implementation of it. It lives with the
gateway, not the engine, because it runs the gateway; the flags are the engine's
(`engine_backend.disaggregate`), parsed by the engine's parser (`gateway.cli`).

This process supervises the engines (the rules in `gateway.run.supervision`, shared with
`serve --workers`): they start on free loopback ports; the router opens only
once each answers `/v1/models` (bounded by `--start-timeout-s`); an engine that dies is started
again on its port (the router ejects it meanwhile and serves colocated, see `gateway.upstreams.pd`),
and one that keeps dying (`RESTART_LIMIT` times within `RESTART_WINDOW_S`) stops everything with
status 1. SIGTERM or SIGINT stops the router, then each engine by its pid, and exits 0. The
engines run in sessions of their own (a terminal's Ctrl-C reaches this process only, which
stops them in order) and stop by themselves if this process disappears (`--parent-pid`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

import engine_backend
from engine_backend.disaggregate import check_arguments, split_devices
from gateway.app import create_app
from gateway.config.settings import SettingsError, load_settings
from gateway.run import supervision
from gateway.run.server import QuietServer, server_config
from gateway.run.supervision import Child, Restarts, StopSignals, stop_children

logger = logging.getLogger(__name__)

ROUTE_NAME = "pd"
GRACE_S = 15.0  # for the router's in-flight requests, then for each engine, to stop
ROUTER_START_S = 30.0


@dataclass(frozen=True)
class EngineSpec:
    """One child engine: what it is and what it was given."""

    name: str  # "prefill", "decode0", "decode1", ... (also its server name in the pd route)
    role: str
    port: int
    device: str | None  # None: the engine's own choice (cuda when there is one)
    threads: int | None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def plan(args: argparse.Namespace, ports: list[int], cores: int) -> list[EngineSpec]:
    """The engines: the prefill engine on the first device, the decoders on the next ones in
    turn; `--threads` each, else the cores split evenly (at least one each)."""
    decoders = args.decoders or 1
    if len(ports) != decoders + 1:
        raise ValueError(f"need {decoders + 1} ports, got {len(ports)}")
    devices = split_devices(args.devices) if args.devices else [args.device]
    threads = args.threads if args.threads is not None else max(1, cores // (decoders + 1))
    specs = [EngineSpec("prefill", "prefill", ports[0], devices[0], threads)]
    decode_devices = devices[1:] or devices
    for i in range(decoders):
        device = decode_devices[i % len(decode_devices)]
        specs.append(EngineSpec(f"decode{i}", "decode", ports[i + 1], device, threads))
    return specs


def engine_argv(args: argparse.Namespace, spec: EngineSpec, parent_pid: int) -> list[str]:
    """The child's command line: this one's model and engine options, its own role and port."""
    argv = [sys.executable, "-m", "engine_backend.server"]
    argv += ["--model", args.model] if args.model is not None else ["--demo"]
    argv += ["--host", "127.0.0.1", "--port", str(spec.port), "--role", spec.role]
    argv += ["--log-level", args.log_level, "--parent-pid", str(parent_pid)]
    options: list[tuple[str, object]] = [
        ("--device", spec.device),
        ("--threads", spec.threads),
        ("--dtype", args.dtype),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--block-size", args.block_size),
        ("--num-blocks", args.num_blocks),
        ("--max-model-len", args.max_model_len),
    ]
    if spec.role == "prefill":
        options += [
            ("--pd-host", args.pd_host),
            ("--pd-port", args.pd_port),
            ("--pd-hold-s", args.pd_hold_s),
            ("--pd-max-held-blocks", args.pd_max_held_blocks),
        ]
    else:
        options += [
            ("--pd-pull-hosts", args.pd_pull_hosts),
            ("--pd-pull-timeout-s", args.pd_pull_timeout_s),
        ]
    for flag, value in options:
        if value is not None:
            argv += [flag, str(value)]
    if args.isolate_tenants:
        argv.append("--isolate-tenants")
    return argv


def pd_route(specs: list[EngineSpec]) -> dict[str, Any]:
    """The gateway route over the engines: every model name, prefill and decode pools."""

    def pool(role: str) -> list[dict[str, str]]:
        return [{"name": s.name, "base_url": s.base_url} for s in specs if s.role == role]

    return {
        "name": ROUTE_NAME,
        "models": ["*"],
        "kind": "openai",
        "probe_interval_s": 1.0,  # loopback probes are cheap: a restarted engine is back soon
        "pd": {"prefill": pool("prefill"), "decode": pool("decode")},
    }


@dataclass(kw_only=True)
class Engine(Child):
    spec: EngineSpec
    ready: bool = False  # this incarnation answered /v1/models


class Deployment:
    """The engines and the router of one `--disaggregate` command (see the module docstring)."""

    def __init__(
        self,
        args: argparse.Namespace,
        specs: list[EngineSpec],
        *,
        restart_limit: int = supervision.RESTART_LIMIT,
        restart_window_s: float = supervision.RESTART_WINDOW_S,
        backoff_s: float = supervision.BACKOFF_S,
        grace_s: float = GRACE_S,
        command: Callable[[argparse.Namespace, EngineSpec, int], list[str]] | None = None,
    ) -> None:
        self.args = args
        self.command = command or engine_argv  # another for tests of the supervision alone
        self.engines = [Engine(spec=spec, label=f"the {spec.name} engine") for spec in specs]
        self.restarts = Restarts(restart_limit, restart_window_s, backoff_s)
        self.grace_s = grace_s
        self.signals = StopSignals()
        self._server: uvicorn.Server | None = None  # once the router is started
        self._router: threading.Thread | None = None

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (0), a crash loop or a router failure (1), or an engine
        refusing its configuration (2)."""
        with self.signals:
            try:
                for engine in self.engines:
                    self._start(engine)
                return self._supervise()
            finally:
                self._stop_router()
                stop_children(self.engines, self.grace_s, logger, forced=lambda: self.signals.force)

    def pids(self) -> dict[str, int]:
        return {e.spec.name: e.proc.pid for e in self.engines if e.proc is not None and e.alive()}

    def _start(self, engine: Engine) -> None:
        spec = engine.spec
        env = dict(os.environ)
        if spec.threads:  # OpenMP and MKL pools outside torch's own setting
            env["OMP_NUM_THREADS"] = str(spec.threads)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_package_root(), env.get("PYTHONPATH")) if p
        )
        engine.ready = False
        engine.proc = subprocess.Popen(
            self.command(self.args, spec, os.getpid()),
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        threads = f"{spec.threads} torch thread{'s' if spec.threads != 1 else ''}"
        logger.info(
            "%s engine: pid %d, %s, device %s, %s",
            spec.name,
            engine.proc.pid,
            spec.base_url,
            spec.device or "auto",
            threads if spec.threads else "torch's default threads",
        )

    def _supervise(self) -> int:
        deadline = time.monotonic() + self.args.start_timeout_s
        while self.signals.signum is None:
            now = time.monotonic()
            # Before the router is up a refusal is the command line's fault: every restart
            # would refuse the same. After, it is one incarnation's, restarted like a crash.
            status = self.restarts.tend(
                self.engines, self._start, now, logger, refusal_ends=self._router is None
            )
            if status is not None:
                return status
            for engine in self.engines:
                if engine.proc is not None and not engine.ready and _answers(engine.spec):
                    engine.ready = True
                    if self._router is not None:
                        logger.info("%s engine is back (pid %d)", engine.spec.name, engine.proc.pid)
            if self._router is None:
                if all(e.ready for e in self.engines):
                    status = self._start_router()
                    if status is not None:
                        return status
                elif now > deadline:
                    waiting = [e.spec.name for e in self.engines if not e.ready]
                    logger.error(
                        "engines %s did not answer within %.0f s (--start-timeout-s); stopping",
                        ", ".join(waiting),
                        self.args.start_timeout_s,
                    )
                    return 1
            elif not self._router.is_alive():
                logger.error("the router stopped; stopping the engines")
                return 1
            time.sleep(supervision.POLL_S)
        logger.info("%s: stopping the router and the engines", self.signals.name)
        return 0

    def _start_router(self) -> int | None:
        """The gateway with the pd route, served by uvicorn in a thread (signals stay with the
        main thread, which supervises); a status to exit with when it cannot start."""
        route = pd_route([e.spec for e in self.engines])
        try:
            settings = load_settings(
                environ={}, routes=json.dumps([route]), log_level=self.args.log_level.lower()
            )
        except SettingsError as e:
            logger.error("the router's settings: %s", e)
            return supervision.REFUSED
        config = server_config(
            create_app(settings),
            settings,
            host=self.args.host,
            port=self.args.port,
            log_level=settings.log_level,
            access_log=False,
            loop="auto",
            lifespan="on",
            timeout_keep_alive=75,
            timeout_graceful_shutdown=self.grace_s,
        )
        self._server = server = QuietServer(config)
        self._router = thread = threading.Thread(target=server.run, name="pd-router", daemon=True)
        thread.start()
        deadline = time.monotonic() + ROUTER_START_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                logger.error("the router could not start on %s:%d", self.args.host, self.args.port)
                return 1
            if self.signals.signum is not None:
                return None
            time.sleep(supervision.POLL_S / 2)
        logger.info(
            "disaggregated serving on http://%s:%d/v1: prefill pid %s, decode pids %s",
            self.args.host,
            self.args.port,
            self.pids().get("prefill"),
            ", ".join(str(pid) for name, pid in self.pids().items() if name != "prefill"),
        )
        return None

    def _stop_router(self) -> None:
        server, thread = self._server, self._router
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(0 if self.signals.force else self.grace_s + 5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)


def serve_disaggregated(args: argparse.Namespace, log_format: str) -> int:
    """`firsttoken engine --disaggregate ...`, its arguments parsed by the engine's parser:
    2 for contradictory flags, else the deployment's exit status."""
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    problem = check_arguments(args)
    if problem is not None:
        print(f"firsttoken engine: {problem}", file=sys.stderr)
        return 2
    return run(args)


def run(args: argparse.Namespace) -> int:
    """The deployment of checked arguments, on free loopback ports and this process's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ports = free_ports((args.decoders or 1) + 1)
    return Deployment(args, plan(args, ports, cores or 1)).run()


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports free now (all held open together, so none is given twice)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def _answers(spec: EngineSpec) -> bool:
    try:
        with urllib.request.urlopen(spec.base_url + "/models", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # refused while loading, reset, timed out
        return False


def _package_root() -> str:
    """The folder holding `engine_backend`, so that a child finds it from a checkout too."""
    return os.path.dirname(os.path.dirname(os.path.abspath(engine_backend.__file__)))

"""`firsttoken serve --workers N`: real processes on one port, supervised.

The main test runs `python -m gateway.cli serve --workers 2` against a mock upstream, with its
routes in a `--config` file and Redis telemetry under a private key prefix. Which worker served
a request is read from the access log, where every worker tags its lines with its index and pid
(clients are never told which process answered them).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from bench.harness import free_port, stop
from gateway.config.settings import Settings
from gateway.run.workers import Supervisor, per_worker_warning
from tests.support.cli import serve_refusal

CHAT = {"model": "mock-1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
STARTED = re.compile(r"worker (\d+) started \(pid (\d+)\)")
SERVED = re.compile(
    r"\[worker \d+, pid (\d+)\] [\d.:]+ - \"POST /v1/chat/completions HTTP/1.1\" 200"
)
APP_UP = re.compile(r"\[worker \d+, pid (\d+)\] Application startup complete")


class Serve:
    """One `serve --workers N` process whose output (all workers' too) goes to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        base = {k: v for k, v in os.environ.items() if not k.upper().startswith("FIRSTTOKEN_")}
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", *args],
            env={**base, **env},
            stdout=self._log,  # uvicorn's access lines
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def started(self) -> dict[int, int]:
        """Worker index -> pid of its latest start, from the supervisor's lines."""
        return {int(i): int(pid) for i, pid in STARTED.findall(self.log())}

    def wait_log(self, pattern: re.Pattern[str], count: int, timeout: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            found = pattern.findall(self.log())
            if len(found) >= count:
                return found
            assert self.proc.poll() is None, f"serve exited early:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"{pattern.pattern} x{count}:\n{self.log()[-3000:]}"
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the supervisor as an operator would (SIGTERM: it stops its workers and removes
        its private copy of the configuration); kill it only if it does not stop in time, when
        its workers see the supervisor go."""
        if self.proc.poll() is None:
            stop(self.proc)
        self._log.close()


def alive(pid: int) -> bool:
    """True while `pid` is a process that is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def chat(url: str) -> str:
    """One streamed chat over a fresh connection; its body."""
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=20)
    assert r.status_code == 200, r.text
    assert "tok0" in r.text
    return r.text


def served_by(serve: Serve) -> Counter[int]:
    return Counter(int(pid) for pid in SERVED.findall(serve.log()))


@pytest.fixture
def two_workers(mock_upstream, redis_url, key_prefix, tmp_path):
    port = free_port()
    config = tmp_path / "firsttoken.toml"
    config.write_text(
        f'metrics_key_prefix = "{key_prefix}"\n'
        "[[routes]]\n"
        'name = "mock"\n'
        'models = ["mock-*"]\n'
        'kind = "openai"\n'
        f'base_url = "{mock_upstream.base_url}"\n'
    )
    serve = Serve(
        ["--workers", "2", "--port", str(port), "--config", str(config), "--access-log"],
        {"FIRSTTOKEN_REDIS_URL": redis_url, "FIRSTTOKEN_LOG_LEVEL": "info"},
        tmp_path / "serve.log",
    )
    try:
        serve.wait_log(APP_UP, 2, timeout=60)
        yield serve, f"http://127.0.0.1:{port}"
    finally:
        serve.stop()


def test_two_workers_share_the_port_redis_a_restart_and_a_clean_stop(two_workers):
    serve, url = two_workers
    first = serve.started()
    assert sorted(first) == [1, 2]
    assert "no Redis" not in serve.log()  # the per-worker warning is for stores in process

    for _ in range(40):
        chat(url)
    # (a) both workers served some of the 40 fresh connections
    counts = served_by(serve)
    assert set(counts) == set(first.values()), (counts, serve.log()[-3000:])
    assert sum(counts.values()) == 40, (counts, serve.log()[-3000:])

    # (b) the TTFT figures of both workers, read through whichever answers: shared in Redis
    # (each worker flushes on its own timer, which a loaded machine may run late)
    deadline = time.monotonic() + 30
    while True:
        routes = httpx.get(url + "/v1/metrics/ttft", timeout=10).json()["routes"]
        total = sum(r["count"] for r in routes)
        if total >= 40 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert total == 40, (routes, serve.log()[-3000:])

    # (c) a worker killed outright is started again, and requests keep succeeding meanwhile
    victim = first[1]
    os.kill(victim, signal.SIGKILL)
    # Until the kernel has torn the victim down, a new connection may still be queued on its
    # listening socket and then reset with it: that is the crash itself, not what is tested.
    deadline = time.monotonic() + 30
    while alive(victim):
        assert time.monotonic() < deadline, serve.log()[-3000:]
        time.sleep(0.01)
    for _ in range(5):
        chat(url)
    deadline = time.monotonic() + 60
    while serve.started()[1] == victim:
        assert time.monotonic() < deadline, serve.log()[-3000:]
        time.sleep(0.05)
    assert f"worker 1 (pid {victim}) died (killed by SIGKILL)" in serve.log(), serve.log()[-3000:]
    successor = serve.started()[1]
    assert not alive(victim)
    deadline = time.monotonic() + 60
    while served_by(serve)[successor] == 0:  # the new worker takes its share once it listens
        assert time.monotonic() < deadline, serve.log()[-3000:]
        chat(url)

    # (d) SIGTERM to the supervisor: exit status 0 and no worker left
    workers = [first[2], successor]
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(40) == 0, serve.log()[-3000:]
    assert not [pid for pid in workers if alive(pid)], serve.log()[-3000:]


def test_a_local_route_is_refused_with_several_workers():
    routes = '[{"name": "on-gpu", "models": ["*"], "kind": "local", "model_path": "/nowhere"}]'
    stderr = serve_refusal("--workers", "2", env={"FIRSTTOKEN_ROUTES": routes})
    assert "'on-gpu' is a local route" in stderr
    assert "--workers 1" in stderr


def test_an_address_in_use_is_an_error_not_a_shared_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        routes = '[{"name": "m", "models": ["*"], "kind": "openai", "base_url": "http://x/v1"}]'
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--workers", "2", "--port", str(port)],
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("FIRSTTOKEN_")},
                "FIRSTTOKEN_ROUTES": routes,
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_a_worker_in_a_crash_loop_stops_the_supervisor():
    supervisor = Supervisor(
        lambda index: [sys.executable, "-c", "raise SystemExit(1)"],
        2,
        restart_limit=3,
        restart_window_s=60,
        backoff_s=0.01,
    )
    began = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - began < 20
    assert supervisor.pids() == []


def test_a_worker_refusing_its_configuration_stops_the_supervisor_at_once():
    supervisor = Supervisor(
        lambda index: [sys.executable, "-c", f"import time; time.sleep({index - 1} * 60); exit(2)"],
        2,
        backoff_s=0.01,
    )
    began = time.monotonic()
    assert supervisor.run() == 2
    assert time.monotonic() - began < 15  # worker 2, asleep, was stopped rather than awaited


def test_the_warning_names_what_each_worker_keeps():
    tenant = Settings(tenant_keys="acme:key-a")
    warning = per_worker_warning(tenant, 4)
    assert warning is not None
    assert "--workers 4" in warning
    assert "TTFT figures" in warning
    assert "prefix-break diagnostics" in warning
    assert "404 object_not_found" in warning
    assert "/metrics and /readyz are per worker" in warning
    assert "object" not in (per_worker_warning(Settings(), 2) or "")  # open mode: no records
    shared = Settings(tenant_keys="acme:key-a", redis_url="redis://127.0.0.1:6379/13")
    assert per_worker_warning(shared, 4) is None
    assert per_worker_warning(tenant, 1) is None
    telemetry_off = Settings(tenant_keys="acme:key-a", redis_url="redis://x:1/0", telemetry=False)
    off = per_worker_warning(telemetry_off, 2)
    assert off is not None and "TELEMETRY=false" in off and "object_not_found" in off

"""`serve --workers N` with real processes: a worker killed outright takes its big-body worker
processes with it, and a worker that stops answering (SIGSTOP: it keeps its socket, so the
kernel keeps handing it connections) is noticed on its private health probe and replaced."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.harness import free_port
from gateway.run.workers import Supervisor
from tests.run.test_workers import APP_UP, Serve, alive, chat

# A stand-in worker: beats on the pipe the supervisor appends (`--worker-heartbeat-fd N`) and
# records its pid; the replacement of a stopped one refuses its configuration (exit 2), which
# ends `Supervisor.run` at once.
FAKE_WORKER = """
import os, sys, time
fd, marker = int(sys.argv[-1]), sys.argv[1]
if os.path.exists(marker):
    open(marker + ".second", "w").write(str(os.getpid()))
    raise SystemExit(2)
open(marker, "w").write(str(os.getpid()))
for _ in range(600):
    os.write(fd, b".")
    time.sleep(0.05)
"""


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def test_a_stopped_worker_is_killed_and_replaced(tmp_path):
    marker = tmp_path / "first.pid"
    supervisor = Supervisor(
        lambda index: [sys.executable, "-c", FAKE_WORKER, str(marker)],
        1,
        backoff_s=0.01,
        hang_s=1.0,
    )
    stopped: list[int] = []

    def stop_the_first() -> None:
        pid = int(wait_for(lambda: marker.exists() and marker.read_text(), 30, "no first worker"))
        time.sleep(0.3)  # a few beats first: the probe is armed
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    helper = threading.Thread(target=stop_the_first, daemon=True)
    helper.start()
    began = time.monotonic()
    assert supervisor.run() == 2  # the replacement started (and refused, ending the run)
    helper.join(5)
    assert stopped and not alive(stopped[0])  # killed, though stopped
    assert Path(str(marker) + ".second").exists()
    assert time.monotonic() - began < 30


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    except FileNotFoundError:
        pass
    return found


@pytest.fixture
def two_workers(mock_upstream, tmp_path):
    port = free_port()
    config = tmp_path / "firsttoken.toml"
    config.write_text(
        "big_body_workers = 1\n"
        "[[routes]]\n"
        'name = "mock"\n'
        'models = ["mock-*"]\n'
        'kind = "openai"\n'
        f'base_url = "{mock_upstream.base_url}"\n'
    )
    serve = Serve(
        ["--workers", "2", "--port", str(port), "--config", str(config), "--access-log"],
        {"FIRSTTOKEN_LOG_LEVEL": "info"},
        tmp_path / "serve.log",
    )
    try:
        serve.wait_log(APP_UP, 2, timeout=90)
        yield serve, f"http://127.0.0.1:{port}"
    finally:
        serve.stop()


def test_killed_and_stopped_workers_leave_nothing_and_are_replaced(two_workers):
    serve, url = two_workers
    first = serve.started()
    # (a) SIGKILL: the worker's big-body processes die with it
    doomed = first[1]
    pool = wait_for(lambda: children_of(doomed), 60, "the big-body pool never started")
    os.kill(doomed, signal.SIGKILL)
    try:
        wait_for(lambda: not [p for p in pool if alive(p)], 10, "orphans left")
    except AssertionError:
        raise AssertionError(f"orphans left: {_described({p for p in pool if alive(p)})}") from None
    # (b) SIGSTOP: noticed on the health probe, killed and replaced; requests go on succeeding
    hung = first[2]
    os.kill(hung, signal.SIGSTOP)
    wait_for(lambda: serve.started()[2] != hung, 40, serve.log()[-3000:])
    assert "has not answered its health probe" in serve.log()
    wait_for(lambda: not alive(hung), 10, "the stopped worker is still there")
    serve.wait_log(APP_UP, 4, timeout=90)  # both replacements listen
    for _ in range(10):
        chat(url)


def _described(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(bytes(1), b" ")[:200].decode()
            out.append(f"{pid}: {command}")
        except FileNotFoundError:
            out.append(f"{pid}: gone")
    return out

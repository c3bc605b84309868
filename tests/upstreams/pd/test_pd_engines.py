"""The gateway's `pd` route in front of real engine processes (`--role prefill`, `--role decode`)
and `firsttoken engine --disaggregate` as one command: output identical to a colocated engine,
KV really pulled and every pool full again, a killed prefill engine served around, a killed
decode engine restarted, SIGTERM leaving no process behind, a crash loop ending the deployment.

The colocated reference is the prefill engine itself asked ordinary requests under a salt of
their own, so that no PD request's blocks are reused (as in tests/engine_pd).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.harness import ROOT, free_port, wait_http
from engine_backend.server import build_parser
from engine_backend.server import main as engine_main
from gateway.run import disaggregate
from tests.support.tiny_model import tiny_spec, write_tiny_model

BLOCK = 4
ENGINE_FLAGS = ["--block-size", str(BLOCK), "--num-blocks", "128", "--threads", "1"]
SYSTEM = " ".join(f"rule {i}: keep answers short and cite sources." for i in range(6))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory, "pd-engines-model", tiny_spec(seed=21))


class Engine:
    """One `python -m engine_backend.server` process on a loopback port."""

    def __init__(self, model_dir: str, role: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "engine_backend.server", "--model", model_dir]
        argv += ["--port", str(self.port), "--role", role, "--log-level", "warning"]
        self.proc = subprocess.Popen(
            [*argv, *ENGINE_FLAGS, "--pd-pull-timeout-s", "5"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def status(self) -> dict:
        return self.client.get("/pd/status").json()

    def stop(self) -> None:
        self.client.close()
        stop_pid(self.proc)


def stop_pid(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def engines(model_dir: str) -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = Engine(model_dir, "prefill"), Engine(model_dir, "decode")
    try:
        for engine in (prefill, decode):
            wait_http(engine.url + "/healthz", timeout=60)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def pd_route(prefill: Engine, decode: Engine) -> dict:
    return {
        "name": "pd",
        "models": ["*"],
        "kind": "openai",
        "pd": {
            "prefill": [{"name": "p", "base_url": prefill.url + "/v1"}],
            "decode": [{"name": "d", "base_url": decode.url + "/v1"}],
            "prefill_timeout_s": 30,
        },
    }


def assert_pools_full(*engines: Engine) -> None:
    for engine in engines:
        deadline = time.monotonic() + 10
        while True:
            status = engine.status()
            idle = status["running"] == status["waiting"] == status["held_blocks"] == 0
            if idle and status["free_blocks"] == status["total_blocks"]:
                break
            assert time.monotonic() < deadline, f"pool not full again: {status}"
            time.sleep(0.05)


_salts = itertools.count()


def chat_body(messages: list[dict], **extra) -> dict:
    return {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}


def ask(client: httpx.Client, path: str, body: dict) -> tuple[str, dict]:
    """The answer's text and usage, streamed or not as `body` says."""
    text_of = (lambda c: c["message"]["content"]) if "messages" in body else (lambda c: c["text"])
    if body.get("stream") is not True:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        return text_of(answer["choices"][0]), answer["usage"]
    delta_of = (lambda c: c["delta"].get("content") or "") if "messages" in body else text_of
    text, usage = "", {}
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                text += "".join(delta_of(c) for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


def colocated(prefill: Engine, path: str, body: dict) -> str:
    alone = {**body, "stream": False, "cache_salt": f"reference-{next(_salts)}"}
    return ask(prefill.client, path, alone)[0]


def test_the_pd_route_over_real_engines_answers_as_a_colocated_engine(engines, make_gateway):
    prefill, decode = engines
    gw = make_gateway([pd_route(prefill, decode)])
    client = httpx.Client(base_url=gw.url, timeout=30)
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "why?"}]
    cases = [
        ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 8, "temperature": 0}),
        (
            "/v1/completions",
            {"model": "m", "prompt": SYSTEM, "max_tokens": 8, "temperature": 0, "stream": True},
        ),
        ("/v1/chat/completions", chat_body(question)),
        ("/v1/chat/completions", chat_body([*question[:1], {"role": "user", "content": "how?"}])),
        ("/v1/chat/completions", chat_body(question, stream=True, seed=3, temperature=0.9)),
    ]
    for path, body in cases:
        body = {**body, "ignore_eos": True}
        assert ask(client, path, body)[0] == colocated(prefill, path, body), (path, body)
    pulled = decode.status()["pulls"]
    assert pulled["ok"] >= len(cases) - 1 and pulled["failed"] == pulled["refused"] == 0
    assert gw.runtime.upstreams["pd"].snapshot()["pd"]["colocated_fallbacks"] == 0

    # The next turn of a conversation: its earlier turn's KV is in the decode engine's cache.
    turn1 = chat_body(question, ignore_eos=True)
    answer, usage1 = ask(client, "/v1/chat/completions", turn1)
    messages = [*question, {"role": "assistant", "content": answer}]
    turn2 = chat_body([*messages, {"role": "user", "content": "and then?"}], ignore_eos=True)
    text, usage2 = ask(client, "/v1/chat/completions", turn2)
    assert text == colocated(prefill, "/v1/chat/completions", turn2)
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (usage1["prompt_tokens"] // BLOCK - 1) * BLOCK > 0
    assert cached % BLOCK == 0 and cached < usage2["prompt_tokens"]
    assert_pools_full(prefill, decode)
    client.close()


def test_a_killed_prefill_engine_leaves_requests_to_the_decode_engine(engines, make_gateway):
    """Last of the module's tests on `engines`: it kills the prefill engine."""
    prefill, decode = engines
    gw = make_gateway([pd_route(prefill, decode)])
    body = chat_body([{"role": "user", "content": SYSTEM + " after the crash"}], ignore_eos=True)
    expected = colocated(prefill, "/v1/chat/completions", body)
    prefill.proc.kill()
    prefill.proc.wait(10)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        assert ask(client, "/v1/chat/completions", body)[0] == expected
        assert ask(client, "/v1/chat/completions", {**body, "stream": True})[0] == expected
    reasons = gw.runtime.upstreams["pd"].snapshot()["pd"]["colocated_by_reason"]
    assert reasons["prefill_error"] >= 1 and sum(reasons.values()) == 2
    assert_pools_full(decode)


# -- `firsttoken engine --disaggregate` -------------------------------------------------------


def children(pid: int) -> dict[int, str]:
    """The live child processes of `pid`: their pids and command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def engine_children(pid: int) -> dict[str, int]:
    """{role: pid} of the engine servers `pid` started."""
    found = {}
    for child, cmdline in children(pid).items():
        if "engine_backend.server" in cmdline:
            argv = cmdline.split()
            found[argv[argv.index("--role") + 1]] = child
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def eventually(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_disaggregate_runs_prefill_decode_and_router_as_one_command(model_dir, tmp_path):
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    router = subprocess.Popen(
        [
            *(sys.executable, "-m", "gateway.cli", "engine", "--disaggregate", "--decoders", "1"),
            *("--model", model_dir, "--port", str(port), "--log-level", "warning", *ENGINE_FLAGS),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    seen: set[int] = set()
    try:

        def ready() -> bool:
            assert router.poll() is None, (tmp_path / "router.log").read_text()
            try:
                return client.get("/readyz").status_code == 200
            except httpx.TransportError:
                return False

        eventually(ready, 60, "the router")
        pids = engine_children(router.pid)
        assert sorted(pids) == ["decode", "prefill"]
        seen.update(pids.values())
        replicas = client.get("/readyz").json()["replicas"]
        assert replicas == {"pd": {"prefill/prefill": "healthy", "decode/decode0": "healthy"}}

        body = chat_body([{"role": "user", "content": SYSTEM}], ignore_eos=True)
        text, usage = ask(client, "/v1/chat/completions", body)
        assert text and usage["prompt_tokens_details"]["cached_tokens"] > 0  # pulled, not run
        report = client.get("/v1/metrics/ttft").json()["replicas"]["pd"]
        assert report["mode"] == "pd" and report["pd"]["requests"] == 1
        assert report["pd"]["colocated_fallbacks"] == 0 and report["pd"]["prefill_count"] == 1

        # A decode engine that dies is started again, and the route serves through it.
        os.kill(pids["decode"], signal.SIGKILL)
        restarted = eventually(
            lambda: (
                engine_children(router.pid).get("decode") not in (None, pids["decode"])
                and engine_children(router.pid)["decode"]
            ),
            20,
            "a new decode engine",
        )
        seen.add(restarted)

        def served() -> bool:
            try:
                return client.post("/v1/chat/completions", json=body).status_code == 200
            except httpx.TransportError:
                return False

        eventually(served, 30, "a request through the restarted decode engine")
        assert ask(client, "/v1/chat/completions", body)[0] == text

        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0
        assert not [pid for pid in seen if alive(pid)]
        assert children(router.pid) == {}
    finally:
        client.close()
        stop_pid(router)
        for pid in seen:  # only if the router failed to stop them
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


FLAKY_ENGINE = textwrap.dedent(
    """
    import http.server, sys, threading
    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": []}')
        def log_message(self, *args): pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Event().wait(float(sys.argv[2]))
    sys.exit(3)
    """
)


def engine_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--demo", *argv])


def test_an_engine_that_keeps_dying_ends_the_deployment_with_status_1(caplog) -> None:
    """The supervision alone, with stand-in engines that answer /v1/models and then exit."""
    args = engine_args("--disaggregate", "--port", str(free_port()), "--start-timeout-s", "20")
    specs = disaggregate.plan(args, disaggregate.free_ports(2), cores=2)
    lifetimes = {"prefill": "60", "decode0": "0.5"}
    deployment = disaggregate.Deployment(
        args,
        specs,
        restart_limit=2,
        backoff_s=0.05,
        grace_s=3,
        command=lambda _, spec, __: [
            sys.executable,
            "-c",
            FLAKY_ENGINE,
            str(spec.port),
            lifetimes[spec.name],
        ],
    )
    started = time.monotonic()
    assert deployment.run() == 1
    assert time.monotonic() - started < 15
    assert deployment.pids() == {}  # the prefill stand-in was stopped, by its pid
    assert "the decode0 engine died 3 times" in caplog.text


def test_engines_get_their_devices_threads_and_roles() -> None:
    args = engine_args("--disaggregate", "--decoders", "3", "--devices", "cuda:0,cuda:1,cuda:2")
    specs = disaggregate.plan(args, [1, 2, 3, 4], cores=8)
    assert [(s.name, s.role, s.device, s.threads) for s in specs] == [
        ("prefill", "prefill", "cuda:0", 2),
        ("decode0", "decode", "cuda:1", 2),
        ("decode1", "decode", "cuda:2", 2),
        ("decode2", "decode", "cuda:1", 2),
    ]
    one_core_each = disaggregate.plan(engine_args("--disaggregate", "--threads", "1"), [5, 6], 16)
    argv = disaggregate.engine_argv(args, one_core_each[1], parent_pid=7)
    assert argv[argv.index("--threads") + 1] == "1" and argv[argv.index("--role") + 1] == "decode"
    assert argv[argv.index("--port") + 1] == "6" and argv[argv.index("--parent-pid") + 1] == "7"
    route = disaggregate.pd_route(specs)["pd"]
    assert [s["name"] for s in route["decode"]] == ["decode0", "decode1", "decode2"]
    assert route["prefill"] == [{"name": "prefill", "base_url": "http://127.0.0.1:1/v1"}]


@pytest.mark.parametrize(
    "argv",
    [
        ["--disaggregate", "--role", "prefill"],
        ["--decoders", "2"],
        ["--disaggregate", "--decoders", "0"],
        ["--disaggregate", "--device", "cpu", "--devices", "cpu,cpu"],
        ["--threads", "0"],
    ],
)
def test_contradictory_flags_are_refused_before_anything_starts(argv, capsys) -> None:
    assert engine_main(["--demo", *argv]) == 2
    assert capsys.readouterr().err.startswith("firsttoken engine: ")

"""Big bodies are parsed, checked and transformed in worker processes, with the same outcome
as on the event loop: the same policies, the same errors, the same ownership checks."""

from __future__ import annotations

import os
import socket
import sys
import time
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest

import gateway.boundary.admit as admit_module
from gateway.boundary.body_files import BodyFile
from gateway.errors import GatewayError
from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, auth
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, openai_route

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG = 4096  # FIRSTTOKEN_BIG_BODY_BYTES in these tests: every body below is bigger
PADDING = "Background.   \n\n\n\n\n" + "lorem ipsum dolor " * 400


def chat(content: str = "hi", **extra) -> dict:
    return {
        "model": "mock-1",
        "messages": [{"role": "system", "content": PADDING}, {"role": "user", "content": content}],
        **extra,
    }


@pytest.fixture
def big_gateway(mock_upstream, make_gateway, tenant_settings):
    return make_gateway(
        [openai_route(mock_upstream)], big_body_bytes=BIG, big_body_workers=2, **tenant_settings
    )


def test_a_big_body_gets_the_same_policies_and_answer(big_gateway, mock_upstream):
    gw = big_gateway
    client = sdk_client(gw, TENANT_A_KEY, timeout=60)
    jobs = gw.runtime.offload.jobs
    whole = client.chat.completions.with_raw_response.create(**chat())
    chunks = list(client.chat.completions.create(**chat("again"), stream=True))
    assert gw.runtime.offload.jobs >= jobs + 2  # both went to a worker process
    assert whole.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
    assert int(whole.headers["x-firsttoken-prompt-tokens-saved"]) >= 1
    assert whole.parse().choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    sent = [r["body"] for r in mock_upstream.mock.requests]
    assert "\n\n\n\n" not in sent[0]["messages"][0]["content"]  # slimmed in the worker
    assert sent[0]["prompt_cache_key"].startswith("ft-")  # cache hints too
    assert sent[1]["stream_options"] == {"include_usage": True}  # usage always asked
    assert not any(c.usage for c in chunks)  # ... and removed again


@pytest.mark.parametrize(
    "body, code, param",
    [
        (
            b'{"model": "mock-1", "messages": [' + b'{"role": "user"}, ' * 400 + b"]",
            "invalid_json",
            None,
        ),
        (b'{"model": "mock-1", "pad": "' + b"x" * BIG + b'"}', None, "messages"),
        (
            b'{"model": "mock-1", "messages": [{"role": "user", "content": "x"}], "d": '
            + b"[" * 80
            + b"]" * 80
            + b', "pad": "'
            + b"x" * BIG
            + b'"}',
            "json_too_deep",
            None,
        ),
    ],
)
def test_a_big_body_is_refused_like_a_small_one(big_gateway, mock_upstream, body, code, param):
    r = httpx.post(
        big_gateway.url + "/v1/chat/completions",
        content=body,
        headers={**auth(TENANT_A_KEY), "content-type": "application/json"},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code
    if param:
        assert error["param"] == param
    assert mock_upstream.mock.requests == []


def test_a_big_body_cannot_name_another_tenants_file(big_gateway, mock_upstream):
    gw = big_gateway
    a = sdk_client(gw, TENANT_A_KEY, timeout=60)
    b = sdk_client(gw, TENANT_B_KEY, timeout=60)
    file_a = a.files.create(file=("a.pdf", b"%PDF-1.4 acme"), purpose="user_data")
    part = {"type": "file", "file": {"file_id": file_a.id}}
    with pytest.raises(openai.NotFoundError):
        b.chat.completions.create(**chat([part, {"type": "text", "text": "summarise"}]))
    assert a.chat.completions.create(**chat([part, {"type": "text", "text": "go"}])).choices
    assert sum(r["path"] == "/v1/chat/completions" for r in mock_upstream.mock.requests) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory files are Linux's")
def test_a_big_body_goes_into_a_memory_file_as_it_arrives(big_gateway, mock_upstream, monkeypatch):
    """Declared big, the body is never one object in the gateway: its pieces go into the
    worker's memory file as they arrive, and `read_body` (which joins them) is not used."""
    joined, appended = [], []
    read_body, append = admit_module.read_body, BodyFile.append

    async def counting_read_body(*args, **kwargs):
        joined.append(1)
        return await read_body(*args, **kwargs)

    def counting_append(self, chunk):
        appended.append(len(chunk))
        return append(self, chunk)

    monkeypatch.setattr(admit_module, "read_body", counting_read_body)
    monkeypatch.setattr(BodyFile, "append", counting_append)
    body = orjson.dumps(chat("x" * 300_000))
    r = httpx.post(
        big_gateway.url + "/v1/chat/completions",
        content=body,
        headers={**auth(TENANT_A_KEY), "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert joined == [] and sum(appended) == len(body)
    sent = mock_upstream.mock.requests[-1]["body"]["messages"]
    assert sent[1]["content"] == "x" * 300_000  # what the worker read back is the whole body


def _body_files_open() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += "firsttoken-body" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return count


def _wait_for_body_files(count: int) -> int:
    """How many memory files are open once there are `count` (or 10 s have passed)."""
    deadline = time.monotonic() + 10
    while _body_files_open() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _body_files_open()


def _post_head(gateway, content_length: int, first_bytes: bytes) -> socket.socket:
    """A connection that has sent a chat request's head declaring `content_length` and only
    `first_bytes` of its body."""
    address = urlsplit(gateway.url)
    conn = socket.create_connection((address.hostname, address.port), timeout=10)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {TENANT_A_KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {content_length}\r\n\r\n"
    )
    conn.sendall(head.encode() + first_bytes)
    return conn


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory files are Linux's")
def test_a_client_that_leaves_mid_body_leaves_no_memory_file_open(big_gateway, mock_upstream):
    before = _body_files_open()
    start = b'{"model": "mock-1", "messages": [' + b" " * 50_000
    with _post_head(big_gateway, 200_000, start):
        # the gateway has begun writing the body into its file
        assert _wait_for_body_files(before + 1) == before + 1
    assert _wait_for_body_files(before) == before
    assert mock_upstream.mock.requests == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory files are Linux's")
def test_a_body_declared_over_the_limit_is_413_and_leaves_no_memory_file(big_gateway):
    before = _body_files_open()
    with _post_head(big_gateway, 1 << 30, b'{"model": "mock-1", "messages": [') as conn:
        answer = b""
        while b"request_too_large" not in answer:
            chunk = conn.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413")
    assert _wait_for_body_files(before) == before


def test_a_policy_header_is_honoured_in_the_worker(big_gateway, mock_upstream):
    r = httpx.post(
        big_gateway.url + "/v1/chat/completions",
        json=chat(),
        headers={**auth(TENANT_A_KEY), "x-firsttoken-policies": "none"},
    )
    assert r.status_code == 200 and r.headers["x-firsttoken-policies"] == "none"
    assert "\n\n\n\n" in mock_upstream.mock.requests[0]["body"]["messages"][0]["content"]


def test_other_route_kinds_keep_big_bodies_in_process(mock_upstream, make_gateway):
    gw = make_gateway(
        [openai_route(mock_upstream), anthropic_route(mock_upstream)],
        big_body_bytes=BIG,
        big_body_workers=2,
    )
    r = httpx.post(
        gw.url + "/v1/chat/completions", json={**chat(), "model": "claude-3-5-haiku"}, timeout=60
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert mock_upstream.mock.requests[-1]["path"] == "/v1/messages"


async def test_a_worker_that_dies_fails_its_request_alone():
    from gateway.boundary.offload import HeavyWork
    from gateway.config.settings import Settings
    from gateway.pipeline.big_bodies import Prepared, dumps_settings, prepare, worker_init

    routes = [{"name": "mock", "models": ["*"], "kind": "openai", "base_url": "http://x/v1"}]
    work = HeavyWork(
        0,
        process_min_bytes=1,
        process_workers=1,
        process_init=(worker_init, (dumps_settings(Settings()), routes)),
    )
    raw = orjson.dumps(chat())
    try:
        with pytest.raises(GatewayError) as err:
            await work.run_in_process("acme", os._exit, 3)
        assert err.value.status == 503
        outcome = await work.run_in_process("acme", prepare, raw, "chat", "acme", None, False, True)
        assert isinstance(outcome, Prepared)  # a new pool serves the next big body
        assert outcome.model == "mock-1" and set(outcome.bodies) == {"mock"}
        assert orjson.loads(outcome.bodies["mock"].encoded)["messages"][1]["content"] == "hi"
    finally:
        work.close()


def test_workers_exit_when_their_gateway_is_killed(tmp_path):
    """A gateway killed outright leaves no worker process behind holding memory, and none of
    its pool's named semaphores in /dev/shm: multiprocessing's resource tracker, which outlives
    the gateway, removes them (and says so on the stderr it inherited, read here)."""
    import contextlib
    import signal
    import subprocess

    script = tmp_path / "gw.py"
    script.write_text(
        "import asyncio, os, sys\n"
        "from gateway.pipeline.big_bodies import dumps_settings, worker_init\n"
        "from gateway.boundary.offload import HeavyWork\n"
        "from gateway.config.settings import Settings\n"
        "routes = [{'name': 'm', 'models': ['*'], 'kind': 'openai', 'base_url': 'http://x/v1'}]\n"
        "async def main():\n"
        "    work = HeavyWork(0, process_min_bytes=1, process_workers=1, process_init=(\n"
        "        worker_init, (dumps_settings(Settings()), routes)))\n"
        "    await work.start_processes()\n"
        "    print(await work.run_in_process('t', os.getpid), flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    before = _named_semaphores()
    gateway = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        worker = int(gateway.stdout.readline())
        assert os.path.exists(f"/proc/{worker}")
        pools = _named_semaphores() - before
        assert pools, "the worker pool made no named semaphore: nothing to check"
        gateway.send_signal(signal.SIGKILL)
        gateway.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker):
            assert time.monotonic() < deadline, "the worker outlived its gateway"
            time.sleep(0.1)
        while pools & _named_semaphores():
            assert time.monotonic() < deadline, "the killed gateway's semaphores stayed"
            time.sleep(0.1)
    finally:
        gateway.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            gateway.communicate(timeout=10)  # the tracker's note on what it removed


def _named_semaphores() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

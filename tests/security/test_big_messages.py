"""Big Messages bodies for an `anthropic` route, and big Responses bodies for an `openai` one,
take the same path as big chat bodies: parsed,
checked and prepared in a worker process, one job per tenant at a time, so the event loop never
holds a parsed copy and ten at once cost no more gateway memory than ten chat bodies."""

from __future__ import annotations

import threading
import tracemalloc

import httpx
import orjson
import pytest

from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, auth
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, openai_route

BIG = 4096  # FIRSTTOKEN_BIG_BODY_BYTES here
PADDING = "Background.   \n\n\n\n\n" + "lorem ipsum dolor " * 400


def messages(*blocks: dict, **extra: object) -> dict:
    content = [*blocks, {"type": "text", "text": "hi"}]
    return {
        "model": "claude-1",
        "max_tokens": 8,
        "system": PADDING,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


@pytest.fixture
def gateway(make_gateway, mock_upstream, tenant_settings):
    gw = make_gateway(
        [openai_route(mock_upstream), anthropic_route(mock_upstream)],
        big_body_bytes=BIG,
        big_body_workers=2,
        **tenant_settings,
    )
    gw.wait_ready()
    return gw


def count_process_jobs(gw) -> list[str]:
    """The APIs of the jobs that went to a worker process from now on."""
    offload, seen = gw.runtime.offload, []
    original = offload.run_in_process

    async def counted(tenant, fn, *args):
        seen.append(args[1])  # prepare(raw, endpoint, ...)
        return await original(tenant, fn, *args)

    offload.run_in_process = counted
    return seen


def post(gw, body: dict, key: str = TENANT_A_KEY) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/messages", content=orjson.dumps(body), headers=auth(key), timeout=60
    )


def test_a_big_messages_body_is_prepared_in_a_worker(gateway, mock_upstream):
    jobs = count_process_jobs(gateway)
    r = post(gateway, messages(kv_transfer_params={"remote_host": "10.0.0.9"}))
    assert r.status_code == 200, r.text
    assert jobs == ["messages"]
    assert r.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
    (sent,) = [q["body"] for q in mock_upstream.mock.requests if q["path"] == "/v1/messages"]
    assert (
        "\n\n\n\n" not in sent["system"][0]["text"]
        if isinstance(sent["system"], list)
        else sent["system"]
    )
    assert "kv_transfer_params" not in sent  # stripped in the worker too


def test_a_big_body_naming_another_tenants_file_is_a_404(gateway, mock_upstream):
    owner = sdk_client(gateway, TENANT_A_KEY)
    theirs = owner.files.create(file=("a.pdf", b"%PDF acme"), purpose="assistants").id
    jobs = count_process_jobs(gateway)
    block = {"type": "document", "source": {"type": "file", "file_id": theirs}}
    r = post(gateway, messages(block), key=TENANT_B_KEY)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert jobs == ["messages"]
    assert not [q for q in mock_upstream.mock.requests if q["path"] == "/v1/messages"]
    assert post(gateway, messages(block)).status_code == 200  # the owner's own


def test_a_big_body_for_a_translating_route_is_still_served(gateway, mock_upstream):
    r = post(gateway, {**messages(), "model": "mock-1"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def _peak_during(gw, path: str, bodies: list[bytes]) -> int:
    """Peak traced memory in this process (the gateway's thread included) while `bodies` are
    posted at once, over what it held before."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    errors: list[str] = []

    def send(raw: bytes) -> None:
        r = httpx.post(gw.url + path, content=raw, headers=auth(TENANT_A_KEY), timeout=120)
        if r.status_code != 200:
            errors.append(r.text[:200])

    threads = [threading.Thread(target=send, args=(raw,)) for raw in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert not errors, errors
    return peak


def test_ten_big_messages_bodies_cost_no_more_than_ten_chat_bodies(gateway):
    parts = [{"type": "text", "text": f"part {i}"} for i in range(20_000)]  # many small objects
    chat = {"model": "mock-1", "messages": [{"role": "user", "content": parts}]}
    native = {
        "model": "claude-1",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": parts}],
    }
    chat_peak = _peak_during(gateway, "/v1/chat/completions", [orjson.dumps(chat)] * 10)
    messages_peak = _peak_during(gateway, "/v1/messages", [orjson.dumps(native)] * 10)
    assert messages_peak <= 1.25 * chat_peak + 2 * 1024 * 1024, (messages_peak, chat_peak)


def responses(**extra: object) -> dict:
    return {"model": "mock-1", "instructions": PADDING, "input": "hi", **extra}


def post_responses(gw, body: dict, key: str = TENANT_A_KEY) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/responses", content=orjson.dumps(body), headers=auth(key), timeout=60
    )


def test_a_big_responses_body_is_prepared_in_a_worker(gateway, mock_upstream):
    jobs = count_process_jobs(gateway)
    r = post_responses(gateway, responses(bootstrap_room=7))
    assert r.status_code == 200, r.text
    assert jobs == ["responses"]
    assert r.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
    (sent,) = [q["body"] for q in mock_upstream.mock.requests if q["path"] == "/v1/responses"]
    sent = orjson.loads(sent) if isinstance(sent, bytes) else sent
    assert "bootstrap_room" not in sent and "\n\n\n\n" not in sent["instructions"]


def test_a_big_responses_body_naming_another_tenants_file_is_a_404(gateway, mock_upstream):
    owner = sdk_client(gateway, TENANT_A_KEY)
    theirs = owner.files.create(file=("a.pdf", b"%PDF acme"), purpose="user_data").id
    item = {"role": "user", "content": [{"type": "input_file", "file_id": theirs}]}
    r = post_responses(gateway, responses(input=[item]), key=TENANT_B_KEY)
    assert r.status_code == 404 and r.json()["error"]["code"] == "object_not_found"
    assert not [q for q in mock_upstream.mock.requests if q["path"] == "/v1/responses"]


def test_ten_big_responses_bodies_cost_no_more_than_ten_chat_bodies(gateway):
    parts = [{"type": "input_text", "text": f"part {i}"} for i in range(20_000)]
    chat = {"model": "mock-1", "messages": [{"role": "user", "content": parts}]}
    native = {"model": "mock-1", "input": [{"role": "user", "content": parts}]}
    chat_peak = _peak_during(gateway, "/v1/chat/completions", [orjson.dumps(chat)] * 10)
    responses_peak = _peak_during(gateway, "/v1/responses", [orjson.dumps(native)] * 10)
    assert responses_peak <= 1.25 * chat_peak + 2 * 1024 * 1024, (responses_peak, chat_peak)

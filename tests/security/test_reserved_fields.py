"""KV-transfer fields are the gateway's own: `kv_transfer_params` (vLLM) and `bootstrap_host`,
`bootstrap_port`, `bootstrap_room` (SGLang) tell a disaggregated server where to pull KV from.
Only the pd router sets them; a client's copy is dropped on every door and route kind, in the
chat, native and passthrough paths and in the big-body worker alike."""

from __future__ import annotations

import httpx
import orjson
import pytest

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from gateway.boundary.body import RESERVED_FIELDS, strip_reserved
from tests.support.gateway import anthropic_route, openai_route

PLANTED = {
    "kv_transfer_params": {
        "remote_host": "10.0.0.9",
        "remote_port": 5557,
        "do_remote_prefill": True,
    },
    "bootstrap_host": "10.0.0.9",
    "bootstrap_port": 8998,
    "bootstrap_room": 12345,
}
CHAT = {"model": "mock-1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DOORS = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": "mock-1", "prompt": "hi", "max_tokens": 4}),
    ("/v1/responses", {"model": "mock-1", "input": "hi"}),  # native to an openai route
    ("/v1/responses", {"model": "claude-1", "input": "hi"}),  # translated to anthropic
    ("/v1/messages", {"model": "claude-1", "max_tokens": 4, "messages": CHAT["messages"]}),
    ("/v1/messages", {"model": "mock-1", "max_tokens": 4, "messages": CHAT["messages"]}),
    ("/v1/embeddings", {"model": "mock-1", "input": "hi"}),  # the passthrough door
    ("/v1/chat/completions", {"model": "rep-1", "messages": CHAT["messages"]}),  # replicas
]


@pytest.fixture
def replica():
    with ThreadedServer(MockUpstream(MockBehaviour())) as server:
        yield server


def _bodies(server: ThreadedServer) -> list[dict]:
    out = []
    for seen in server.mock.requests:
        body = seen["body"]
        out.append(orjson.loads(body) if isinstance(body, bytes) else body)
    return out


@pytest.mark.parametrize("path,body", DOORS)
@pytest.mark.parametrize("escaped", [False, True])
def test_client_kv_fields_never_reach_the_upstream(
    make_gateway, mock_upstream, replica, path, body, escaped
):
    routes = [
        openai_route(mock_upstream),
        anthropic_route(mock_upstream),
        {
            "name": "rep",
            "models": ["rep-*"],
            "kind": "openai",
            "replicas": [{"base_url": replica.base_url}],
        },
    ]
    gw = make_gateway(routes)
    raw = orjson.dumps({**body, **PLANTED})
    if escaped:  # the same keys, spelt with a JSON escape that a byte search would miss
        raw = raw.replace(b'"kv_transfer_params"', b'"kv_transfer\\u005fparams"')
    r = httpx.post(
        gw.url + path, content=raw, headers={"content-type": "application/json"}, timeout=20
    )
    assert r.status_code == 200, r.text
    seen = _bodies(mock_upstream) + _bodies(replica)
    assert seen, "the upstream heard nothing"
    for upstream_body in seen:
        assert not set(RESERVED_FIELDS) & set(upstream_body), upstream_body
    assert b"10.0.0.9" not in b"".join(orjson.dumps(b) for b in seen)


def test_big_chat_bodies_lose_them_in_the_worker_too(make_gateway, mock_upstream):
    gw = make_gateway(
        [openai_route(mock_upstream)],
        big_body_bytes=64 * 1024,
        big_body_workers=2,
        policy_thread_min_bytes=1024,
    )
    gw.wait_ready()
    big = {**CHAT, "messages": [{"role": "user", "content": "x " * 100_000}], **PLANTED}
    r = httpx.post(gw.url + "/v1/chat/completions", content=orjson.dumps(big), timeout=30)
    assert r.status_code == 200, r.text
    assert gw.runtime.offload.jobs >= 1  # it went through the worker process
    (seen,) = _bodies(mock_upstream)
    assert not set(RESERVED_FIELDS) & set(seen)


def test_a_body_without_them_is_left_alone():
    body = {"model": "m", "messages": [], "kv": 1, "bootstrap": 2}
    assert strip_reserved(body) is False
    assert body == {"model": "m", "messages": [], "kv": 1, "bootstrap": 2}

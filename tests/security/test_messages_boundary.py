"""The Messages API door (`POST /v1/messages`, `/v1/messages/count_tokens`) against hostile
clients and a hostile upstream: every refusal is a clean Anthropic-shaped error that never
reaches the upstream, no client key goes upstream, redirects are never followed, events are
bounded, and a client that leaves closes the upstream request."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.security.conftest import TENANT_A_KEY, UPSTREAM_KEY
from tests.security.hostile_upstream import (
    anthropic_event,
    anthropic_stream,
    endless_answer,
    hang_until_gone,
    json_answer,
    redirect_answer,
    sse_answer,
)
from tests.support.gateway import anthropic_route
from tests.support.waiting import eventually, named_events

BODY = {
    "model": "claude-x",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "secret prompt"}],
}
STREAM = {**BODY, "stream": True}
MESSAGE = {
    "id": "msg_h",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [{"type": "text", "text": "hi"}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 3, "output_tokens": 1},
}


def post(gw, body: object, path: str = "/v1/messages", **options) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **options.pop("headers", {})}
    return httpx.post(gw.url + path, content=content, headers=headers, timeout=20, **options)


def anthropic_error(r: httpx.Response, status: int, type: str) -> str:
    """The response is Anthropic's error shape with this status and type; its message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type, body
    assert set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


# --- hostile request bodies: refused before any upstream work ---------------------------------


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b'{"model": "claude-x", "messages": [', "not valid JSON"),
        (b'["model", "claude-x"]', "JSON object"),
        (b'"claude-x"', "JSON object"),
        (b'{"model": "claude-x", "messages": "hi"}', "'messages'"),
        (b'{"messages": []}', "'model'"),
        (b'{"model": 7, "messages": []}', "'model'"),
        (b'{"model": "claude-x", "messages": [], "stream": "yes"}', "'stream'"),
        (orjson.dumps({**BODY, "model": "claude-" + "x" * 300}), "FIRSTTOKEN_MAX_MODEL_CHARS"),
        (
            b'{"model": "claude-x", "messages": [], "metadata": ' + b"[" * 100 + b"]" * 100 + b"}",
            "FIRSTTOKEN_MAX_JSON_DEPTH",
        ),
        (orjson.dumps({**BODY, "messages": [{"role": "user"}] * 50}), "FIRSTTOKEN_MAX_MESSAGES"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_bad_bodies_are_anthropic_400s_that_never_reach_upstream(
    hostile, make_gateway, raw, needle, path
):
    gw = make_gateway([anthropic_route(hostile)], max_messages=10)
    message = anthropic_error(post(gw, raw, path), 400, "invalid_request_error")
    assert needle in message
    assert hostile.upstream.posts() == []


def test_body_over_its_limit_is_a_413(hostile, make_gateway):
    gw = make_gateway([anthropic_route(hostile)], max_body_bytes=4096)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 8192}]}
    anthropic_error(post(gw, big), 413, "request_too_large")
    assert hostile.upstream.posts() == []


def test_missing_or_wrong_tenant_key_is_an_anthropic_401(hostile, make_gateway, tenant_settings):
    gw = make_gateway([anthropic_route(hostile)], **tenant_settings)
    anthropic_error(post(gw, BODY), 401, "authentication_error")
    anthropic_error(post(gw, BODY, headers={"x-api-key": "nope"}), 401, "authentication_error")
    assert hostile.upstream.posts() == []


# --- what goes upstream ------------------------------------------------------------------


def test_client_keys_and_account_headers_never_reach_upstream(
    hostile, make_gateway, tenant_settings
):
    hostile.upstream.handler = json_answer(MESSAGE)
    gw = make_gateway([anthropic_route(hostile)], **tenant_settings)
    sneaky = {
        "x-api-key": TENANT_A_KEY,
        "cookie": "session=abc",
        "x-forwarded-for": "10.0.0.1",
        "openai-organization": "org-x",
        "anthropic-beta": "tools-2024-04-04",
    }
    assert post(gw, BODY, headers=sneaky).status_code == 200
    bearer = {"authorization": f"Bearer {TENANT_A_KEY}"}
    assert post(gw, BODY, "/v1/messages/count_tokens", headers=bearer).status_code == 200
    for sent in hostile.upstream.posts():
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        assert headers["x-api-key"] == UPSTREAM_KEY
        assert TENANT_A_KEY not in repr(sent)
        assert not {"cookie", "x-forwarded-for", "openai-organization", "authorization"} & set(
            headers
        )
    assert [p["path"] for p in hostile.upstream.posts()] == [
        "/v1/messages",
        "/v1/messages/count_tokens",
    ]


@pytest.mark.parametrize("body", [BODY, STREAM])
def test_redirect_is_a_502_and_never_followed(hostile, witness, make_gateway, body):
    hostile.upstream.handler = redirect_answer(witness.origin + "/v1/messages", status=307)
    gw = make_gateway([anthropic_route(hostile)])
    message = anthropic_error(post(gw, body), 502, "api_error")
    assert "redirect" in message
    assert witness.upstream.requests == []
    assert len(hostile.upstream.posts()) == 1


# --- hostile answers ------------------------------------------------------------------------


def test_oversized_event_ends_the_stream_with_an_error_event(hostile, make_gateway):
    start = b"".join(anthropic_stream("hello ", stop=False)[:3]) + b"event: x\ndata: "
    hostile.upstream.handler = endless_answer(start, b"x" * 65536, 32 * 1024 * 1024)
    gw = make_gateway([anthropic_route(hostile)], max_event_bytes=256 * 1024)
    started = time.perf_counter()
    r = post(gw, STREAM)
    assert time.perf_counter() - started < 5.0
    assert r.status_code == 200
    events = named_events(r.text)
    assert [name for name, _ in events][:3] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    name, data = events[-1]
    assert name == "error" and "262144" in data["error"]["message"]
    assert eventually(lambda: hostile.upstream.disconnects)  # the rest is never read


def test_oversized_body_is_a_502(hostile, make_gateway):
    total = 8 * 1024 * 1024
    hostile.upstream.handler = endless_answer(
        b'{"junk": "', b"x" * 65536, total, content_type="application/json"
    )
    gw = make_gateway([anthropic_route(hostile)], max_response_bytes=1024 * 1024)
    anthropic_error(post(gw, BODY), 502, "api_error")


@pytest.mark.parametrize(
    "handler",
    [
        json_answer(b"<html>hi</html>", content_type="text/html"),
        json_answer(b'["not", "an", "object"]'),
    ],
)
def test_wrong_shaped_200_is_a_502(hostile, make_gateway, handler):
    hostile.upstream.handler = handler
    gw = make_gateway([anthropic_route(hostile)])
    anthropic_error(post(gw, BODY), 502, "api_error")


def test_stream_answered_with_json_is_a_502(hostile, make_gateway):
    hostile.upstream.handler = json_answer(MESSAGE)
    gw = make_gateway([anthropic_route(hostile)])
    anthropic_error(post(gw, STREAM), 502, "api_error")


def test_upstream_5xx_is_ours_and_upstream_4xx_passes(hostile, make_gateway):
    gw = make_gateway([anthropic_route(hostile)])
    hostile.upstream.handler = json_answer({"boom": "trace"}, status=500)
    message = anthropic_error(post(gw, BODY), 502, "api_error")
    assert "trace" not in message
    hostile.upstream.handler = json_answer(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        status=529,
    )
    anthropic_error(post(gw, BODY), 529, "overloaded_error")
    own = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad tool"}}
    hostile.upstream.handler = json_answer(own, status=400)
    assert anthropic_error(post(gw, BODY), 400, "invalid_request_error") == "bad tool"


def test_nothing_after_message_stop_is_forwarded(hostile, make_gateway):
    smuggled = anthropic_event(
        "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "SMUGGLED"}}
    )
    hostile.upstream.handler = sse_answer([*anthropic_stream("the end"), smuggled], then="hang")
    gw = make_gateway([anthropic_route(hostile)])
    r = post(gw, STREAM)
    assert "SMUGGLED" not in r.text
    assert named_events(r.text)[-1][0] == "message_stop"


@pytest.mark.parametrize("then", ["close", "reset"])
def test_stream_cut_before_message_stop_ends_with_an_error_event(hostile, make_gateway, then):
    hostile.upstream.handler = sse_answer(anthropic_stream("cut short", stop=False), then=then)
    gw = make_gateway([anthropic_route(hostile)])
    events = named_events(post(gw, STREAM).text)
    assert events[-1][0] == "error" and events[-1][1]["type"] == "error"


def test_route_timeout_mid_stream_ends_with_a_timeout_error_event(hostile, make_gateway):
    hostile.upstream.handler = sse_answer(anthropic_stream("slow", stop=False)[:3], then="hang")
    gw = make_gateway([anthropic_route(hostile, timeout_s=0.8)])
    events = named_events(post(gw, STREAM).text)
    assert [name for name, _ in events[:-1]][-1] == "content_block_delta"
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"]["type"] == "timeout_error" and "0.8s" in data["error"]["message"]
    assert eventually(lambda: hostile.upstream.disconnects)


def test_route_timeout_before_an_answer_is_a_504(hostile, make_gateway):
    async def never(request):
        await hang_until_gone(request)

    hostile.upstream.handler = never
    gw = make_gateway([anthropic_route(hostile, timeout_s=0.5)])
    anthropic_error(post(gw, BODY), 504, "timeout_error")


def test_client_leaving_mid_stream_closes_the_upstream_request(hostile, make_gateway):
    hostile.upstream.handler = sse_answer(anthropic_stream("first ", stop=False)[:3], then="hang")
    gw = make_gateway([anthropic_route(hostile)])
    with httpx.stream("POST", gw.url + "/v1/messages", json=STREAM, timeout=20) as r:
        for chunk in r.iter_bytes():
            if b"content_block_delta" in chunk:
                break
    assert eventually(lambda: hostile.upstream.disconnects, timeout=5.0)

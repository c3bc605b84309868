"""An upstream's error body is untrusted input like any other: what is read of it is bounded
(ERROR_BODY_BYTES), and the client gets it in its door's own error shape (OpenAI's, or
Anthropic's on /v1/messages) with the upstream's message kept, on every door and route kind."""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway.errors import ERROR_BODY_BYTES
from tests.security.hostile_upstream import json_answer
from tests.support.gateway import anthropic_route, openai_route

MESSAGES = [{"role": "user", "content": "hi"}]
# (path, body, the error shape the client must get)
DOORS = [
    ("/v1/chat/completions", {"model": "mock-1", "messages": MESSAGES}, "openai"),
    ("/v1/chat/completions", {"model": "mock-1", "messages": MESSAGES, "stream": True}, "openai"),
    ("/v1/chat/completions", {"model": "claude-1", "messages": MESSAGES}, "openai"),
    ("/v1/completions", {"model": "mock-1", "prompt": "hi"}, "openai"),
    ("/v1/responses", {"model": "mock-1", "input": "hi"}, "openai"),
    ("/v1/responses", {"model": "claude-1", "input": "hi"}, "openai"),
    ("/v1/embeddings", {"model": "mock-1", "input": "hi"}, "openai"),
    ("/v1/messages", {"model": "claude-1", "max_tokens": 4, "messages": MESSAGES}, "anthropic"),
    ("/v1/messages", {"model": "mock-1", "max_tokens": 4, "messages": MESSAGES}, "anthropic"),
    (
        "/v1/messages/count_tokens",
        {"model": "claude-1", "max_tokens": 4, "messages": MESSAGES},
        "anthropic",
    ),
]


def error_of(r: httpx.Response, shape: str) -> dict:
    """The error object of a response in `shape`, checked to be well-formed."""
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error", body
    error = body["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body
    return error


@pytest.fixture
def gateway(make_gateway, hostile):
    return make_gateway([openai_route(hostile), anthropic_route(hostile)], retry_attempts=1)


def post(gw, path: str, body: dict) -> httpx.Response:
    return httpx.post(gw.url + path, content=orjson.dumps(body), timeout=30)


@pytest.mark.parametrize("path,body,shape", DOORS)
def test_a_huge_text_error_is_cut_and_reshaped(gateway, hostile, path, body, shape):
    page = b"Bad request: the proxy refused it. " + b"x" * (4 * 1024 * 1024)
    hostile.upstream.handler = json_answer(page, status=400, content_type="text/plain")
    r = post(gateway, path, body)
    assert r.status_code == 400, r.text[:500]
    assert len(r.content) < ERROR_BODY_BYTES + 1024
    error = error_of(r, shape)
    assert error["message"].startswith("Bad request: the proxy refused it.")


@pytest.mark.parametrize("path,body,shape", DOORS)
def test_a_429_without_type_gets_one_and_keeps_its_message(gateway, hostile, path, body, shape):
    answer = {"error": {"message": "Slow down, tenant.", "code": "rate_limit_exceeded"}}
    hostile.upstream.handler = json_answer(answer, status=429)
    r = post(gateway, path, body)
    assert r.status_code == 429, r.text[:500]
    error = error_of(r, shape)
    assert error["message"] == "Slow down, tenant."
    assert error["type"] == "rate_limit_error"


@pytest.mark.parametrize("path,body,shape", DOORS)
def test_a_fastapi_detail_becomes_the_message(gateway, hostile, path, body, shape):
    hostile.upstream.handler = json_answer({"detail": "max_tokens is too large"}, status=400)
    r = post(gateway, path, body)
    assert r.status_code == 400, r.text[:500]
    assert error_of(r, shape)["message"] == "max_tokens is too large"


def test_a_well_formed_error_goes_as_it_came(gateway, hostile):
    answer = {
        "error": {"message": "no", "type": "invalid_request_error", "param": "x", "code": "c"},
        "extra": 1,
    }
    hostile.upstream.handler = json_answer(answer, status=400)
    r = post(gateway, "/v1/chat/completions", {"model": "mock-1", "messages": MESSAGES})
    assert r.status_code == 400 and r.json() == answer

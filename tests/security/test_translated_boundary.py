"""The Responses door and the translated doors (Messages on an `openai` route, Responses on an
`anthropic` route) against a hostile upstream and hostile clients: junk in the upstream's answer
never breaks the translation (the client gets its API's shapes or a clean error), a client that
leaves closes the upstream request, a native Responses stream is bounded, and nothing a door
refuses reaches the upstream."""

from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest

from tests.security.conftest import TENANT_A_KEY, UPSTREAM_KEY
from tests.security.hostile_upstream import (
    DONE,
    anthropic_stream,
    chunk,
    completion,
    json_answer,
    openai_stream,
    sse_answer,
)
from tests.support.gateway import anthropic_route, openai_route
from tests.support.waiting import eventually, named_events

MESSAGES_BODY = {
    "model": "gpt-x",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "secret prompt"}],
}
RESPONSES_BODY = {"model": "claude-x", "input": "secret prompt"}


def post(gw, path: str, body: object, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(
        gw.url + path,
        content=content,
        headers={"content-type": "application/json", **headers},
        timeout=20,
    )


JUNK_CHUNKS = [
    chunk(""),
    chunk("fine "),
    b'data: {"choices": [{"index": 0, "delta": {"content": 42}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": "not a list"}}]}\n\n',
    b'data: {"choices": "nope"}\n\n',
    b"data: [1, 2, 3]\n\n",
    chunk(finish="stop"),
    chunk(usage={"prompt_tokens": "many", "completion_tokens": -5}),
    DONE,
]


def test_junk_chat_chunks_still_give_a_well_formed_messages_stream(hostile, make_gateway):
    hostile.upstream.handler = sse_answer(JUNK_CHUNKS)
    gw = make_gateway([openai_route(hostile)])
    r = post(gw, "/v1/messages", {**MESSAGES_BODY, "stream": True})
    assert r.status_code == 200
    names = [name for name, _ in named_events(r.text)]
    assert names[0] == "message_start" and names[-1] in ("message_stop", "error")
    text = "".join(
        data["delta"].get("text", "")
        for name, data in named_events(r.text)
        if name == "content_block_delta"
    )
    assert text.startswith("fine ")
    for _, data in named_events(r.text):  # the usage never carries the upstream's junk
        usage = data.get("usage") or (data.get("message") or {}).get("usage") or {}
        assert all(isinstance(v, int) and v >= 0 for v in usage.values() if v is not None)


def test_junk_chat_completion_gives_an_anthropic_message(hostile, make_gateway):
    junk = completion("hi", usage={"prompt_tokens": [1], "completion_tokens": "x"})
    junk["choices"][0]["message"]["tool_calls"] = [{"function": "not an object"}, 7]
    hostile.upstream.handler = json_answer(junk)
    gw = make_gateway([openai_route(hostile)])
    client = anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0, timeout=20)
    try:
        message = client.messages.create(**MESSAGES_BODY)
    except anthropic.APIStatusError as exc:  # a clean refusal of the junk is fine too
        assert exc.status_code == 502 and exc.body["type"] == "error"  # type: ignore[index]
    else:
        assert message.usage.input_tokens == 0 and message.usage.output_tokens == 0


def test_anthropic_stream_cut_short_ends_a_responses_stream_with_an_error(hostile, make_gateway):
    hostile.upstream.handler = sse_answer(anthropic_stream("cut short", stop=False))
    gw = make_gateway([anthropic_route(hostile)])
    r = post(gw, "/v1/responses", {**RESPONSES_BODY, "stream": True})
    names = [name for name, _ in named_events(r.text)]
    assert names[0] == "response.created"
    assert "response.output_text.delta" in names
    assert names[-1] == "error" and "response.completed" not in names


def test_client_leaving_a_translated_stream_closes_the_upstream(hostile, make_gateway):
    hostile.upstream.handler = sse_answer(openai_stream("first ", done=False)[:2], then="hang")
    gw = make_gateway([openai_route(hostile)])
    body = {**MESSAGES_BODY, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=20) as r:
        for data in r.iter_bytes():
            if b"content_block_delta" in data:
                break
    assert eventually(lambda: hostile.upstream.disconnects, timeout=5.0)


def test_client_leaving_a_native_responses_stream_closes_the_upstream(hostile, make_gateway):
    created = b'event: response.created\ndata: {"type":"response.created","response":{}}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"delta":"a"}\n\n'
    hostile.upstream.handler = sse_answer([created, delta], then="hang")
    gw = make_gateway([openai_route(hostile)])
    body = {"model": "gpt-x", "input": "hi", "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=20) as r:
        for data in r.iter_bytes():
            if b"output_text.delta" in data:
                break
    assert eventually(lambda: hostile.upstream.disconnects, timeout=5.0)


def test_native_responses_event_over_its_limit_ends_with_an_error_event(hostile, make_gateway):
    big = b'event: response.output_text.delta\ndata: {"delta":"' + b"x" * 4096 + b'"}\n\n'
    hostile.upstream.handler = sse_answer([big])
    gw = make_gateway([openai_route(hostile)], max_event_bytes=1024)
    r = post(gw, "/v1/responses", {"model": "gpt-x", "input": "hi", "stream": True})
    (name, data), *_ = named_events(r.text)
    assert name == "error" and "FIRSTTOKEN_MAX_EVENT_BYTES" in data["error"]["message"]
    assert b"x" * 1024 not in r.content


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"model": "gpt-x", "input": {"not": "valid"}}),
        ("/v1/responses", {"model": "claude-x", "input": "hi", "previous_response_id": "resp_1"}),
        ("/v1/responses", {"model": "claude-x", "input": [{"type": "item_reference", "id": "x"}]}),
        ("/v1/messages", {"model": "gpt-x", "max_tokens": 8, "messages": "nope"}),
        (
            "/v1/messages",
            {**MESSAGES_BODY, "tools": [{"type": "web_search_20250305", "name": "w"}]},
        ),
    ],
)
def test_refused_bodies_never_reach_any_upstream(hostile, make_gateway, path, body):
    gw = make_gateway([anthropic_route(hostile), openai_route(hostile)])
    r = post(gw, path, body)
    assert r.status_code == 400
    assert hostile.upstream.posts() == []


def test_tenant_key_never_reaches_a_translated_upstream(hostile, make_gateway, tenant_settings):
    hostile.upstream.handler = json_answer(completion("ok"))
    gw = make_gateway([openai_route(hostile)], **tenant_settings)
    r = post(gw, "/v1/messages", MESSAGES_BODY, **{"x-api-key": TENANT_A_KEY})
    assert r.status_code == 200 and r.json()["type"] == "message"
    (sent,) = hostile.upstream.posts()
    headers = {k.lower(): v for k, v in sent["headers"].items()}
    assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert not any(TENANT_A_KEY in v for v in headers.values())
    assert post(gw, "/v1/responses", {"model": "gpt-x", "input": "x"}).status_code == 401

"""Every door authenticates, reads, parses and routes a request exactly once, translated
requests included: a door hands the admitted request on, it never re-encodes the body to be
admitted again, and a native exchange never authenticates or routes it a second time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

import gateway.boundary.admit as admit_module
import gateway.boundary.body as body_module
import gateway.doors.messages as messages_module
import gateway.doors.passthrough as passthrough_module
import gateway.doors.responses as responses_module
from gateway.boundary.auth import KeyRing
from gateway.config.routes import RouteTable
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, capture_events, openai_route, wait_for

KEYS = "acme:key-a"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How often each step of admission ran, wherever it is called from."""
    counted: Counter = Counter()

    def counting(step: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(original, "__wrapped_step__", None):
            return original

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counted[step] += 1
            return original(*args, **kwargs)

        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            counted[step] += 1
            return await original(*args, **kwargs)

        chosen = async_wrapper if step == "read" else wrapper
        chosen.__wrapped_step__ = True  # type: ignore[attr-defined]
        return chosen

    monkeypatch.setattr(KeyRing, "tenant_for", counting("authenticate", KeyRing.tenant_for))
    monkeypatch.setattr(RouteTable, "match", counting("route", RouteTable.match))
    parse = counting("parse", body_module.parse_json)
    for module in (body_module, responses_module, messages_module, passthrough_module):
        if hasattr(module, "parse_json"):
            monkeypatch.setattr(module, "parse_json", parse)
    read = counting("read", body_module.read_body)
    for module in (body_module, admit_module, passthrough_module):
        if hasattr(module, "read_body"):
            monkeypatch.setattr(module, "read_body", read)
    return counted


def once_each(calls: Counter) -> None:
    assert dict(calls) == {"authenticate": 1, "read": 1, "parse": 1, "route": 1}


@pytest.mark.parametrize("stream", [False, True])
def test_a_translated_messages_request_is_admitted_once(mock_upstream, make_gateway, calls, stream):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS)
    events = capture_events(gw)
    calls.clear()
    client = anthropic.Anthropic(base_url=gw.url, api_key="key-a", max_retries=0, timeout=20)
    request = {
        "model": "gpt-x",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Hello?"}],
    }
    if stream:
        with client.messages.stream(**request) as answer:
            text = "".join(answer.text_stream)
    else:
        text = "".join(
            b.text for b in client.messages.create(**request).content if b.type == "text"
        )
    assert text  # the chat answer came back in Anthropic's shape
    once_each(calls)
    (event,) = wait_for(events, api="messages")
    assert event.tenant == "acme" and event.status == "ok"
    (sent,) = [r for r in mock_upstream.mock.requests if r["path"] == "/v1/chat/completions"]
    assert sent["body"]["messages"][-1]["content"] in (
        "Hello?",
        [{"type": "text", "text": "Hello?"}],
    )


def test_a_native_responses_request_is_admitted_once(mock_upstream, make_gateway, calls):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS)
    events = capture_events(gw)
    calls.clear()
    response = sdk_client(gw, "key-a").responses.create(model="gpt-x", input="Hello?")
    assert response.output_text
    once_each(calls)
    (event,) = wait_for(events, api="responses")
    assert event.tenant == "acme" and event.status == "ok"


def test_a_chat_request_is_admitted_once(mock_upstream, make_gateway, calls):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS)
    calls.clear()
    client = sdk_client(gw, "key-a")
    answer = client.chat.completions.create(
        model="gpt-x", messages=[{"role": "user", "content": "Hello?"}]
    )
    assert answer.choices[0].message.content
    once_each(calls)


def test_a_native_messages_request_is_admitted_once(mock_upstream, make_gateway, calls):
    gw = make_gateway([anthropic_route(mock_upstream)], tenant_keys=KEYS)
    calls.clear()
    client = anthropic.Anthropic(base_url=gw.url, api_key="key-a", max_retries=0, timeout=20)
    message = client.messages.create(
        model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "Hello?"}]
    )
    assert message.content
    once_each(calls)


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
def test_count_tokens_is_admitted_once_natively_and_translated(
    mock_upstream, make_gateway, calls, kind
):
    route = anthropic_route(mock_upstream) if kind == "anthropic" else openai_route(mock_upstream)
    route["models"] = ["*"]  # claude-x: natively to anthropic, translated to openai
    gw = make_gateway([route], tenant_keys=KEYS)
    calls.clear()
    client = anthropic.Anthropic(base_url=gw.url, api_key="key-a", max_retries=0, timeout=20)
    counted = client.messages.count_tokens(
        model="claude-x", messages=[{"role": "user", "content": "Hello?"}]
    )
    assert counted.input_tokens > 0
    once_each(calls)


def test_a_passthrough_request_is_admitted_once(mock_upstream, make_gateway, calls):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS)
    calls.clear()
    embedding = sdk_client(gw, "key-a").embeddings.create(model="gpt-embed", input="hello")
    assert embedding.data
    once_each(calls)

"""What a client sees of the gateway itself: the model list and lookups, request ids and the
upstream's rate-limit headers, through the real OpenAI SDK."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV, anthropic_route, openai_route

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def two_kinds(mock_upstream, make_gateway):
    routes = [
        {
            "name": "pinned",
            "models": ["gpt-pinned"],
            "kind": "openai",
            "base_url": mock_upstream.base_url,
            "api_key_env": UPSTREAM_KEY_ENV,
        },
        openai_route(
            mock_upstream, model_map={"fast": "mock-model"}, models=["mock-*", "gpt-*", "fast"]
        ),
        anthropic_route(mock_upstream),
        # Shadowed: every name it lists is served by an earlier route.
        openai_route(mock_upstream, name="shadow", models=["gpt-shadowed", "mock-*"]),
    ]
    gw = make_gateway(routes)
    gw.wait_ready()
    return gw


def test_models_list_holds_servable_names_each_with_its_serving_route(two_kinds):
    cards = {m.id: m for m in sdk_client(two_kinds).models.list().data}
    # The upstream's own list, filtered by the route's patterns; aliases; Anthropic's list.
    assert cards["mock-model"].owned_by == "mock"
    assert cards["fast"].owned_by == "mock"
    assert cards["gpt-pinned"].owned_by == "pinned"
    assert cards["claude-mock-4"].owned_by == "anthropic"
    assert cards["claude-mock-4"].created == 1747872000  # 2025-05-22T00:00:00Z
    # Patterns are not names, and a name is listed once, by the route that serves it:
    # `gpt-shadowed` matches the `mock` route's `gpt-*` first.
    assert not [name for name in cards if any(ch in name for ch in "*?[")]
    assert cards["gpt-shadowed"].owned_by == "mock"
    assert "shadow" not in {card.owned_by for card in cards.values()}


def test_models_retrieve_answers_for_every_listed_name_and_404s_the_rest(two_kinds, mock_upstream):
    client = sdk_client(two_kinds)
    listed = client.models.list().data
    before = len(mock_upstream.mock.requests)
    for card in listed:
        assert client.models.retrieve(card.id) == card
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"
    # Served by the gateway: nothing was passed through to an upstream.
    assert [r for r in mock_upstream.mock.requests[before:] if "/models/" in r["path"]] == []


def test_a_local_style_route_lists_only_names_its_patterns_accept(mock_upstream, make_gateway):
    # The upstream lists `mock-model`; a route for `local-*` must not offer it.
    gw = make_gateway([openai_route(mock_upstream, models=["local-*"])])
    gw.wait_ready()
    assert [m.id for m in sdk_client(gw).models.list().data] == []


def test_request_id_is_the_upstreams_when_it_sends_one(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.answer_headers = {
        "x-request-id": "req_upstream_1",
        "openai-processing-ms": "12",
        "x-ratelimit-remaining-requests": "99",
    }
    gw = make_gateway([openai_route(mock_upstream)])
    client = sdk_client(gw)
    raw = client.chat.completions.with_raw_response.create(model="mock-a", messages=MESSAGES)
    assert raw.request_id == "req_upstream_1"
    assert raw.headers["openai-processing-ms"] == "12"
    assert raw.headers["x-ratelimit-remaining-requests"] == "99"
    assert len(raw.headers.get_list("x-request-id")) == 1
    streamed = client.chat.completions.with_raw_response.create(
        model="mock-a", messages=MESSAGES, stream=True
    )
    assert streamed.request_id == "req_upstream_1"
    assert streamed.headers["x-ratelimit-remaining-requests"] == "99"
    assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)


def test_request_id_is_the_gateways_own_when_the_upstream_sends_none(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    client = sdk_client(gw)
    ids = [
        client.chat.completions.with_raw_response.create(
            model="mock-a", messages=MESSAGES, stream=stream
        ).request_id
        for stream in (False, True)
    ]
    assert all(i and i.startswith("req_") for i in ids)
    assert ids[0] != ids[1]
    # Errors carry one too, from the gateway's own checks and from other endpoints.
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="unrouted", messages=MESSAGES)
    assert caught.value.request_id.startswith("req_")
    for path in ("/v1/models", "/healthz", "/v1/nowhere"):
        assert httpx.get(gw.url + path).headers["x-request-id"].startswith("req_")


def test_anthropic_request_id_reaches_the_client_as_x_request_id(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.answer_headers = {
        "request-id": "req_anthropic_7",
        "anthropic-ratelimit-requests-remaining": "41",
    }
    gw = make_gateway([anthropic_route(mock_upstream)])
    client = sdk_client(gw)
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model="claude-x", messages=MESSAGES, stream=stream
        )
        assert raw.request_id == "req_anthropic_7"
        assert raw.headers["anthropic-ratelimit-requests-remaining"] == "41"


def test_anthropic_answers_name_the_model_the_client_asked_for(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream, model_map={"claude-x": "claude-upstream"})])
    client = sdk_client(gw)
    assert client.chat.completions.create(model="claude-x", messages=MESSAGES).model == "claude-x"
    chunks = list(client.chat.completions.create(model="claude-x", messages=MESSAGES, stream=True))
    assert {c.model for c in chunks} == {"claude-x"}
    assert mock_upstream.mock.requests[-1]["body"]["model"] == "claude-upstream"


def test_prometheus_scrapes_are_gzipped_when_the_scraper_takes_it(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    sdk_client(gw).chat.completions.create(model="mock-a", messages=MESSAGES)
    plain = httpx.get(gw.url + "/metrics", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert "# TYPE firsttoken_ttft_seconds histogram" in plain.text
    raw = httpx.get(gw.url + "/metrics", headers={"accept-encoding": "gzip"})
    assert raw.headers["content-encoding"] == "gzip"
    assert int(raw.headers["content-length"]) < len(plain.content)
    assert raw.text.splitlines()[0] == plain.text.splitlines()[0]  # httpx decompressed it


def test_the_request_id_a_client_got_is_in_the_gateways_log(mock_upstream, make_gateway, caplog):
    mock_upstream.mock.behaviour.fail_statuses = [500, 500]
    gw = make_gateway([openai_route(mock_upstream)])
    with caplog.at_level(logging.INFO, logger="firsttoken.proxy"):
        with pytest.raises(openai.InternalServerError) as caught:
            sdk_client(gw).chat.completions.create(model="mock-a", messages=MESSAGES)
    request_id = caught.value.response.headers["x-request-id"]
    assert request_id.startswith("req_")
    assert any(request_id in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "door", ["chat", "chat-stream", "responses", "messages", "models", "unrouted", "405"]
)
def test_a_clients_well_formed_request_id_is_kept_on_every_door(mock_upstream, make_gateway, door):
    gw = make_gateway([openai_route(mock_upstream)])
    mine = "trace-01HZX3:span.7/ab+c="
    headers = {"x-request-id": mine, "authorization": "Bearer k"}
    chat = {"model": "mock-a", "messages": MESSAGES}
    calls = {
        "chat": ("POST", "/v1/chat/completions", chat),
        "chat-stream": ("POST", "/v1/chat/completions", {**chat, "stream": True}),
        "responses": ("POST", "/v1/responses", {"model": "mock-a", "input": "hi"}),
        "messages": ("POST", "/v1/messages", {**chat, "max_tokens": 5}),
        "models": ("GET", "/v1/models", None),
        "unrouted": ("POST", "/v1/chat/completions", {**chat, "model": "unrouted"}),
        "405": ("GET", "/v1/chat/completions", None),
    }
    method, path, body = calls[door]
    answer = httpx.request(method, gw.url + path, json=body, headers=headers, timeout=20)
    assert answer.headers.get_list("x-request-id") == [mine]
    # the upstream never gets it: what pairs a request's steps upstream stays the gateway's
    assert all(mine not in r["headers"].values() for r in mock_upstream.mock.requests)


@pytest.mark.parametrize(
    "sent", ["", "a" * 129, "has space", "semi;colon", "ünïcode", "new\\nline", 'q"uote']
)
def test_a_malformed_request_id_is_replaced_by_the_gateways(mock_upstream, make_gateway, sent):
    gw = make_gateway([openai_route(mock_upstream)])
    answer = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "mock-a", "messages": MESSAGES},
        headers={"x-request-id": sent.encode("utf-8")},
        timeout=20,
    )
    assert answer.status_code == 200
    (named,) = answer.headers.get_list("x-request-id")
    assert named.startswith("req_") and named != sent


def test_a_translated_messages_answer_names_its_id_as_the_anthropic_sdk_reads_it(
    mock_upstream, make_gateway
):
    import anthropic

    gw = make_gateway([openai_route(mock_upstream)])
    client = anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0, timeout=20)
    request = {"model": "mock-a", "max_tokens": 5, "messages": MESSAGES}
    whole = client.messages.with_raw_response.create(**request)
    assert whole.request_id and whole.request_id == whole.headers["x-request-id"]
    assert whole.request_id.startswith("req_")
    assert whole.parse()._request_id == whole.request_id
    streamed = client.messages.with_raw_response.create(**request, stream=True)
    assert streamed.request_id and streamed.request_id == streamed.headers["x-request-id"]
    assert [event.type for event in streamed.parse()][-1] == "message_stop"
    mock_upstream.mock.behaviour.fail_statuses = [400]  # an upstream error, translated
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**request)
    assert caught.value.request_id == caught.value.response.headers["x-request-id"]
    kept = client.messages.with_raw_response.create(
        **request, extra_headers={"x-request-id": "my-trace-1"}
    )
    assert kept.request_id == "my-trace-1"

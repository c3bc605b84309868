"""Every error status the gateway itself produces, in OpenAI's shape, as the SDK sees it."""

from __future__ import annotations

import httpx
import openai
import pytest

from bench.harness import free_port
from gateway.config.settings import Settings
from tests.support.clients import sdk_client
from tests.support.gateway import GatewayThread, openai_route

MESSAGES = [{"role": "user", "content": "hi"}]


def test_malformed_json_is_400(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MESSAGES}, "model"),
        ({"model": 3, "messages": MESSAGES}, "model"),
        ({"model": "mock-1"}, "messages"),
        ({"model": "mock-1", "messages": []}, "messages"),
    ],
)
def test_missing_or_invalid_fields_are_400(mock_upstream, make_gateway, body, param):
    gw = make_gateway([openai_route(mock_upstream)])
    with pytest.raises(openai.BadRequestError) as err:
        sdk_client(gw).post("/chat/completions", body=body, cast_to=object)
    assert err.value.body["param"] == param


def test_unknown_tenant_key_is_401_and_known_key_works(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys="acme:good-key")
    with pytest.raises(openai.AuthenticationError):
        sdk_client(gw, "bad-key").chat.completions.create(model="mock-1", messages=MESSAGES)
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "mock-1", "messages": MESSAGES})
    assert r.status_code == 401 and "good-key" not in r.text
    assert (
        sdk_client(gw, "good-key")
        .chat.completions.create(model="mock-1", messages=MESSAGES)
        .choices
    )


def test_unrouted_model_is_404(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    with pytest.raises(openai.NotFoundError):
        sdk_client(gw).chat.completions.create(model="llama-9", messages=MESSAGES)


def test_body_over_limit_is_413(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], max_body_bytes=2000)
    with pytest.raises(openai.APIStatusError) as err:
        sdk_client(gw).chat.completions.create(
            model="mock-1", messages=[{"role": "user", "content": "x" * 5000}]
        )
    assert err.value.status_code == 413
    assert mock_upstream.mock.requests == []


def test_upstream_5xx_after_retries_is_502(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.fail_statuses = [500, 500]
    gw = make_gateway([openai_route(mock_upstream)], retry_attempts=2)
    with pytest.raises(openai.APIStatusError) as err:
        sdk_client(gw).chat.completions.create(model="mock-1", messages=MESSAGES, stream=True)
    assert err.value.status_code == 502
    assert len(mock_upstream.mock.requests) == 2


def test_upstream_503_is_503_and_unreachable_is_503(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.fail_statuses = [503]
    gw = make_gateway(
        [
            openai_route(mock_upstream),
            {
                "name": "down",
                "models": ["down-*"],
                "kind": "openai",
                "base_url": f"http://127.0.0.1:{free_port()}/v1",
            },
        ],
        retry_attempts=1,
    )
    with pytest.raises(openai.InternalServerError) as err:
        sdk_client(gw).chat.completions.create(model="mock-1", messages=MESSAGES)
    assert err.value.status_code == 503
    with pytest.raises(openai.InternalServerError) as err:
        sdk_client(gw).chat.completions.create(model="down-1", messages=MESSAGES)
    assert err.value.status_code == 503


def test_upstream_4xx_passes_through_with_body(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.fail_statuses = [422]
    gw = make_gateway([openai_route(mock_upstream)])
    with pytest.raises(openai.UnprocessableEntityError) as err:
        sdk_client(gw).chat.completions.create(model="mock-1", messages=MESSAGES)
    assert err.value.body["message"] == "mock failure 422"
    assert len(mock_upstream.mock.requests) == 1


def test_no_route_configured_is_503_with_help(make_gateway, monkeypatch):
    monkeypatch.setattr("gateway.runtime.engine_installed", lambda: False)
    with GatewayThread(Settings()) as gw:
        with pytest.raises(openai.InternalServerError) as err:
            sdk_client(gw).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.status_code == 503
    assert "OPENAI_API_KEY" in err.value.message and "FIRSTTOKEN_ROUTES" in err.value.message

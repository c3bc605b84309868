"""The `azure` route kind against an Azure OpenAI mock at Azure's wire format: what Azure's own
SDK (`openai.AzureOpenAI`) sends is what the gateway sends, and the plain OpenAI SDK works
through the gateway (stream, non-stream, tools, 429, retries before the first byte)."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from bench.mock_openai import ThreadedServer
from gateway.config.settings import load_settings
from tests.ops.test_metrics_through_gateway import wait_for_count
from tests.support.azure_mock import AzureBehaviour, AzureMock
from tests.support.clients import sdk_client

KEY_ENV = "AZURE_OPENAI_API_KEY"
VERSION = "2024-10-21"
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def azure():
    mock = AzureMock(AzureBehaviour())
    with ThreadedServer(mock) as server:  # type: ignore[arg-type]
        yield mock, f"http://127.0.0.1:{server.port}"


def azure_route(root: str, **extra) -> dict:
    return {
        "name": "az",
        "models": ["gpt-*", "text-embedding-*"],
        "kind": "azure",
        "base_url": root,
        "api_version": VERSION,
        "model_map": {"gpt-4o-mini": "my-deployment", "text-embedding-3-small": "embed-deployment"},
        "api_key_env": KEY_ENV,
        **extra,
    }


def gateway(make_gateway, root: str, **settings):
    routes = [azure_route(root, **settings.pop("route", {}))]
    return make_gateway(
        routes, environ={KEY_ENV: "azure-secret"}, tenant_keys="acme:key-a", **settings
    )


def azure_sdk(root: str) -> openai.AzureOpenAI:
    return openai.AzureOpenAI(
        azure_endpoint=root, api_key="azure-secret", api_version=VERSION, max_retries=0, timeout=10
    )


def wire(request: dict) -> tuple:
    """What identifies a request on Azure's side: method, path, query and auth headers."""
    headers = request["headers"]
    return (
        request["method"],
        request["raw_path"].split("?")[0],
        request["query"],
        headers.get("api-key"),
        "authorization" in headers,
    )


def test_the_gateway_sends_what_azure_s_sdk_sends(azure, make_gateway):
    mock, root = azure
    sdk = azure_sdk(root)
    sdk.chat.completions.create(model="my-deployment", messages=MESSAGES)
    list(sdk.chat.completions.create(model="my-deployment", messages=MESSAGES, stream=True))
    sdk.embeddings.create(model="embed-deployment", input="hi")
    sdk.files.list()
    from_sdk = [wire(r) for r in mock.requests]
    mock.requests.clear()
    client = sdk_client(gateway(make_gateway, root), "key-a")
    client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    list(client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True))
    client.embeddings.create(model="text-embedding-3-small", input="hi")
    client.files.list()
    from_gateway = [wire(r) for r in mock.requests if r["path"] != "/openai/models"]
    assert from_gateway == from_sdk
    assert from_sdk[0] == (
        "POST",
        "/openai/deployments/my-deployment/chat/completions",
        {"api-version": VERSION},
        "azure-secret",
        False,
    )
    assert from_sdk[3][1] == "/openai/files"


def test_stream_non_stream_and_usage_through_the_openai_sdk(azure, make_gateway):
    mock, root = azure
    gw = gateway(make_gateway, root)
    client = sdk_client(gw, "key-a")
    whole = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert whole.choices[0].message.content == "hello from azure"
    assert whole.usage.prompt_tokens_details.cached_tokens == 1024
    assert whole.model_extra["prompt_filter_results"][0]["prompt_index"] == 0
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "hello from azure"
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 1024
    sent = mock.requests[-1]
    assert sent["body"]["model"] == "my-deployment"
    assert "prompt_cache_key" not in sent["body"]
    assert sent["body"]["stream_options"] == {"include_usage": True}
    route = wait_for_count(gw, "key-a", 2)["routes"][0]
    assert route["route"] == "az" and route["cached_prompt_tokens"] == 2048


def test_tools_stream_and_non_stream(azure, make_gateway):
    _, root = azure
    client = sdk_client(gateway(make_gateway, root), "key-a")
    whole = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == '{"city":"Paris"}'
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS, stream=True
        )
    )
    arguments = "".join(
        d.function.arguments or ""
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or ()
    )
    assert arguments == '{"city":"Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_unmapped_models_name_their_deployment(azure, make_gateway):
    mock, root = azure
    client = sdk_client(gateway(make_gateway, root), "key-a")
    client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert mock.requests[-1]["path"] == "/openai/deployments/gpt-4o/chat/completions"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-unknown", messages=MESSAGES)
    assert caught.value.body["code"] == "DeploymentNotFound"


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4o/../../files",
        "gpt-4o?api-version=1",
        "gpt-4o#x",
        "gpt-4o\\x",
        "gpt-4o x",
        "gpt-4o%2fx",
        "gpt-" + "a" * 70,
    ],
)
def test_a_model_name_never_changes_the_path(azure, make_gateway, model):
    mock, root = azure
    gw = gateway(make_gateway, root)
    answer = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES},
        headers={"authorization": "Bearer key-a"},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "model"
    assert [r for r in mock.requests if "chat" in r["path"]] == []


def test_429_reaches_the_client_with_retry_after(azure, make_gateway):
    mock, root = azure
    mock.behaviour.fail_429 = 5
    client = sdk_client(gateway(make_gateway, root, retry_attempts=1), "key-a")
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert caught.value.status_code == 429
    assert caught.value.response.headers["retry-after"] == "0"
    assert caught.value.response.headers["retry-after-ms"] == "10"
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert "exceeded token rate limit" in caught.value.body["message"]
    assert "azure-secret" not in caught.value.response.text


def test_429_then_success_is_retried_before_the_first_byte(azure, make_gateway):
    mock, root = azure
    mock.behaviour.fail_429 = 1
    client = sdk_client(gateway(make_gateway, root, retry_attempts=2), "key-a")
    chunks = list(
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)
    )
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert mock.chat_calls == 2


def test_no_first_token_in_time_is_retried(azure, make_gateway):
    mock, root = azure
    mock.behaviour.hang_first_s = 3.0
    gw = gateway(make_gateway, root, retry_attempts=2, route={"first_token_timeout_s": 1.0})
    client = sdk_client(gw, "key-a")
    chunks = list(
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "hello from azure"
    )
    assert mock.chat_calls == 2


def test_passthrough_families_map_to_azure_s_paths(azure, make_gateway):
    mock, root = azure
    gw = gateway(make_gateway, root)
    client = sdk_client(gw, "key-a")
    embedded = client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert embedded.data[0].embedding == [0.1, 0.2]
    sent = mock.requests[-1]
    assert sent["path"] == "/openai/deployments/embed-deployment/embeddings"
    assert sent["query"] == {"api-version": VERSION}
    assert "authorization" not in sent["headers"]
    listed = httpx.get(
        gw.url + "/v1/files",
        params={"api-version": "1999-01-01", "limit": "2"},
        headers={"authorization": "Bearer key-a"},
    )
    assert listed.status_code == 200
    assert mock.requests[-1]["query"] == {"limit": "2", "api-version": VERSION}
    missing = httpx.post(
        gw.url + "/v1/moderations",
        json={"model": "gpt-4o-mini", "input": "x"},
        headers={"authorization": "Bearer key-a"},
    )
    assert missing.status_code == 404
    assert "Azure" in missing.json()["error"]["message"]


def test_v1_surface_takes_the_deployment_in_the_body(azure, make_gateway):
    mock, root = azure
    gw = gateway(make_gateway, root, route={"api_version": "v1"})
    client = sdk_client(gw, "key-a")
    whole = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert whole.choices[0].message.content == "hello from azure"
    sent = mock.requests[-1]
    assert sent["path"] == "/openai/v1/chat/completions" and sent["query"] == {}
    assert sent["body"]["model"] == "my-deployment"
    assert sent["headers"]["api-key"] == "azure-secret" and "authorization" not in sent["headers"]
    list(client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True))
    client.embeddings.create(model="embed-deployment", input="hi")
    assert mock.requests[-1]["path"] == "/openai/v1/embeddings"


def test_messages_and_responses_doors_on_an_azure_route(azure, make_gateway):
    _, root = azure
    gw = gateway(make_gateway, root)
    headers = {"x-api-key": "key-a", "anthropic-version": "2023-06-01"}
    body = {"model": "gpt-4o-mini", "max_tokens": 16, "messages": MESSAGES}
    message = httpx.post(gw.url + "/v1/messages", json=body, headers=headers).json()
    assert message["content"][0]["text"] == "hello from azure"
    assert message["usage"]["cache_read_input_tokens"] == 1024
    response = sdk_client(gw, "key-a").responses.create(model="gpt-4o-mini", input="hi")
    assert response.output_text == "hello from azure"
    assert response.usage.input_tokens_details.cached_tokens == 1024


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"api_version": None}, "needs api_version"),
        ({"api_version": "yesterday"}, "needs api_version"),
        ({"model_map": {"gpt-4o": "a/../b"}}, "not valid Azure deployment names"),
        ({"base_url": None}, "needs base_url"),
    ],
)
def test_route_config_is_checked_at_start(extra, message):
    route = {**azure_route("https://res.openai.azure.com"), **extra}
    with pytest.raises(ValueError) as caught:
        load_settings(environ={}, routes=orjson.dumps([route]).decode())
    assert message in str(caught.value)


def test_a_big_body_of_an_azure_chain_is_prepared_in_a_worker(monkeypatch):
    """A worker prepares an azure route's body like an openai route's (the upstream takes
    OpenAI's JSON as it is); only an anthropic route in the chain keeps it in the gateway."""
    from gateway.config.routes import Route, RouteTable
    from gateway.config.settings import Settings
    from gateway.pipeline import big_bodies
    from gateway.pipeline.policies import PolicyRunner

    settings = Settings()
    routes = [
        Route.model_validate(azure_route("https://res.openai.azure.com")),
        Route.model_validate(
            {"name": "claude", "models": ["claude-*"], "kind": "anthropic", "base_url": "http://x"}
        ),
    ]
    worker = {
        "settings": settings,
        "table": RouteTable(routes),
        "policies": PolicyRunner(settings, routes),
    }
    monkeypatch.setattr(big_bodies, "_WORKER", worker)
    body = {"model": "gpt-4o-mini", "messages": MESSAGES}
    prepared = big_bodies.prepare(orjson.dumps(body), "chat", "acme", None, False, False)
    assert isinstance(prepared, big_bodies.Prepared)
    claude = {**body, "model": "claude-3-5-haiku"}
    kept = big_bodies.prepare(orjson.dumps(claude), "chat", "acme", None, False, False)
    assert isinstance(kept, big_bodies.NotHere)


def test_legacy_completions_go_to_the_deployment(azure, make_gateway):
    mock, root = azure
    client = sdk_client(gateway(make_gateway, root), "key-a")
    with pytest.raises(openai.NotFoundError) as caught:  # the mock has no completions model
        client.completions.create(model="gpt-4o-mini", prompt="hi")
    assert caught.value.body["message"] == "Resource not found"
    sent = mock.requests[-1]
    assert sent["path"] == "/openai/deployments/my-deployment/completions"
    assert sent["query"] == {"api-version": VERSION}

"""`bedrock` routes end to end against a mock Bedrock runtime at its wire format: the OpenAI
SDK through InvokeModel (Claude) and Converse, the Anthropic SDK on `/v1/messages`, SigV4
signatures verified with botocore, errors and in-stream exceptions, cached tokens counted."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta

import anthropic
import botocore.session
import openai
import orjson
import pytest
from aiohttp import web

from bench.mock_openai import ThreadedServer
from tests.support import mock_bedrock
from tests.support.gateway import capture_events, wait_for
from tests.support.mock_bedrock import AWS_ENV, CACHE_READ, CACHE_WRITE, MockBedrock

CLAUDE = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
NOVA = "amazon.nova-pro-v1:0"
ARN = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/abc123def456"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def bedrock(monkeypatch):
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with ThreadedServer(MockBedrock()) as server:
        yield server


def bedrock_route(server, **extra) -> dict:
    return {
        "name": "bedrock",
        "models": ["*anthropic.*", "amazon.*", "arn:*", "claude-alias"],
        "kind": "bedrock",
        "region": mock_bedrock.REGION,
        "base_url": f"http://127.0.0.1:{server.port}",
        **extra,
    }


def chat_client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="client-key", max_retries=0, timeout=20)


def last(server) -> dict:
    request = server.mock.requests[-1]
    assert request["verified"], "the mock could not verify the request's SigV4 signature"
    return request


def test_claude_streams_through_invoke_model_with_a_verified_signature(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    events = capture_events(gw)
    stream = chat_client(gw).chat.completions.create(
        model=CLAUDE,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from Bedrock"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == CACHE_READ
    assert usage.prompt_tokens == 12 + CACHE_READ + CACHE_WRITE
    sent = last(bedrock)
    assert (
        sent["raw_path"]
        == "/model/us.anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke-with-response-stream"
    )
    assert sent["headers"]["Accept"] == "application/vnd.amazon.eventstream"
    body = sent["body"]
    assert body["anthropic_version"] == "bedrock-2023-05-31"
    assert "model" not in body and "stream" not in body
    assert body["system"][0]["text"] == "Be brief."
    (event,) = wait_for(events, route="bedrock")
    assert event.cached_prompt_tokens == CACHE_READ and event.status == "ok"


def test_claude_tool_call_whole_and_streamed(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    client = chat_client(gw)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.chat.completions.create(model=CLAUDE, messages=messages, tools=TOOLS)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and orjson.loads(call.function.arguments) == {
        "city": "Paris"
    }
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.usage.prompt_tokens_details.cached_tokens == CACHE_READ
    assert last(bedrock)["action"] == "invoke"
    assert last(bedrock)["body"]["tools"][0]["name"] == "get_weather"
    chunks = list(
        client.chat.completions.create(model=CLAUDE, messages=messages, tools=TOOLS, stream=True)
    )
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    )
    assert orjson.loads(arguments) == {"city": "Paris"}


def test_converse_stream_and_whole_with_tools_and_cache_points(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    events = capture_events(gw)
    client = chat_client(gw)
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]
    messages = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
            ],
        },
        {"role": "user", "content": "Weather in Paris?"},
    ]
    chunks = list(
        client.chat.completions.create(
            model=NOVA,
            messages=messages,
            tools=tools,
            max_tokens=100,
            temperature=0.5,
            stop=["END"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = [
        c.choices[0].delta.tool_calls[0]
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert calls[0].id == "tooluse_1" and calls[0].function.name == "get_weather"
    assert orjson.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == CACHE_READ
    sent = last(bedrock)
    assert sent["raw_path"] == "/model/amazon.nova-pro-v1%3A0/converse-stream"
    body = sent["body"]
    assert body["system"] == [{"text": "Be brief."}, {"cachePoint": {"type": "default"}}]
    assert body["messages"] == [{"role": "user", "content": [{"text": "Weather in Paris?"}]}]
    assert body["inferenceConfig"] == {
        "maxTokens": 100,
        "temperature": 0.5,
        "stopSequences": ["END"],
    }
    spec = body["toolConfig"]["tools"]
    assert spec[0]["toolSpec"]["name"] == "get_weather"
    assert spec[0]["toolSpec"]["inputSchema"]["json"]["properties"] == {"city": {"type": "string"}}
    assert spec[1] == {"cachePoint": {"type": "default"}}
    whole = client.chat.completions.create(model=NOVA, messages=[{"role": "user", "content": "Hi"}])
    assert whole.choices[0].message.content == "Hello from Nova"
    assert whole.usage.prompt_tokens_details.cached_tokens == CACHE_READ
    assert whole.usage.model_extra["cacheReadInputTokens"] == CACHE_READ  # Bedrock's own field
    assert last(bedrock)["action"] == "converse"
    recorded = wait_for(events, count=2, route="bedrock")
    assert [e.cached_prompt_tokens for e in recorded] == [CACHE_READ, CACHE_READ]


def test_tool_round_trip_is_tool_use_and_tool_result_blocks(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "tooluse_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "tooluse_1", "content": "Sunny"},
    ]
    chat_client(gw).chat.completions.create(model=NOVA, messages=messages, tools=TOOLS)
    turns = last(bedrock)["body"]["messages"]
    assert turns[1] == {
        "role": "assistant",
        "content": [
            {
                "toolUse": {
                    "toolUseId": "tooluse_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            }
        ],
    }
    assert turns[2] == {
        "role": "user",
        "content": [{"toolResult": {"toolUseId": "tooluse_1", "content": [{"text": "Sunny"}]}}],
    }


def test_in_stream_throttling_before_the_first_byte_is_a_429(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)], retry_attempts=2)
    bedrock.mock.script.stream_exceptions = ["throttlingException"] * 2
    with pytest.raises(openai.RateLimitError) as caught:
        list(
            chat_client(gw).chat.completions.create(
                model=CLAUDE, messages=[{"role": "user", "content": "Hi"}], stream=True
            )
        )
    assert caught.value.status_code == 429
    assert "throttlingException" in caught.value.message
    assert len(bedrock.mock.requests) == 2  # retried once before the client saw a byte


def test_throttle_retried_once_then_the_answer_streams(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)], retry_attempts=2)
    bedrock.mock.script.stream_exceptions = ["throttlingException"]
    chunks = list(
        chat_client(gw).chat.completions.create(
            model=NOVA, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from Nova"
    )


def test_exception_after_content_is_an_in_stream_error(bedrock, make_gateway):
    import httpx

    gw = make_gateway([bedrock_route(bedrock)])
    seen_content = threading.Event()
    bedrock.mock.script.late_exception = "modelStreamErrorException"
    bedrock.mock.script.late_gate = seen_content  # thrown only once the client has content
    body = {"model": NOVA, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    payloads = []
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json=body,
        timeout=20,
        headers={"authorization": "Bearer client-key"},
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:])
                if '"Hello"' in line:
                    seen_content.set()
    assert seen_content.is_set()
    error = orjson.loads(payloads[-2])["error"]
    assert "modelStreamErrorException" in error["message"]
    assert payloads[-1] == "[DONE]"
    assert len(bedrock.mock.requests) == 1  # never retried once content went out


@pytest.mark.parametrize(
    ("status", "kind", "expected"),
    [
        (429, "ThrottlingException", openai.RateLimitError),
        (400, "ValidationException", openai.BadRequestError),
        (403, "AccessDeniedException", openai.PermissionDeniedError),
        (404, "ResourceNotFoundException", openai.NotFoundError),
    ],
)
def test_http_errors_keep_their_status(bedrock, make_gateway, status, kind, expected):
    gw = make_gateway([bedrock_route(bedrock)], retry_attempts=1)
    bedrock.mock.script.http_errors = [(status, kind, "no good")]
    with pytest.raises(expected) as caught:
        chat_client(gw).chat.completions.create(
            model=NOVA, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.status_code == status and "no good" in caught.value.message
    assert caught.value.response.headers["x-request-id"] == "req-bedrock-error"


def test_throttling_passes_retry_after_and_unavailable_is_a_503(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)], retry_attempts=1)
    bedrock.mock.script.retry_after = "7"
    bedrock.mock.script.http_errors = [
        (429, "ThrottlingException", "slow down"),
        (503, "ServiceUnavailableException", "busy"),
    ]
    client = chat_client(gw)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=NOVA, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.response.headers["retry-after"] == "7"
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.chat.completions.create(model=NOVA, messages=[{"role": "user", "content": "Hi"}])
    assert unavailable.value.status_code == 503


def test_an_arn_travels_as_botocores_own_client_sends_it(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    chat_client(gw).chat.completions.create(model=ARN, messages=[{"role": "user", "content": "Hi"}])
    ours = last(bedrock)["raw_path"]
    client = botocore.session.get_session().create_client(
        "bedrock-runtime",
        region_name=mock_bedrock.REGION,
        endpoint_url=f"http://127.0.0.1:{bedrock.port}",
    )
    done = threading.Event()

    def call() -> None:
        try:
            client.converse(modelId=ARN, messages=[{"role": "user", "content": [{"text": "Hi"}]}])
        finally:
            done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(20)
    theirs = last(bedrock)  # botocore's own request verifies against the same signer too
    assert theirs["raw_path"] == ours
    assert (
        ours == "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3A"
        "application-inference-profile%2Fabc123def456/converse"
    )


def test_anthropic_sdk_on_messages_for_a_bedrock_claude_model(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock, model_map={"claude-alias": CLAUDE})])
    events = capture_events(gw)
    client = anthropic.Anthropic(base_url=gw.url, api_key="client-key", max_retries=0, timeout=20)
    message = client.messages.create(
        model="claude-alias",
        max_tokens=64,
        messages=[{"role": "user", "content": "Hi"}],
        extra_headers={"anthropic-beta": "context-1m-2025-08-07"},
    )
    assert message.content[0].text == "Hello from Bedrock"
    assert message.usage.cache_read_input_tokens == CACHE_READ
    sent = last(bedrock)
    assert sent["model_id"] == CLAUDE and sent["action"] == "invoke"
    assert sent["body"]["anthropic_version"] == "bedrock-2023-05-31"
    assert sent["body"]["anthropic_beta"] == ["context-1m-2025-08-07"]
    assert "model" not in sent["body"]
    with client.messages.stream(
        model=CLAUDE, max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["request-id"] == "req-bedrock-1"
    assert text == "Hello from Bedrock"
    assert final.usage.cache_read_input_tokens == CACHE_READ and final.stop_reason == "end_turn"
    assert last(bedrock)["action"] == "invoke-with-response-stream"
    assert "stream" not in last(bedrock)["body"]
    recorded = wait_for(events, count=2, route="bedrock")
    assert [e.cached_prompt_tokens for e in recorded] == [CACHE_READ, CACHE_READ]


def test_messages_door_throttled_before_content_is_a_429(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    bedrock.mock.script.stream_exceptions = ["throttlingException"]
    client = anthropic.Anthropic(base_url=gw.url, api_key="client-key", max_retries=0, timeout=20)
    with pytest.raises(anthropic.RateLimitError):
        with client.messages.stream(
            model=CLAUDE, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            list(stream.text_stream)


def test_no_credential_in_logs_error_bodies_or_metrics(bedrock, make_gateway, caplog):
    caplog.set_level(logging.DEBUG)
    gw = make_gateway([bedrock_route(bedrock)], retry_attempts=1)
    client = chat_client(gw)
    client.chat.completions.create(model=CLAUDE, messages=[{"role": "user", "content": "Hi"}])
    signature = last(bedrock)["headers"]["Authorization"].rsplit("Signature=", 1)[1]
    bedrock.mock.script.http_errors = [(400, "ValidationException", "bad input")]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NOVA, messages=[{"role": "user", "content": "Hi"}])
    import httpx

    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    seen = [caught.value.response.text, metrics, *(r.getMessage() for r in caplog.records)]
    for secret in (mock_bedrock.SECRET_KEY, mock_bedrock.SESSION_TOKEN, signature):
        assert not any(secret in text for text in seen)


def test_a_bedrock_route_without_botocore_is_a_start_up_error_naming_the_extra(monkeypatch):
    import importlib.util

    from gateway.config.settings import SettingsError, load_settings

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "botocore" else real(name, *a)
    )
    routes = [{"name": "b", "models": ["*"], "kind": "bedrock", "region": "us-east-1"}]
    with pytest.raises(SettingsError, match=r"pip install 'firsttoken\[bedrock\]'"):
        load_settings(environ={"FIRSTTOKEN_ROUTES": orjson.dumps(routes).decode()})


def test_region_is_required_and_checked():
    from gateway.config.routes import Route

    with pytest.raises(ValueError, match="region"):
        Route(name="b", models=["*"], kind="bedrock")
    with pytest.raises(ValueError, match="region"):
        Route(name="b", models=["*"], kind="bedrock", region="us-east-1.evil.com/")


def test_cache_hints_put_breakpoints_on_claude_and_cache_points_on_converse(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    client = chat_client(gw)
    system = " ".join(["You answer questions about the weather of European cities."] * 250)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Paris?"}]
    client.chat.completions.create(model=CLAUDE, messages=messages)
    claude = last(bedrock)["body"]
    assert claude["system"][-1]["cache_control"] == {"type": "ephemeral"}
    client.chat.completions.create(model=NOVA, messages=messages)
    converse = last(bedrock)["body"]
    assert converse["system"] == [{"text": system}, {"cachePoint": {"type": "default"}}]
    assert {"cachePoint": {"type": "default"}} in converse["messages"][-1]["content"]
    client.chat.completions.create(model="amazon.titan-text-premier-v1:0", messages=messages)
    plain = last(bedrock)["body"]  # a model without prompt caching gets no cache point
    assert plain["system"] == [{"text": system}]


def test_responses_door_goes_through_the_chat_path(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    answer = chat_client(gw).responses.create(model=NOVA, input="Hi")
    assert answer.output_text == "Hello from Nova"
    assert answer.usage.input_tokens_details.cached_tokens == CACHE_READ
    assert last(bedrock)["action"] == "converse"


class ContainerCredentials:
    """The ECS/EKS container-credentials endpoint: temporary credentials expiring in five
    minutes, so botocore asks for a refresh on every use."""

    def __init__(self) -> None:
        self.calls = 0
        self.app = web.Application()
        self.app.router.add_get("/creds", self.creds)

    async def creds(self, request: web.Request) -> web.Response:
        self.calls += 1
        expires = datetime.now(UTC) + timedelta(minutes=5)
        return web.json_response(
            {
                "AccessKeyId": mock_bedrock.ACCESS_KEY,
                "SecretAccessKey": mock_bedrock.SECRET_KEY,
                "Token": mock_bedrock.SESSION_TOKEN,
                "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        )


def test_container_role_credentials_are_fetched_and_refreshed(bedrock, make_gateway, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with ThreadedServer(ContainerCredentials()) as endpoint:
        monkeypatch.setenv(
            "AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{endpoint.port}/creds"
        )
        gw = make_gateway([bedrock_route(bedrock)])
        client = chat_client(gw)
        for _ in range(2):
            answer = client.chat.completions.create(
                model=NOVA, messages=[{"role": "user", "content": "Hi"}]
            )
            assert answer.choices[0].message.content == "Hello from Nova"
            assert last(bedrock)["verified"]
        calls_after_requests = endpoint.mock.calls
        assert calls_after_requests >= 2  # fetched at start, and refreshed since


def test_messages_door_adds_breakpoints_to_a_bedrock_claude_body(bedrock, make_gateway):
    gw = make_gateway([bedrock_route(bedrock)])
    client = anthropic.Anthropic(base_url=gw.url, api_key="client-key", max_retries=0, timeout=20)
    system = " ".join(["You answer questions about the weather of European cities."] * 250)
    client.messages.create(
        model=CLAUDE, max_tokens=16, system=system, messages=[{"role": "user", "content": "Hi"}]
    )
    body = last(bedrock)["body"]
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "model" not in body and body["anthropic_version"] == "bedrock-2023-05-31"


def test_a_gateway_without_bedrock_routes_never_imports_botocore():
    import subprocess
    import sys

    code = (
        "import sys; from gateway.app import create_app; from gateway.config.settings import "
        "load_settings; create_app(load_settings(environ={'FIRSTTOKEN_ROUTES': "
        '\'[{"name": "o", "models": ["*"], "kind": "openai", '
        '"base_url": "http://127.0.0.1:9/v1"}]\'})); '
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('botocore', 'boto3')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_no_credentials_fails_the_route_not_the_gateway(bedrock, make_gateway, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    gw = make_gateway([bedrock_route(bedrock)])
    with pytest.raises(openai.APIStatusError) as caught:
        chat_client(gw).chat.completions.create(
            model=NOVA, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.status_code == 503
    assert "NoAwsCredentials" in caught.value.message
    assert gw.runtime.upstreams.states()["bedrock"] == "failed: NoAwsCredentials"
    assert bedrock.mock.requests == []

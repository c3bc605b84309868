"""`POST /v1/responses` through the gateway with the real `openai` SDK, on every route kind:
natively to an `openai` route (policies, TTFT, cached tokens, stored responses), translated to
chat for `anthropic` routes, and the 400s for what only OpenAI keeps on its side."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from policies.slim import slim_text
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, capture_events, openai_route, wait_for

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
INSTRUCTIONS = "You are a weather bot.   \nAnswer briefly.\n\n\n\nUse the tool."


def posts(mock_upstream, path: str) -> list[dict]:
    """The requests the mock got on `path`, bodies parsed (object endpoints keep raw bytes)."""
    found = [r for r in mock_upstream.mock.requests if r["path"] == path]
    return [
        {**r, "body": orjson.loads(r["body"]) if isinstance(r["body"], bytes) else r["body"]}
        for r in found
    ]


# -- openai routes: native ---------------------------------------------------------------------


def test_create_goes_out_in_its_own_shape_with_policies_and_cache_key(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    response = sdk_client(gw).responses.create(
        model="gpt-x", instructions=INSTRUCTIONS, input="Weather in Paris?"
    )
    assert response.output_text == "Hello from the mock"
    (sent,) = posts(mock_upstream, "/v1/responses")
    body = sent["body"]
    assert body["input"] == "Weather in Paris?"
    assert body["instructions"] == slim_text(INSTRUCTIONS) != INSTRUCTIONS
    assert body["prompt_cache_key"].startswith("ft-")  # cache_hints on an openai route
    assert "messages" not in body and "stream_options" not in body


def test_stream_relays_semantic_events_and_records_ttft_and_cached_tokens(
    mock_upstream, make_gateway
):
    mock_upstream.mock.behaviour.cached_tokens = 6
    gw = make_gateway([openai_route(mock_upstream)])
    events = capture_events(gw)
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/responses",
        json={"model": "gpt-x", "input": "hi", "stream": True},
        timeout=10,
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert names.count("response.output_text.delta") == 3
    (event,) = wait_for(events, api="responses")
    assert event.ttft_s is not None and event.ttft_s > 0
    assert event.cached_prompt_tokens == 6 and event.prompt_tokens == 10
    assert event.route == "mock" and event.status == "ok"


def test_function_tool_round_trip_and_retrieve(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys="acme:key-a,globex:key-b")
    client = sdk_client(gw, "key-a")
    stream = client.responses.create(
        model="gpt-x", input="Weather in Paris?", tools=[WEATHER_TOOL], stream=True
    )
    events = list(stream)
    done = next(e for e in events if e.type == "response.completed").response
    (call,) = [item for item in done.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.arguments == '{"city":"Paris"}'
    second = client.responses.create(
        model="gpt-x",
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"},
        ],
    )
    assert second.output_text == "Hello from the mock"
    assert posts(mock_upstream, "/v1/responses")[-1]["body"]["input"][2]["output"] == "Sunny, 21C"
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError):  # another tenant never sees it
        sdk_client(gw, "key-b").responses.retrieve(second.id)


def test_bad_bodies_are_openai_400s_that_never_reach_upstream(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    for body in (
        {"model": "gpt-x"},
        {"model": "gpt-x", "input": 3},
        {"model": "gpt-x", "input": "x", "stream": "yes"},
        {"model": "gpt-x", "input": "x", "instructions": ["a"]},
        {"input": "x"},
    ):
        resp = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=10)
        assert resp.status_code == 400, body
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert posts(mock_upstream, "/v1/responses") == []


def test_unknown_model_is_a_404_not_the_first_openai_route(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    with pytest.raises(openai.NotFoundError):
        sdk_client(gw).responses.create(model="other-model", input="hi")
    assert posts(mock_upstream, "/v1/responses") == []


# -- anthropic routes: translated ----------------------------------------------------------------


def test_anthropic_route_serves_responses_translated(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    client = sdk_client(gw)
    response = client.responses.create(
        model="claude-x", instructions="Be brief.", input="Hi", max_output_tokens=50
    )
    assert response.output_text == "Hello from Claude"
    assert response.model == "claude-x" and response.status == "completed"
    assert response.usage.input_tokens_details.cached_tokens == 100
    (sent,) = posts(mock_upstream, "/v1/messages")
    assert sent["body"]["max_tokens"] == 50
    assert sent["body"]["system"][0]["text"] == "Be brief."
    assert sent["body"]["messages"][0]["role"] == "user"


def test_anthropic_route_streams_text_and_tool_calls_as_responses_events(
    mock_upstream, make_gateway
):
    gw = make_gateway([anthropic_route(mock_upstream)])
    events = capture_events(gw)
    with sdk_client(gw).responses.stream(
        model="claude-x", input="Weather in Paris?", tools=[WEATHER_TOOL]
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Hello from Claude"
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.arguments.replace(" ", "") == '{"city":"Paris"}'
    (event,) = wait_for(events, api="responses")
    assert event.ttft_s is not None and event.route == "claude"


def test_anthropic_route_takes_a_tool_result_round_trip(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    sdk_client(gw).responses.create(
        model="claude-x",
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "toolu_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"},
        ],
    )
    messages = posts(mock_upstream, "/v1/messages")[0]["body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"][-1]["type"] == "tool_use"
    assert messages[1]["content"][-1]["input"] == {"city": "Paris"}
    assert messages[2]["content"][0]["type"] == "tool_result"
    assert messages[2]["content"][0]["tool_use_id"] == "toolu_1"


@pytest.mark.parametrize(
    "extra",
    [
        {"previous_response_id": "resp_123"},
        {"tools": [{"type": "web_search"}]},
        {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
    ],
)
def test_what_only_openai_keeps_is_a_400_on_other_routes(mock_upstream, make_gateway, extra):
    gw = make_gateway([anthropic_route(mock_upstream)])
    with pytest.raises(openai.BadRequestError) as caught:
        sdk_client(gw).responses.create(model="claude-x", input="hi", **extra)
    assert "claude" in caught.value.message  # names the route it would have gone to
    assert posts(mock_upstream, "/v1/messages") == []


def test_prefix_break_diagnostics_name_the_changed_block(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    client = sdk_client(gw)
    first = "You are a weather bot. " + "Be precise about the forecast. " * 40
    stable = client.responses.with_raw_response.create(
        model="gpt-x", instructions=first, input="Paris?", prompt_cache_key="family-1"
    )
    assert "x-firsttoken-prefix-break" not in stable.headers
    again = client.responses.with_raw_response.create(
        model="gpt-x", instructions=first, input="Paris?", prompt_cache_key="family-1"
    )
    assert int(again.headers["x-firsttoken-prefix-stable-tokens"]) > 100
    changed = client.responses.with_raw_response.create(
        model="gpt-x",
        instructions=first.replace("precise", "brief", 1),
        input="Paris?",
        prompt_cache_key="family-1",
    )
    assert changed.headers["x-firsttoken-prefix-break"].startswith("messages[0]@char")

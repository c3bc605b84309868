"""Odd JSON types in a body never crash the policies: a door checks only what it routes on, so
`tools: 5`, a content part whose `type` is `["text"]` or a message that is a number reach the
chain. The chain either reads the body or refuses its shape (`PolicyShapeError`, the body then
goes upstream unchanged); the gateway logs that as one short line per minute, never a traceback
per request, so no tenant can flood the log."""

from __future__ import annotations

import logging

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config.settings import Settings
from gateway.pipeline.policies import PolicyRunner, limited
from policies import DEFAULT_POLICIES, PolicyContext, PolicyShapeError, build_chain
from tests.policies.test_policy_properties import ALL_OPT_INS
from tests.support.gateway import anthropic_route, openai_route

CHAINS = [
    build_chain(DEFAULT_POLICIES, {}),
    build_chain(("slim", "canonicalize", "cache_hints"), ALL_OPT_INS),
]
NAMES = [
    "text",
    "input_text",
    "image_url",
    "tool_use",
    "tool_result",
    "thinking",
    "system",
    "user",
    "assistant",
    "function",
    "message",
    "ephemeral",
    "2026-03-01T10:00:00Z",
]
KEYS = [
    "type",
    "text",
    "role",
    "content",
    "name",
    "function",
    "parameters",
    "cache_control",
    "input_schema",
    "description",
    "properties",
    "tool_calls",
    "arguments",
    "id",
    "input",
    "image_url",
    "source",
    "file_id",
    "output",
    "call_id",
    "required",
    "tool_use_id",
]
atom = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=6),
    st.sampled_from(NAMES),
)
odd = st.recursive(
    atom,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)
    ),
    max_leaves=14,
)
part_or_item = st.dictionaries(st.sampled_from(KEYS), odd, max_size=5)
FIELDS = [
    "tools",
    "system",
    "instructions",
    "tool_choice",
    "metadata",
    "response_format",
    "text",
    "prompt",
    "prompt_cache_key",
    "max_tokens",
]


@st.composite
def door_bodies(draw) -> tuple[str, dict]:
    """A body as each door lets it through: the fields it routes on are right, the rest odd."""
    endpoint = draw(st.sampled_from(["chat", "messages", "responses", "completions"]))
    body: dict = {"model": "m"}
    body.update(
        draw(
            st.dictionaries(
                st.sampled_from(FIELDS),
                st.one_of(odd, st.lists(part_or_item, max_size=3)),
                max_size=5,
            )
        )
    )
    if endpoint == "chat":
        messages = draw(st.lists(part_or_item, min_size=1, max_size=4))
        for message in messages:
            message["role"] = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
        body["messages"] = messages
    elif endpoint == "messages":
        body["messages"] = draw(st.lists(st.one_of(part_or_item, odd), max_size=4))
    elif endpoint == "responses":
        body["input"] = draw(
            st.one_of(st.text(max_size=8), st.lists(st.one_of(part_or_item, odd), max_size=4))
        )
        if not isinstance(body.get("tools"), list | type(None)):
            del body["tools"]
        if not isinstance(body.get("instructions"), str | type(None)):
            del body["instructions"]
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=8), st.lists(odd, min_size=1, max_size=3)))
    return endpoint, body


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(door_bodies(), st.sampled_from(["openai", "anthropic", "local"]))
def test_the_chain_reads_or_refuses_any_shape_without_crashing(case, kind):
    endpoint, body = case
    frozen = orjson.dumps(body)
    ctx = PolicyContext(endpoint=endpoint, route_kind=kind, model="claude-x", tenant="t")
    for chain in CHAINS:
        try:
            result = chain.transform(body, ctx)
        except PolicyShapeError:
            continue
        result.measure(fingerprints=True)
        orjson.dumps(result.body)  # what goes upstream can be written
    assert orjson.dumps(body) == frozen  # the client's body is never changed in place


ODD_PART = {"type": ["text"], "text": "hi"}
FLOOD = [
    ("messages", {"model": "m", "tools": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ("messages", {"model": "m", "messages": [7, {"role": ["user"], "content": {"a": 1}}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [ODD_PART]}]}),
    ("chat", {"model": "m", "tools": [3], "messages": [{"role": "user", "content": "hi"}]}),
    ("responses", {"model": "m", "input": [[1], {"type": {}, "content": [ODD_PART]}]}),
]


def test_a_flood_of_odd_bodies_logs_a_bounded_number_of_short_lines(caplog):
    runner = PolicyRunner(Settings(), [])
    limited.forget()
    with caplog.at_level(logging.WARNING, logger="firsttoken.policies"):
        for _ in range(200):
            for endpoint, body in FLOOD:
                ctx = PolicyContext(
                    endpoint=endpoint, route_kind="anthropic", model="m", tenant="t"
                )
                runner.apply(("slim", "canonicalize", "cache_hints"), body, ctx)
    records = [r for r in caplog.records if r.name == "firsttoken.policies"]
    assert 1 <= len(records) <= 2  # one per kind (shape, chain) a minute, for 1,000 requests
    for record in records:
        assert record.exc_info is None and len(record.getMessage()) < 300


def test_odd_bodies_go_upstream_unchanged_through_the_gateway(make_gateway, mock_upstream, caplog):
    gw = make_gateway([openai_route(mock_upstream), anthropic_route(mock_upstream)])
    limited.forget()
    odd_part = {"type": ["text"], "text": "hi"}
    bodies = [
        (
            "/v1/messages",
            {
                "model": "claude-1",
                "max_tokens": 4,
                "tools": 5,
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
        (
            "/v1/chat/completions",
            {
                "model": "mock-1",
                "messages": [
                    {"role": "system", "content": [odd_part]},
                    {"role": "user", "content": [odd_part]},
                ],
            },
        ),
        ("/v1/messages", {"model": "claude-1", "max_tokens": 4, "messages": [7, "x"]}),
    ]
    with caplog.at_level(logging.WARNING, logger="firsttoken.policies"):
        for _ in range(10):
            for path, body in bodies:
                r = httpx.post(gw.url + path, content=orjson.dumps(body), timeout=20)
                assert r.status_code < 500, r.text
    records = [r for r in caplog.records if r.name == "firsttoken.policies"]
    assert len(records) <= 2 and all(r.exc_info is None for r in records)
    tools_bodies = [r["body"] for r in mock_upstream.mock.requests if "tools" in r["body"]]
    assert tools_bodies and all(b["tools"] == 5 for b in tools_bodies)

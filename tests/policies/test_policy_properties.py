"""Property tests over generated chat requests (hypothesis)."""

import os

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import DEFAULT_POLICIES, build_chain, count_request_tokens
from tests.policies.policy_helpers import ANTHROPIC, LOCAL, OPENAI, code_blocks, tool

ALL_OPT_INS = {
    "SLIM_MINIFY_JSON": "true",
    "SLIM_DEDUPE_PASSAGES": "true",
    "SLIM_MAX_PROMPT_TOKENS": "400",
    "CANONICALIZE_SORT_TOOLS": "true",
    "CANONICALIZE_SORT_SCHEMA_KEYS": "true",
    "CANONICALIZE_VOLATILE": "true",
    "CANONICALIZE_SORT_PASSAGES": "true",
    "CACHE_HINTS_HEAD_TTL": "1h",
}
FRAGMENTS = [
    "word",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n\n\n",
    "\u200b",
    "\ufeff",
    "\u200d",
    "caf\u00e9",
    "\u4e2d\u6587",
    "```py\nx = 1  \n\n\n\n\n```\n",
    '```json\n{ "a" : [1, 2] }\n```\n',
    "~~~\nopen fence  \n",
    "``` ",
    '<passage id="1">alpha</passage>',
    "<passage>beta</passage>",
    "\n<passage>alpha</passage>",
    "2026-03-01T10:00:00Z",
    "12:30:45",
    "3f2a8c1e-77b4-4c1d-9a0e-5b6c7d8e9f00",
    "deadbeef12345678",
    '{ "k": 1 }',
    "[firsttoken",
    "lorem ipsum dolor sit amet " * 8,
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=12).map(
    "".join
)
content = st.one_of(
    texts,
    st.lists(
        st.one_of(
            texts.map(lambda t: {"type": "text", "text": t}),
            st.just({"type": "image_url", "image_url": {"detail": "low", "url": "data:,x"}}),
        ),
        min_size=1,
        max_size=3,
    ),
)


@st.composite
def requests(draw, distinct=False):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    call_number = 0
    for _ in range(draw(st.integers(1, 5))):
        messages.append({"role": "user", "content": draw(content)})
        if draw(st.booleans()):
            calls = []
            for _ in range(draw(st.integers(1, 2))):
                call_number += 1
                calls.append(
                    {
                        "type": "function",
                        "id": f"call_{call_number}",
                        "function": {
                            "arguments": draw(st.sampled_from(['{"a":  1}', "{ }", "not json  "])),
                            "name": "search",
                        },
                    }
                )
            messages.append(
                {
                    "role": "assistant",
                    "content": draw(st.one_of(st.none(), texts)),
                    "tool_calls": calls,
                }
            )
            for call in calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": draw(content)}
                )
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(texts)})
    if distinct:  # no empty and no duplicate messages: the safe rules then keep every message
        for index, message in enumerate(messages):
            if message["role"] != "tool" and not message.get("tool_calls"):
                message["content"] = f"m{index} " + (
                    message["content"] if isinstance(message["content"], str) else ""
                )
    names = draw(
        st.lists(st.sampled_from(["search", "fetch", "add", "zeta"]), unique=True, max_size=4)
    )
    body = {"messages": messages, "model": "gpt-4.1", "stream": draw(st.booleans())}
    if names:
        body["tools"] = [
            tool(name, {"b": {"type": "string"}, "a": {"enum": [3, 1, 2]}}) for name in names
        ]
    return body


def assert_valid(body):
    assert isinstance(body["messages"], list) and body["messages"]
    answered, open_calls = set(), set()
    for message in body["messages"]:
        assert message["role"] in ("system", "developer", "user", "assistant", "tool")
        c = message.get("content")
        assert (
            c is None or isinstance(c, str) or (isinstance(c, list) and all("type" in p for p in c))
        )
        for call in message.get("tool_calls") or ():
            open_calls.add(call["id"])
        if message["role"] == "tool":
            assert message["tool_call_id"] in open_calls
            answered.add(message["tool_call_id"])
    assert answered == open_calls
    for item in body.get("tools") or ():
        assert item["function"]["name"]
    markers = orjson.dumps(body).count(b'"cache_control"')
    assert markers <= 4
    assert orjson.loads(orjson.dumps(body)) == body


def _difference(first, second):
    """Name the first differing part of two request bodies (hypothesis reports this)."""
    for key in sorted(set(first) | set(second)):
        if key != "messages" and first.get(key) != second.get(key):
            return f"{key}: {first.get(key)!r} != {second.get(key)!r}"
    pairs = list(zip(first["messages"], second["messages"], strict=False))
    for index, (a, b) in enumerate(pairs):
        if a != b:
            return f"messages[{index}]: {a!r} != {b!r}"
    return f"message counts {len(first['messages'])} != {len(second['messages'])}"


def tool_call_ids(body):
    return [call["id"] for m in body["messages"] for call in m.get("tool_calls") or ()]


def all_code_blocks(body):
    blocks = []
    for message in body["messages"]:
        c = message.get("content")
        parts = (
            [c]
            if isinstance(c, str)
            else [p.get("text", "") for p in c or () if p.get("type") == "text"]
        )
        for text in parts:
            blocks += code_blocks(text)
    return blocks


# POLICY_PROPERTY_EXAMPLES=5000 searches harder; the default keeps the suite fast.
EXAMPLES = int(os.environ.get("POLICY_PROPERTY_EXAMPLES", "150"))
PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
CHAINS = {
    "default": build_chain(DEFAULT_POLICIES, {}),
    "opt_ins": build_chain(DEFAULT_POLICIES, ALL_OPT_INS),
    **{name: build_chain((name,), {}) for name in DEFAULT_POLICIES},
    **{f"{name}+opt_ins": build_chain((name,), ALL_OPT_INS) for name in DEFAULT_POLICIES},
}


@PROPERTY_SETTINGS
@given(
    body=requests(),
    chain_name=st.sampled_from(sorted(CHAINS)),
    ctx=st.sampled_from([OPENAI, ANTHROPIC, LOCAL]),
)
def test_every_policy_is_idempotent_and_output_valid(body, chain_name, ctx):
    chain = CHAINS[chain_name]
    snapshot = orjson.dumps(body)
    once = chain.apply(body, ctx)
    assert orjson.dumps(body) == snapshot  # input untouched
    assert once.prompt_tokens_after == count_request_tokens(once.body)
    assert_valid(once.body)
    twice = chain.apply(once.body, ctx)
    assert twice.body == once.body, _difference(once.body, twice.body)
    assert orjson.dumps(twice.body) == orjson.dumps(once.body)


@PROPERTY_SETTINGS
@given(body=requests(distinct=True), ctx=st.sampled_from([OPENAI, ANTHROPIC, LOCAL]))
def test_default_chain_keeps_roles_ids_code_and_tools(body, ctx):
    result = CHAINS["default"].apply(body, ctx).body
    assert [m["role"] for m in result["messages"]] == [m["role"] for m in body["messages"]]
    assert tool_call_ids(result) == tool_call_ids(body)
    assert all_code_blocks(result) == all_code_blocks(body)
    assert [t["function"]["name"] for t in result.get("tools", [])] == [
        t["function"]["name"] for t in body.get("tools", [])
    ]
    assert [t["function"]["parameters"] for t in result.get("tools", [])] == [
        t["function"]["parameters"] for t in body.get("tools", [])
    ]

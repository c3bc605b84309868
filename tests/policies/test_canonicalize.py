import copy
import random

import orjson

from bench.cache_hit import shuffle_keys
from policies import build_chain
from policies.volatile import NOTE_MARKER
from tests.policies.policy_helpers import ANTHROPIC, OPENAI, chat, tool


def run(body, ctx=OPENAI, **options):
    chain = build_chain(("canonicalize",), {key: str(value) for key, value in options.items()})
    return chain.apply(body, ctx)


def sample_request():
    return chat(
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "caf\u00e9 \u2603"},
                {"type": "image_url", "image_url": {"url": "data:,x", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"b":1,"a":2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": '{"z": 1.50}'},
        tools=[
            tool(
                "lookup",
                {"zeta": {"type": "string", "enum": ["b", "a"]}, "alpha": {"type": "integer"}},
            ),
            tool("Add"),
        ],
        tool_choice={"function": {"name": "lookup"}, "type": "function"},
        temperature=0.70,
        x_vendor_flag=True,
        stream=True,
    )


def test_same_logical_request_same_bytes_and_nothing_reordered():
    base = sample_request()
    expected = orjson.dumps(run(base).body)
    rng = random.Random(5)
    for _ in range(20):
        variant = shuffle_keys(copy.deepcopy(base), rng)
        # the schema is user content: its key order is kept by default, so keep it fixed here
        for index, original_tool in enumerate(base["tools"]):
            function = variant["tools"][index]["function"]
            function["parameters"] = original_tool["function"]["parameters"]
        assert orjson.dumps(run(variant).body) == expected
    body = run(base).body
    assert list(body)[:2] == ["model", "messages"]
    assert [t["function"]["name"] for t in body["tools"]] == ["lookup", "Add"]
    assert body["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"b":1,"a":2}'
    assert body["messages"][3]["content"] == '{"z": 1.50}'
    assert body["temperature"] == 0.70
    assert list(body["tools"][0]["function"]["parameters"]["properties"]) == ["zeta", "alpha"]


def test_sort_tools_and_schema_keys_keep_lists():
    body = run(
        sample_request(), CANONICALIZE_SORT_TOOLS="true", CANONICALIZE_SORT_SCHEMA_KEYS="true"
    ).body
    assert [t["function"]["name"] for t in body["tools"]] == ["Add", "lookup"]
    lookup = body["tools"][1]
    assert list(lookup) == ["function", "type"]
    properties = lookup["function"]["parameters"]["properties"]
    assert list(properties) == ["alpha", "zeta"]
    assert properties["zeta"]["enum"] == ["b", "a"]
    assert lookup["function"]["parameters"]["required"] == ["zeta", "alpha"]


def test_volatile_values_move_to_a_note_after_the_last_message():
    system = (
        "You are Ava. Now: 2026-03-01T09:15:02.123Z. Today is March 1, 2026. "
        "Trace 3f2a8c1e-77b4-4c1d-9a0e-5b6c7d8e9f00 "
        "build 9fceb02d0ae598e95dc970b74767f19372d61af8. "
        "Again at 2026-03-01T09:15:02.123Z. Port 8080, call 555-1234."
    )
    body = chat({"role": "system", "content": system}, {"role": "user", "content": "hi"})
    result = run(body, CANONICALIZE_VOLATILE="true")
    messages = result.body["messages"]
    assert messages[0]["content"] == (
        "You are Ava. Now: [time_1]. Today is [date_1]. Trace [id_1] build [id_2]. "
        "Again at [time_1]. Port 8080, call 555-1234."
    )
    assert messages[-1]["role"] == "system"
    assert messages[-1]["content"].startswith(NOTE_MARKER)
    for value in (
        "2026-03-01T09:15:02.123Z",
        "March 1, 2026",
        "3f2a8c1e-77b4-4c1d-9a0e-5b6c7d8e9f00",
    ):
        assert value in messages[-1]["content"]
    assert result.notes["canonicalize"]["volatile_values"] == 4
    again = run(result.body, CANONICALIZE_VOLATILE="true").body
    assert again == result.body
    later = chat(
        {"role": "system", "content": system.replace("09:15:02", "09:16:40")},
        {"role": "user", "content": "hi"},
    )
    assert run(later, CANONICALIZE_VOLATILE="true").body["messages"][:2] == messages[:2]


def test_volatile_note_for_anthropic_is_a_user_turn_before_a_prefill():
    body = chat(
        {"role": "system", "content": "time 12:00:01"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Sure,"},
    )
    messages = run(body, ANTHROPIC, CANONICALIZE_VOLATILE="true").body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "user", "assistant"]
    assert messages[2]["content"].startswith(NOTE_MARKER)


def test_passages_put_in_stable_order():
    a, b, c = (
        '<passage id="{}">{}</passage>'.format(*pair)
        for pair in (("1", "alpha"), ("2", "beta"), ("3", "gamma"))
    )
    orders = [f"Context:\n{x}\n{y}\n{z}\nQuestion" for x, y, z in ((a, b, c), (c, a, b), (b, c, a))]
    outputs = {
        run(chat({"role": "system", "content": text}), CANONICALIZE_SORT_PASSAGES="true").body[
            "messages"
        ][0]["content"]
        for text in orders
    }
    assert outputs == {f"Context:\n{a}\n{b}\n{c}\nQuestion"}
    untouched = run(chat({"role": "system", "content": orders[1]})).body["messages"][0]["content"]
    assert untouched == orders[1]


def test_input_not_mutated_and_idempotent_with_all_opt_ins():
    body = sample_request()
    original = copy.deepcopy(body)
    options = dict(
        CANONICALIZE_SORT_TOOLS="true",
        CANONICALIZE_SORT_SCHEMA_KEYS="true",
        CANONICALIZE_VOLATILE="true",
        CANONICALIZE_SORT_PASSAGES="true",
    )
    once = run(body, **options).body
    assert body == original
    assert run(once, **options).body == once

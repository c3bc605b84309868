"""The policies on Anthropic Messages and OpenAI Responses bodies (lifted, run, lowered)."""

import copy

import orjson
import pytest

from policies import DEFAULT_POLICIES, PolicyContext, build_chain
from policies.shapes import LIFTED_KEY, lift, lower
from policies.volatile import NOTE_MARKER

MESSAGES = PolicyContext("messages", "anthropic", "claude-sonnet-4", "acme")
RESPONSES = PolicyContext("responses", "openai", "gpt-4.1", "acme")
LONG = "lorem ipsum dolor sit amet " * 400  # ~2k tokens
STAMP = "Current time: 2026-05-01T10:11:12Z. Request id: 9fceb02d0ae5."
ALL_OPT_INS = {
    "SLIM_MINIFY_JSON": "true",
    "SLIM_DEDUPE_PASSAGES": "true",
    "CANONICALIZE_SORT_TOOLS": "true",
    "CANONICALIZE_SORT_SCHEMA_KEYS": "true",
    "CANONICALIZE_VOLATILE": "true",
    "CANONICALIZE_SORT_PASSAGES": "true",
}

FUNCTION_CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "search",
    "arguments": '{"q":  "x"}',
    "id": "fc_1",
}
FUNCTION_OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": '{"a":   1}'}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "abc"}
TOOL_USE = {"type": "tool_use", "name": "search", "id": "tu_1", "input": {"q": "x  "}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "tu_1", "content": '{"a":   1}   '}
THINKING = {"type": "thinking", "thinking": "hmm   ", "signature": "sig"}


def run(body, ctx, names=DEFAULT_POLICIES, **options):
    return build_chain(names, options).apply(body, ctx)


def dumps(body):
    return orjson.dumps(body)


def responses_body(**extra):
    return {
        "model": "gpt-4.1",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            REASONING,
            FUNCTION_CALL,
            FUNCTION_OUTPUT,
            {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "search",
                "description": "find",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                "strict": True,
            },
            {"type": "web_search"},
        ],
        "stream": True,
        **extra,
    }


def messages_body(**extra):
    return {
        "model": "claude-sonnet-4",
        "max_tokens": 1024,
        "system": "You help.",
        "messages": [
            {"role": "user", "content": "find x"},
            {"role": "assistant", "content": [THINKING, {"type": "text", "text": "ok"}, TOOL_USE]},
            {"role": "user", "content": [TOOL_RESULT]},
            {"role": "assistant", "content": "found it"},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
        ],
        "tools": [
            {
                "name": "search",
                "description": "find",
                "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        **extra,
    }


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("responses", responses_body()),
        ("responses", {"model": "m", "input": "just a string", "instructions": None}),
        ("responses", {"input": [], "model": "m"}),
        ("messages", messages_body()),
        ("messages", messages_body(system=[{"type": "text", "text": "blocks"}])),
        ("messages", {"messages": [{"role": "user", "content": "x"}], "model": "m"}),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_lift_then_lower_is_the_identity(endpoint, body):
    before = copy.deepcopy(body)
    view = lift(body, endpoint)
    assert dumps(lower(view, body, endpoint)) == dumps(body)
    assert body == before
    result = run(body, PolicyContext(endpoint, "local", "m", "acme"), names=())
    assert dumps(result.body) == dumps(body)


def test_lift_presents_a_chat_view():
    view = lift(responses_body(), "responses")
    assert list(view)[:3] == ["model", "instructions", "messages"]  # key order kept
    assert view["messages"][0] == {"role": "system", "content": "Be brief.", LIFTED_KEY: True}
    assert view["messages"][2] is REASONING
    assert lift({"input": "hello"}, "responses")["messages"] == [
        {"role": "user", "content": "hello"}
    ]
    blocks = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    view = lift(messages_body(system=blocks), "messages")
    assert view["messages"][0]["content"] is blocks
    assert "system" in view and len(view["messages"]) == 6


def test_slim_rewrites_text_of_every_shape_and_keeps_part_types():
    body = responses_body(instructions="Be brief.   \n\n\n\n\nReally.")
    body["input"][0]["content"][0]["text"] = "hi   \n"
    result = run(body, RESPONSES)
    assert result.body["instructions"] == "Be brief.\n\n\nReally."  # at most 2 blank lines
    assert result.body["input"][0]["content"] == [{"type": "input_text", "text": "hi\n"}]
    anthropic = messages_body(system=[{"type": "text", "text": "You help.  \u200b"}])
    anthropic["messages"][3]["content"] = "found it   "
    out = run(anthropic, MESSAGES).body
    assert out["system"][0]["text"] == "You help."
    assert out["messages"][3]["content"] == "found it"
    assert out["messages"][1]["content"][0] == THINKING  # whitespace inside kept
    assert out["messages"][1]["content"][2] == TOOL_USE
    assert out["messages"][2]["content"] == [TOOL_RESULT]


def test_slim_never_drops_collapses_or_touches_items():
    twice = [REASONING, REASONING, FUNCTION_CALL, FUNCTION_OUTPUT, FUNCTION_OUTPUT]
    body = {"model": "m", "input": [{"role": "user", "content": "   "}, *twice, "x"]}
    body["input"][-1] = {"role": "user", "content": "go"}
    result = run(body, RESPONSES, names=("slim", "canonicalize"), **ALL_OPT_INS)
    items = result.body["input"]
    assert all(a is b for a, b in zip(items[:5], twice, strict=True))
    assert items[5] == {"role": "user", "content": "go"}  # the empty user message was dropped
    assert result.notes["slim"]["dropped_empty"] == 1
    doubled = messages_body()
    doubled["messages"][2:2] = [doubled["messages"][1], doubled["messages"][2]]
    out = run(doubled, MESSAGES, names=("slim", "canonicalize"), **ALL_OPT_INS).body
    assert [m["content"] for m in out["messages"][1:5]] == [
        m["content"] for m in doubled["messages"][1:5]
    ]


def test_history_trimming_is_chat_only():
    body = messages_body()
    body["messages"][0]["content"] = LONG.strip()
    for endpoint, ctx in (("messages", MESSAGES), ("responses", RESPONSES)):
        result = run(body, ctx, names=("slim",), SLIM_MAX_PROMPT_TOKENS="100")
        assert lift(result.body, endpoint)["messages"] == lift(body, endpoint)["messages"]
        assert "trimmed_messages" not in result.notes.get("slim", {})
    chat = {"model": "m", "messages": [*body["messages"][:1], *body["messages"][3:]]}
    trimmed = run(
        chat,
        PolicyContext("chat", "anthropic", "m", "t"),
        names=("slim",),
        SLIM_MAX_PROMPT_TOKENS="100",
    )
    assert trimmed.notes["slim"]["trimmed_messages"] > 0


def test_canonicalize_sorts_flat_and_anthropic_tools():
    body = responses_body()
    body["tools"] = [
        {
            "strict": True,
            "parameters": {"type": "object", "b": 1, "a": 2},
            "name": "zeta",
            "type": "function",
        },
        {"type": "web_search"},
        {"name": "alpha", "type": "function", "parameters": {"type": "object"}},
    ]
    safe = run(body, RESPONSES).body["tools"]
    assert [list(tool) for tool in safe] == [
        ["type", "name", "parameters", "strict"],
        ["type"],
        ["type", "name", "parameters"],
    ]
    assert list(safe[0]["parameters"]) == ["type", "b", "a"]  # schema untouched by default
    opted = run(
        body, RESPONSES, CANONICALIZE_SORT_TOOLS="true", CANONICALIZE_SORT_SCHEMA_KEYS="true"
    ).body["tools"]
    assert [tool.get("name") for tool in opted] == [None, "alpha", "zeta"]
    assert list(opted[2]["parameters"]) == ["a", "b", "type"]
    anthropic = messages_body()
    anthropic["tools"] = [
        {"input_schema": {"type": "object", "z": 1, "a": 0}, "name": "zeta", "description": "z"},
        {"name": "alpha", "input_schema": {"type": "object"}},
    ]
    out = run(
        anthropic,
        MESSAGES,
        names=("canonicalize",),
        CANONICALIZE_SORT_TOOLS="true",
        CANONICALIZE_SORT_SCHEMA_KEYS="true",
    ).body["tools"]
    assert [tool["name"] for tool in out] == ["alpha", "zeta"]
    assert list(out[1]) == ["description", "input_schema", "name"]
    assert list(out[1]["input_schema"]) == ["a", "type", "z"]
    # Safe default: the wrapper in a fixed order, the schema as sent.
    safe_tools = run(anthropic, MESSAGES, names=("canonicalize",)).body["tools"]
    assert list(safe_tools[0]) == ["name", "description", "input_schema"]
    assert list(safe_tools[0]["input_schema"]) == ["type", "z", "a"]


def test_volatile_values_leave_instructions_for_an_input_message_item():
    body = responses_body(instructions=f"{STAMP} Be brief.")
    result = run(body, RESPONSES, CANONICALIZE_VOLATILE="true")
    sent = result.body
    assert sent["instructions"] == "Current time: [time_1]. Request id: [id_1]. Be brief."
    note = sent["input"][-1]
    assert note["type"] == "message" and note["role"] == "system"
    assert note["content"].startswith(NOTE_MARKER) and "2026-05-01T10:11:12Z" in note["content"]
    assert sent["input"][:-1] == body["input"]
    # Twice through the chain: the same bytes.
    assert dumps(run(sent, RESPONSES, CANONICALIZE_VOLATILE="true").body) == dumps(sent)


def test_volatile_values_leave_system_for_a_user_text_turn():
    body = messages_body(system=[{"type": "text", "text": f"{STAMP} You help."}])
    sent = run(body, MESSAGES, CANONICALIZE_VOLATILE="true").body
    assert sent["system"][0]["text"].startswith("Current time: [time_1].")
    note = sent["messages"][-1]
    assert note["role"] == "user" and note["content"][0]["type"] == "text"
    assert note["content"][0]["text"].startswith(NOTE_MARKER)
    assert sent["messages"][:-1] == body["messages"]


def test_volatile_note_goes_before_an_assistant_prefill():
    body = messages_body(system=f"{STAMP} You help.")
    body["messages"].append({"role": "assistant", "content": "Sure,"})
    sent = run(body, MESSAGES, names=("canonicalize",), CANONICALIZE_VOLATILE="true").body
    assert sent["messages"][-1] == {"role": "assistant", "content": "Sure,"}
    assert sent["messages"][-2]["content"][0]["text"].startswith(NOTE_MARKER)


def long_messages_body(**extra):
    body = messages_body(system=LONG, **extra)
    body["tools"][0]["description"] = LONG
    body["messages"][3]["content"] = "found it " + LONG
    return body


def test_cache_hints_breakpoints_on_a_messages_body():
    result = run(long_messages_body(), MESSAGES, names=("cache_hints",), CACHE_HINTS_HEAD_TTL="1h")
    sent = result.body
    hour = {"type": "ephemeral", "ttl": "1h"}
    assert sent["tools"][-1]["cache_control"] == hour
    assert sent["system"] == [{"type": "text", "text": LONG, "cache_control": hour}]
    # The previous turn ends at the tool_result; the last stable message is the last user turn.
    assert sent["messages"][2]["content"] == [
        {**TOOL_RESULT, "cache_control": {"type": "ephemeral"}}
    ]
    assert sent["messages"][4]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert result.notes["cache_hints"]["breakpoints"] == [
        "tools",
        "messages[0]",
        "messages[3]",
        "messages[5]",  # positions in the chat view
    ]
    assert run(sent, MESSAGES, names=("cache_hints",)).body == sent  # idempotent
    assert all(LIFTED_KEY not in str(message) for message in sent["messages"])


def test_cache_hints_skip_thinking_blocks():
    body = long_messages_body()
    body["messages"] = body["messages"][:1]  # ends with an assistant prefill
    body["messages"].append(
        {"role": "assistant", "content": [{"type": "text", "text": LONG}, THINKING]}
    )
    sent = run(body, MESSAGES, names=("cache_hints",)).body
    assert sent["messages"][1]["content"][1] == THINKING
    assert sent["messages"][1]["content"][0]["cache_control"] == {"type": "ephemeral"}


@pytest.mark.parametrize(
    "place",
    ["system", "tool", "message", "tool_result"],
)
def test_cache_hints_none_when_the_client_set_any(place):
    body = long_messages_body()
    marker = {"type": "ephemeral"}
    if place == "system":
        body["system"] = [{"type": "text", "text": LONG, "cache_control": marker}]
    elif place == "tool":
        body["tools"][1] = {**body["tools"][1], "cache_control": marker}
    elif place == "message":
        body["messages"][0]["content"] = [{"type": "text", "text": "x", "cache_control": marker}]
    else:
        body["messages"][2]["content"] = [
            {**TOOL_RESULT, "content": [{"type": "text", "text": "r", "cache_control": marker}]}
        ]
    result = run(body, MESSAGES, names=("cache_hints",))
    assert dumps(result.body) == dumps(body)
    assert result.notes["cache_hints"] == {"family": "anthropic", "client_breakpoints": True}


def test_prompt_cache_key_on_responses_and_client_key_honoured():
    result = run(responses_body(), RESPONSES)
    key = result.body["prompt_cache_key"]
    assert key.startswith("ft-") and result.cache_key == key
    other = run(responses_body(input="another question"), RESPONSES)
    assert other.body["prompt_cache_key"] == key  # same instructions and tools: same family
    own = run(responses_body(prompt_cache_key="x" * 200), RESPONSES)
    assert own.body["prompt_cache_key"] == "x" * 200
    assert own.cache_key.startswith("h-") and len(own.cache_key) < 64
    assert "prompt_cache_key" not in run(messages_body(), MESSAGES).body


def test_items_survive_untouched_and_in_order_with_every_option():
    body = responses_body(instructions=f"{STAMP} Be brief.")
    sent = run(body, RESPONSES, **ALL_OPT_INS).body["input"]
    assert [item for item in sent if item.get("type") not in (None, "message")] == [
        REASONING,
        FUNCTION_CALL,
        FUNCTION_OUTPUT,
    ]
    assert sent[1] is REASONING and sent[2] is FUNCTION_CALL and sent[3] is FUNCTION_OUTPUT
    anthropic = run(messages_body(), MESSAGES, **ALL_OPT_INS).body["messages"]
    assert anthropic[1]["content"][0] == THINKING and anthropic[1]["content"][2] == TOOL_USE
    assert list(anthropic[1]["content"][2]) == list(TOOL_USE)  # key order too
    assert {k: v for k, v in anthropic[2]["content"][0].items() if k != "cache_control"} == (
        TOOL_RESULT
    )


@pytest.mark.parametrize(
    ("body", "ctx"),
    [
        (responses_body(instructions=f"{STAMP} Be brief."), RESPONSES),
        (messages_body(system=f"{STAMP} You help."), MESSAGES),
    ],
)
def test_measure_counts_tokens_and_fingerprints_on_the_views(body, ctx):
    padded = lower(lift(body, ctx.endpoint), body, ctx.endpoint)
    padded[{"responses": "instructions", "messages": "system"}[ctx.endpoint]] += " \t \n" * 200
    saved = run(padded, ctx)
    assert saved.prompt_tokens_before > saved.prompt_tokens_after > 100
    assert saved.prompt_tokens_saved >= 100
    result = run(body, ctx, **ALL_OPT_INS)
    blocks = result.fingerprints.blocks
    assert [block.kind for block in blocks[:2]] == ["tools", "tools"]
    assert blocks[2].kind == "system" and blocks[2].label == "messages[0]"
    # The volatile note is left out of the fingerprint; a tool block or item is counted as JSON.
    assert len([b for b in blocks if b.kind in ("system", "messages")]) == 6 + (ctx is RESPONSES)
    assert max(block.tokens for block in blocks[3:]) > 5
    again = run(body, ctx, **ALL_OPT_INS)
    assert again.fingerprints == result.fingerprints

import pytest

from policies import PrefixFingerprints, build_chain, find_prefix_break, stable_prefix_tokens
from tests.policies.policy_helpers import ANTHROPIC, OPENAI, chat, tool

SYSTEM = "".join(f"Rule {index}: answer politely and cite sources. " for index in range(60))


def fingerprints(body, ctx=OPENAI, **options):
    chain = build_chain(
        ("slim", "canonicalize", "cache_hints"), {k: str(v) for k, v in options.items()}
    )
    return chain.apply(body, ctx).fingerprints


def request(system=SYSTEM, tools=None, extra=(), **params):
    return chat(
        {"role": "system", "content": system},
        {"role": "user", "content": "question one"},
        *extra,
        tools=tools if tools is not None else [tool("a"), tool("b"), tool("c"), tool("d")],
        **params,
    )


def test_new_turn_is_not_a_break_and_reports_stable_tokens():
    first = fingerprints(request())
    second = fingerprints(
        request(
            extra=[
                {"role": "assistant", "content": "answer"},
                {"role": "user", "content": "question two"},
            ]
        )
    )
    assert find_prefix_break(first, second) is None
    assert stable_prefix_tokens(first, second) == first.total_tokens > 0


def test_break_in_system_prompt_names_the_character_range():
    first = fingerprints(request())
    position = SYSTEM.index("Rule 20")
    changed = SYSTEM[:position] + "Rule XX" + SYSTEM[position + 7 :]
    found = find_prefix_break(first, fingerprints(request(system=changed)))
    assert found.kind == "system"
    start = int(found.location.split("@char ")[1])
    assert found.location.startswith("messages[0]@char ")
    assert start <= position < start + 256
    tools_tokens = sum(b.tokens for b in first.blocks if b.kind == "tools")
    assert tools_tokens < found.stable_tokens < first.total_tokens


def test_break_in_a_long_block_uses_coarser_chunks():
    long_system = SYSTEM * 20  # > 16 chunks of 256 characters
    first = fingerprints(request(system=long_system))
    position = len(long_system) - 100
    changed = long_system[:position] + "!" + long_system[position + 1 :]
    found = find_prefix_break(first, fingerprints(request(system=changed)))
    start = int(found.location.split("@char ")[1])
    assert start <= position and position - start < len(long_system) // 8


@pytest.mark.parametrize(
    ("change", "location", "kind"),
    [
        (
            lambda r: r["tools"].__setitem__(3, tool("d", {"x": {"type": "integer"}})),
            "tools[3]",
            "tools",
        ),
        (lambda r: r["tools"].reverse(), "tools(order)", "tools"),
        (lambda r: r["tools"].append(tool("e")), "tools[4]", "tools"),
        (lambda r: r["tools"].pop(), "tools[3]", "tools"),
        (lambda r: r.__setitem__("tool_choice", "required"), "tool_choice", "params"),
        (
            lambda r: r["messages"][1].__setitem__("content", "question 1"),
            "messages[1]@char 0",
            "messages",
        ),
        (lambda r: r["messages"][1].__setitem__("name", "bob"), "messages[1]", "messages"),
        (lambda r: r["messages"].pop(), "messages[1]", "messages"),
    ],
)
def test_break_locations(change, location, kind):
    first = fingerprints(request())
    changed = request()
    change(changed)
    found = find_prefix_break(first, fingerprints(changed))
    assert (found.location, found.kind) == (location, kind)


def test_moving_cache_markers_and_volatile_note_are_not_breaks():
    clock_a = request(system=SYSTEM + " Now 2026-05-01T10:00:00Z")
    clock_b = request(
        system=SYSTEM + " Now 2026-05-01T10:05:00Z",
        extra=[{"role": "assistant", "content": "answer"}, {"role": "user", "content": "two"}],
    )
    first = fingerprints(clock_a, ANTHROPIC, CANONICALIZE_VOLATILE="true")
    second = fingerprints(clock_b, ANTHROPIC, CANONICALIZE_VOLATILE="true")
    assert find_prefix_break(first, second) is None
    without = find_prefix_break(fingerprints(clock_a, ANTHROPIC), fingerprints(clock_b, ANTHROPIC))
    assert without.location.startswith("messages[0]@char ") and without.kind == "system"


def test_round_trip_is_compact_and_holds_no_text():
    body = request(system=SYSTEM * 20)
    prints = fingerprints(body)
    blob = prints.to_bytes()
    assert PrefixFingerprints.from_bytes(blob) == prints
    assert len(blob) < 600
    assert b"Rule" not in blob and b"question" not in blob
    with pytest.raises(ValueError):
        PrefixFingerprints.from_bytes(b"nope")
    with pytest.raises(ValueError):
        PrefixFingerprints.from_bytes(blob[:-3])


def test_completions_prompt_fingerprint():
    chain = build_chain(("slim",), {})
    ctx = OPENAI
    first = chain.apply({"model": "m", "prompt": "abc " * 300}, ctx).fingerprints
    second = chain.apply({"model": "m", "prompt": "abc " * 200 + "xyz " * 100}, ctx).fingerprints
    found = find_prefix_break(first, second)
    assert found.location == "prompt@char 768"

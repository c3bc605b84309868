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


def _first_changed_chunk(previous, current):
    """The definition `first_changed_char` computes faster: both texts' chunk hashes at the
    coarser of their levels, compared one by one."""
    from policies.diagnostics import CHUNK_CHARS, _coarsen, _split

    if (previous.text_len, previous.level, previous.chunks) == (
        current.text_len,
        current.level,
        current.chunks,
    ):
        return None
    old, new = _split(previous.chunks), _split(current.chunks)
    level = max(previous.level, current.level)
    for _ in range(level - previous.level):
        old = _coarsen(old)
    for _ in range(level - current.level):
        new = _coarsen(new)
    for index, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return index * (CHUNK_CHARS << level)
    return min(len(old), len(new)) * (CHUNK_CHARS << level)


def test_first_changed_char_matches_a_chunk_by_chunk_comparison():
    import random

    from policies.diagnostics import _fingerprint, first_changed_char

    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice("abcde ") for _ in range(rng.randrange(0, 12_000)))
        edit = rng.randrange(4)
        if edit == 0 and text:  # one character changed
            at = rng.randrange(len(text))
            other = text[:at] + "Z" + text[at + 1 :]
        elif edit == 1:  # cut short (possibly to a coarser or finer level)
            other = text[: rng.randrange(len(text) + 1)]
        elif edit == 2:  # grown
            other = text + "x" * rng.randrange(1, 9_000)
        else:
            other = text
        old = _fingerprint("messages[0]", "system", text, str, len)
        new = _fingerprint("messages[0]", "system", other, str, len)
        assert first_changed_char(old, new) == _first_changed_chunk(old, new)


def test_a_block_counts_the_same_tokens_with_or_without_cache_markers():
    """A block's fingerprint (tokens included) is kept by its bytes without cache markers, so a
    marker on a tool, a message or a payload part must not change its count either."""
    from policies.tokens import count_message, count_tool

    result = {"type": "tool_result", "tool_use_id": "t1", "content": "forty-two " * 30}
    marked = {**result, "cache_control": {"type": "ephemeral"}}
    message = {"role": "user", "content": [{"type": "text", "text": "see"}, result]}
    with_marker = {
        "role": "user",
        "content": [{"type": "text", "text": "see"}, marked],
        "cache_control": {"type": "ephemeral"},
    }
    assert count_message(with_marker) == count_message(message) > 30
    plain = tool("a")
    assert count_tool({**plain, "cache_control": {"type": "ephemeral"}}) == count_tool(plain)
    first = PrefixFingerprints.from_body(chat(message))
    second = PrefixFingerprints.from_body(chat(with_marker))
    assert [b.tokens for b in first.blocks] == [b.tokens for b in second.blocks]

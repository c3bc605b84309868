from policies import PolicyContext, build_chain, count_request_tokens
from policies.provider_limits import anthropic_min_tokens, openai_cached_tokens
from policies.volatile import NOTE_MARKER
from tests.policies.policy_helpers import ANTHROPIC, LOCAL, OPENAI, chat, tool

LONG = "lorem ipsum dolor sit amet " * 400  # ~2k tokens


def run(body, ctx, names=("cache_hints",), **options):
    return build_chain(names, {key: str(value) for key, value in options.items()}).apply(body, ctx)


def markers(body):
    found = []
    for index, item in enumerate(body.get("tools") or ()):
        if "cache_control" in item:
            found.append((f"tools[{index}]", item["cache_control"]))
    for index, message in enumerate(body["messages"]):
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if "cache_control" in part:
                    found.append((f"messages[{index}]", part["cache_control"]))
    return found


def conversation():
    return chat(
        {"role": "system", "content": LONG},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question " + LONG},
        tools=[tool("a", description=LONG), tool("b")],
    )


def test_anthropic_breakpoints_at_tools_system_previous_and_last():
    result = run(conversation(), ANTHROPIC, CACHE_HINTS_HEAD_TTL="1h")
    assert markers(result.body) == [
        ("tools[1]", {"type": "ephemeral", "ttl": "1h"}),
        ("messages[0]", {"type": "ephemeral", "ttl": "1h"}),
        ("messages[1]", {"type": "ephemeral"}),
        ("messages[3]", {"type": "ephemeral"}),
    ]
    assert result.body["messages"][3]["content"][0]["text"].startswith("second question")
    assert result.notes["cache_hints"]["breakpoints"] == [
        "tools",
        "messages[0]",
        "messages[1]",
        "messages[3]",
    ]
    assert run(result.body, ANTHROPIC).body == result.body  # idempotent


def test_anthropic_respects_model_minimum_and_client_markers():
    short = chat(
        {"role": "system", "content": "short"}, {"role": "user", "content": "hi"}, tools=[tool("a")]
    )
    assert markers(run(short, ANTHROPIC).body) == []
    haiku = PolicyContext("chat", "anthropic", "claude-haiku-4-5", "acme")
    mid = chat(
        {"role": "system", "content": "lorem ipsum dolor sit amet " * 600},
        {"role": "user", "content": "q"},
    )
    assert count_request_tokens(mid) < anthropic_min_tokens("claude-haiku-4-5")
    assert markers(run(mid, haiku).body) == []
    assert markers(run(mid, ANTHROPIC).body) != []
    client = conversation()
    client["messages"][1] = {
        "role": "user",
        "content": [{"type": "text", "text": "mine", "cache_control": {"type": "ephemeral"}}],
    }
    result = run(client, ANTHROPIC)
    assert markers(result.body) == [("messages[1]", {"type": "ephemeral"})]
    assert result.notes["cache_hints"] == {"family": "anthropic", "client_breakpoints": True}


def test_anthropic_breakpoint_skips_the_volatile_note():
    body = conversation()
    body["messages"][0]["content"] = LONG + " at 2026-01-01T00:00:00Z"
    result = run(
        body, ANTHROPIC, names=("canonicalize", "cache_hints"), CANONICALIZE_VOLATILE="true"
    )
    assert result.body["messages"][-1]["content"].startswith(NOTE_MARKER)
    assert markers(result.body)[-1][0] == "messages[3]"


def test_openai_prompt_cache_key_stable_per_family_and_tenant():
    first = run(conversation(), OPENAI)
    key = first.body["prompt_cache_key"]
    assert key == first.cache_key and key.startswith("ft-")
    later = conversation()
    later["messages"] += [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    later["user"] = "someone-else"
    reordered = conversation()
    reordered["tools"].reverse()
    assert run(later, OPENAI).body["prompt_cache_key"] == key
    assert run(reordered, OPENAI).body["prompt_cache_key"] == key
    assert run(later, OPENAI).body["user"] == "someone-else"
    other_tenant = PolicyContext("chat", "openai", "gpt-4.1", "globex")
    assert run(conversation(), other_tenant).body["prompt_cache_key"] != key
    other_prompt = conversation()
    other_prompt["messages"][0]["content"] = "another system prompt"
    assert run(other_prompt, OPENAI).body["prompt_cache_key"] != key
    clock = conversation()
    clock["messages"][0]["content"] += " now 2026-01-01T00:00:01"
    clock2 = conversation()
    clock2["messages"][0]["content"] += " now 2026-01-01T00:00:02"
    assert run(clock, OPENAI).cache_key == run(clock2, OPENAI).cache_key
    client = conversation()
    client["prompt_cache_key"] = "mine"
    result = run(client, OPENAI)
    assert result.body["prompt_cache_key"] == "mine" and result.cache_key == "mine"


def test_local_routes_only_compute_the_key():
    body = conversation()
    result = run(body, LOCAL)
    assert result.body == body
    assert result.cache_key.startswith("ft-")


def test_a_key_the_body_does_not_carry_is_derived_after_the_transform():
    """Only the report reads the family key of a route whose body does not carry it: the
    transform leaves it to be derived (it masks and digests the whole system prompt), and it is
    the same key when it is."""
    body = conversation()
    chain = build_chain(("slim", "canonicalize", "cache_hints"), {})
    transformed = chain.transform(body, LOCAL)
    assert transformed.given_cache_key is None
    assert transformed.cache_key == chain.apply(body, LOCAL).cache_key
    assert transformed.cache_key.startswith("ft-")
    carried = build_chain(("cache_hints",), {}).transform(conversation(), OPENAI)
    assert carried.given_cache_key == carried.body["prompt_cache_key"]  # the body needed it


def test_provider_tables():
    assert anthropic_min_tokens("claude-3-5-haiku-20241022") == 2048
    assert anthropic_min_tokens("claude-opus-4-5") == 4096
    assert anthropic_min_tokens("claude-sonnet-4-20250514") == 1024
    assert openai_cached_tokens(1023) == 0
    assert openai_cached_tokens(1024) == 1024
    assert openai_cached_tokens(1300) == 1280


def test_anthropic_no_breakpoint_after_a_clock_in_the_system_prompt():
    body = conversation()
    body["messages"][0]["content"] = "Now 2026-01-01T00:00:07Z. " + LONG
    assert [where for where, _ in markers(run(body, ANTHROPIC).body)] == ["tools[1]"]
    moved = run(
        body, ANTHROPIC, names=("canonicalize", "cache_hints"), CANONICALIZE_VOLATILE="true"
    )
    assert len(markers(moved.body)) == 4


def test_a_kept_family_key_is_the_key_computed_afresh():
    """The family key is kept by the texts it is made of: a kept key must be what hashing the
    masked prompt again gives, and a changed prompt must not get the kept one."""
    from policies import clear_caches
    from policies.cache_hints import prefix_family_key

    system = "You are the support agent. Today is 2026-12-06 10:00. " + "Be brief. " * 200
    bodies = [
        chat({"role": "system", "content": system}, {"role": "user", "content": "hi"}),
        chat(
            {"role": "system", "content": system.replace("10:00", "11:30")},
            {"role": "user", "content": "x"},
        ),
        chat(
            {"role": "system", "content": system + " Extra rule."},
            {"role": "user", "content": "hi"},
        ),
        chat(
            {"role": "system", "content": system},
            {"role": "user", "content": "hi"},
            tools=[tool("a")],
        ),
    ]
    kept = [prefix_family_key(body, "t", "m") for body in bodies + bodies]
    fresh = []
    for body in bodies:
        clear_caches()
        fresh.append(prefix_family_key(body, "t", "m"))
    assert kept == fresh + fresh
    assert kept[0] == kept[1]  # a clock in the system prompt does not split the family
    assert len({kept[0], kept[2], kept[3]}) == 3
    assert prefix_family_key(bodies[0], "other tenant", "m") != kept[0]

"""The one cache-rules table: which family a route belongs to, and what each family gets."""

import pytest

from policies import PolicyContext, build_chain
from policies.provider_limits import (
    CACHE_FAMILIES,
    cache_family,
    cached_tokens,
    converse_cache_point_min_tokens,
    min_cacheable_tokens,
)
from tests.policies.policy_helpers import chat

LONG = "lorem ipsum dolor sit amet " * 400  # ~2k tokens


@pytest.mark.parametrize(
    ("kind", "model", "base_url", "family"),
    [
        ("openai", "gpt-4.1", None, "openai"),
        ("openai", "gpt-4.1", "https://api.openai.com/v1", "openai"),
        ("azure", "gpt-4o", "https://res.openai.azure.com", "azure"),
        ("openai", "deepseek-chat", "https://api.deepseek.com", "deepseek"),
        ("openai", "deepseek-chat", "https://API.DeepSeek.com/v1", "deepseek"),
        ("openai", "kimi-k2", "https://api.moonshot.ai/v1", "moonshot"),
        ("openai", "moonshot-v1-8k", "https://api.moonshot.cn/v1", "moonshot"),
        ("openai", "deepseek-chat", "https://api.deepseek.com.evil.example", "openai"),
        ("openai", "m", "not a url at all [", "openai"),
        ("anthropic", "claude-sonnet-4", None, "anthropic"),
        ("bedrock", "anthropic.claude-3-5-haiku-20241022-v1:0", None, "anthropic"),
        ("bedrock", "us.anthropic.claude-sonnet-4-20250514-v1:0", None, "anthropic"),
        ("bedrock", "amazon.nova-pro-v1:0", None, "bedrock_converse"),
        ("bedrock", "meta.llama3-70b-instruct-v1:0", None, "bedrock_converse"),
        ("vertex", "claude-sonnet-4@20250514", None, "anthropic"),
        ("vertex", "gemini-2.5-pro", None, "gemini"),
        ("gemini", "gemini-2.5-flash", None, "gemini"),
        ("local", "tiny", None, "local"),
    ],
)
def test_each_route_kind_lands_in_its_family(kind, model, base_url, family):
    assert cache_family(kind, model, base_url) == family
    assert family in CACHE_FAMILIES


def test_converse_cache_points_only_on_models_that_cache():
    assert converse_cache_point_min_tokens("amazon.nova-pro-v1:0") == 1000
    assert converse_cache_point_min_tokens("us.amazon.nova-lite-v1:0") == 1000
    assert converse_cache_point_min_tokens("anthropic.claude-3-5-haiku-20241022-v1:0") == 2048
    assert converse_cache_point_min_tokens("us.anthropic.claude-sonnet-4-v1:0") == 1024
    assert converse_cache_point_min_tokens("meta.llama3-70b-instruct-v1:0") is None
    assert converse_cache_point_min_tokens("mistral.mistral-large-2402-v1:0") is None


def test_minimums_per_family_and_model():
    assert min_cacheable_tokens("openai", "gpt-4o") == 1024
    assert min_cacheable_tokens("deepseek", "deepseek-chat") == 64
    assert min_cacheable_tokens("gemini", "gemini-2.5-flash") == 1024
    assert min_cacheable_tokens("gemini", "gemini-2.5-pro") == 4096
    assert min_cacheable_tokens("anthropic", "claude-haiku-4-5") == 4096
    assert min_cacheable_tokens("bedrock_converse", "meta.llama3") is None
    assert min_cacheable_tokens("no-such-family", "m") is None


@pytest.mark.parametrize(
    ("family", "model", "stable", "cached"),
    [
        ("openai", "gpt-4o", 1023, 0),
        ("openai", "gpt-4o", 1300, 1280),
        ("deepseek", "deepseek-chat", 63, 0),
        ("deepseek", "deepseek-chat", 1300, 1280),
        ("deepseek", "deepseek-chat", 130, 128),
        ("moonshot", "kimi-k2", 777, 777),
        ("anthropic", "claude-sonnet-4", 1023, 0),
        ("anthropic", "claude-sonnet-4", 1500, 1500),
        ("gemini", "gemini-2.5-pro", 4000, 0),
        ("gemini", "gemini-2.5-flash", 4000, 4000),
        ("bedrock_converse", "amazon.nova-pro-v1:0", 1500, 1500),
        ("bedrock_converse", "meta.llama3-70b", 5000, 0),
        ("openai", "gpt-4o", 0, 0),
        ("no-such-family", "m", 5000, 0),
    ],
)
def test_cached_estimate_follows_each_family(family, model, stable, cached):
    assert cached_tokens(family, model, stable) == cached


def hinted(ctx, body=None):
    body = body or chat({"role": "system", "content": LONG}, {"role": "user", "content": "hi"})
    return build_chain(("cache_hints",), {}).apply(body, ctx)


def ctx(kind, model, base_url=None, endpoint="chat"):
    return PolicyContext(endpoint, kind, model, "acme", base_url=base_url)


def has_marker(body):
    return any(
        isinstance(part, dict) and "cache_control" in part
        for message in body["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def test_automatic_families_get_no_hint():
    for context in (
        ctx("openai", "deepseek-chat", "https://api.deepseek.com"),
        ctx("openai", "kimi-k2", "https://api.moonshot.ai/v1"),
        ctx("gemini", "gemini-2.5-flash"),
        ctx("vertex", "gemini-2.5-flash"),
        ctx("local", "tiny"),
    ):
        result = hinted(context)
        assert "prompt_cache_key" not in result.body, context
        assert not has_marker(result.body), context
        assert result.notes["cache_hints"]["family"] == context.cache_family


def test_openai_family_gets_prompt_cache_key():
    result = hinted(ctx("openai", "gpt-4o"))
    assert result.body["prompt_cache_key"].startswith("ft-")
    assert not has_marker(result.body)


def test_azure_gets_no_prompt_cache_key_but_openai_s_numbers():
    result = hinted(ctx("azure", "gpt-4o", "https://r.openai.azure.com"))
    assert "prompt_cache_key" not in result.body and not has_marker(result.body)
    assert result.notes["cache_hints"]["family"] == "azure"
    assert cached_tokens("azure", "gpt-4o", 1300) == cached_tokens("openai", "gpt-4o", 1300)
    client_key = {**chat({"role": "user", "content": "hi"}), "prompt_cache_key": "mine"}
    assert hinted(ctx("azure", "gpt-4o"), client_key).body["prompt_cache_key"] == "mine"


def test_anthropic_models_get_breakpoints_wherever_they_run():
    for context in (
        ctx("anthropic", "claude-sonnet-4"),
        ctx("bedrock", "us.anthropic.claude-sonnet-4-20250514-v1:0"),
        ctx("vertex", "claude-sonnet-4@20250514"),
    ):
        result = hinted(context)
        assert has_marker(result.body), context
        assert "prompt_cache_key" not in result.body
        assert result.notes["cache_hints"]["family"] == "anthropic"


def test_converse_gets_markers_only_for_models_with_cache_points():
    nova = hinted(ctx("bedrock", "amazon.nova-pro-v1:0"))
    assert has_marker(nova.body)
    assert nova.notes["cache_hints"]["breakpoints"]
    llama = hinted(ctx("bedrock", "meta.llama3-70b-instruct-v1:0"))
    assert not has_marker(llama.body)
    assert "breakpoints" not in llama.notes["cache_hints"]


def test_volatile_note_is_a_system_message_only_where_the_api_takes_a_late_one():
    body = chat(
        {"role": "system", "content": "Today is 2026-12-01T18:20:01Z. " + LONG},
        {"role": "user", "content": "hi"},
    )
    chain = build_chain(("canonicalize",), {"CANONICALIZE_VOLATILE": "true"})
    roles = {}
    for kind, model, base_url in (
        ("openai", "gpt-4o", None),
        ("azure", "gpt-4o", None),
        ("openai", "deepseek-chat", "https://api.deepseek.com"),
        ("anthropic", "claude-sonnet-4", None),
        ("gemini", "gemini-2.5-flash", None),
        ("local", "tiny", None),
    ):
        messages = chain.apply(body, ctx(kind, model, base_url)).body["messages"]
        roles[kind + ":" + model] = messages[-1]["role"]
    assert roles == {
        "openai:gpt-4o": "system",
        "azure:gpt-4o": "system",
        "openai:deepseek-chat": "system",
        "anthropic:claude-sonnet-4": "user",
        "gemini:gemini-2.5-flash": "user",
        "local:tiny": "user",
    }

"""The advisor counts each request under its route's cache family, as cache_hints noted it, and
prices and estimates it by that family's rules."""

from __future__ import annotations

from gateway.advisor import CacheRules, guess_route
from gateway.advisor.advice import family_advice
from policies import DEFAULT_POLICIES, PolicyContext, build_chain

LONG = "lorem ipsum dolor sit amet " * 400
BODY = {
    "model": "m",
    "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}],
}


def observed(kind: str, model: str, base_url: str | None = None):
    chain = build_chain(DEFAULT_POLICIES, {})
    return chain.apply(BODY, PolicyContext("chat", kind, model, "acme", base_url=base_url))


def test_the_family_comes_from_cache_hints_notes():
    assert guess_route(observed("openai", "deepseek-chat", "https://api.deepseek.com")).kind == (
        "deepseek"
    )
    assert guess_route(observed("azure", "gpt-4o", "https://r.openai.azure.com")).kind == "azure"
    assert guess_route(observed("openai", "gpt-4o")).kind == "openai"
    assert guess_route(observed("anthropic", "claude-sonnet-4")).kind == "anthropic"


def test_estimates_follow_the_family():
    assert CacheRules("deepseek", "deepseek-chat").cached(1100) == 1088
    assert CacheRules("openai", "gpt-4o").cached(1100) == 1024
    assert CacheRules("azure", "gpt-4o").cached(1000) == 0


def test_advice_is_priced_by_the_family_most_requests_went_to():
    fields = {"requests": 3, "sampled": 3, "route:deepseek": 2, "route:openai": 1}
    assert family_advice("f", fields, 3600)["route_rules"] == "deepseek"
    assert family_advice("f", {"route:openai": 1, "route:azure": 1}, 3600)["route_rules"] == (
        "openai"
    )
    assert family_advice("f", {"route:gemini": 1}, 3600)["route_rules"] == "gemini"

"""The policies, configured by environment, per route and per request, as a client sees them."""

from __future__ import annotations

import httpx
import pytest

from tests.support.gateway import openai_route

SYSTEM = "You are a careful assistant.   \n\n\n\n\nAnswer briefly.\u200b"


def chat(gw, system: str = SYSTEM, headers: dict | None = None, user: str = "hi") -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=20,
        headers=headers or {},
        json={
            "model": "mock-1",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        },
    )


def test_default_chain_slims_and_sets_a_cache_key(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    r = chat(gw)
    assert r.status_code == 200
    assert r.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
    assert int(r.headers["x-firsttoken-prompt-tokens-saved"]) > 0
    sent = mock_upstream.mock.requests[-1]["body"]
    assert sent["messages"][0]["content"] == "You are a careful assistant.\n\n\nAnswer briefly."
    assert sent["prompt_cache_key"].startswith("ft-")


def test_servers_of_ones_own_get_no_cache_key(mock_upstream, make_gateway):
    """A route that names its servers' kind (vLLM, SGLang) gets the policies without OpenAI's
    `prompt_cache_key`: their prefix caches are automatic and the field is unknown to them."""
    gw = make_gateway([openai_route(mock_upstream, load_metrics="vllm")])
    r = chat(gw)
    assert r.status_code == 200
    assert r.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
    sent = mock_upstream.mock.requests[-1]["body"]
    assert sent["messages"][0]["content"] == "You are a careful assistant.\n\n\nAnswer briefly."
    assert "prompt_cache_key" not in sent


def test_client_can_switch_policies_off_for_one_request(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    r = chat(gw, headers={"x-firsttoken-policies": "none"})
    assert r.headers["x-firsttoken-policies"] == "none"
    sent = mock_upstream.mock.requests[-1]["body"]
    assert sent["messages"][0]["content"] == SYSTEM and "prompt_cache_key" not in sent


def test_operator_can_forbid_the_override(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], allow_client_policies=False)
    r = chat(gw, headers={"x-firsttoken-policies": "none"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-firsttoken-policies"
    assert mock_upstream.mock.requests == []


def test_unknown_policy_in_header_is_400(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    r = chat(gw, headers={"x-firsttoken-policies": "slim,teleport"})
    assert r.status_code == 400 and "teleport" in r.json()["error"]["message"]


def test_route_override_and_env_options(mock_upstream, make_gateway):
    gw = make_gateway(
        [openai_route(mock_upstream, policies=["slim"])],
        environ={"FIRSTTOKEN_SLIM_MINIFY_JSON": "true"},
    )
    r = chat(gw, user='```json\n{ "a": 1,   "b": [1, 2] }\n```')
    assert r.headers["x-firsttoken-policies"] == "slim"
    sent = mock_upstream.mock.requests[-1]["body"]
    assert sent["messages"][1]["content"] == '```json\n{"a":1,"b":[1,2]}\n```'
    assert "prompt_cache_key" not in sent


def test_bad_policy_option_fails_start_naming_the_variable(mock_upstream):
    import orjson

    from gateway.config.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="FIRSTTOKEN_SLIM_MAX_PROMPT_TOKENS"):
        load_settings(
            environ={"FIRSTTOKEN_SLIM_MAX_PROMPT_TOKENS": "lots"},
            routes=orjson.dumps([openai_route(mock_upstream)]).decode(),
        )


def test_prefix_break_is_named_and_stable_prefix_counted(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    rules = "Rules of the house. " * 200
    long_system = rules[:1000] + "Time: 12:00:00. " + rules[1000:]
    first = chat(gw, system=long_system)
    assert "x-firsttoken-prefix-break" not in first.headers
    same = chat(gw, system=long_system, user="hi")
    assert int(same.headers["x-firsttoken-prefix-stable-tokens"]) > 500
    changed = rules[:1000] + "Time: 12:01:07. " + rules[1000:]  # a clock in the prompt
    broken = chat(gw, system=changed)
    assert broken.headers["x-firsttoken-prefix-break"].startswith("messages[0]@char ")
    where = int(broken.headers["x-firsttoken-prefix-break"].split("@char ")[1])
    assert where <= 1000
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'firsttoken_prefix_breaks_total{kind="system"' in metrics or (
        "firsttoken_prefix_breaks_total" in metrics and 'kind="system"' in metrics
    )

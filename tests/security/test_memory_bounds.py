"""A tenant cannot pin memory with unique huge names, and a bad store URL stops the start."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from bench.harness import free_port
from gateway.app import create_app
from gateway.config.routes import MATCH_CACHE_BYTES, Route, RouteTable
from gateway.config.settings import Settings, SettingsError, load_settings
from policies import DEFAULT_POLICIES, PolicyContext, build_chain
from policies.chain import MAX_CACHE_KEY_CHARS
from tests.security.conftest import TENANT_A_KEY, auth
from tests.support.cli import serve_refusal
from tests.support.gateway import openai_route

CTX = PolicyContext(endpoint="chat", route_kind="openai", model="gpt-4o", tenant="acme")


def test_a_huge_prompt_cache_key_names_a_short_family():
    chain = build_chain(tuple(DEFAULT_POLICIES), {})
    huge = "k" * 1_000_000
    body = {
        "model": "gpt-4o",
        "prompt_cache_key": huge,
        "messages": [{"role": "user", "content": "hi"}],
    }
    result = chain.transform(body, CTX)
    assert len(result.cache_key) <= MAX_CACHE_KEY_CHARS
    assert result.body["prompt_cache_key"] == huge  # the upstream still gets it as sent
    other = chain.transform({**body, "prompt_cache_key": huge[:-1] + "j"}, CTX)
    assert other.cache_key != result.cache_key  # distinct keys stay distinct
    short = chain.transform({**body, "prompt_cache_key": "mine"}, CTX)
    assert short.cache_key == "mine"  # a normal key is kept as it is


def test_unique_model_names_cannot_grow_the_route_cache():
    table = RouteTable([Route(name="any", models=("*",), kind="openai", base_url="http://x")])
    for i in range(20_000):
        assert table.match(f"{i:06d}-" + "m" * 250) is not None
    assert table._matched_bytes <= MATCH_CACHE_BYTES
    assert sum(map(len, table._matched)) <= MATCH_CACHE_BYTES


def test_unique_huge_cache_keys_do_not_pile_up_in_diagnostics(
    mock_upstream, make_gateway, tenant_settings
):
    gw = make_gateway([openai_route(mock_upstream)], **tenant_settings)
    with httpx.Client(base_url=gw.url, timeout=30, headers=auth(TENANT_A_KEY)) as client:
        for i in range(20):
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock-1",
                    "prompt_cache_key": f"{i:04d}" + "z" * 200_000,
                    "messages": [{"role": "user", "content": "hello"}],
                },
            )
            assert r.status_code == 200
    telemetry = gw.runtime.telemetry
    families = [family for (_, family) in telemetry.writer._blobs]
    families += [family for shelf in telemetry.store._blobs._tenants.values() for family in shelf]
    assert len(families) >= 20 and all(len(f) <= MAX_CACHE_KEY_CHARS for f in families)


@pytest.mark.parametrize(
    "url, reason",
    [
        ("foo://bar", "not a valid Redis URL"),
        ("redis://127.0.0.1:6379/99", "DB index is out of range"),
    ],
)
def test_a_bad_redis_url_stops_the_start_naming_the_variable(url, reason):
    with pytest.raises(SettingsError, match=f"FIRSTTOKEN_REDIS_URL.*{reason}"):
        create_app(Settings(redis_url=url))
    with pytest.raises(SettingsError, match=r"^REDIS_URL"):
        create_app(load_settings(environ={"REDIS_URL": url}))


def test_the_cli_says_which_variable_is_wrong_and_exits_2():
    env = {
        "FIRSTTOKEN_REDIS_URL": "foo://bar",
        "FIRSTTOKEN_ROUTES": orjson.dumps(
            [{"name": "x", "models": ["*"], "kind": "openai", "base_url": "http://127.0.0.1:9"}]
        ).decode(),
    }
    assert "FIRSTTOKEN_REDIS_URL" in serve_refusal(env=env)


def test_an_unreachable_redis_only_degrades_telemetry(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], redis_url=f"redis://127.0.0.1:{free_port()}/0")
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "mock-1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200
    deadline = time.monotonic() + 10  # the writer's first probe or write finds it down
    while (ready := httpx.get(gw.url + "/readyz").json())["telemetry"]["state"] != "degraded":
        assert time.monotonic() < deadline, ready
        time.sleep(0.05)
    assert ready["ready"] is True

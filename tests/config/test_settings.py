"""Start-up validation names the variable at fault; routes come from keys when not configured."""

from __future__ import annotations

import orjson
import pytest

from gateway.config.routes import RouteTable, default_routes
from gateway.config.settings import Settings, SettingsError, load_settings
from tests.support.cli import serve_refusal


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_MAX_BODY_BYTES", "sixteen")
    with pytest.raises(SettingsError, match="FIRSTTOKEN_MAX_BODY_BYTES"):
        load_settings()


def _routes(*items: dict) -> str:
    return orjson.dumps(list(items)).decode()


A = {"name": "a", "models": ["*"], "kind": "openai", "base_url": "http://x"}


@pytest.mark.parametrize(
    "raw,where",
    [
        ("[{", "FIRSTTOKEN_ROUTES: not valid JSON"),
        ('{"name": "x"}', "FIRSTTOKEN_ROUTES: expected a non-empty JSON list"),
        (_routes({**A, "base_url": None}), "FIRSTTOKEN_ROUTES[0]"),
        (_routes({**A, "kind": "grpc"}), "FIRSTTOKEN_ROUTES[0].kind"),
        (_routes({**A, "fallbacks": ["b"]}), "unknown fallback 'b'"),
        (_routes({**A, "api_key": "sk-1"}), "FIRSTTOKEN_ROUTES[0].api_key"),
        (_routes(A, A), "FIRSTTOKEN_ROUTES: route name 'a' is used twice"),
    ],
)
def test_bad_routes_are_explained(raw, where):
    with pytest.raises(SettingsError) as err:
        load_settings(environ={}, routes=raw)
    assert where in str(err.value)
    assert "sk-1" not in str(err.value)


def test_bad_tenant_keys_fail_start():
    with pytest.raises(SettingsError, match="FIRSTTOKEN_TENANT_KEYS"):
        load_settings(environ={}, tenant_keys="acme")
    with pytest.raises(SettingsError, match="'\\*' is not a tenant"):
        load_settings(environ={}, tenant_keys="*:k")


def test_slo_tenants_parse_and_fail_clearly():
    assert Settings(ttft_slo_tenants="acme:800, big:co:1500").ttft_slo_tenants == {
        "acme": 800.0,
        "big:co": 1500.0,
    }
    with pytest.raises(SettingsError, match="FIRSTTOKEN_TTFT_SLO_TENANTS: expected 'tenant:ms'"):
        load_settings(environ={"FIRSTTOKEN_TTFT_SLO_TENANTS": "acme:fast"})
    with pytest.raises(SettingsError, match="FIRSTTOKEN_TTFT_SLO_TENANTS: tenant 'acme'"):
        load_settings(environ={"FIRSTTOKEN_TTFT_SLO_TENANTS": "acme:0"})


def test_routes_from_provider_keys_put_the_catch_all_last():
    routes = default_routes({"OPENAI_API_KEY", "ANTHROPIC_API_KEY"})
    assert [r.name for r in routes] == ["anthropic", "openai"]
    settings = load_settings(environ={"OPENAI_API_KEY": "sk-a", "ANTHROPIC_API_KEY": "sk-b"})
    table = RouteTable(settings.routes or ())
    assert table.match("claude-sonnet-4").name == "anthropic"
    assert table.match("gpt-4o").name == "openai"
    assert settings.route_api_key(table.by_name["openai"]) == "sk-a"
    assert load_settings(environ={"OPENAI_API_KEY": ""}).routes is None


def test_cli_exits_2_with_the_variable_named():
    assert "FIRSTTOKEN_KEEPALIVE_S" in serve_refusal(env={"FIRSTTOKEN_KEEPALIVE_S": "-1"})

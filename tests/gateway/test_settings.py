"""Start-up validation names the variable at fault; routes come from keys when not configured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.app import create_app
from gateway.routes import default_routes, load_routes
from gateway.settings import Settings, SettingsError, load_settings


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_MAX_BODY_BYTES", "sixteen")
    with pytest.raises(SettingsError, match="FIRSTTOKEN_MAX_BODY_BYTES"):
        load_settings()


@pytest.mark.parametrize(
    "raw,where",
    [
        ("[{", "FIRSTTOKEN_ROUTES: not valid JSON"),
        ('{"name": "x"}', "FIRSTTOKEN_ROUTES: expected a non-empty JSON list"),
        ('[{"name": "a", "models": ["*"], "kind": "openai"}]', "FIRSTTOKEN_ROUTES[0]"),
        (
            '[{"name": "a", "models": ["*"], "kind": "grpc", "base_url": "http://x"}]',
            "FIRSTTOKEN_ROUTES[0].kind",
        ),
        (
            '[{"name": "a", "models": ["*"], "kind": "openai", "base_url": "http://x", "fallbacks": ["b"]}]',
            "unknown fallback 'b'",
        ),
        (
            '[{"name": "a", "models": ["*"], "kind": "openai", "base_url": "http://x", "api_key": "sk-1"}]',
            "FIRSTTOKEN_ROUTES[0].api_key",
        ),
    ],
)
def test_bad_routes_are_explained(raw, where):
    with pytest.raises(SettingsError) as err:
        load_routes(raw, {})
    assert where in str(err.value)


def test_bad_tenant_keys_fail_start():
    with pytest.raises(SettingsError, match="FIRSTTOKEN_TENANT_KEYS"):
        create_app(
            Settings(
                tenant_keys="acme",
                routes='[{"name": "a", "models": ["*"], "kind": "openai", "base_url": "http://x"}]',
            ),
            {},
        )
    with pytest.raises(SettingsError, match="'\\*' is not a tenant"):
        create_app(
            Settings(
                tenant_keys="*:k",
                routes='[{"name": "a", "models": ["*"], "kind": "openai", "base_url": "http://x"}]',
            ),
            {},
        )


def test_slo_tenants_parse_and_fail_clearly():
    assert Settings(ttft_slo_tenants="acme:800, big:co:1500").slo_targets() == {
        "acme": 800.0,
        "big:co": 1500.0,
    }
    with pytest.raises(SettingsError, match="FIRSTTOKEN_TTFT_SLO_TENANTS"):
        Settings(ttft_slo_tenants="acme:fast").slo_targets()


def test_routes_from_provider_keys_put_the_catch_all_last():
    routes = default_routes({"OPENAI_API_KEY": "sk-a", "ANTHROPIC_API_KEY": "sk-b"})
    assert [r.name for r in routes] == ["anthropic", "openai"]
    table = load_routes(None, {"OPENAI_API_KEY": "sk-a", "ANTHROPIC_API_KEY": "sk-b"})
    assert table.match("claude-sonnet-4").name == "anthropic"
    assert table.match("gpt-4o").name == "openai"
    assert load_routes(None, {}).routes == []


def test_cli_exits_2_with_the_variable_named():
    env = {**os.environ, "FIRSTTOKEN_KEEPALIVE_S": "-1"}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "FIRSTTOKEN_KEEPALIVE_S" in proc.stderr and "Traceback" not in proc.stderr

"""One door for configuration: `load_settings` reads the environment once, into typed values,
and warns about what it cannot use; `Runtime(settings)` needs nothing else."""

from __future__ import annotations

import inspect
import logging

import orjson
import pytest

from gateway.app import create_app
from gateway.config.routes import Route
from gateway.config.settings import Settings, SettingsError, load_settings
from gateway.runtime import Runtime
from gateway.upstreams.build import build_upstream
from policies import PolicyOptions

KEY = "sk-very-secret-upstream-key"


def route(**extra: object) -> dict:
    return {"name": "up", "models": ["*"], "kind": "openai", "base_url": "http://x/v1", **extra}


def routes_json(*items: dict) -> str:
    return orjson.dumps(list(items)).decode()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "firsttoken" and r.levelno == logging.WARNING
    ]


def test_a_misspelled_variable_is_a_warning_that_suggests_the_name(caplog):
    caplog.set_level(logging.WARNING, logger="firsttoken")
    settings = load_settings(
        environ={"FIRSTTOKEN_TIMEOUT": "5", "FIRSTTOKEN_ROUTE": routes_json(route())}
    )
    messages = warnings_of(caplog)
    assert any(
        m.startswith("FIRSTTOKEN_TIMEOUT:") and "did you mean FIRSTTOKEN_TIMEOUT_S?" in m
        for m in messages
    ), messages
    assert any(
        "FIRSTTOKEN_ROUTE:" in m and "did you mean FIRSTTOKEN_ROUTES?" in m for m in messages
    )
    assert settings.timeout_s == 600 and settings.routes is None  # ignored, as the warning says


def test_a_name_far_from_any_setting_is_warned_without_a_guess(caplog):
    caplog.set_level(logging.WARNING, logger="firsttoken")
    # the demo's cache folder and the compiled build's switch are read elsewhere: not warned
    environ = {"FIRSTTOKEN_ZZZ_QQQ": "1", "FIRSTTOKEN_CACHE_DIR": "/tmp/x", "FIRSTTOKEN_MYPYC": "1"}
    load_settings(environ=environ)
    assert warnings_of(caplog) == ["FIRSTTOKEN_ZZZ_QQQ: no such setting, ignored"]


def test_known_variables_and_other_prefixes_are_not_warned(caplog):
    caplog.set_level(logging.WARNING, logger="firsttoken")
    load_settings(environ={"FIRSTTOKEN_TIMEOUT_S": "5", "OTHER_TIMEOUT": "1", "PATH": "/bin"})
    assert warnings_of(caplog) == []


def test_a_route_key_variable_that_is_unset_is_a_warning_naming_it(caplog):
    caplog.set_level(logging.WARNING, logger="firsttoken")
    settings = load_settings(
        environ={"FIRSTTOKEN_ROUTES": routes_json(route(api_key_env="UP_KEY"))}
    )
    (message,) = warnings_of(caplog)
    assert "'up'" in message and "UP_KEY" in message and "not set" in message
    assert settings.route_api_key(settings.routes[0]) is None
    caplog.clear()
    settings = load_settings(
        environ={"FIRSTTOKEN_ROUTES": routes_json(route(api_key_env="UP_KEY")), "UP_KEY": KEY}
    )
    assert warnings_of(caplog) == []
    assert settings.route_api_key(settings.routes[0]) == KEY


@pytest.mark.parametrize(
    "base_url", ["localhost:9100", "ftp://example.com/v1", "http://", "example.com/v1"]
)
def test_a_base_url_without_http_scheme_and_host_is_refused(base_url):
    raw = routes_json(route(base_url="http://ok:1/v1"), route(name="bad", base_url=base_url))
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"FIRSTTOKEN_ROUTES": raw})
    message = str(err.value)
    assert message.startswith("FIRSTTOKEN_ROUTES[1]")
    assert "route 'bad'" in message and "base_url" in message and "http" in message


def test_a_base_url_with_credentials_is_not_echoed():
    raw = routes_json(route(base_url="redis://user:hunter2@host/v1"))
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"FIRSTTOKEN_ROUTES": raw})
    assert "hunter2" not in str(err.value)


def test_good_base_urls_pass():
    settings = load_settings(
        environ={},
        routes=routes_json(
            route(base_url="https://api.example.com/v1"),
            route(name="v6", base_url="http://[::1]:8000/v1"),
        ),
    )
    assert [r.name for r in settings.routes] == ["up", "v6"]


def test_one_key_for_two_tenants_stops_the_start_naming_the_tenants_not_the_key():
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"FIRSTTOKEN_TENANT_KEYS": f"globex:{KEY},acme:{KEY}"})
    message = str(err.value)
    assert message.startswith("FIRSTTOKEN_TENANT_KEYS")
    assert "'acme'" in message and "'globex'" in message
    assert KEY not in message


def test_a_tenant_key_that_is_an_admin_key_stops_the_start_naming_the_tenant():
    with pytest.raises(SettingsError) as err:
        load_settings(
            environ={
                "FIRSTTOKEN_TENANT_KEYS": f"acme:{KEY},globex:sk-other",
                "FIRSTTOKEN_ADMIN_KEYS": KEY,
            }
        )
    message = str(err.value)
    assert message.startswith("FIRSTTOKEN_ADMIN_KEYS") and "'acme'" in message
    assert "globex" not in message and KEY not in message


def test_a_tenant_may_have_two_keys():
    settings = load_settings(environ={"FIRSTTOKEN_TENANT_KEYS": "acme:k1,acme:k2"})
    assert sorted(settings.tenant_keys.values()) == ["acme", "acme"]


def test_keys_never_show_in_repr_or_dumps():
    settings = load_settings(
        environ={
            "FIRSTTOKEN_TENANT_KEYS": f"acme:{KEY}-t",
            "FIRSTTOKEN_ADMIN_KEYS": f"{KEY}-a",
            "OPENAI_API_KEY": KEY,
        }
    )
    assert settings.route_api_key(settings.routes[0]) == KEY
    for text in (repr(settings), str(settings), str(settings.model_dump())):
        assert KEY not in text


def test_typed_values_come_out_of_the_strings():
    settings = load_settings(
        environ={
            "FIRSTTOKEN_ROUTES": routes_json(route(), route(name="two", fallbacks=["up"])),
            "FIRSTTOKEN_TTFT_SLO_TENANTS": "acme:800,big:co:1500",
            "FIRSTTOKEN_POLICIES": "slim,cache_hints",
            "FIRSTTOKEN_SLIM_MINIFY_JSON": "true",
            "FIRSTTOKEN_CACHE_HINTS_HEAD_TTL": "1h",
            "FIRSTTOKEN_TENANT_KEYS": "acme:k1",
        }
    )
    assert [r.name for r in settings.routes] == ["up", "two"]
    assert settings.routes[1].fallbacks == ("up",)
    assert settings.ttft_slo_tenants == {"acme": 800.0, "big:co": 1500.0}
    assert settings.policies == ("slim", "cache_hints")
    assert settings.policy_options.slim.minify_json is True
    assert settings.policy_options.cache_hints.head_ttl == "1h"
    assert list(settings.tenant_keys.values()) == ["acme"]
    assert isinstance(settings.policy_options, PolicyOptions)


def test_a_misspelled_policy_option_stops_the_start_with_a_suggestion():
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"FIRSTTOKEN_SLIM_MINIFY_JSN": "true"})
    assert "FIRSTTOKEN_SLIM_MINIFY_JSN" in str(err.value)
    assert "did you mean FIRSTTOKEN_SLIM_MINIFY_JSON?" in str(err.value)


def test_redis_url_falls_back_to_REDIS_URL_read_at_load():
    settings = load_settings(environ={"REDIS_URL": "redis://127.0.0.1:6379/3"})
    assert settings.effective_redis_url() == "redis://127.0.0.1:6379/3"
    assert settings.redis_url_variable() == "REDIS_URL"
    own = load_settings(environ={"FIRSTTOKEN_REDIS_URL": "redis://a/1", "REDIS_URL": "redis://b/2"})
    assert own.effective_redis_url() == "redis://a/1"
    assert own.redis_url_variable() == "FIRSTTOKEN_REDIS_URL"


def test_settings_built_directly_read_no_environment(monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_TIMEOUT_S", "5")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/3")
    settings = Settings()
    assert settings.timeout_s == 600 and settings.routes is None
    assert settings.effective_redis_url() is None
    assert load_settings().timeout_s == 5  # the process environment, read by the one door


def test_the_engine_token_budget_is_the_engines_own_unless_set():
    local = Route(name="local", models=("*",), kind="local", demo=True)
    assert build_upstream(local, Settings()).max_num_batched_tokens is None
    settings = load_settings(environ={"FIRSTTOKEN_ENGINE_MAX_NUM_BATCHED_TOKENS": "256"})
    assert build_upstream(local, settings).max_num_batched_tokens == 256


def test_the_gateway_and_the_app_take_settings_only():
    assert list(inspect.signature(Runtime).parameters) == ["settings"]
    assert list(inspect.signature(create_app).parameters) == ["settings"]
    assert list(inspect.signature(build_upstream).parameters) == ["route", "settings"]
    settings = load_settings(
        environ={"UP_KEY": KEY, "FIRSTTOKEN_SLIM_MINIFY_JSON": "true"},
        routes=routes_json(route(api_key_env="UP_KEY")),
    )
    runtime = Runtime(settings)
    assert runtime.upstreams["up"].route.name == "up"
    assert runtime.policies.default_names == settings.policies


def test_a_route_with_an_unknown_policy_stops_the_start_naming_the_route():
    settings = Settings(routes=routes_json(route(policies=["slim", "teleport"])))
    with pytest.raises(SettingsError) as err:
        Runtime(settings)
    assert str(err.value).startswith("FIRSTTOKEN_ROUTES: route 'up' policies:")
    assert "teleport" in str(err.value)


def test_workers_get_the_policy_options_and_no_key():
    from gateway.pipeline.big_bodies import dumps_settings

    settings = load_settings(
        environ={
            "FIRSTTOKEN_TENANT_KEYS": f"acme:{KEY}",
            "FIRSTTOKEN_SLIM_MINIFY_JSON": "true",
            "UP_KEY": KEY,
        },
        routes=routes_json(route(api_key_env="UP_KEY")),
    )
    data = dumps_settings(settings)
    assert KEY not in orjson.dumps(data).decode()
    worker = Settings.model_validate(data)
    assert worker.policy_options == settings.policy_options
    assert worker.policy_options.slim.minify_json is True
    assert worker.routes == settings.routes and worker.tenant_keys == {}

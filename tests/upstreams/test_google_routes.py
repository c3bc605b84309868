"""Configuring gemini and vertex routes: what start-up accepts, refuses, and says about it."""

from __future__ import annotations

import orjson
import pytest

import gateway.upstreams.google_token as google_token
from gateway.app import create_app
from gateway.config.settings import SettingsError, load_settings
from gateway.upstreams.build import build_upstream
from gateway.upstreams.gemini import GEMINI_BASE_URL
from gateway.upstreams.vertex import vertex_base_url

VERTEX = {"name": "v", "models": ["claude-*"], "kind": "vertex"}


def settings_for(*routes: dict, environ: dict | None = None):
    return load_settings(environ=environ or {}, routes=orjson.dumps(list(routes)).decode())


def test_default_base_urls():
    gemini = settings_for({"name": "g", "models": ["gemini-*"], "kind": "gemini"})
    upstream = build_upstream(gemini.routes[0], gemini)
    assert upstream.http.base_url == GEMINI_BASE_URL
    assert vertex_base_url("us-east5") == "https://us-east5-aiplatform.googleapis.com"
    assert vertex_base_url("global") == "https://aiplatform.googleapis.com"
    vertex = settings_for({**VERTEX, "project": "my-project", "region": "global"})
    assert build_upstream(vertex.routes[0], vertex).http.base_url == vertex_base_url("global")


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"region": "us-east5"}, "needs 'project'"),
        ({"project": "my-project"}, "needs 'region'"),
        ({"project": "my-project/../x", "region": "us-east5"}, "needs 'project'"),
        ({"project": "my-project", "region": "us-east5/../../x"}, "needs 'region'"),
        ({"project": "my-project", "region": "us-east5?x"}, "needs 'region'"),
        ({"project": "My:Project", "region": "us-east5"}, "needs 'project'"),
    ],
)
def test_vertex_project_and_region_are_checked_at_start_up(fields, complaint):
    with pytest.raises(SettingsError, match=complaint):
        settings_for({**VERTEX, **fields})


def test_project_and_region_belong_to_vertex_only():
    route = {"name": "g", "models": ["gemini-*"], "kind": "gemini", "region": "us-east5"}
    with pytest.raises(SettingsError, match="region applies to vertex and bedrock only"):
        settings_for(route)
    with pytest.raises(SettingsError, match="project applies to vertex only"):
        settings_for({**route, "region": None, "project": "my-project"})


def test_vertex_without_google_auth_is_a_start_up_error_naming_the_extra(monkeypatch):
    monkeypatch.setattr(google_token, "google_auth_installed", lambda: False)
    settings = settings_for({**VERTEX, "project": "my-project", "region": "us-east5"})
    with pytest.raises(SettingsError, match=r"pip install 'firsttoken\[vertex\]'"):
        create_app(settings)


def test_the_credentials_file_is_read_from_the_settings():
    path = "/run/secrets/sa.json"
    settings = settings_for(
        {**VERTEX, "project": "my-project", "region": "us-east5"},
        environ={"GOOGLE_APPLICATION_CREDENTIALS": path},
    )
    upstream = build_upstream(settings.routes[0], settings)
    assert upstream.tokens.credentials_file == path


def test_gemini_api_key_alone_makes_a_gemini_route():
    settings = load_settings(environ={"GEMINI_API_KEY": "gm-key", "OPENAI_API_KEY": "sk-a"})
    routes = {r.name: r for r in settings.routes or ()}
    assert routes["gemini"].kind == "gemini" and routes["gemini"].models == ("gemini-*",)
    assert [r.name for r in settings.routes or ()][-1] == "openai"  # the catch-all last
    assert settings.route_api_key(routes["gemini"]) == "gm-key"

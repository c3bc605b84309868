"""The dashboard's HTTP side, without a browser: the page and its assets (policy and cache
headers, a fixed list of files), and `whoami`, which tells the page what its key may read."""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest

from gateway.ops.dashboard import ASSET_DIR, ASSETS, IMMUTABLE, load_assets
from tests.support.gateway import openai_route

KEYS = "acme:sk-acme-1,bravo:sk-bravo-1"
ADMIN = "sk-root-1"


@pytest.fixture
def gw(make_gateway, mock_upstream):
    return make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys=ADMIN)


def whoami(gw, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(gw.url + "/dashboard/whoami", headers=headers, timeout=10)


def test_the_page_links_every_asset_by_its_content_hash(gw):
    page = httpx.get(gw.url + "/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    linked = dict(re.findall(r'/dashboard/static/([\w./]+)\?v=([0-9a-f]{16})"', page.text))
    assert set(linked) == set(ASSETS)
    for name, version in linked.items():
        body = (ASSET_DIR / name).read_bytes()
        assert version == hashlib.sha256(body).hexdigest()[:16]
        asset = httpx.get(f"{gw.url}/dashboard/static/{name}", params={"v": version}, timeout=10)
        assert asset.status_code == 200 and asset.content == body
        assert asset.headers["cache-control"] == IMMUTABLE
        assert asset.headers["content-type"].split(";")[0] == ASSETS[name].split(";")[0]
    # No inline script anywhere: every <script> has a src.
    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", page.text) == []


def test_an_unversioned_or_stale_asset_url_is_revalidated(gw):
    for params in ({}, {"v": "0" * 16}):
        asset = httpx.get(gw.url + "/dashboard/static/dashboard.js", params=params, timeout=10)
        assert asset.status_code == 200 and asset.headers["cache-control"] == "no-cache"


@pytest.mark.parametrize(
    "path", ["../dashboard_api.py", "index.html", "uplot/LICENSE", "%2e%2e/app.py", "nope.js"]
)
def test_only_the_listed_assets_are_served(gw, path):
    answer = httpx.get(f"{gw.url}/dashboard/static/{path}", timeout=10)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "unknown_url"


def test_whoami_names_the_keys_tenant_or_admin(gw):
    assert whoami(gw, "sk-acme-1").json() == {"tenant": "acme", "admin": False, "open": False}
    assert whoami(gw, "sk-bravo-1").json() == {"tenant": "bravo", "admin": False, "open": False}
    assert whoami(gw, ADMIN).json() == {"tenant": None, "admin": True, "open": False}
    for key in (None, "sk-wrong"):
        refused = whoami(gw, key)
        assert refused.status_code == 401
        assert refused.headers["cache-control"] == "no-store"
        assert "sk-wrong" not in refused.text


def test_the_trailing_slash_redirects_to_the_page(gw):
    answer = httpx.get(gw.url + "/dashboard/", timeout=10)
    assert answer.status_code == 308 and answer.headers["location"] == "/dashboard"


def test_a_page_naming_an_unknown_asset_is_refused_at_start(tmp_path):
    for name in ASSETS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "index.html").write_text('<script src="{{asset:missing.js}}"></script>')
    with pytest.raises(ValueError, match="not in ASSETS"):
        load_assets(tmp_path)

"""`GET /dashboard`: a static page that draws the metrics JSON endpoints in the browser.

The page holds no data and needs no key to load: the key is typed into it, kept in the tab's
`sessionStorage`, and sent by the page's own `fetch()` calls as `Authorization: Bearer`, so every
figure it shows passes the same tenant checks as a `curl` of the JSON endpoints would. Nothing is
rendered on the server and there is no server-side session.

Assets are read once at start-up and served from memory under `/dashboard/static/`, from a fixed
list (no path is ever joined with request input). The page links them with a content hash
(`?v=`), so they can be cached for a year while a new release is fetched at once; the page
itself is revalidated on every load. A strict Content-Security-Policy allows scripts, styles and
requests from this origin only, and no inline script.

`GET /dashboard/whoami` tells the page whether its key is an admin key (tenant picker and
fleet view) or which tenant it belongs to; it answers 401 for a missing or unknown key, like
the metrics endpoints.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import orjson
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from gateway.boundary.admit import Admission
from gateway.errors import GatewayError

ASSET_DIR = Path(__file__).with_name("assets")
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
    "uplot/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uplot/uPlot.min.css": "text/css; charset=utf-8",
}
STATIC_PREFIX = "/dashboard/static/"

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
}
IMMUTABLE = "public, max-age=31536000, immutable"


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str
    version: str  # the first 16 hex digits of the body's SHA-256


def load_assets(directory: Path = ASSET_DIR) -> tuple[bytes, dict[str, Asset]]:
    """(the page with each `{{asset:NAME}}` replaced by its versioned URL, the assets)."""
    assets = {}
    for name, media_type in ASSETS.items():
        body = (directory / name).read_bytes()
        assets[name] = Asset(body, media_type, hashlib.sha256(body).hexdigest()[:16])
    page = (directory / "index.html").read_text(encoding="utf-8")
    for name, asset in assets.items():
        page = page.replace("{{asset:" + name + "}}", f"{STATIC_PREFIX}{name}?v={asset.version}")
    if "{{asset:" in page:
        raise ValueError("dashboard/index.html names an asset that is not in ASSETS")
    return page.encode("utf-8"), assets


def dashboard_endpoints(admission: Admission) -> list[Route]:
    """The page, its assets and `whoami`; register them before the `/v1/{path}` catch-all."""
    page, assets = load_assets()

    async def index(request: Request) -> Response:
        return Response(
            page,
            media_type="text/html; charset=utf-8",
            headers={**SECURITY_HEADERS, "cache-control": "no-cache"},
        )

    async def with_slash(request: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=308)

    async def static(request: Request) -> Response:
        asset = assets.get(request.path_params["name"])
        if asset is None:
            return GatewayError(404, "No such dashboard asset.", code="unknown_url").to_response()
        # Only the version the page links may be kept for a year; any other URL is revalidated.
        versioned = request.query_params.get("v") == asset.version
        return Response(
            asset.body,
            media_type=asset.media_type,
            headers={
                **SECURITY_HEADERS,
                "cache-control": IMMUTABLE if versioned else "no-cache",
                "etag": f'"{asset.version}"',
            },
        )

    async def whoami(request: Request) -> Response:
        headers = {"cache-control": "no-store"}
        try:
            body: dict[str, str | bool | None]
            if admission.is_admin(request):
                body = {"tenant": None, "admin": True, "open": admission.open}
            else:
                # 401 for a missing or unknown key
                tenant = admission.authenticate(admission.begin(request, "whoami")).tenant
                body = {"tenant": tenant, "admin": False, "open": admission.open}
        except GatewayError as exc:
            response = exc.to_response()
            response.headers.update(headers)
            return response
        return Response(orjson.dumps(body), media_type="application/json", headers=headers)

    return [
        Route("/dashboard", index, methods=["GET"]),
        Route("/dashboard/", with_slash, methods=["GET"]),
        Route("/dashboard/whoami", whoami, methods=["GET"]),
        Route(STATIC_PREFIX + "{name:path}", static, methods=["GET"]),
    ]

"""An upstream's cookies are untrusted state: one tenant's answer must never shape another
tenant's request. Real providers set cookies (Cloudflare's `__cf_bm` and `_cfuvid` on OpenAI's
API); a shared client that kept them would send the cookie one tenant's request earned with
every later tenant's request to that origin, linking their traffic. The gateway keeps none,
on the chat path and on passthrough alike.

The route's host is `localhost`, not an IP address: a cookie jar ignores cookies for IP hosts,
so an IP would hide the leak."""

from __future__ import annotations

import httpx
import orjson
import pytest
from aiohttp import web

from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, auth
from tests.security.hostile_upstream import completion, openai_stream
from tests.support.gateway import openai_route

COOKIE = "__cf_bm=tenant-a-bot-score; Path=/; HttpOnly"


def cookie_setting_answer(stream: bool):
    """Every answer sets a cookie, as a provider behind Cloudflare does."""

    async def answer(request: web.Request) -> web.StreamResponse:
        headers = {"set-cookie": COOKIE}
        if not stream:
            return web.json_response(completion("hi"), headers=headers)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
        await resp.prepare(request)
        for event in openai_stream("hi"):
            await resp.write(event)
        await resp.write_eof()
        return resp

    return answer


@pytest.fixture
def gateway(make_gateway, hostile, tenant_settings):
    route = openai_route(hostile)
    route["base_url"] = route["base_url"].replace("127.0.0.1", "localhost")
    return make_gateway([route], **tenant_settings)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"model": "mock-1", "stream": True, "messages": []}),
        ("/v1/chat/completions", {"model": "mock-1", "messages": []}),
        ("/v1/embeddings", {"model": "mock-1", "input": "hi"}),
    ],
    ids=["chat-stream", "chat", "passthrough"],
)
def test_no_upstream_cookie_reaches_another_tenants_request(gateway, hostile, path, body):
    body = {**body}
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": "hi"}]
    hostile.upstream.handler = cookie_setting_answer(bool(body.get("stream")))
    for key in (TENANT_A_KEY, TENANT_B_KEY, TENANT_A_KEY):
        r = httpx.post(gateway.url + path, content=orjson.dumps(body), headers=auth(key))
        assert r.status_code == 200, r.text[:300]
    posts = hostile.upstream.posts()
    assert len(posts) == 3
    sent = [{k.lower(): v for k, v in p["headers"].items()} for p in posts]
    assert all("cookie" not in headers for headers in sent), sent

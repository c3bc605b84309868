"""Tenant-owned objects: two tenants share one upstream account through the gateway, and neither
can read, list, change, delete or reference the other's files, batches or stored responses.
The OpenAI SDK is the client; ownership records live in process or in a real Redis."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest
import redis

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from gateway.boundary.ownership import (
    MemoryRecords,
    Ownership,
    RedisRecords,
    find_references,
    might_reference,
)
from gateway.doors.passthrough_relay import created_ids
from gateway.errors import GatewayError
from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, auth
from tests.support.clients import sdk_client
from tests.support.gateway import openai_route


@pytest.fixture(params=["memory", "redis"])
def store_settings(request, tenant_settings):
    """Tenant mode over the in-process store, or over Redis under a prefix of its own. Request
    it before `make_gateway`, so that the prefix is cleaned after the gateways' last flush."""
    if request.param == "memory":
        return {**tenant_settings, "telemetry": True}
    return {
        **tenant_settings,
        "redis_url": request.getfixturevalue("redis_url"),
        "metrics_key_prefix": request.getfixturevalue("key_prefix"),
    }


def seen_with(mock_upstream, needle: str) -> list[str]:
    """The upstream requests whose path or body mentions `needle`."""
    out = []
    for r in mock_upstream.mock.requests:
        body = r["body"] if isinstance(r["body"], bytes) else str(r["body"]).encode()
        if needle in r["path"] or needle.encode() in body:
            out.append(f"{r.get('method', 'POST')} {r['path']}")
    return out


def test_files_belong_to_the_tenant_that_uploaded_them(store_settings, mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], **store_settings)
    a, b = sdk_client(gw, TENANT_A_KEY), sdk_client(gw, TENANT_B_KEY)
    fa = a.files.create(file=("a.jsonl", b'{"secret": "acme"}\n'), purpose="batch")
    fb = b.files.create(file=("b.jsonl", b'{"x": 1}\n'), purpose="batch")
    records = gw.runtime.objects.records
    if "redis_url" in store_settings:
        with redis.Redis.from_url(store_settings["redis_url"]) as client:
            assert client.get(records.key("acme", fa.id)) == b"mock"
    else:
        assert isinstance(records, MemoryRecords)
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(fa.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(fa.id)
    with pytest.raises(openai.NotFoundError):
        b.files.delete(fa.id)
    with pytest.raises(openai.NotFoundError):  # an id in another tenant's body is no way in
        b.embeddings.create(model="mock-1", input="x", extra_body={"file_id": fa.id})
    assert seen_with(mock_upstream, fa.id) == [], "B's requests for A's file reached upstream"
    assert [f.id for f in b.files.list()] == [fb.id]
    page = a.files.list()
    assert [f.id for f in page.data] == [fa.id]
    assert a.files.content(fa.id).read() == b'{"secret": "acme"}\n'
    assert a.files.delete(fa.id).deleted
    with pytest.raises(openai.NotFoundError):  # the record went with the object
        a.files.retrieve(fa.id)
    assert seen_with(mock_upstream, fa.id) == [
        f"GET /v1/files/{fa.id}/content",
        f"DELETE /v1/files/{fa.id}",
    ]


def test_batches_and_their_output_files_belong_to_their_tenant(
    store_settings, mock_upstream, make_gateway
):
    gw = make_gateway([openai_route(mock_upstream)], **store_settings)
    a, b = sdk_client(gw, TENANT_A_KEY), sdk_client(gw, TENANT_B_KEY)
    fa = a.files.create(file=("in.jsonl", b'{"custom_id": "1"}\n'), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        b.batches.create(
            input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert not any(r["path"] == "/v1/batches" for r in mock_upstream.mock.requests)
    batch = a.batches.create(
        input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (b.batches.retrieve, b.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    assert b.batches.list().data == []
    assert [x.id for x in a.batches.list().data] == [batch.id]
    output = a.batches.retrieve(batch.id).output_file_id
    assert a.files.content(output).read().startswith(b'{"custom_id"')
    with pytest.raises(openai.NotFoundError):
        b.files.content(output)
    assert seen_with(mock_upstream, batch.id) == [f"GET /v1/batches/{batch.id}"]


def test_stored_responses_belong_to_their_tenant(store_settings, mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], **store_settings)
    a, b = sdk_client(gw, TENANT_A_KEY), sdk_client(gw, TENANT_B_KEY)
    ra = a.responses.create(model="mock-1", input="acme's secret plan")
    with a.responses.create(model="mock-1", input="streamed", stream=True) as events:
        kinds = [(e.type, getattr(getattr(e, "response", None), "id", None)) for e in events]
    streamed = kinds[0][1]
    assert kinds[0][0] == "response.created" and kinds[-1][0] == "response.completed"
    for rid in (ra.id, streamed):
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.input_items.list(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model="mock-1", input="go on", previous_response_id=rid)
        assert seen_with(mock_upstream, rid) == [], "B's request for A's response reached upstream"
    assert a.responses.retrieve(streamed).status == "completed"
    assert a.responses.input_items.list(ra.id).data[0].content[0].text == "acme's secret plan"
    follow = a.responses.create(model="mock-1", input="go on", previous_response_id=ra.id)
    assert follow.previous_response_id == ra.id
    a.responses.delete(ra.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(ra.id)
    # metadata keys are the client's own names, never references
    assert b.responses.create(model="mock-1", input="x", metadata={"file_id": "mine"}).id


def test_an_unreachable_ownership_store_fails_object_requests_closed(
    private_redis, mock_upstream, make_gateway, tenant_settings
):
    private_redis.start()
    gw = make_gateway(
        [openai_route(mock_upstream)],
        **tenant_settings,
        redis_url=private_redis.url,
        metrics_key_prefix="fttest-down",
    )
    a = sdk_client(gw, TENANT_A_KEY)
    fa = a.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    private_redis.kill()
    before = len(mock_upstream.mock.requests)
    with pytest.raises(openai.APIStatusError) as caught:
        a.files.retrieve(fa.id)
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "ownership_store_unavailable"
    assert len(mock_upstream.mock.requests) == before
    reply = a.chat.completions.create(model="mock-1", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content.startswith("tok0")


def test_open_mode_records_and_checks_nothing(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    assert not gw.runtime.objects.enabled
    one, other = sdk_client(gw, "key-1"), sdk_client(gw, "key-2")
    created = one.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    assert other.files.retrieve(created.id).id == created.id


def test_account_wide_writes_are_not_open_to_tenants(mock_upstream, make_gateway, tenant_settings):
    gw = make_gateway([openai_route(mock_upstream)], **tenant_settings)
    with pytest.raises(openai.NotFoundError):
        sdk_client(gw, TENANT_A_KEY).models.delete("ft:gpt-4o-mini:org:custom:abc")
    assert mock_upstream.mock.requests == []


# -- the ownership API itself (the chat path calls check_references) ---------------------


def test_check_references_finds_ids_by_key_anywhere_in_the_body():
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "file_id is just text here"},
                    {"type": "file", "file": {"file_id": "file-b"}},
                ],
            }
        ],
        "tools": [{"type": "file_search", "vector_store_ids": ["vs_1", "vs_2"]}],
        "conversation": {"id": "conv_1"},
        "metadata": {"file_id": "not-a-reference"},
    }
    assert sorted(find_references(body)) == ["conv_1", "file-b", "vs_1", "vs_2"]
    with pytest.raises(GatewayError) as caught:
        find_references({"x": [[0] * 1000] * 300})
    assert caught.value.status == 400


def test_might_reference_is_a_safe_prefilter():
    assert not might_reference(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    for raw in (
        b'{"file_id":"x"}',
        b'{"training_file":"x"}',
        b'{"file_ids":["x"]}',
        b'{"conversation":"c"}',
        b'{"container":"c"}',
        b'{"file\\u005fid":"x"}',
    ):
        assert might_reference(raw), raw


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_check_references_is_per_tenant(backend, request):
    if backend == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("key_prefix")

    async def run() -> None:
        if backend == "memory":
            ownership = Ownership(MemoryRecords())
        else:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(url)
            ownership = Ownership(RedisRecords(client, prefix))
        body = {
            "messages": [
                {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-a1"}}]}
            ]
        }
        raw = orjson.dumps(body)
        try:
            with pytest.raises(GatewayError) as caught:
                await ownership.check_references("acme", raw, body)
            assert caught.value.status == 404
            await ownership.record("acme", "files", "mock", ["file-a1"])
            await ownership.check_references("acme", raw, body)
            with pytest.raises(GatewayError):
                await ownership.check_references("globex", raw, body)
        finally:
            if backend == "redis":
                keys = [k async for k in client.scan_iter(f"{prefix}:*")]
                assert keys and all(b"{t=acme}" in k for k in keys)
                await client.aclose()

    asyncio.run(run())


def test_memory_records_are_bounded_per_tenant():
    async def run() -> None:
        records = MemoryRecords(max_objects=3, max_bytes=10_000)
        await records.put("acme", [f"file-{i}" for i in range(5)], "r", None)
        await records.put("globex", ["file-g"], "r", None)
        assert await records.get("acme", ["file-0", "file-1", "file-2", "file-4"]) == [
            None,
            None,
            "r",
            "r",
        ]
        assert await records.get("globex", ["file-g"]) == ["r"]
        small = MemoryRecords(max_objects=1000, max_bytes=500)
        await small.put("acme", ["x" * 200, "y" * 200, "z" * 200], "r", None)
        assert await small.get("acme", ["x" * 200, "z" * 200]) == [None, "r"]

    asyncio.run(run())


def test_no_content_type_trick_skips_the_reference_check(
    mock_upstream, make_gateway, tenant_settings
):
    gw = make_gateway([openai_route(mock_upstream)], **tenant_settings)
    ra = sdk_client(gw, TENANT_A_KEY).responses.create(model="mock-1", input="acme only")
    body = orjson.dumps({"model": "mock-1", "input": "x", "previous_response_id": ra.id})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/jsonl"):
        resp = httpx.post(
            gw.url + "/v1/responses",
            content=body,
            timeout=10,
            headers={**auth(TENANT_B_KEY), "content-type": content_type},
        )
        assert resp.status_code == 404, content_type
    resp = httpx.post(
        gw.url + "/v1/batches",
        timeout=10,
        headers=auth(TENANT_B_KEY),
        files={"input_file_id": (None, ra.id)},
    )
    assert resp.status_code == 415
    assert seen_with(mock_upstream, ra.id) == []


def test_an_object_is_read_through_the_route_that_created_it(
    mock_upstream, make_gateway, tenant_settings
):
    second = MockUpstream(MockBehaviour())
    with ThreadedServer(second) as other:
        routes = [
            openai_route(mock_upstream),
            openai_route(other, name="second", models=["other-*"]),
        ]
        gw = make_gateway(routes, **tenant_settings)
        a = sdk_client(gw, TENANT_A_KEY)
        created = a.responses.create(model="other-1", input="hi")
        assert a.responses.retrieve(created.id).id == created.id
        assert [r["path"] for r in second.requests] == [
            "/v1/responses",
            f"/v1/responses/{created.id}",
        ]
    assert mock_upstream.mock.requests == []


def test_streamed_creates_name_their_ids():
    response = orjson.dumps({"type": "response.created", "response": {"id": "resp_1"}})
    assert created_ids("response.created", response) == ["resp_1"]
    assert created_ids("thread.created", b'{"id": "thread_1", "created_at": 1}') == ["thread_1"]
    assert created_ids(
        "thread.run.created", b'{"id": "run_1", "thread_id": "thread_2", "created_at": 1}'
    ) == ["thread_2"]
    assert created_ids("response.output_text.delta", b'{"delta": "created"}') == []
    assert created_ids(None, b"[DONE]") == []


def test_a_chat_file_part_must_name_the_tenants_own_file(
    store_settings, mock_upstream, make_gateway
):
    gw = make_gateway([openai_route(mock_upstream)], **store_settings)
    a, b = sdk_client(gw, TENANT_A_KEY), sdk_client(gw, TENANT_B_KEY)
    fa = a.files.create(file=("a.pdf", b"%PDF-1.4 acme"), purpose="user_data")

    def ask(client: openai.OpenAI):
        return client.chat.completions.create(
            model="mock-1",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "file", "file": {"file_id": fa.id}},
                        {"type": "text", "text": "summarise"},
                    ],
                }
            ],
        )

    with pytest.raises(openai.NotFoundError):
        ask(b)
    assert [
        r["path"] for r in mock_upstream.mock.requests if r["path"] == "/v1/chat/completions"
    ] == []  # B's request never went upstream
    assert ask(a).choices  # A's own file is fine

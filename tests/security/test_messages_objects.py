"""Object references on the Messages door obey the same ownership rules as on OpenAI's doors: a
`file` source (`file_id`) in a document or image block and a top-level `container` must name an
object the tenant created through the gateway; anything else is an Anthropic-shaped 404 that
never reaches the `anthropic` route (nor, translated, an `openai` one)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, auth
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, openai_route


def document(file_id: str) -> dict:
    return {"type": "document", "source": {"type": "file", "file_id": file_id}}


def image(file_id: str) -> dict:
    return {"type": "image", "source": {"type": "file", "file_id": file_id}}


def body(model: str, *blocks: dict, **extra: object) -> dict:
    content = [*blocks, {"type": "text", "text": "summarise"}]
    return {
        "model": model,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


@pytest.fixture
def gateway(make_gateway, mock_upstream, tenant_settings):
    return make_gateway(
        [openai_route(mock_upstream), anthropic_route(mock_upstream)], **tenant_settings
    )


def reached(mock_upstream, needle: str) -> list[str]:
    out = []
    for r in mock_upstream.mock.requests:
        raw = r["body"] if isinstance(r["body"], bytes) else orjson.dumps(r["body"])
        if needle.encode() in raw:
            out.append(r["path"])
    return out


@pytest.mark.parametrize("model", ["claude-1", "mock-1"])  # native, and translated
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "make",
    [
        lambda oid: body("M", document(oid)),
        lambda oid: body("M", image(oid)),
        lambda oid: body("M", container=oid),
        lambda oid: body("M", container={"id": oid, "skills": []}),
    ],
    ids=["document", "image", "container", "container-object"],
)
def test_another_tenants_or_unknown_ids_are_a_404_that_never_goes_upstream(
    gateway, mock_upstream, model, path, make
):
    owner = sdk_client(gateway, TENANT_A_KEY)
    theirs = owner.files.create(file=("a.pdf", b"%PDF-1.4 acme"), purpose="assistants").id
    for oid in (theirs, "file_011CNha8iCJcU1wXNR6q4V8w"):
        sent = make(oid)
        sent["model"] = model
        r = httpx.post(
            gateway.url + path, content=orjson.dumps(sent), headers=auth(TENANT_B_KEY), timeout=20
        )
        assert r.status_code == 404, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
        assert reached(mock_upstream, oid) == []


def test_the_creators_own_file_goes_through(gateway, mock_upstream):
    owner = sdk_client(gateway, TENANT_A_KEY)
    mine = owner.files.create(file=("a.pdf", b"%PDF-1.4 acme"), purpose="assistants").id
    r = httpx.post(
        gateway.url + "/v1/messages",
        content=orjson.dumps(body("claude-1", document(mine))),
        headers=auth(TENANT_A_KEY),
        timeout=20,
    )
    assert r.status_code == 200, r.text
    assert reached(mock_upstream, mine)[-1] == "/v1/messages"

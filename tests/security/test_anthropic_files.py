"""Anthropic's Files API through the gateway, with the ownership rules of OpenAI's: a request
to `/v1/files...` carrying `anthropic-version` (the Anthropic SDK's) goes to the `anthropic`
route with the route's key; the file it creates is its tenant's, usable in that tenant's
Messages `document` blocks, and another tenant's id is a 404 that never reaches the upstream;
a list shows the tenant's own files only."""

from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest

from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, UPSTREAM_KEY
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, openai_route


@pytest.fixture
def gateway(make_gateway, mock_upstream, tenant_settings):
    return make_gateway(
        [openai_route(mock_upstream), anthropic_route(mock_upstream)], **tenant_settings
    )


def claude(gateway, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=20)


def upload(client: anthropic.Anthropic, content: bytes) -> str:
    return client.beta.files.upload(file=("notes.pdf", content, "application/pdf")).id


def reached(mock_upstream, needle: str) -> list[tuple[str, str]]:
    out = []
    for r in mock_upstream.mock.requests:
        raw = r["body"] if isinstance(r["body"], bytes) else orjson.dumps(r["body"])
        if needle in r["path"] or needle.encode() in raw:
            out.append((r.get("method", "POST"), r["path"]))
    return out


def test_an_anthropic_upload_goes_to_the_anthropic_route_with_the_routes_key(
    gateway, mock_upstream
):
    file = claude(gateway, TENANT_A_KEY).beta.files.upload(
        file=("notes.pdf", b"%PDF-1.4 acme", "application/pdf"), betas=["files-api-2025-04-14"]
    )
    assert file.id.startswith("file_") and file.type == "file"
    sent = mock_upstream.mock.requests[-1]
    headers = {k.lower(): v for k, v in sent["headers"].items()}
    assert sent["path"] == "/v1/files" and sent["body"] == b"%PDF-1.4 acme"
    assert headers["x-api-key"] == UPSTREAM_KEY  # the route's key, never the tenant's
    assert TENANT_A_KEY not in orjson.dumps(headers).decode()
    assert headers["anthropic-beta"] == "files-api-2025-04-14"  # the client's, forwarded
    assert "authorization" not in headers


def test_anthropic_files_belong_to_the_tenant_that_uploaded_them(gateway, mock_upstream):
    owner, other = claude(gateway, TENANT_A_KEY), claude(gateway, TENANT_B_KEY)
    mine = upload(owner, b"%PDF-1.4 acme")
    theirs = upload(other, b"%PDF-1.4 globex")

    assert owner.beta.files.retrieve_metadata(mine).id == mine
    assert owner.beta.files.download(mine).read() == b"%PDF-1.4 acme"
    assert [f.id for f in owner.beta.files.list()] == [mine]
    assert [f.id for f in other.beta.files.list()] == [theirs]

    before = len(reached(mock_upstream, mine))
    with pytest.raises(anthropic.NotFoundError):
        other.beta.files.retrieve_metadata(mine)
    with pytest.raises(anthropic.NotFoundError):
        other.beta.files.download(mine)
    with pytest.raises(anthropic.NotFoundError):
        other.beta.files.delete(mine)
    assert len(reached(mock_upstream, mine)) == before  # none reached the upstream
    r = httpx.get(
        f"{gateway.url}/v1/files/{mine}",
        headers={"x-api-key": TENANT_B_KEY, "anthropic-version": "2023-06-01"},
        timeout=20,
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"  # its shape

    assert owner.beta.files.delete(mine).id == mine
    with pytest.raises(anthropic.NotFoundError):  # forgotten with the object
        owner.beta.files.retrieve_metadata(mine)
    assert [f.id for f in other.beta.files.list()] == [theirs]


def test_an_uploaded_file_is_usable_in_its_creators_messages_only(gateway, mock_upstream):
    mine = upload(claude(gateway, TENANT_A_KEY), b"%PDF-1.4 acme")

    def ask(key: str) -> anthropic.types.Message:
        return claude(gateway, key).messages.create(
            model="claude-1",
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "document", "source": {"type": "file", "file_id": mine}},
                        {"type": "text", "text": "summarise"},
                    ],
                }
            ],
            extra_headers={"anthropic-beta": "files-api-2025-04-14"},
        )

    assert ask(TENANT_A_KEY).type == "message"
    assert reached(mock_upstream, mine)[-1] == ("POST", "/v1/messages")
    before = len(reached(mock_upstream, mine))
    with pytest.raises(anthropic.NotFoundError):
        ask(TENANT_B_KEY)
    assert len(reached(mock_upstream, mine)) == before


def test_openai_files_still_go_to_the_openai_route(gateway, mock_upstream):
    """Without `anthropic-version` the same path is OpenAI's, and an Anthropic file id is not
    confused with one: the request carries the tenant's key as the OpenAI SDK sends it."""
    openai_file = sdk_client(gateway, TENANT_A_KEY).files.create(
        file=("a.jsonl", b"{}"), purpose="batch"
    )
    assert openai_file.id.startswith("file-") and openai_file.object == "file"
    listed = [f.id for f in sdk_client(gateway, TENANT_A_KEY).files.list()]
    assert openai_file.id in listed
    sent = {k.lower(): v for k, v in mock_upstream.mock.requests[-1]["headers"].items()}
    assert sent["authorization"] == f"Bearer {UPSTREAM_KEY}" and "x-api-key" not in sent


def test_upstream_errors_keep_anthropics_shape(make_gateway, mock_upstream):
    gateway = make_gateway([anthropic_route(mock_upstream)])  # open mode: no ownership check
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude(gateway, "client-key").beta.files.retrieve_metadata("file_011CNhaUnknown")
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "File not found."},
    }


def test_a_gateway_without_an_anthropic_route_answers_404(make_gateway, mock_upstream):
    gateway = make_gateway([openai_route(mock_upstream)])
    r = httpx.get(
        gateway.url + "/v1/files",
        headers={"x-api-key": "client-key", "anthropic-version": "2023-06-01"},
        timeout=20,
    )
    assert r.status_code == 404, r.text
    assert r.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": r.json()["error"]["message"]},
    }
    assert all(req["path"] != "/v1/files" for req in mock_upstream.mock.requests)


@pytest.mark.parametrize(
    ("method", "target", "served"),
    [
        ("POST", "/v1/messages", True),
        ("POST", "/v1/messages/count_tokens", True),
        ("POST", "/v1/messages?beta=true", False),
        ("POST", "/v1/files", True),
        ("GET", "/v1/files?limit=5&after_id=file_1", True),
        ("GET", "/v1/files/file_1", True),
        ("GET", "/v1/files/file_1/content", True),
        ("DELETE", "/v1/files/file_1", True),
        ("POST", "/v1/files/file_1", False),
        ("DELETE", "/v1/files", False),
        ("POST", "/v1/files/file_1/content", False),
        ("GET", "/v1/batches", False),
        ("GET", "/v1/messages", False),
    ],
)
def test_the_anthropic_kind_forwards_only_its_allow_listed_paths(method, target, served):
    from gateway.paths import PassPath, parse_query, parse_target
    from gateway.upstreams.anthropic import forwarded

    raw, _, query = target.partition("?")
    if raw.startswith("/v1/messages"):  # not an OpenAI family: the Messages door names it
        path = PassPath(tuple(raw[4:].split("/")), parse_query(query.encode()))
    else:
        path = parse_target(raw.encode(), query.encode())
    assert forwarded(method, path) is served


def test_an_anthropic_route_can_turn_its_files_api_off(make_gateway, mock_upstream):
    gateway = make_gateway([anthropic_route(mock_upstream, passthrough=[])])
    with pytest.raises(anthropic.NotFoundError):
        claude(gateway, "client-key").beta.files.list()
    assert all(req["path"] != "/v1/files" for req in mock_upstream.mock.requests)


def test_an_anthropic_route_passes_through_files_only():
    from gateway.config.routes import Route

    route = {"name": "c", "models": ["claude-*"], "kind": "anthropic"}
    route["base_url"] = "https://api.anthropic.com/v1"
    assert Route(**route, passthrough=["files"]).serves_anthropic_files()
    assert not Route(**route, passthrough=[]).serves_anthropic_files()
    with pytest.raises(ValueError, match="files only"):
        Route(**route, passthrough=["batches"])

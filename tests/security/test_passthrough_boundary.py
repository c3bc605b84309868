"""Passthrough (every /v1 path but chat and completions) as an attacker would try it: paths that
escape /v1, redirects to another host, headers that belong to the client's account, hanging
upstreams, clients that leave, oversized bodies both ways. Real loopback servers throughout."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from yarl import URL

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from gateway.config.settings import Settings, SettingsError
from gateway.errors import GatewayError
from gateway.paths import parse_target, upstream_url
from tests.security.conftest import UPSTREAM_KEY
from tests.support.clients import sdk_client
from tests.support.gateway import GatewayThread, anthropic_route, openai_route


def raw_request(
    gw, method: str, target: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[int, dict, bytes]:
    """The request target goes out byte for byte (no client-side normalisation)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request(method, target, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def assert_openai_error(status: int, data: bytes, expected: tuple[int, ...]) -> dict:
    assert status in expected, (status, data)
    error = orjson.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


TRAVERSALS = [
    ("GET", "/v1/%2e%2e/%2e%2e/admin/users?all=1"),
    ("GET", "/v1/%2E%2E/admin/users"),
    ("GET", "/v1/../../admin/users?all=1"),
    ("GET", "/v1/..%2f..%2fadmin/users"),
    ("GET", "/v1/files/..%2F..%2F..%2Fadmin/users"),
    ("GET", "/v1/files/%2e%2e/%2e%2e/admin"),
    ("GET", "/v1/files/%252e%252e/admin"),
    ("GET", "/v1/files%3Fall=1"),
    ("GET", "/v1/files/x%23frag"),
    ("GET", "/v1/files/a%5c..%5cadmin"),
    ("GET", "/v1/files/a\\..\\admin"),
    ("GET", "/v1/files/a%00"),
    ("GET", "/v1/files/a%0d%0aHost:%20evil"),
    ("GET", "/v1/files//admin"),
    ("GET", "/v1/files/"),
    ("GET", "/v1/./files"),
    ("GET", "/v1/admin/users"),
    ("GET", "/v1/organization/users"),
    ("POST", "/v1/realtime/client_secrets"),
    ("GET", "/v1/chat/completions"),
    ("GET", "/v1/chat/completions/chatcmpl-1"),
    ("POST", "/v1/%2e%2e/admin/users"),
    ("POST", "/v1/files/..%2f..%2fadmin"),
    ("DELETE", "/v1/files/..%2f..%2fadmin"),
]


@pytest.mark.parametrize("method,target", TRAVERSALS)
def test_paths_outside_the_allowed_families_never_reach_the_upstream(
    mock_upstream, make_gateway, method, target
):
    gw = make_gateway([openai_route(mock_upstream)])
    body = b'{"model": "mock-1"}' if method == "POST" else None
    status, _, data = raw_request(
        gw, method, target, body, {"content-type": "application/json"} if body else None
    )
    assert_openai_error(status, data, (400, 404, 405))
    assert mock_upstream.mock.requests == []


def test_control_characters_in_the_raw_target_never_reach_the_upstream(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(b"GET /v1/files/a\x01b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.split(b" ")[1] in (b"400", b"404")
    assert mock_upstream.mock.requests == []


def test_query_is_reencoded_and_the_path_reaches_exactly_its_family(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream, base_url=mock_upstream.base_url + "/")])
    status, _, _ = raw_request(gw, "GET", "/v1/files?purpose=a%26b%3Fc&limit=2")
    assert status == 200
    [seen] = mock_upstream.mock.requests
    assert seen["raw_path"] == "/v1/files?purpose=a%26b%3Fc&limit=2"
    assert seen["headers"]["Authorization"] == f"Bearer {UPSTREAM_KEY}"


def test_a_redirect_is_not_followed_and_the_other_host_sees_nothing(mock_upstream, make_gateway):
    other = MockUpstream(MockBehaviour())
    with ThreadedServer(other) as elsewhere:
        mock_upstream.mock.behaviour.redirect_to = elsewhere.base_url
        gw = make_gateway([openai_route(mock_upstream)])
        c = sdk_client(gw)
        with pytest.raises(openai.APIStatusError) as caught:
            c.responses.create(model="mock-1", input="the tenant's secret prompt")
        assert caught.value.status_code == 502
        assert caught.value.body["code"] == "upstream_redirect"
        with pytest.raises(openai.APIStatusError) as caught:
            c.files.list()
        assert caught.value.status_code == 502
        assert other.requests == []
    assert [r["path"] for r in mock_upstream.mock.requests] == ["/v1/responses", "/v1/files"]


ACCOUNT_HEADERS = {
    "authorization": "Bearer client-own-openai-key",
    "x-api-key": "client-x-api-key",
    "openai-organization": "org-client",
    "openai-project": "proj-client",
    "cookie": "session=client",
    "x-forwarded-for": "10.0.0.1",
    "x-forwarded-host": "evil",
    "x-real-ip": "10.0.0.2",
    "proxy-authorization": "Basic Y2xpZW50",
    "x-custom": "hop",
    "forwarded": "for=10.0.0.3",
}


def test_client_account_and_hop_by_hop_headers_are_never_forwarded(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.object_headers = {
        "set-cookie": "upstream=1",
        "openai-organization": "org-route",
        "x-request-id": "req_1",
        "x-ratelimit-remaining-requests": "9",
        "openai-processing-ms": "5",
    }
    gw = make_gateway([openai_route(mock_upstream)])
    status, headers, _ = raw_request(
        gw,
        "GET",
        "/v1/files",
        headers={
            **ACCOUNT_HEADERS,
            "connection": "keep-alive, x-custom",
            "openai-beta": "assistants=v2",
            "idempotency-key": "idem-1",
        },
    )
    assert status == 200
    seen = {k.lower(): v for k, v in mock_upstream.mock.requests[-1]["headers"].items()}
    assert seen["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert seen["openai-beta"] == "assistants=v2" and seen["idempotency-key"] == "idem-1"
    for name in ACCOUNT_HEADERS:
        if name != "authorization":
            assert name not in seen, name
    assert "client" not in str(seen) and "10.0.0" not in str(seen)
    assert headers["x-request-id"] == "req_1"
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert "set-cookie" not in headers and "openai-organization" not in headers

    raw_request(
        gw,
        "GET",
        "/v1/files",
        headers={"connection": "idempotency-key", "idempotency-key": "idem-2"},
    )
    seen = {k.lower() for k in mock_upstream.mock.requests[-1]["headers"]}
    assert "idempotency-key" not in seen


def test_the_route_timeout_bounds_a_hanging_upstream_and_closes_it(mock_upstream, make_gateway):
    hang_s = 20  # what the upstream would take; a loaded machine is slow, never this slow
    mock_upstream.mock.behaviour.hang_s = hang_s
    gw = make_gateway([openai_route(mock_upstream, timeout_s=0.5)])
    started = time.perf_counter()
    status, _, data = raw_request(gw, "GET", "/v1/files/file-1")
    elapsed = time.perf_counter() - started
    assert assert_openai_error(status, data, (504,))["code"] == "upstream_timeout"
    assert elapsed < hang_s / 4
    deadline = time.monotonic() + hang_s / 4
    while not mock_upstream.mock.disconnects and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mock_upstream.mock.disconnects, "the upstream request was left open"


def test_departed_clients_close_the_upstream_and_leave_the_pool_free(mock_upstream, make_gateway):
    # The upstream would hold each request for HANG_S: a close well before that is the
    # gateway's, however slowly a loaded machine gets there.
    hang_s = 60
    mock_upstream.mock.behaviour.hang_s = hang_s
    gw = make_gateway([openai_route(mock_upstream)], pool_size=2)
    gw.wait_ready()

    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(gw.url + "/v1/files", timeout=0.3)

    workers = [threading.Thread(target=leave) for _ in range(2)]  # as many as the pool holds
    left = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join(hang_s / 4)
    deadline = time.monotonic() + hang_s / 4
    while len(mock_upstream.mock.disconnects) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(mock_upstream.mock.disconnects) == 2
    assert max(mock_upstream.mock.disconnects) - left < hang_s / 2
    # Both pool connections are free again: a new request is answered, not queued behind
    # the departed ones for the rest of their hang.
    reply = sdk_client(gw, timeout=hang_s / 4).chat.completions.create(
        model="mock-1", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content.startswith("tok0")


def test_a_departed_stream_client_closes_the_upstream_stream(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.hang_s = 8
    gw = make_gateway([openai_route(mock_upstream)])
    with httpx.stream(
        "POST",
        gw.url + "/v1/responses",
        timeout=5,
        json={"model": "mock-1", "input": "hi", "stream": True},
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        first = next(resp.iter_raw())
        assert b"response.created" in first
        left = time.perf_counter()
    deadline = time.monotonic() + 3
    while not mock_upstream.mock.disconnects and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mock_upstream.mock.disconnects and mock_upstream.mock.disconnects[0] - left < 1.5


def test_request_bodies_are_bounded_before_the_upstream(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], max_body_bytes=1024, max_upload_bytes=2048)
    status, _, data = raw_request(
        gw,
        "POST",
        "/v1/embeddings",
        orjson.dumps({"model": "mock-1", "input": "x" * 4000}),
        {"content-type": "application/json"},
    )
    assert assert_openai_error(status, data, (413,))["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as caught:
        sdk_client(gw).files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert caught.value.status_code == 413
    assert mock_upstream.mock.requests == []

    def chunks():
        for _ in range(10):
            yield b"y" * 1000

    resp = httpx.post(
        gw.url + "/v1/files",
        content=chunks(),
        timeout=10,
        headers={"content-type": "multipart/form-data; boundary=zz"},
    )
    assert resp.status_code == 413
    assert mock_upstream.mock.objects.files == {}


def test_an_upload_is_streamed_with_its_length(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    created = sdk_client(gw).files.create(file=("a.jsonl", b'{"a": 1}\n' * 100), purpose="batch")
    assert mock_upstream.mock.objects.contents[created.id] == b'{"a": 1}\n' * 100
    seen = mock_upstream.mock.requests[-1]["headers"]
    assert seen["Content-Type"].startswith("multipart/form-data; boundary=")
    assert int(seen["Content-Length"]) > 900


def test_upstream_bodies_and_events_are_bounded(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.pad_bytes = 300_000
    mock_upstream.mock.behaviour.huge_event_bytes = 200_000
    gw = make_gateway(
        [openai_route(mock_upstream)], max_response_bytes=100_000, max_event_bytes=100_000
    )
    status, _, data = raw_request(gw, "GET", "/v1/files")
    assert assert_openai_error(status, data, (502,))["code"] == "upstream_too_large"
    with httpx.stream(
        "POST",
        gw.url + "/v1/responses",
        timeout=10,
        json={"model": "mock-1", "input": "hi", "stream": True},
    ) as resp:
        body = resp.read()
    assert b"response.created" in body and b"event: error" in body
    assert b"xxxxxxxxxx" not in body and b"response.completed" not in body
    assert b"FIRSTTOKEN_MAX_EVENT_BYTES" in body


def test_passthrough_families_can_be_switched_off_per_route(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream, passthrough=["embeddings"])])
    assert sdk_client(gw).embeddings.create(model="mock-1", input="hi").data
    with pytest.raises(openai.NotFoundError):
        sdk_client(gw).files.list()
    none = make_gateway([openai_route(mock_upstream, passthrough=[])])
    with pytest.raises(openai.NotFoundError):
        sdk_client(none).embeddings.create(model="mock-1", input="hi")
    assert [r["path"] for r in mock_upstream.mock.requests] == ["/v1/embeddings"]
    # chat is not a passthrough family: a route with passthrough off still serves it
    assert (
        sdk_client(none)
        .chat.completions.create(model="mock-1", messages=[{"role": "user", "content": "hi"}])
        .choices
    )


def test_a_model_of_another_route_kind_is_refused_not_sent_to_the_wrong_provider(
    mock_upstream, make_gateway
):
    gw = make_gateway([anthropic_route(mock_upstream), openai_route(mock_upstream)])
    with pytest.raises(openai.BadRequestError) as caught:  # Anthropic has no embeddings
        sdk_client(gw).embeddings.create(model="claude-x", input="hi")
    assert caught.value.body["code"] == "unsupported_route_kind"
    assert "claude" in caught.value.message
    assert mock_upstream.mock.requests == []  # neither provider heard of it


def test_an_unknown_passthrough_family_is_a_start_up_error(mock_upstream):
    routes = [openai_route(mock_upstream, passthrough=["files", "admin"])]
    with pytest.raises(SettingsError, match=r"FIRSTTOKEN_ROUTES.*admin"):
        GatewayThread(Settings(routes=orjson.dumps(routes).decode()))


def test_passthrough_is_counted_per_family_and_status_class(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    raw_request(gw, "GET", "/v1/files")
    raw_request(gw, "GET", "/v1/files/%2e%2e")
    metrics = httpx.get(gw.url + "/metrics").text
    assert (
        'firsttoken_passthrough_requests_total{family="files",status="2xx",tenant="default"} 1.0'
    ) in metrics
    assert (
        'firsttoken_passthrough_requests_total{family="invalid",status="4xx",tenant="default"} 1.0'
    ) in metrics
    assert 'firsttoken_passthrough_seconds_count{family="files",tenant="default"} 1.0' in metrics


SEGMENT_ALPHABET = st.sampled_from(
    [
        "files",
        "batches",
        "..",
        ".",
        "%2e",
        "%2E",
        "%2f",
        "%5c",
        "%3f",
        "%23",
        "%00",
        "%25",
        "%252e",
        "\\",
        "a",
        "file-1",
        ":",
        "@",
        "%3A",
        "%41",
        "%",
        "",
        "~",
        "%0a",
        "admin",
        "?",
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.lists(SEGMENT_ALPHABET, min_size=1, max_size=3).map("".join), min_size=1, max_size=5
    )
)
def test_any_accepted_path_maps_to_one_canonical_url_under_the_base(segments):
    raw = ("/v1/" + "/".join(segments)).encode()
    try:
        target = parse_target(raw)
    except GatewayError as exc:
        assert exc.status in (400, 404)
        return
    url = upstream_url("http://127.0.0.1:9/base/v1", target)
    assert url.raw_path.startswith("/base/v1/" + target.family)
    assert url.origin() == URL("http://127.0.0.1:9").origin()
    assert URL(str(url)).raw_path == url.raw_path  # nothing left for yarl to normalise
    for segment in url.raw_path.split("/")[1:]:
        assert segment not in ("", ".", "..") and "%2" not in segment.lower()
        assert "%5c" not in segment.lower() and "%3f" not in segment.lower()

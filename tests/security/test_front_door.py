"""The front door: what any client (a stranger included) sends is capped before it is parsed.

Request line (414), header count and header bytes (431) in the HTTP protocol layer; body bytes
(413), JSON depth, message count and model length (400) before policies. Every refusal is an
OpenAI-shaped JSON error, and an oversized head never stalls other clients. Raw sockets send
what an HTTP client library would refuse to.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.boundary.body import nested_deeper_than
from tests.security.conftest import ADMIN_KEY, TENANT_A_KEY, auth
from tests.support.clients import sdk_client
from tests.support.gateway import openai_route

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(
    body: bytes | dict, code: str | None = None, param: str | None = None
) -> dict:
    error = (orjson.loads(body) if isinstance(body, bytes) else body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param
    return error


def exchange(port: int, data: bytes, timeout: float = 20.0, one_answer: bool = False) -> bytes:
    """Send raw bytes, then read until the server closes (or `timeout`); with `one_answer`,
    until one whole answer is in: one the server keeps the connection open after, which
    reading until it closes would wait out its keep-alive time for."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused early; the answer is already on its way
        return read_all(sock, time.monotonic() + timeout, one_answer)


def read_all(sock: socket.socket, deadline: float, one_answer: bool = False) -> bytes:
    out = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            break
        if not chunk:
            break
        out += chunk
        if one_answer and holds_one_answer(out):
            break
    return out


def holds_one_answer(raw: bytes) -> bool:
    """`raw` holds a whole head and as much body as its content-length says."""
    head, found, body = raw.partition(b"\r\n\r\n")
    if not found:
        return False
    _, headers, _ = parse_response(head + found)
    return len(body) >= int(headers.get("content-length", 0))


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body[: int(headers.get("content-length", len(body)))]


def get_with(path: str = "/healthz", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: gw\r\n" + extra + b"\r\n"


@pytest.fixture
def gateway(mock_upstream, make_gateway, tenant_settings):
    return make_gateway([openai_route(mock_upstream)], **tenant_settings)


# --- head limits (protocol layer) -------------------------------------------------------------


def test_too_many_header_fields_is_431(gateway):
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(101))
    status, headers, body = parse_response(exchange(gateway.port, get_with(extra=fields)))
    assert status == 431
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert (
        "FIRSTTOKEN_MAX_HEADERS"
        in assert_openai_error(body, "request_header_fields_too_large")["message"]
    )
    # 99 fields plus host is within the default of 100.
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(99))
    assert parse_response(exchange(gateway.port, get_with(extra=fields), one_answer=True))[0] == 200


def test_header_bytes_over_limit_is_431(gateway):
    big = b"x-big: " + b"a" * (65 * 1024) + b"\r\n"
    status, _, body = parse_response(exchange(gateway.port, get_with(extra=big)))
    assert status == 431
    assert (
        "FIRSTTOKEN_MAX_HEADER_BYTES"
        in assert_openai_error(body, "request_header_fields_too_large")["message"]
    )
    # Many medium fields that add up past the limit are refused the same way.
    fields = b"".join(b"x-f%d: %s\r\n" % (i, b"b" * 1000) for i in range(70))
    assert parse_response(exchange(gateway.port, get_with(extra=fields)))[0] == 431


def test_head_limits_follow_settings(mock_upstream, make_gateway):
    gw = make_gateway(
        [openai_route(mock_upstream)],
        max_header_bytes=2048,
        max_headers=10,
        max_request_line_bytes=512,
    )
    assert (
        parse_response(
            exchange(gw.port, get_with(extra=b"x-a: " + b"a" * 1500 + b"\r\n"), one_answer=True)
        )[0]
        == 200
    )
    assert (
        parse_response(exchange(gw.port, get_with(extra=b"x-a: " + b"a" * 2100 + b"\r\n")))[0]
        == 431
    )
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(10))
    assert parse_response(exchange(gw.port, get_with(extra=fields)))[0] == 431
    assert (
        parse_response(exchange(gw.port, get_with("/healthz?" + "q" * 400), one_answer=True))[0]
        == 200
    )
    assert parse_response(exchange(gw.port, get_with("/healthz?" + "q" * 600)))[0] == 414


def test_long_request_line_is_414(gateway):
    status, headers, body = parse_response(
        exchange(gateway.port, get_with("/v1/models?" + "a" * 9000))
    )
    assert status == 414 and headers["connection"] == "close"
    assert (
        "FIRSTTOKEN_MAX_REQUEST_LINE_BYTES" in assert_openai_error(body, "uri_too_long")["message"]
    )


def test_oversized_head_after_a_good_request_on_one_connection(gateway):
    """Keep-alive and pipelining: the second head is held to the limit like the first."""
    good = get_with()
    bad = get_with(extra=b"x-big: " + b"a" * (200 * 1024) + b"\r\n")
    raw = exchange(gateway.port, good + bad)
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1 431" in rest


def test_malformed_request_is_json_400(gateway):
    for junk in (
        b"NOT AN HTTP REQUEST\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad header\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ):
        status, headers, body = parse_response(exchange(gateway.port, junk))
        assert status == 400 and headers["content-type"] == "application/json"
        assert_openai_error(body, "invalid_http_request")


def test_64mb_header_does_not_stall_other_clients(gateway):
    """A stranger's 64 MB header: refused after the limit, and /healthz stays fast meanwhile.
    (Without the limit one such header froze the event loop for seconds.)"""
    latencies: list[float] = []
    attack_done = threading.Event()
    answers: list[bytes] = []

    def attack() -> None:
        head = b"GET /healthz HTTP/1.1\r\nhost: gw\r\nx-big: "
        try:
            answers.append(
                exchange(gateway.port, head + b"a" * (64 << 20) + b"\r\n\r\n", timeout=20)
            )
        finally:
            attack_done.set()

    with httpx.Client(base_url=gateway.url, timeout=5) as client:
        for _ in range(5):  # warm: connection made, code paths loaded
            assert client.get("/healthz").status_code == 200
        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        deadline = time.monotonic() + 30
        while not attack_done.is_set() or len(latencies) < 20:
            assert time.monotonic() < deadline, "attack did not end in time"
            start = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.002)
        attacker.join(5)
    assert answers and answers[0].startswith(b"HTTP/1.1 431"), answers[:1]
    # Without the limit the loop froze for seconds; with it /healthz answers in about a
    # millisecond. The bound sits far from both, so a loaded machine's scheduling cannot fail it
    # and a stalled loop still does.
    assert max(latencies) < 1.0, (max(latencies), statistics.median(latencies))


# --- body limits (before policies) ------------------------------------------------------------


def test_big_declared_body_is_413_without_reading_it(gateway, mock_upstream):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + TENANT_A_KEY.encode() + b"\r\n"
        b"content-length: " + str(1 << 30).encode() + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(head + b'{"model": "mock-1", "messages": [')
        start = time.monotonic()
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.endswith(b"}}"):
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
    status, _, body = parse_response(raw)
    assert status == 413 and time.monotonic() - start < 5
    assert_openai_error(body, "request_too_large")
    assert mock_upstream.mock.requests == []


def nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_deep_json_is_400_through_the_sdk(gateway, mock_upstream):
    # The body is one level, so 64 lists inside it make 65 (the limit is 64).
    with pytest.raises(openai.BadRequestError) as err:
        sdk_client(gateway, TENANT_A_KEY).chat.completions.create(
            model="mock-1", messages=MESSAGES, extra_body={"metadata": nested(64)}
        )
    assert err.value.body["code"] == "json_too_deep"
    assert mock_upstream.mock.requests == []


@pytest.mark.parametrize("levels,code", [(300, "json_too_deep"), (1100, "invalid_json")])
def test_deeper_than_serializable_json_is_400_not_502(gateway, mock_upstream, levels, code):
    """Past 254 levels orjson cannot serialize the body for the upstream (this was a 502 after
    a retry); past 1024 it cannot parse it."""
    deep = b"[" * levels + b"1" + b"]" * levels
    body = b'{"model": "mock-1", "messages": [{"role": "user", "content": "hi"}], "x": %s}' % deep
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers={**auth(TENANT_A_KEY), "content-type": "application/json"},
    )
    assert r.status_code == 400
    assert_openai_error(r.json(), code)
    assert mock_upstream.mock.requests == []


def reference_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    return 0


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=5),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=30,
)


@given(
    value=st.one_of(
        st.lists(json_values, max_size=3),
        st.dictionaries(st.text(max_size=3), json_values, max_size=3),
    )
)
@settings(max_examples=300, deadline=None)
def test_depth_walk_matches_a_plain_recursive_walk(value):
    """The C-level walk relies on CPython not tracking dicts of scalars; check it against a
    plain recursive depth, on values as orjson parses them and as Python builds them."""
    parsed = orjson.loads(orjson.dumps(value))
    depth = reference_depth(value)
    for limit in range(1, depth + 2):
        assert nested_deeper_than(parsed, limit) == (depth > limit)
        assert nested_deeper_than(value, limit) == (depth > limit)


def test_json_depth_at_the_limit_is_served(gateway, mock_upstream):
    reply = sdk_client(gateway, TENANT_A_KEY).chat.completions.create(
        model="mock-1", messages=MESSAGES, extra_body={"x_deep": nested(63)}
    )
    assert reply.choices
    assert len(mock_upstream.mock.requests) == 1


def test_json_depth_limit_follows_settings(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], max_json_depth=8)
    body = {"model": "mock-1", "messages": MESSAGES, "x": nested(7)}  # 8 deep
    assert httpx.post(gw.url + "/v1/chat/completions", json=body).status_code == 200
    body["x"] = [{"a": nested(6)}]  # 9 deep, through a dict
    r = httpx.post(gw.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "FIRSTTOKEN_MAX_JSON_DEPTH" in assert_openai_error(r.json(), "json_too_deep")["message"]


def test_too_many_messages_is_400(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], max_messages=10)
    client = sdk_client(gw)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="mock-1", messages=MESSAGES * 11)
    assert err.value.body["param"] == "messages"
    assert err.value.body["code"] == "too_many_messages"
    assert client.chat.completions.create(model="mock-1", messages=MESSAGES * 10).choices
    assert len(mock_upstream.mock.requests) == 1


def test_long_model_is_400(gateway, mock_upstream):
    with pytest.raises(openai.BadRequestError) as err:
        sdk_client(gateway, TENANT_A_KEY).chat.completions.create(
            model="mock-" + "x" * 300, messages=MESSAGES
        )
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_too_long"
    assert "x" * 300 not in str(err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        sdk_client(gateway, TENANT_A_KEY).completions.create(model="mock-" + "x" * 300, prompt="hi")
    assert err.value.body["param"] == "model"
    assert mock_upstream.mock.requests == []


# --- routing: 404, 405, trailing slashes ------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,allow",
    [
        ("GET", "/nowhere", None),
        ("POST", "/healthz/deeper", None),
        ("DELETE", "/healthz", "GET, HEAD"),
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/v1/chat/completions/", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/v1/completions/", "POST"),
        ("OPTIONS", "/v1/files", "DELETE, GET, HEAD, PATCH, POST, PUT"),
    ],
)
def test_404_and_405_are_openai_errors(gateway, mock_upstream, method, path, allow):
    r = httpx.request(method, gateway.url + path, headers=auth(TENANT_A_KEY))
    assert r.status_code == (405 if allow else 404)
    assert r.headers["content-type"] == "application/json"
    assert r.headers.get("allow") == allow
    assert_openai_error(r.json(), "method_not_allowed" if allow else "unknown_url")
    assert mock_upstream.mock.requests == []


def test_sdk_sees_405_as_a_typed_error(gateway):
    with pytest.raises(openai.APIStatusError) as err:
        sdk_client(gateway, TENANT_A_KEY).get("/chat/completions", cast_to=object)
    assert err.value.status_code == 405
    assert err.value.body["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions/", {"model": "mock-1", "messages": MESSAGES}),
        ("/v1/completions/", {"model": "mock-1", "prompt": "hi"}),
    ],
)
def test_trailing_slash_takes_the_hot_path(gateway, mock_upstream, path, body):
    # Validation runs: a missing field is the gateway's 400, not an upstream's answer.
    broken = {k: v for k, v in body.items() if k not in ("messages", "prompt")}
    r = httpx.post(gateway.url + path, json=broken, headers=auth(TENANT_A_KEY))
    assert r.status_code == 400
    assert r.json()["error"]["param"] in ("messages", "prompt")
    assert mock_upstream.mock.requests == []
    # Policies and the hot path's upstream call: the policy header, and the upstream sees the
    # canonical path, never the slash variant.
    r = httpx.post(gateway.url + path, json=body, headers=auth(TENANT_A_KEY))
    assert r.status_code == 200
    assert "x-firsttoken-policies" in r.headers
    assert [req["path"] for req in mock_upstream.mock.requests] == [path.rstrip("/")]


# --- metrics query parameters -----------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "window=%C2%B2",
        "window=%D9%A3",
        "window=" + "9" * 5000,
        "window=-1",
        "window=0",
        "window=1e3",
        "tenant=" + "t" * 300,
        "tenant=%00",
    ],
)
def test_bad_metrics_query_is_400(gateway, query):
    r = httpx.get(gateway.url + "/v1/metrics/ttft?" + query, headers=auth(ADMIN_KEY))
    assert r.status_code == 400
    assert_openai_error(r.json(), None, query.partition("=")[0])


def test_good_metrics_query_is_served(gateway):
    r = httpx.get(gateway.url + "/v1/metrics/ttft?window=60", headers=auth(TENANT_A_KEY))
    assert r.status_code == 200


def test_too_many_json_containers_is_400_before_parsing(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], max_json_containers=1000)
    parts = [{"type": "text", "text": "a"}] * 1200
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "mock-1", "messages": [{"role": "user", "content": parts}]},
    )
    assert r.status_code == 400
    error = assert_openai_error(r.json(), "json_too_large")
    assert "FIRSTTOKEN_MAX_JSON_CONTAINERS" in error["message"]
    ok = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "mock-1", "messages": [{"role": "user", "content": parts[:400]}]},
    )
    assert ok.status_code == 200
    assert len(mock_upstream.mock.requests) == 1  # the refused body never went upstream

"""Property-based fuzzing of request bodies, paths and headers against a real gateway.

Whatever a client sends: never a 500, never a hang, and never a key or another tenant's data in
a response, in a request the upstream received, or in a log line. The gateway runs in tenant
mode in front of one loopback mock that speaks both OpenAI's and Anthropic's APIs.
"""

from __future__ import annotations

import logging
import string

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from gateway.config.settings import load_settings
from tests.security.conftest import (
    ADMIN_KEY,
    SECRETS,
    TENANT_A_KEY,
    TENANT_B_KEY,
    TENANT_KEYS,
    auth,
)
from tests.support.gateway import UPSTREAM_KEY_ENV, GatewayThread, anthropic_route, openai_route

pytestmark = pytest.mark.timeout(600)

# Tenant A's private prompt; tenant B's fuzzed traffic must never see it.
VICTIM_MARKER = "victim-secret-7f3a91"
EXAMPLES = 120
CLIENT_TIMEOUT_S = 20.0

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)

roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "x", ""])
content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=60)}),
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["image_url", "file", "input_audio", "??"]),
                "image_url": json_values,
            }
        ),
        json_values,
    ),
    max_size=3,
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": roles, "content": st.one_of(st.text(max_size=200), content_parts, json_values)}
        ),
        st.fixed_dictionaries(
            {"role": st.just("assistant"), "content": st.none(), "tool_calls": json_values}
        ),
        json_values,
    ),
    min_size=0,
    max_size=6,
)
models = st.one_of(
    st.sampled_from(
        ["mock-fuzz", "gpt-4o", "claude-3-5-haiku", "unknown-model", "mock-" + "x" * 300]
    ),
    st.text(max_size=30),
    json_values,
)

chat_bodies = st.fixed_dictionaries(
    {"model": models, "messages": messages},
    optional={
        "stream": st.one_of(st.booleans(), json_values),
        "stream_options": st.one_of(
            st.fixed_dictionaries({"include_usage": json_values}), json_values
        ),
        "max_tokens": st.one_of(st.integers(min_value=-5, max_value=2**64), json_values),
        "temperature": st.one_of(st.floats(allow_nan=False), json_values),
        "top_p": json_values,
        "top_k": st.integers(min_value=-(2**64), max_value=2**64),
        "n": json_values,
        "seed": st.integers(min_value=-(2**64), max_value=2**64),
        "tools": json_values,
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "function": json_values}),
            json_values,
        ),
        "stop": json_values,
        "prompt_cache_key": st.one_of(st.text(max_size=100), json_values),
        "response_format": json_values,
        "user": json_values,
        "metadata": json_values,
    },
)
completion_bodies = st.fixed_dictionaries(
    {"model": models, "prompt": st.one_of(st.text(max_size=100), json_values)},
    optional={"stream": st.booleans(), "max_tokens": json_values, "echo": json_values},
)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(min_value=1, max_value=600)),
    st.builds(
        lambda depth: (
            b'{"model":"mock-a","messages":[{"role":"user","content":'
            + b"[" * depth
            + b"]" * depth
            + b"}]}"
        ),
        st.integers(min_value=1, max_value=600),
    ),
)

paths = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/files",
        "/v1/files/file-abc",
        "/v1/../admin",
        "/v1/%2e%2e/%2e%2e/admin/users?all=1",
        "/v1/files/..%2f..%2fadmin",
        "/v1/responses",
        "/v1/models",
        "/v1/metrics/ttft?window=%C2%B2",
        "/v1/metrics/ttft?tenant=acme",
        "/metrics",
        "/readyz",
        "/v1//files",
        "/v1/files%3Fx=1",
        "/nope",
        "/v1/batches/batch_x/cancel",
    ]
)
methods = st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH"])
header_names = st.text(alphabet=string.ascii_letters + string.digits + "-", min_size=1, max_size=30)
header_values = st.text(
    alphabet=string.printable.replace("\r", "")
    .replace("\n", "")
    .replace("\x0b", "")
    .replace("\x0c", ""),
    max_size=80,
).map(str.strip)
extra_headers = st.dictionaries(
    st.one_of(
        header_names,
        st.sampled_from(
            [
                "x-firsttoken-policies",
                "content-type",
                "openai-organization",
                "cookie",
                "x-api-key",
                "x-forwarded-for",
                "connection",
                "openai-beta",
            ]
        ),
    ),
    header_values,
    max_size=5,
)


@pytest.fixture(scope="module")
def fuzz_env():
    mock = MockUpstream(MockBehaviour(chunks=2))
    with ThreadedServer(mock) as upstream:
        routes = [openai_route(upstream), anthropic_route(upstream)]
        settings_ = load_settings(
            environ={UPSTREAM_KEY_ENV: SECRETS[3]},
            routes=orjson.dumps(routes).decode(),
            tenant_keys=TENANT_KEYS,
            admin_keys=ADMIN_KEY,
            retry_attempts=1,
        )
        gw = GatewayThread(settings_)
        gw.__enter__()
        try:
            gw.wait_ready()
            with httpx.Client(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:
                # Tenant A's private conversation, before any fuzzing.
                victim = client.post(
                    "/v1/chat/completions",
                    headers=auth(TENANT_A_KEY),
                    json={
                        "model": "mock-victim",
                        "prompt_cache_key": VICTIM_MARKER,
                        "messages": [{"role": "user", "content": VICTIM_MARKER}],
                    },
                )
                assert victim.status_code == 200
                yield mock, client
        finally:
            gw.__exit__(None, None, None)


class LogTrap(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001  # a record that cannot format is itself worth seeing
            self.lines.append(repr(record.msg))


@pytest.fixture(scope="module")
def log_trap():
    trap = LogTrap()
    trap.setFormatter(logging.Formatter("%(name)s %(message)s %(exc_text)s"))
    root, ours = logging.getLogger(), logging.getLogger("firsttoken")
    old_level = ours.level
    root.addHandler(trap)
    ours.setLevel(logging.DEBUG)
    yield trap
    root.removeHandler(trap)
    ours.setLevel(old_level)


def _check_response(response: httpx.Response, mock: MockUpstream, seen: int) -> None:
    assert response.status_code != 500, response.text[:500]
    assert response.status_code < 600
    if response.status_code >= 500:  # the mock is healthy: a 5xx must come from what it said
        assert len(mock.requests) > seen, (response.status_code, response.text[:300])
    text = response.text
    header_text = " ".join(f"{k}: {v}" for k, v in response.headers.items())
    for secret in (*SECRETS, VICTIM_MARKER):
        assert secret not in text and secret not in header_text, secret
    if (
        response.headers.get("content-type", "").startswith("application/json")
        and response.status_code >= 400
    ):
        error = response.json().get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str)
        assert "Traceback" not in error["message"]
    for sent in mock.requests[seen:]:
        # Only the route's own key, and never a client's key or tenant A's text.
        body = sent["body"]
        blob = (
            body.decode("utf-8", "replace")
            if isinstance(body, bytes)
            else orjson.dumps(body).decode()
        ) + str(sent["headers"])
        for secret in (TENANT_A_KEY, TENANT_B_KEY, ADMIN_KEY, VICTIM_MARKER):
            assert secret not in blob, secret
        assert sent["path"].startswith("/v1/") and ".." not in sent["path"]


def _send(
    client: httpx.Client, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> httpx.Response:
    merged = {"content-type": "application/json", **headers, **auth(TENANT_B_KEY)}
    try:
        return client.request(method, path, content=body, headers=merged)
    except httpx.TimeoutException:  # pragma: no cover - a hang is exactly the failure
        pytest.fail(f"{method} {path} hung for {CLIENT_TIMEOUT_S}s")


common = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@common
@given(body=chat_bodies, headers=extra_headers)
def test_chat_bodies_never_500_or_leak(fuzz_env, log_trap, body, headers):
    mock, client = fuzz_env
    seen = len(mock.requests)
    raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS) if _encodable(body) else b"{}"
    _check_response(_send(client, "POST", "/v1/chat/completions", raw, headers), mock, seen)


@common
@given(body=completion_bodies, headers=extra_headers)
def test_completion_bodies_never_500_or_leak(fuzz_env, log_trap, body, headers):
    mock, client = fuzz_env
    seen = len(mock.requests)
    raw = orjson.dumps(body) if _encodable(body) else b"{}"
    _check_response(_send(client, "POST", "/v1/completions", raw, headers), mock, seen)


@common
@given(
    method=methods,
    path=paths,
    body=st.one_of(
        raw_bodies, chat_bodies.map(lambda b: orjson.dumps(b) if _encodable(b) else b"{}")
    ),
    headers=extra_headers,
)
def test_any_path_method_and_bytes_never_500_or_leak(
    fuzz_env, log_trap, method, path, body, headers
):
    mock, client = fuzz_env
    seen = len(mock.requests)
    _check_response(_send(client, method, path, body, headers), mock, seen)


def test_no_secret_in_any_log_line(fuzz_env, log_trap):
    """Runs after the fuzzers in this module (file order): every line they caused is clean."""
    logging.getLogger("firsttoken.test").info("trap check %s", "ok")
    assert log_trap.lines[-1].endswith("trap check ok None"), log_trap.lines[-1:]
    for line in log_trap.lines:
        for secret in (*SECRETS, VICTIM_MARKER):
            assert secret not in line, line[:300]


def _encodable(body: object) -> bool:
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        return False
    return True

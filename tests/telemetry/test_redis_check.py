"""A bad telemetry Redis URL is a start-up error that names the variable; an unreachable
server is only a warning (the gateway starts with telemetry degraded)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from bench.harness import free_port
from gateway.config.settings import SettingsError
from gateway.telemetry.redis_check import check_redis_url, redact_url

VAR = "FIRSTTOKEN_REDIS_URL"


def _refused(url: str, match: str) -> str:
    with pytest.raises(SettingsError, match=match) as info:
        check_redis_url(url, VAR, timeout_s=1.0)
    message = str(info.value)
    assert message.startswith(VAR + "=")
    assert info.value.__cause__ is None  # a message, not a chain of redis-py tracebacks
    return message


@pytest.mark.parametrize(
    "url, match",
    [
        ("foo://bar", "not a valid Redis URL"),
        ("", "not a valid Redis URL"),
        ("redis://127.0.0.1:notaport/0", "not a valid Redis URL"),
        ("redis://127.0.0.1:6379/x", "not a number"),
        ("redis://127.0.0.1:6379/13?no_such_option=1", "not a valid Redis URL"),
        ("redis://[::1", "not a valid Redis URL"),
    ],
)
def test_malformed_urls(url, match):
    _refused(url, match)


def test_db_index_out_of_range(redis_url):
    assert "DB index is out of range" in _refused("redis://127.0.0.1:6379/99", "refused")


@pytest.fixture
def password_redis(private_redis):
    private_redis.password = "s3cret-pw"
    private_redis.start()
    return private_redis


def test_wrong_missing_and_right_password(password_redis):
    port = password_redis.port
    wrong = _refused(f"redis://:not-the-pw@127.0.0.1:{port}/0", "refused the credentials")
    assert "not-the-pw" not in wrong and "***@127.0.0.1" in wrong
    _refused(f"redis://127.0.0.1:{port}/0", "refused the credentials")
    user = _refused(f"redis://bob:hunter2@127.0.0.1:{port}/0", "refused the credentials")
    assert "hunter2" not in user and "bob" not in user
    check_redis_url(password_redis.url, VAR)  # the right one passes
    assert "s3cret-pw" not in redact_url(password_redis.url + "?password=s3cret-pw")


def test_unreachable_server_is_a_warning(caplog):
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="firsttoken.telemetry"):
        check_redis_url(url, VAR, timeout_s=0.5)
    assert time.monotonic() - began < 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert VAR in line and "unreachable" in line and ":pw@" not in line


def test_something_else_on_the_port():
    """An HTTP server where Redis should be is a settings error, not an outage."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            time.sleep(0.2)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        _refused(f"redis://127.0.0.1:{port}/0", "does not answer as Redis")
    finally:
        thread.join(5)
        listener.close()


def test_cluster_flag_must_match(redis_url):
    with pytest.raises(SettingsError, match="not in cluster mode"):
        check_redis_url(redis_url, VAR, cluster=True)
    check_redis_url(redis_url, VAR, cluster=False)
    check_redis_url(redis_url, VAR)

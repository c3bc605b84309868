from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import redis

from tests.local_servers import PrivateRedis, free_port

REDIS_DB = 13
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _redis_available() -> bool:
    try:
        return redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.exceptions.RedisError:
        return False


@pytest.fixture
def redis_url() -> str:
    if not _redis_available():
        pytest.skip("no Redis at 127.0.0.1:6379")
    return REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str):
    """A prefix unique to the test; every key under it is deleted afterwards."""
    prefix = "fttest-" + uuid.uuid4().hex[:12]
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def sync_redis(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def private_redis():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = PrivateRedis(free_port())
    yield server
    server.kill()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env

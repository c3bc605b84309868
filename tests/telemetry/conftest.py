from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as client:
        yield client


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """The environment for a child Python that imports `tests.*`: a script's own folder is
    all it gets on sys.path, so the repository root is added."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env

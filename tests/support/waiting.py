"""Small helpers for tests that watch a live server: wait for a condition, read an SSE body."""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson


def eventually(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """True once `predicate()` is truthy, False if `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def named_events(text: str) -> list[tuple[str, dict]]:
    """The `event:`-named events of an SSE body, with their JSON data, in order."""
    out = []
    for raw in text.split("\n\n"):
        name = data = None
        for line in raw.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = orjson.loads(line[5:])
        if name is not None:
            out.append((name, data))
    return out

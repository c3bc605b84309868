"""Redis dies while requests stream: nothing fails or slows, and the buffered events land once
it is back; what the bound could not hold is counted exactly."""

from __future__ import annotations

import statistics
import time

import httpx
import openai

from tests.support.clients import sdk_client
from tests.support.gateway import openai_route

BUFFER = 4


def timed_stream(client: openai.OpenAI) -> float:
    start = time.perf_counter()
    chunks = list(
        client.chat.completions.create(
            model="mock-1", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("tok0")
    return time.perf_counter() - start


def count(gw) -> int | None:
    r = httpx.get(gw.url + "/v1/metrics/ttft", timeout=5)
    if r.status_code != 200:
        return None
    return sum(route["count"] for route in r.json()["routes"])


def dropped(gw) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("firsttoken_telemetry_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("no dropped counter")


def test_redis_outage_slows_nothing_and_buffer_drains(mock_upstream, make_gateway, private_redis):
    private_redis.start()
    mock_upstream.mock.behaviour.first_delay_s = 0.02
    # No policies: prefix fingerprints would share the buffer and blur the exact count.
    gw = make_gateway(
        [openai_route(mock_upstream)],
        telemetry_buffer=BUFFER,
        policies="none",
        redis_url=private_redis.url,
    )
    client = sdk_client(gw)
    healthy = [timed_stream(client) for _ in range(4)]
    deadline = time.monotonic() + 5
    while count(gw) != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count(gw) == 4

    private_redis.kill()
    down = [timed_stream(client) for _ in range(BUFFER + 3)]
    assert statistics.median(down) < statistics.median(healthy) + 0.05
    assert max(down) < 1.0
    assert dropped(gw) == 3

    private_redis.start()  # same port, empty: the first four events died with the old server
    deadline = time.monotonic() + 15
    while count(gw) != BUFFER and time.monotonic() < deadline:
        time.sleep(0.1)
    assert count(gw) == BUFFER

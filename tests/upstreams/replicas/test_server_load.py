"""Reading an inference server's own load from its Prometheus text, and using it to route."""

from __future__ import annotations

import httpx
from aiohttp import web

from gateway.upstreams.replicas.server_load import parse_server_load
from tests.security.hostile_upstream import HostileServer, openai_stream, sse_answer
from tests.support.gateway import UPSTREAM_KEY_ENV
from tests.support.waiting import eventually

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:kv_cache_usage_perc{model_name="b"} 0.75
"""
SGLANG = """# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{tp_rank="0"} 7
# TYPE sglang:token_usage gauge
sglang:token_usage{tp_rank="0"} 0.5
"""


def test_vllm_and_sglang_figures() -> None:
    vllm = parse_server_load(VLLM, "vllm")
    assert vllm.queue == 5 and vllm.kv_usage == 0.75
    sglang = parse_server_load(SGLANG, "sglang")
    assert sglang.queue == 7 and sglang.kv_usage == 0.5
    old = parse_server_load(VLLM.replace("kv_cache_usage_perc", "gpu_cache_usage_perc"), "vllm")
    assert old.kv_usage == 0.75


def test_the_figures_are_found_among_a_real_page_s_other_metrics() -> None:
    histogram = "".join(
        f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="a"}} {i}\n'
        for i, le in enumerate(("0.01", "0.1", "1.0", "+Inf"))
    )
    page = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        + histogram
        + 'vllm:num_requests_waiting_by_reason{reason="x"} 40\n'  # a longer name: not ours
        + VLLM
        + "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 8\n"
    )
    load = parse_server_load(page, "vllm")
    assert load.queue == 5 and load.kv_usage == 0.75


def test_junk_is_unknown_never_an_error() -> None:
    for text in ("", "not prometheus {{{", 'vllm:num_requests_waiting{a="b"} NaN\n', "x 1 2 3 4\n"):
        load = parse_server_load(text, "vllm")
        assert load.queue is None and load.kv_usage is None
    huge = parse_server_load("vllm:num_requests_waiting 1e30\nvllm:kv_cache_usage_perc 9\n", "vllm")
    assert huge.queue == 1_000_000 and huge.kv_usage == 1.0
    negative = parse_server_load("vllm:num_requests_waiting -4\n", "vllm")
    assert negative.queue is None


def metrics_server(text: str) -> HostileServer:
    server = HostileServer()
    stream = sse_answer(openai_stream("hello"))

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            return web.Response(text=text, content_type="text/plain")
        return await stream(request)

    server.upstream.handler = handler
    return server


def test_a_replica_reporting_a_long_queue_gets_less_traffic(make_gateway) -> None:
    busy_text = "vllm:num_requests_waiting 40\nvllm:kv_cache_usage_perc 0.9\n"
    with metrics_server(busy_text) as busy, metrics_server("vllm:num_requests_waiting 0\n") as idle:
        route = {
            "name": "fleet",
            "models": ["*"],
            "kind": "openai",
            "api_key_env": UPSTREAM_KEY_ENV,
            "balance": "least_loaded",
            "load_metrics": "vllm",
            "load_interval_s": 0.1,
            "replicas": [
                {"name": "busy", "base_url": busy.base_url},
                {"name": "idle", "base_url": idle.base_url},
            ],
        }
        gw = make_gateway([route])

        def figures() -> dict:
            report = httpx.get(gw.url + "/v1/metrics/ttft", timeout=10).json()
            return {r["name"]: r for r in report["replicas"]["fleet"]["replicas"]}

        assert eventually(lambda: figures()["busy"]["queue"] == 40, 5.0)
        assert figures()["busy"]["kv_usage"] == 0.9 and figures()["idle"]["queue"] == 0
        for _ in range(6):
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                timeout=10,
            )
            assert r.status_code == 200
        chats = [p for p in busy.upstream.posts() if p["path"].endswith("/chat/completions")]
        assert chats == []  # a queue of 40 elsewhere: every request went to the idle replica
        key_seen = [p["headers"].get("Authorization") for p in idle.upstream.requests]
        assert all(k == "Bearer sk-upstream-secret" for k in key_seen if k)

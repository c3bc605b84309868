"""The fleet bench's native relay (`bench/native_relay.py`): nginx in front of the bench's
engines, relaying each answer as it streams, joined to the bench only where nginx is installed."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time

import orjson
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, ROOT)

from bench import fleet_http  # noqa: E402
from bench.harness import free_port, process_tree, stop, wait_http  # noqa: E402
from bench.native_relay import nginx_config, nginx_path, start_nginx  # noqa: E402


def test_config_takes_every_engine_in_turn_unbuffered_and_writes_only_its_folder() -> None:
    engines = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    conf = nginx_config(engines, 8123, "/tmp/fleet-x")
    upstream = re.search(r"upstream engines \{(.*?)\}", conf, re.S)
    assert upstream is not None
    assert re.findall(r"server (\S+);", upstream.group(1)) == [
        "127.0.0.1:9001",
        "127.0.0.1:9002",
        "127.0.0.1:9003",
    ]
    assert "listen 127.0.0.1:8123;" in conf  # loopback only
    assert "proxy_buffering off;" in conf  # each event goes out as it arrives
    assert "worker_processes 1;" in conf  # one event loop, as the gateway's
    paths = re.findall(r"(?:_path|pid|error_log) (/\S+?)[;\s]", conf)
    assert len(paths) == 7 and all(p.startswith("/tmp/fleet-x/") for p in paths), paths


def test_the_bench_runs_nginx_only_where_it_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["fleet_http.py", "--only", "floor,native"])
    args = fleet_http.parse_args()
    monkeypatch.setattr(fleet_http, "nginx_path", lambda: None)
    assert [v.kind for v in fleet_http.variants(args)] == ["floor"]
    monkeypatch.setattr(fleet_http, "nginx_path", lambda: "/usr/sbin/nginx")
    assert [v.kind for v in fleet_http.variants(args)] == ["floor", "native"]


@pytest.mark.skipif(nginx_path() is None, reason="nginx is not installed (nginx-light)")
def test_nginx_relays_an_engines_stream_event_by_event(tmp_path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "bench.fleet_engine", "--port", str(port), "--name", "e0"]
    argv += ["--chunks", "5", "--gap-ms", "500"]  # an answer spread over 2 s
    engine = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    relay = None
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc=engine)
        relay, url = start_nginx([f"http://127.0.0.1:{port}"], str(tmp_path))
        host, rest = url.removeprefix("http://").split("/", 1)
        conn = http.client.HTTPConnection(host, timeout=30)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        conn.request("POST", "/" + rest, orjson.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        arrivals = []
        for line in response:
            if line.startswith(b"data: "):
                arrivals.append((time.perf_counter(), line))
        conn.close()
        events = [line for _, line in arrivals]
        assert events[-1] == b"data: [DONE]\n"
        chunks = [orjson.loads(line[6:]) for line in events[:-1]]
        assert chunks[-1]["usage"]["prompt_tokens"] > 0
        # streamed: the 5 chunks 500 ms apart arrive spread out as they were sent, each event
        # relayed on its own as the bench's CPU figure assumes (a stall under 1 s cannot fail it)
        assert len(chunks) == 6 and arrivals[-1][0] - arrivals[0][0] > 1.0
        assert len(process_tree(relay.pid)) == 2  # its one worker counts in its tree's CPU
    finally:
        if relay is not None:
            stop(relay)
        stop(engine)
    assert not os.path.exists(tmp_path / "nginx.pid")  # stopped: it removed its pid file

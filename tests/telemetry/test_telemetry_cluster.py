"""The store on a real three-node Redis Cluster, started on loopback by the test: a tenant's
keys share a slot through their hash tag, tenants spread over nodes, and the merged figures
equal those of the events written."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import time

import pytest
import redis

from tests.support.redis_servers import redis_server_command
from tests.telemetry.telemetry_events import make_events, make_telemetry

NODES = 3


@pytest.fixture
def redis_cluster(tmp_path):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed for a local cluster")
    ports = [_cluster_port() for _ in range(NODES)]
    procs = [
        subprocess.Popen(
            redis_server_command(
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--dir",
                str(tmp_path),
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        _wait(lambda: all(redis.Redis(port=p, socket_connect_timeout=0.2).ping() for p in ports))
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait(
            lambda: all(
                redis.Redis(port=p, decode_responses=True).cluster("info").get("cluster_state")
                == "ok"
                for p in ports
            )
        )
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(5)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(ready, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except redis.exceptions.RedisError:
            pass
        time.sleep(0.05)
    raise RuntimeError("local redis cluster did not come up")


def test_cluster_store_merges_tenants_across_nodes(redis_cluster):
    events = [
        event
        for i, tenant in enumerate(("acme", "glob:ex", "{x}", "delta", "echo"))
        for event in make_events(seed=i, count=24, tenant=tenant, routes=("a", "b"))
    ]
    url = f"redis://127.0.0.1:{redis_cluster[0]}/0"

    async def run() -> tuple[dict, dict]:
        telemetry = make_telemetry(url, redis_cluster=True, metrics_key_prefix="ftc")
        memory = make_telemetry()
        await telemetry.start()
        for event in events:
            telemetry.record(event)
            memory.record(event)
        await telemetry.writer.drain()
        await memory.writer.drain()
        try:
            return await telemetry.report("*", 3600), await memory.report("*", 3600)
        finally:
            await telemetry.aclose()
            await memory.aclose()

    shared, local = asyncio.run(run())
    assert shared == local
    assert sum(r["count"] for t in shared["tenants"] for r in t["routes"]) == 120
    keys_per_node = [len(redis.Redis(port=p).keys("ftc:ttft:*")) for p in redis_cluster]
    assert sum(keys_per_node) > 0 and sum(1 for n in keys_per_node if n) >= 2

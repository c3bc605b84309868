"""Redis for tests: a database of the shared server set aside for them, and throwaway
redis-server processes that a test may kill and restart."""

from __future__ import annotations

import subprocess
import time

import redis

from bench.harness import free_port

SHARED_REDIS_URL = "redis://127.0.0.1:6379/13"
"""The shared server's database for tests; each test keeps to a key prefix of its own."""


def shared_redis_up(url: str = SHARED_REDIS_URL) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            return bool(client.ping())
    except redis.exceptions.RedisError:
        return False


def redis_server_command(port: int, *options: str) -> list[str]:
    """A redis-server on 127.0.0.1:`port` that keeps nothing on disk, plus `options`."""
    return [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        *options,
    ]


class PrivateRedis:
    """A throwaway redis-server on a loopback port, started and stopped by pid, so that a test
    can take Redis away and bring it back (empty) on the same port. With `password`, the
    server requires it (`--requirepass`) and `url` carries it."""

    def __init__(self, port: int, password: str | None = None) -> None:
        self.port = port
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.started_once = False

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server and wait until it answers. A first start whose port was taken in
        the meantime (another process bound it after `free_port` chose it) moves to a fresh
        port; a restart keeps its port, which is the point of restarting."""
        if self.running:
            raise RuntimeError("private redis-server is already running")
        for _ in range(3 if not self.started_once else 1):
            if self._start_once():
                self.started_once = True
                return
            if self.started_once:
                break
            self.port = free_port()
        raise RuntimeError(f"private redis-server did not start on port {self.port}")

    def _start_once(self) -> bool:
        self.proc = subprocess.Popen(
            redis_server_command(
                self.port, *(["--requirepass", self.password] if self.password else [])
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Generous: a loaded machine may take seconds to start a process; a server that
        # exits (its port taken) ends the wait at once.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.running:
            try:
                with redis.Redis(
                    port=self.port, password=self.password, socket_connect_timeout=0.2
                ) as client:
                    if client.ping():
                        return True
            except redis.exceptions.RedisError:
                time.sleep(0.02)
        self.kill()
        return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

"""Throwaway servers for tests: free loopback ports and a private redis-server by pid."""

from __future__ import annotations

import socket
import subprocess
import time

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """A throwaway redis-server on a loopback port, started and stopped by pid; with
    `password`, the server requires it (`--requirepass`) and `url` carries it."""

    def __init__(self, port: int, password: str | None = None) -> None:
        self.port = port
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if redis.Redis(
                    port=self.port, password=self.password, socket_connect_timeout=0.2
                ).ping():
                    return
            except redis.exceptions.RedisError:
                time.sleep(0.02)
        raise RuntimeError("private redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

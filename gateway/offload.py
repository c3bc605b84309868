"""CPU-heavy request work (policies and their report on big bodies) off the event loop.

One tenant's 16 MB body must not raise another tenant's latency. Work on a body of at least
`FIRSTTOKEN_POLICY_THREAD_MIN_BYTES` runs on a small thread pool; each tenant has at most one
such job at a time, so a tenant that floods the gateway with huge bodies queues behind itself
while the other worker stays free for everyone else. Small bodies stay on the loop: a thread
hop costs more than their work.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

WORKERS = 2
# The loop thread waits at most this long for the GIL while a worker runs Python code
# (CPython's default is 5 ms, which shows in every other request's latency).
SWITCH_INTERVAL_S = 0.001


class HeavyWork:
    def __init__(self, min_bytes: int, workers: int = WORKERS) -> None:
        self.min_bytes = min_bytes
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="firsttoken-heavy")
        self._per_tenant: dict[str, asyncio.Semaphore] = {}
        self.jobs = 0  # jobs run so far (tests and diagnostics)
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def is_heavy(self, body_bytes: int) -> bool:
        return body_bytes >= self.min_bytes

    async def run(self, tenant: str, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the pool, one job per tenant at a time."""
        semaphore = self._per_tenant.get(tenant)
        if semaphore is None:
            semaphore = self._per_tenant[tenant] = asyncio.Semaphore(1)
        async with semaphore:
            self.jobs += 1
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""CPU-heavy request work (parsing, policies and their report on big bodies) off the event loop.

One tenant's 16 MB body must not raise another tenant's latency. Work on a body of at least
`FIRSTTOKEN_POLICY_THREAD_MIN_BYTES` runs on a small thread pool, and a body of at least
`FIRSTTOKEN_BIG_BODY_BYTES` is parsed and transformed in a worker process
(`gateway.pipeline.big_bodies`: parsing holds the GIL, so a thread would not free the loop). Each
tenant has at most one such job at a time, so a tenant that floods the gateway with huge bodies
queues behind itself while the other worker stays free for everyone else. Small bodies stay on the
loop: a hop costs more than their work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

from gateway.errors import GatewayError

log = logging.getLogger("firsttoken.offload")

T = TypeVar("T")

WORKERS = 2
# The loop thread waits at most this long for the GIL while a worker runs Python code
# (CPython's default is 5 ms, which shows in every other request's latency).
SWITCH_INTERVAL_S = 0.001


class HeavyWork:
    def __init__(
        self,
        min_bytes: int,
        workers: int = WORKERS,
        *,
        process_min_bytes: int = 0,
        process_workers: int = 0,
        process_init: tuple[Callable[..., None], tuple[Any, ...]] | None = None,
    ) -> None:
        self.min_bytes = min_bytes
        self.process_min_bytes = process_min_bytes
        self._process_workers = process_workers
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="firsttoken-heavy"
        )
        self._process_init = process_init
        self._processes: ProcessPoolExecutor | None = None  # started on the first big body
        self._per_tenant: dict[str, asyncio.Semaphore] = {}
        self.jobs = 0  # jobs run so far (tests and diagnostics)
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def is_heavy(self, body_bytes: int) -> bool:
        return body_bytes >= self.min_bytes

    def is_big(self, body_bytes: int) -> bool:
        return (
            self._process_workers > 0
            and self._process_init is not None
            and body_bytes >= self.process_min_bytes
        )

    async def run(self, tenant: str, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the thread pool, one job per tenant at a time."""
        return await self._run(tenant, self._executor, fn, args)

    async def run_in_process(self, tenant: str, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` in a worker process (arguments and result must pickle), one job per
        tenant at a time. A worker that dies fails this request alone: the pool is rebuilt."""
        from concurrent.futures.process import BrokenProcessPool

        pool = self._processes or self._new_pool()
        try:
            return await self._run(tenant, pool, fn, args)
        except BrokenProcessPool:
            log.error("a big-body worker process died; restarting the pool")
            if self._processes is pool:
                self._processes = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise GatewayError(
                503,
                "The gateway could not process this request body; try again.",
                code="worker_failed",
            ) from None

    def _new_pool(self) -> ProcessPoolExecutor:
        import multiprocessing  # only for a gateway that starts workers
        from concurrent.futures import ProcessPoolExecutor

        assert self._process_init is not None  # callers check it: no workers without one
        init, initargs = self._process_init
        self._processes = ProcessPoolExecutor(
            max_workers=self._process_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init,
            initargs=initargs,
        )
        return self._processes

    async def start_processes(self) -> None:
        """Start the worker processes now, off the loop: starting one forks this process,
        which would stall every stream for tens of milliseconds if the first big body did it."""
        if self._process_workers <= 0 or self._process_init is None:
            return
        pool = self._processes or self._new_pool()

        def spawn_all() -> None:
            for future in [pool.submit(os.getpid) for _ in range(self._process_workers)]:
                future.result()

        await asyncio.to_thread(spawn_all)

    async def _run(
        self, tenant: str, executor: Executor, fn: Callable[..., T], args: tuple[object, ...]
    ) -> T:
        semaphore = self._per_tenant.get(tenant)
        if semaphore is None:
            semaphore = self._per_tenant[tenant] = asyncio.Semaphore(1)
        async with semaphore:
            self.jobs += 1
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)
            self._processes = None

    async def aclose(self, timeout_s: float = 3.0) -> None:
        """Stop the workers, waiting a little for them to exit cleanly (a job still running
        after `timeout_s` is left to finish on its own)."""
        pool, self._processes = self._processes, None
        self.close()
        if pool is not None:
            try:
                await asyncio.wait_for(
                    asyncio.to_thread(pool.shutdown, True, cancel_futures=True), timeout_s
                )
            except TimeoutError:
                log.warning("a big-body worker was still busy at shutdown")

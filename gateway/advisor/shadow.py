"""The advisor's shadow work: after a request went upstream, re-run it under each opt-in.

``observe_cache_advice`` is the one call ``report_headers`` makes, after measuring: it counts the
request for its family (O(1)) and, when sampled, starts a task of its own that is never awaited
by the request, so the report headers (and the first token) never wait for it:

1. read the family's variant history (a telemetry blob: in process, or Redis),
2. transform the ORIGINAL body under each variant, fingerprint, compare (on the advisor's own
   worker thread, unless the prompt is small enough that the hop would cost more than the work),
3. queue the counters and the new history for the telemetry writer (batched like the rest).

Cost is bounded three ways. One evaluation runs at a time per gateway process; a request that
arrives while one runs is counted but not evaluated (this is the "pool busy: skip" rule, on a
thread of its own: the heavy-work pool admits one job per tenant, so shadow work there would
make the tenant's next big request wait behind it). At most ``MAX_EVALUATIONS_PER_S`` a second
(a token bucket with ``BURST``). And a CPU budget: the evaluations' own CPU time (measured: on the
loop, the thread time of the work; off it, all the CPU time of the advisor's thread, its wake-ups
and hand-offs included, which on a gateway between streams cost as much as the work itself)
stays within ``CPU_SHARE`` of the gateway process's CPU time (a bucket that fills
with that share of the process's CPU as it is spent, up to ``CPU_BURST_S``, and that each
evaluation drains by what it cost), so the advisor's share of the gateway's work is bounded
whatever the prompts' length; above either bound, requests are sampled. Shares are
computed over evaluated requests only, so sampling thins the estimate, not its scale; every
request is counted in the tenant's totals (family ``TOTALS_FAMILY``), and the per-day figures
scale the evaluated requests up to all of them.

Not evaluated: bodies a worker process parsed (``prepared_report_headers``: the original body
never reaches this process), and gateways with telemetry off (no fingerprints).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.telemetry.store import ADVICE_BUCKET_S
from policies import PolicyResult
from policies.config import PolicyOptions
from policies.diagnostics import PrefixFingerprints

from .accounting import CacheRules, decode_history, evaluate
from .advice import TOTALS_FAMILY
from .variants import OBSERVED, RouteGuess, ShadowChains, guess_route

log = logging.getLogger("firsttoken.advisor")
T = TypeVar("T")

MAX_EVALUATIONS_PER_S = 20.0
BURST = 20.0
HISTORY_TTL_S = 3600  # like the diagnostics' fingerprints
HISTORY_PREFIX = "advice:"  # blob family names: apart from the diagnostics' own
INLINE_MAX_TOKENS = 2048  # shadow work on a prompt this small stays on the loop
CPU_SHARE = 0.05  # of the process's CPU time, at most, for the evaluations (long prompts hit it)
CPU_BURST_S = 0.05  # the CPU budget's bucket: a few evaluations at start-up


def bucket_of(now: float) -> int:
    return int(now // ADVICE_BUCKET_S)


class CacheAdvisor:
    """One per telemetry object (``advisor_for``): the chains, the sampling state, counters."""

    def __init__(
        self,
        telemetry: Any,
        options: PolicyOptions | None = None,
        *,
        max_per_s: float = MAX_EVALUATIONS_PER_S,
        burst: float = BURST,
        cpu_share: float = CPU_SHARE,
    ) -> None:
        self._telemetry = weakref.proxy(telemetry)
        self.chains = ShadowChains(options)
        self.max_per_s = max_per_s
        self.burst = burst
        self._tokens = burst
        self._refilled = time.monotonic()
        self.cpu_share = cpu_share  # 1 or more: no CPU budget (benchmarks that evaluate all)
        self._cpu_budget = CPU_BURST_S
        self._cpu_seen = time.process_time()
        self.cpu_spent_s = 0.0
        self._busy = False
        self._worker: ThreadPoolExecutor | None = None  # started on the first big evaluation
        self._worker_cpu_s = 0.0  # the worker thread's CPU time when its last job ended
        self._tasks: set[asyncio.Task[None]] = set()
        self.evaluated = 0
        self.skipped = 0
        self.failed = 0

    def configure(self, options: PolicyOptions) -> None:
        """The gateway's policy options: the base each variant adds its opt-in to."""
        if options != self.chains.base:
            self.chains = ShadowChains(options)

    def _admit(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.max_per_s)
        self._refilled = now
        if self._busy or self._tokens < 1:
            return False
        if self.cpu_share < 1:
            # The process's CPU clock is read only for a request the rate would admit (at most
            # `max_per_s` times a second, not on every request): the budget it earns is the
            # same, since it accrues from the clock's difference between two readings.
            cpu = time.process_time()
            earned = (cpu - self._cpu_seen) * self.cpu_share
            self._cpu_budget = min(CPU_BURST_S, self._cpu_budget + earned)
            self._cpu_seen = cpu
            if self._cpu_budget <= 0:
                return False
        self._tokens -= 1
        return True

    def _charge(self, cpu_s: float) -> None:
        self.cpu_spent_s += cpu_s
        self._cpu_budget -= cpu_s

    async def _timed(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the loop, charged its thread time (a coroutine only so that
        `_evaluate` calls it as it calls `_off_loop`)."""
        started = time.thread_time()
        try:
            return work(*args)
        finally:
            self._charge(time.thread_time() - started)

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the advisor's thread, charged all that thread's CPU time since its
        previous job ended: the work, and waking up for it."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="firsttoken-advisor")
            weakref.finalize(self, self._worker.shutdown, wait=False)
        loop = asyncio.get_running_loop()
        out, cpu_s = await loop.run_in_executor(self._worker, _run_and_clock, work, args)
        self._charge(cpu_s - self._worker_cpu_s)
        self._worker_cpu_s = cpu_s
        return out

    def observe(self, tenant: str, result: PolicyResult) -> None:
        """Count the request in the tenant's totals; maybe start its shadow evaluation. O(1) on
        the loop (the family is only known after the shadow transforms)."""
        prints = result.fingerprints
        if prints is None or result.original is None:
            return
        bucket = bucket_of(time.time())
        totals = {"requests": 1, "prompt": prints.total_tokens}
        self._telemetry.put_advice(tenant, TOTALS_FAMILY, bucket, totals)
        if not self._admit():
            self.skipped += 1
            return
        self._busy = True
        task = asyncio.ensure_future(self._evaluate(tenant, bucket, result, guess_route(result)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def account(
        blob: bytes | None, current: dict[str, PrefixFingerprints], route: RouteGuess
    ) -> tuple[dict[str, int], bytes]:
        """Compare with the family's history: counter deltas and the new history blob."""
        rules = CacheRules(route.kind, route.model)
        fields, new_blob = evaluate(decode_history(blob), current, rules)
        fields.update({"requests": 1, f"route:{route.kind}": 1})
        fields["prompt"] = current[OBSERVED].total_tokens
        return fields, new_blob

    async def _evaluate(
        self, tenant: str, bucket: int, result: PolicyResult, route: RouteGuess
    ) -> None:
        try:
            # A small prompt's shadow work costs less than a hop to a thread and back (and the
            # thread would contend for the interpreter with the loop); a big one leaves the loop.
            inline = result.fingerprints is not None and (
                result.fingerprints.total_tokens <= INLINE_MAX_TOKENS
            )
            run = self._timed if inline else self._off_loop
            family, current = await run(self.chains.fingerprints, result, route, tenant)
            key = HISTORY_PREFIX + family
            blob = await self._telemetry.get_fingerprints(tenant, key)
            fields, new_blob = await run(self.account, blob, current, route)
            self._telemetry.put_fingerprints(tenant, key, new_blob, HISTORY_TTL_S)
            self._telemetry.put_advice(tenant, family, bucket, fields)
            self.evaluated += 1
        except Exception:  # the advisor only observes: its failure is its own
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.exception("cache advisor evaluation failed (%d so far)", self.failed)
        finally:
            self._busy = False


def _run_and_clock(work: Callable[..., T], args: tuple[Any, ...]) -> tuple[T, float]:
    """``work(*args)`` and the CPU time of the thread that ran it, when it ended."""
    out = work(*args)
    return out, time.thread_time()


_advisors: weakref.WeakKeyDictionary[Any, CacheAdvisor] = weakref.WeakKeyDictionary()


def advisor_for(telemetry: Any) -> CacheAdvisor:
    """The advisor of this telemetry object (made on first use, gone with it)."""
    advisor = _advisors.get(telemetry)
    if advisor is None:
        advisor = _advisors[telemetry] = CacheAdvisor(telemetry)
    return advisor


def observe_cache_advice(telemetry: Any, tenant: str, result: PolicyResult) -> None:
    """The hook in ``report_headers``: never raises, never awaits, never changes the traffic."""
    try:
        if getattr(telemetry, "enabled", False):
            advisor_for(telemetry).observe(tenant, result)
    except Exception:  # the advisor must never fail a request
        log.exception("cache advisor failed to observe a request")

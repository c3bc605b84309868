"""`Telemetry`: the one object the gateway holds for recording and reading TTFT figures.

The request path calls `record` (Prometheus update plus an enqueue, never I/O);
the background writer moves events to the store; readers ask for `report`. With a
Redis URL the store is shared by every gateway process; without one it lives in
this process and nothing is shared, with the same API and the same figures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from .event import RequestEvent
from .keys import KeySpace
from .prometheus import PrometheusMetrics
from .report import SloConfig, tenant_report
from .store import MemoryStore, Store
from .writer import BatchWriter

log = logging.getLogger("firsttoken.telemetry")


class Telemetry:
    def __init__(
        self,
        store: Store,
        *,
        buffer_max: int = 10_000,
        flush_interval_s: float = 0.1,
        flush_batch: int = 500,
        max_tenants: int = 100,
        slo: SloConfig | None = None,
        enabled: bool = True,
    ) -> None:
        self.store = store
        self.enabled = enabled
        self.slo = slo or SloConfig()
        self.metrics = PrometheusMetrics(max_tenants=max_tenants)
        self.writer = BatchWriter(
            store,
            buffer_max=buffer_max,
            flush_interval_s=flush_interval_s,
            flush_batch=flush_batch,
            on_drop=self.metrics.dropped.inc,
        )
        self.metrics.buffered.set_function(lambda: self.writer.buffered)
        self._record_failures = 0

    @classmethod
    def create(
        cls,
        *,
        redis_url: str | None,
        key_prefix: str = "ft",
        retention_s: int = 7 * 86400,
        buffer_max: int = 10_000,
        flush_interval_s: float = 0.1,
        flush_batch: int = 500,
        max_tenants: int = 100,
        slo_default_ms: float = 1000.0,
        slo_tenants: Mapping[str, float] = {},
        slo_objective: float = 0.99,
        enabled: bool = True,
        redis_cluster: bool = False,
    ) -> Telemetry:
        """Build telemetry over Redis when a URL is given, else over an in-process store."""
        if retention_s <= 0:
            raise ValueError("retention_s must be positive")
        store: Store
        if redis_url and enabled:
            from .redis_store import RedisStore, connect  # redis-py only when Redis is used

            store = RedisStore(
                connect(redis_url, cluster=redis_cluster), KeySpace(key_prefix), retention_s
            )
        else:
            store = MemoryStore(retention_s)
        slo = SloConfig(
            default_ms=slo_default_ms, tenants=dict(slo_tenants), objective=slo_objective
        )
        return cls(
            store,
            buffer_max=buffer_max,
            flush_interval_s=flush_interval_s,
            flush_batch=flush_batch,
            max_tenants=max_tenants,
            slo=slo,
            enabled=enabled,
        )

    @property
    def dropped(self) -> int:
        """Events lost because the buffer was full (or, at shutdown, still unwritten)."""
        return self.writer.dropped

    def health(self) -> dict:
        """The telemetry store's state for `/readyz`, O(1) from the writer's own counters.

        `degraded` while the last write or probe of the store failed (the gateway serves on,
        buffering events up to the bound and counting what it drops); `ok` once it answers.
        """
        if not self.enabled:
            return {"store": "off", "state": "disabled"}
        writer = self.writer
        return {
            "store": getattr(self.store, "kind", type(self.store).__name__),
            "state": "degraded" if writer.failures else "ok",
            "buffered": writer.buffered,
            "dropped": writer.dropped,
            "failures": writer.failures,
        }

    def record(self, event: RequestEvent) -> None:
        """Count one finished request: O(1), no I/O, never raises. Call it on the loop thread."""
        if not self.enabled:
            return
        try:
            self.metrics.observe(event)
        except Exception:
            self._note_record_failure()
        try:
            self.writer.enqueue(event)
        except Exception:
            self._note_record_failure()

    def _note_record_failure(self) -> None:
        self._record_failures += 1
        if self._record_failures == 1 or self._record_failures % 10_000 == 0:
            log.exception("telemetry record failed (%d so far)", self._record_failures)

    def record_prefix_break(self, tenant: str, kind: str) -> None:
        """Count a prompt prefix that stopped matching (`firsttoken_prefix_breaks_total`)."""
        if not self.enabled:
            return
        try:
            self.metrics.prefix_breaks.labels(
                self.metrics.tenant_label(tenant)[:200], kind[:64]
            ).inc()
        except Exception:
            self._note_record_failure()

    async def start(self) -> None:
        """Start the background batch writer (call once, inside the serving event loop)."""
        if self.enabled:
            self.writer.start()

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Flush what is buffered (for at most `timeout_s`) and release the store."""
        try:
            await self.writer.aclose(timeout_s)
        finally:
            try:
                await self.store.aclose()
            except Exception:
                log.debug("telemetry store close failed", exc_info=True)

    async def report(self, tenant: str, window_s: int = 3600) -> dict:
        """Figures for one tenant over the last `window_s` seconds, or for all with tenant `*`.

        The window is rounded out to whole minutes (the storage bucket).
        """
        now = time.time()
        if tenant == "*":
            tenants = await self.known_tenants()
            reports = [await tenant_report(self.store, t, window_s, self.slo, now) for t in tenants]
            return {"window_s": window_s, "tenants": [r for r in reports if r["routes"]]}
        return await tenant_report(self.store, tenant, window_s, self.slo, now)

    async def known_tenants(self) -> list[str]:
        return await self.store.tenants()

    def prometheus_exposition(self) -> tuple[bytes, str]:
        """The `/metrics` body and its content type, from this gateway's private registry."""
        return self.metrics.exposition()

    async def get_fingerprints(
        self, tenant: str, family: str, timeout_s: float = 0.05
    ) -> bytes | None:
        """The last stored prefix fingerprints, or None if absent, slow or unreachable."""
        try:
            pending = self.writer.pending_blob(tenant, family)
            if pending is not None:
                return pending
            return await asyncio.wait_for(self.store.get_blob(tenant, family), timeout_s)
        except Exception:
            return None

    def put_fingerprints(self, tenant: str, family: str, blob: bytes, ttl_s: int = 3600) -> None:
        """Queue the fingerprints for the store (latest wins); O(1), never raises."""
        if not self.enabled:
            return
        try:
            self.writer.put_blob(tenant, family, bytes(blob), ttl_s)
        except Exception:
            self._note_record_failure()

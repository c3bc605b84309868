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
from typing import TYPE_CHECKING

from .event import RequestEvent
from .keys import KeySpace
from .prometheus import PrometheusMetrics
from .report import SloConfig, tenant_report
from .series import tenant_series
from .store import MemoryStore, Store
from .writer import BatchWriter

if TYPE_CHECKING:
    from gateway.config.settings import Settings

log = logging.getLogger("firsttoken.telemetry")

# How the background writer batches; tuning of this module, not operator settings.
FLUSH_INTERVAL_S = 0.1
FLUSH_BATCH = 500


class Telemetry:
    """Options come from `Settings` only, so their defaults live in one place."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_batch: int = FLUSH_BATCH,
    ) -> None:
        self.store = store
        self.enabled = settings.telemetry
        self.slo = SloConfig.from_settings(settings)
        self.metrics = PrometheusMetrics(
            max_tenants=settings.metrics_max_tenants, max_models=settings.metrics_max_models
        )
        self.writer = BatchWriter(
            store,
            buffer_max=settings.telemetry_buffer,
            flush_interval_s=flush_interval_s,
            flush_batch=flush_batch,
            on_drop=self.metrics.dropped.inc,
        )
        self.metrics.buffered.set_function(lambda: self.writer.buffered)
        self._record_failures = 0

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        redis_url: str | None,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_batch: int = FLUSH_BATCH,
    ) -> Telemetry:
        """Telemetry over Redis when a URL is given (and telemetry is on), else over an
        in-process store. `redis_url` is passed apart because it may come from `REDIS_URL`
        (`Settings.effective_redis_url`)."""
        store: Store
        if redis_url and settings.telemetry:
            from .redis_store import RedisStore, connect  # redis-py only when Redis is used

            store = RedisStore(
                connect(redis_url, cluster=settings.redis_cluster),
                KeySpace(settings.metrics_key_prefix),
                settings.metrics_retention,
            )
        else:
            store = MemoryStore(settings.metrics_retention)
        return cls(store, settings, flush_interval_s=flush_interval_s, flush_batch=flush_batch)

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
        except Exception:  # noqa: BLE001  # recording must never fail a request
            self._note_record_failure()
        try:
            self.writer.enqueue(event)
        except Exception:  # noqa: BLE001  # recording must never fail a request
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
            self.metrics.observe_prefix_break(tenant, kind)
        except Exception:  # noqa: BLE001  # recording must never fail a request
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
            except Exception:  # closing must not mask the writer's own outcome (logged)
                log.debug("telemetry store close failed", exc_info=True)

    async def report(self, tenant: str, window_s: int = 3600, api: str | None = None) -> dict:
        """Figures for one tenant over the last `window_s` seconds, or for all with tenant `*`;
        with `api` (one of `APIS`, else ValueError), only the requests of that client API.

        The window is rounded out to whole minutes (the storage bucket).
        """
        now = time.time()
        if tenant == "*":
            tenants = await self.known_tenants()
            reports = [
                await tenant_report(self.store, t, window_s, self.slo, now, api) for t in tenants
            ]
            return {
                "window_s": window_s,
                "api": api,
                "tenants": [r for r in reports if r["routes"]],
            }
        return await tenant_report(self.store, tenant, window_s, self.slo, now, api)

    async def series(
        self,
        tenant: str,
        window_s: int = 3600,
        step_s: int = 60,
        route: str | None = None,
        api: str | None = None,
    ) -> dict:
        """Figures per step of the last `window_s` seconds for one tenant, or summed over all
        with tenant `*`; see `series.py`. ValueError for a window, step or `api` out of bounds."""
        tenants = await self.known_tenants() if tenant == "*" else None
        return await tenant_series(
            self.store, tenant, window_s, step_s, self.slo, time.time(), route, api, tenants
        )

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
            if isinstance(self.store, MemoryStore):  # answers at once: no timer, no task
                return await self.store.get_blob(tenant, family)
            return await asyncio.wait_for(self.store.get_blob(tenant, family), timeout_s)
        except Exception:  # noqa: BLE001  # fingerprints are advisory: any failure reads as absent
            return None

    def put_fingerprints(self, tenant: str, family: str, blob: bytes, ttl_s: int = 3600) -> None:
        """Queue the fingerprints for the store (latest wins); O(1), never raises."""
        if not self.enabled:
            return
        try:
            self.writer.put_blob(tenant, family, bytes(blob), ttl_s)
        except Exception:  # noqa: BLE001  # recording must never fail a request
            self._note_record_failure()

    def put_advice(self, tenant: str, family: str, bucket: int, fields: dict[str, int]) -> None:
        """Queue the cache advisor's counter deltas for the store; never raises."""
        if not self.enabled:
            return
        try:
            self.writer.put_advice(tenant, family, bucket, fields)
        except Exception:  # noqa: BLE001  # recording must never fail a request
            self._note_record_failure()

    async def read_advice(
        self, tenant: str, first_bucket: int, last_bucket: int
    ) -> dict[str, dict[str, int]]:
        """Per prefix family, the advisor's counters of one tenant summed over the buckets
        (empty for a store that keeps none)."""
        read = getattr(self.store, "read_advice", None)
        if read is None:
            return {}
        result: dict[str, dict[str, int]] = await read(tenant, first_bucket, last_bucket)
        return result

"""Where aggregated counters live: the `Store` interface and the in-process `MemoryStore`.

A store only adds pre-aggregated counters and reads them back merged; percentiles,
ratios and SLOs are computed by `report.py` from what any store returns, which is
why the in-process store and Redis give the same report for the same events.
"""

from __future__ import annotations

import asyncio

import time
from typing import Mapping, Protocol

from .aggregate import Aggregate, Fields, merge_fields

Blobs = Mapping[tuple[str, str], tuple[bytes, int]]  # (tenant, family) -> (blob, ttl seconds)


class Store(Protocol):
    async def write(self, aggregate: Aggregate, blobs: Blobs) -> None:
        """Add the counters and set the blobs; raise if the write did not happen."""

    async def read(self, tenant: str, first_minute: int, last_minute: int) -> dict[str, Fields]:
        """Per route, the counters of a tenant summed over minutes in `[first, last]`."""

    async def tenants(self) -> list[str]: ...

    async def get_blob(self, tenant: str, family: str) -> bytes | None: ...

    async def aclose(self) -> None: ...

    def is_transient(self, exc: BaseException) -> bool:
        """True for a failure after which the same batch may be retried whole."""
        ...


class MemoryStore:
    """The embedded default: one process's counters in dictionaries, pruned after retention."""

    def __init__(self, retention_s: int) -> None:
        self.retention_s = retention_s
        self._buckets: dict[
            str, dict[tuple[str, int], Fields]
        ] = {}  # tenant -> (route, minute) -> fields
        self._blobs: dict[tuple[str, str], tuple[bytes, float]] = {}
        self._last_prune = time.time()

    async def write(self, aggregate: Aggregate, blobs: Blobs) -> None:
        for (tenant, route, minute), fields in aggregate.items():
            per_tenant = self._buckets.setdefault(tenant, {})
            merge_fields(per_tenant.setdefault((route, minute), {}), fields)
        now = time.time()
        for key, (blob, ttl_s) in blobs.items():
            self._blobs[key] = (blob, now + ttl_s)
        if now - self._last_prune > 60:
            self._prune(now)

    def _prune(self, now: float) -> None:
        self._last_prune = now
        oldest_minute = int((now - self.retention_s) // 60)
        for tenant in list(self._buckets):
            per_tenant = self._buckets[tenant]
            for key in [k for k in per_tenant if k[1] < oldest_minute]:
                del per_tenant[key]
            if not per_tenant:
                del self._buckets[tenant]
        for key in [k for k, (_, expires) in self._blobs.items() if expires <= now]:
            del self._blobs[key]

    async def read(self, tenant: str, first_minute: int, last_minute: int) -> dict[str, Fields]:
        merged: dict[str, Fields] = {}
        for (route, minute), fields in self._buckets.get(tenant, {}).items():
            if first_minute <= minute <= last_minute:
                merge_fields(merged.setdefault(route, {}), fields)
        return merged

    async def tenants(self) -> list[str]:
        return sorted(self._buckets)

    async def get_blob(self, tenant: str, family: str) -> bytes | None:
        entry = self._blobs.get((tenant, family))
        if entry is None or entry[1] <= time.time():
            return None
        return entry[0]

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, (OSError, asyncio.TimeoutError))

    async def aclose(self) -> None:
        return None

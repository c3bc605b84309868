"""Where aggregated counters live: the `Store` interface and the in-process `MemoryStore`.

A store only adds pre-aggregated counters and reads them back merged; percentiles,
ratios and SLOs are computed by `report.py` from what any store returns, which is
why the in-process store and Redis give the same report for the same events.

Blobs (prefix fingerprints, one per tenant and model family) are diagnostics that a tenant
controls the size and number of, so the in-process store bounds them by bytes, per tenant and
in all, evicting the oldest: `MEMORY_BLOBS_TENANT_MAX_BYTES`, `MEMORY_BLOBS_MAX_BYTES`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Protocol

from .aggregate import Aggregate, Fields, merge_fields

RouteApi = tuple[str, str]  # (route, api)
Blobs = Mapping[tuple[str, str], tuple[bytes, int]]  # (tenant, family) -> (blob, ttl seconds)
BatchId = tuple[str, int]  # (writer id, batch number): a retried batch keeps its id

MEMORY_BLOBS_MAX_BYTES = 64 * 2**20  # fingerprint blobs kept in process, all tenants
MEMORY_BLOBS_TENANT_MAX_BYTES = 8 * 2**20  # ... and one tenant's share of that
BLOB_ENTRY_OVERHEAD_BYTES = 200  # dictionary slots, tuples and the tenant name, roughly


def blob_bytes(family: str, blob: bytes) -> int:
    """The memory one blob entry holds, counted in O(1): a family name may be 1 MB too."""
    return len(blob) + sys.getsizeof(family) + BLOB_ENTRY_OVERHEAD_BYTES


class Store(Protocol):
    async def write(self, aggregate: Aggregate, blobs: Blobs, batch: BatchId | None = None) -> None:
        """Add the counters and set the blobs, at most once per `batch`; raise if the write
        must be retried."""

    async def read(self, tenant: str, first_minute: int, last_minute: int) -> dict[str, Fields]:
        """Per route, the counters of a tenant summed over minutes in `[first, last]` and over
        client APIs."""

    async def read_split(
        self, tenant: str, first_minute: int, last_minute: int
    ) -> dict[RouteApi, Fields]:
        """Per (route, api), the counters of a tenant summed over minutes in `[first, last]`:
        what a report needs to show routes, APIs, or the routes of one API."""

    async def tenants(self) -> list[str]: ...

    async def get_blob(self, tenant: str, family: str) -> bytes | None: ...

    async def aclose(self) -> None: ...

    async def ping(self) -> None:
        """Raise if the store cannot be reached (the writer probes it while idle)."""

    def is_transient(self, exc: BaseException) -> bool:
        """True for a failure after which the same batch may be retried whole."""
        ...


def per_route(split: Mapping[RouteApi, Fields]) -> dict[str, Fields]:
    """Per route, counters summed over APIs, from `read_split`."""
    merged: dict[str, Fields] = {}
    for (route, _), fields in split.items():
        merge_fields(merged.setdefault(route, {}), fields)
    return merged


def per_api(split: Mapping[RouteApi, Fields]) -> dict[str, Fields]:
    """Per API, counters summed over routes, from `read_split`."""
    merged: dict[str, Fields] = {}
    for (_, api), fields in split.items():
        merge_fields(merged.setdefault(api, {}), fields)
    return merged


class _BlobShelf:
    """Expiring blobs by tenant and family, bounded in bytes per tenant and in all.

    Over a tenant's bound its own oldest blobs go; over the total, the oldest of the tenant
    holding the most, so one tenant's churn cannot evict another's while it stays in its share.
    """

    def __init__(self, max_bytes: int, tenant_max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.tenant_max_bytes = tenant_max_bytes
        self.bytes = 0
        self._tenants: dict[str, OrderedDict[str, tuple[bytes, float, int]]] = {}
        self._tenant_bytes: dict[str, int] = {}

    def put(self, tenant: str, family: str, blob: bytes, expires: float) -> bool:
        self.remove(tenant, family)
        size = blob_bytes(family, blob)
        if size > self.tenant_max_bytes or size > self.max_bytes:
            return False
        while self._tenant_bytes.get(tenant, 0) + size > self.tenant_max_bytes:
            self._evict_oldest(tenant)
        while self.bytes + size > self.max_bytes:
            self._evict_oldest(max(self._tenant_bytes, key=self._tenant_bytes.__getitem__))
        self._tenants.setdefault(tenant, OrderedDict())[family] = (blob, expires, size)
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.bytes += size
        return True

    def get(self, tenant: str, family: str) -> tuple[bytes, float] | None:
        shelf = self._tenants.get(tenant)
        entry = None if shelf is None else shelf.get(family)
        return None if entry is None else (entry[0], entry[1])

    def _evict_oldest(self, tenant: str) -> None:
        self.remove(tenant, next(iter(self._tenants[tenant])))

    def remove(self, tenant: str, family: str) -> None:
        shelf = self._tenants.get(tenant)
        if shelf is None or family not in shelf:
            return
        size = shelf.pop(family)[2]
        self.bytes -= size
        self._tenant_bytes[tenant] -= size
        if not shelf:
            del self._tenants[tenant], self._tenant_bytes[tenant]

    def prune(self, now: float) -> None:
        for tenant, shelf in list(self._tenants.items()):
            for family in [f for f, entry in shelf.items() if entry[1] <= now]:
                self.remove(tenant, family)


class MemoryStore:
    """The embedded default: one process's counters in dictionaries, pruned after retention."""

    kind = "memory"

    def __init__(self, retention_s: int) -> None:
        self.retention_s = retention_s
        # tenant -> (route, api, minute) -> fields
        self._buckets: dict[str, dict[tuple[str, str, int], Fields]] = {}
        self._blobs = _BlobShelf(MEMORY_BLOBS_MAX_BYTES, MEMORY_BLOBS_TENANT_MAX_BYTES)
        self._last_prune = time.time()

    async def write(self, aggregate: Aggregate, blobs: Blobs, batch: BatchId | None = None) -> None:
        for (tenant, route, api, minute), fields in aggregate.items():
            per_tenant = self._buckets.setdefault(tenant, {})
            merge_fields(per_tenant.setdefault((route, api, minute), {}), fields)
        now = time.time()
        for (tenant, family), (blob, ttl_s) in blobs.items():
            self._blobs.put(tenant, family, blob, now + ttl_s)
        if now - self._last_prune > 60:
            self._prune(now)

    def _prune(self, now: float) -> None:
        self._last_prune = now
        oldest_minute = int((now - self.retention_s) // 60)
        for tenant in list(self._buckets):
            per_tenant = self._buckets[tenant]
            for key in [k for k in per_tenant if k[2] < oldest_minute]:
                del per_tenant[key]
            if not per_tenant:
                del self._buckets[tenant]
        self._blobs.prune(now)

    async def read(self, tenant: str, first_minute: int, last_minute: int) -> dict[str, Fields]:
        return per_route(await self.read_split(tenant, first_minute, last_minute))

    async def read_split(
        self, tenant: str, first_minute: int, last_minute: int
    ) -> dict[RouteApi, Fields]:
        merged: dict[RouteApi, Fields] = {}
        for (route, api, minute), fields in self._buckets.get(tenant, {}).items():
            if first_minute <= minute <= last_minute:
                merge_fields(merged.setdefault((route, api), {}), fields)
        return merged

    async def tenants(self) -> list[str]:
        return sorted(self._buckets)

    async def get_blob(self, tenant: str, family: str) -> bytes | None:
        entry = self._blobs.get(tenant, family)
        if entry is None or entry[1] <= time.time():
            return None
        return entry[0]

    @property
    def blob_bytes(self) -> int:
        """Bytes the blobs hold now (bounded by `MEMORY_BLOBS_MAX_BYTES`)."""
        return self._blobs.bytes

    async def ping(self) -> None:
        return None

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, (OSError, asyncio.TimeoutError))

    async def aclose(self) -> None:
        return None

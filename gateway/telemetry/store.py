"""Where aggregated counters live: the `Store` interface and the in-process `MemoryStore`.

A store only adds pre-aggregated counters and reads them back merged; percentiles,
ratios and SLOs are computed by `report.py` from what any store returns, which is
why the in-process store and Redis give the same report for the same events.

Blobs (prefix fingerprints, one per tenant and model family) are diagnostics that a tenant
controls the size and number of, so the in-process store bounds them by bytes, per tenant and
in all, evicting the oldest: `MEMORY_BLOBS_TENANT_MAX_BYTES`, `MEMORY_BLOBS_MAX_BYTES`.

The cache advisor's counters (`gateway.advisor`) are kept per tenant, prefix family and
`ADVICE_BUCKET_S` bucket, for at most `ADVICE_RETENTION_S`: a tenant's families are capped at
`ADVICE_FAMILIES_PER_TENANT` (least recently written go first), all tenants' at
`ADVICE_FAMILIES_MAX`, and field names at `ADVICE_FIELDS_MAX`, so their memory is bounded
whatever the traffic.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from typing import Protocol

from .aggregate import Aggregate, Fields, merge_fields

RouteApi = tuple[str, str]  # (route, api)
StepKey = tuple[str, str, int]  # (route, api, first minute of the step)
Blobs = Mapping[tuple[str, str], tuple[bytes, int]]  # (tenant, family) -> (blob, ttl seconds)
BatchId = tuple[str, int]  # (writer id, batch number): a retried batch keeps its id
# (tenant, family, bucket) -> counter deltas: what the cache advisor adds per write.
Advice = Mapping[tuple[str, str, int], Mapping[str, int]]

ADVICE_BUCKET_S = 600  # the advisor's counters are summed per family and 10 minutes
ADVICE_RETENTION_S = 86400  # ... and kept a day (or the metrics retention, if shorter)
ADVICE_FAMILIES_PER_TENANT = 32  # families one tenant's advice keeps (least recent go)
ADVICE_FAMILIES_MAX = 1024  # families kept in process, all tenants together
ADVICE_FIELDS_MAX = 256  # distinct counter names kept in process

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

    async def read_steps(
        self, tenant: str, first_minute: int, last_minute: int, step_minutes: int
    ) -> dict[StepKey, Fields]:
        """Per (route, api, step), the counters of a tenant summed over the minutes in
        `[first, last]` of each step; steps are aligned to `step_minutes` since the epoch and
        keyed by their first minute. A time series reads the whole window in this one call."""

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


class _AdviceShelf:
    """The advisor's counters in process: per (tenant, family), buckets of int64 arrays indexed
    by a shared field table, so a bucket costs a few hundred bytes whatever its field names."""

    def __init__(self, retention_s: int) -> None:
        self.retention_s = min(retention_s, ADVICE_RETENTION_S)
        self._fields: dict[str, int] = {}
        self._families: OrderedDict[tuple[str, str], dict[int, array]] = OrderedDict()
        self._per_tenant: dict[str, int] = {}

    def add(self, advice: Advice, now: float) -> None:
        oldest = int((now - self.retention_s) // ADVICE_BUCKET_S)
        for (tenant, family, bucket), fields in advice.items():
            if bucket < oldest:
                continue
            key = (tenant, family)
            buckets = self._families.get(key)
            if buckets is None:
                buckets = self._new_family(key)
            else:
                self._families.move_to_end(key)
            values = buckets.get(bucket)
            if values is None:
                values = buckets[bucket] = array("q")
                for stale in [b for b in buckets if b < oldest]:
                    del buckets[stale]
            for name, amount in fields.items():
                index = self._index(name)
                if index is None:
                    continue
                if index >= len(values):
                    values.extend([0] * (index + 1 - len(values)))
                values[index] += int(amount)

    def _index(self, name: str) -> int | None:
        index = self._fields.get(name)
        if index is None and len(self._fields) < ADVICE_FIELDS_MAX:
            index = self._fields[name] = len(self._fields)
        return index

    def _new_family(self, key: tuple[str, str]) -> dict[int, array]:
        tenant = key[0]
        if self._per_tenant.get(tenant, 0) >= ADVICE_FAMILIES_PER_TENANT:
            self._drop(next(k for k in self._families if k[0] == tenant))
        while len(self._families) >= ADVICE_FAMILIES_MAX:
            self._drop(next(iter(self._families)))
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        buckets: dict[int, array] = {}
        self._families[key] = buckets
        return buckets

    def _drop(self, key: tuple[str, str]) -> None:
        del self._families[key]
        left = self._per_tenant[key[0]] - 1
        if left:
            self._per_tenant[key[0]] = left
        else:
            del self._per_tenant[key[0]]

    def read(self, tenant: str, first: int, last: int) -> dict[str, dict[str, int]]:
        names = list(self._fields)
        out: dict[str, dict[str, int]] = {}
        for (owner, family), buckets in self._families.items():
            if owner != tenant:
                continue
            summed: dict[str, int] = {}
            for bucket, values in buckets.items():
                if first <= bucket <= last:
                    for index, amount in enumerate(values):
                        if amount:
                            summed[names[index]] = summed.get(names[index], 0) + amount
            if summed:
                out[family] = summed
        return out

    def families(self, tenant: str | None = None) -> int:
        return len(self._families) if tenant is None else self._per_tenant.get(tenant, 0)


class MemoryStore:
    """The embedded default: one process's counters in dictionaries, pruned after retention."""

    kind = "memory"

    def __init__(self, retention_s: int) -> None:
        self.retention_s = retention_s
        # tenant -> (route, api, minute) -> fields
        self._buckets: dict[str, dict[tuple[str, str, int], Fields]] = {}
        self._blobs = _BlobShelf(MEMORY_BLOBS_MAX_BYTES, MEMORY_BLOBS_TENANT_MAX_BYTES)
        self.advice = _AdviceShelf(retention_s)
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

    async def read_steps(
        self, tenant: str, first_minute: int, last_minute: int, step_minutes: int
    ) -> dict[StepKey, Fields]:
        merged: dict[StepKey, Fields] = {}
        for (route, api, minute), fields in self._buckets.get(tenant, {}).items():
            if first_minute <= minute <= last_minute:
                step = minute - minute % step_minutes
                merge_fields(merged.setdefault((route, api, step), {}), fields)
        return merged

    async def tenants(self) -> list[str]:
        return sorted(self._buckets)

    async def get_blob(self, tenant: str, family: str) -> bytes | None:
        entry = self._blobs.get(tenant, family)
        if entry is None or entry[1] <= time.time():
            return None
        return entry[0]

    async def write_advice(self, advice: Advice) -> None:
        """Add the cache advisor's counter deltas (bounded, see `_AdviceShelf`)."""
        self.advice.add(advice, time.time())

    async def read_advice(
        self, tenant: str, first_bucket: int, last_bucket: int
    ) -> dict[str, dict[str, int]]:
        """Per prefix family, a tenant's advisor counters summed over buckets in the range."""
        return self.advice.read(tenant, first_bucket, last_bucket)

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

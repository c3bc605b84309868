"""The shared store: counters in Redis hashes, one per tenant, route and minute.

A batch is one MULTI/EXEC pipeline: per bucket, one small script that runs its
`HINCRBY`/`HINCRBYFLOAT` updates and `EXPIREAT`, then the name hashes and blobs. On Redis
Cluster (keys carry `{t=...}` hash tags, so a tenant's keys share a slot) the batch is a
plain pipeline split by node.
A batch that fails to reach Redis (refused, reset) is not applied and is retried
whole by the writer without counting anything twice. One case is not covered: a
timeout after EXEC was sent, where Redis may have applied it and the retry counts
it again. The client's own retries are off: the batch writer owns retrying, with
backoff, and a short socket timeout keeps a hung Redis from holding it for long.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .aggregate import Aggregate, Fields, merge_fields, parse_field_value
from .keys import KeySpace, escape_name
from .store import Blobs

_READ_CHUNK = 2000  # commands per read pipeline


def _is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)

# One command per bucket instead of one per field: a batch touches few buckets but
# many fields (every histogram bucket), and each command costs the client far more
# than the server. ARGV: expire-at, number of integer pairs, integer pairs, float pairs.
_ADD_FIELDS = """
local key = KEYS[1]
local ints = tonumber(ARGV[2])
local last_int = 2 + 2 * ints
for i = 3, last_int, 2 do redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1]) end
for i = last_int + 1, #ARGV, 2 do redis.call('HINCRBYFLOAT', key, ARGV[i], ARGV[i + 1]) end
redis.call('EXPIREAT', key, ARGV[1])
"""


# Server replies that mean "not now", after which the same batch may be retried whole.
RETRYABLE_REPLIES = ("EXECABORT", "OOM", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN")


def connect(url: str, *, timeout_s: float = 1.0, cluster: bool = False) -> Any:
    """A client for the telemetry store: short timeouts, no hidden retries. With `cluster`, a
    Redis Cluster client that routes each key by its hash tag."""
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                   retry=Retry(NoBackoff(), 0))
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **options)
    return aioredis.Redis.from_url(url, health_check_interval=0, **options)


class RedisStore:
    def __init__(self, client: Any, keys: KeySpace, retention_s: int) -> None:
        self.client = client
        self.keys = keys
        self.retention_s = retention_s
        # A cluster pipeline cannot be one MULTI/EXEC (its keys live on several nodes): each
        # bucket's script is still atomic, but a failed batch may be partly applied.
        self.transactional = not _is_cluster(client)

    async def write(self, aggregate: Aggregate, blobs: Blobs) -> None:
        if not aggregate and not blobs:
            return
        pipe = self.client.pipeline(transaction=self.transactional)
        names_ttl = self.retention_s + 120  # outlive the newest bucket they name
        tenants: dict[str, set[str]] = {}
        for (tenant, route, minute), fields in aggregate.items():
            tenants.setdefault(tenant, set()).add(route)
            ints: list[Any] = []
            floats: list[Any] = []
            for name, amount in fields.items():
                (floats if isinstance(amount, float) else ints).extend((name, amount))
            expire_at = (minute + 1) * 60 + self.retention_s
            key = self.keys.bucket(tenant, route, minute)
            pipe.eval(_ADD_FIELDS, 1, key, expire_at, len(ints) // 2, *ints, *floats)
        if tenants:
            pipe.hset(self.keys.tenants(), mapping={escape_name(t): t for t in tenants})
            pipe.expire(self.keys.tenants(), names_ttl)
            for tenant, routes in tenants.items():
                routes_key = self.keys.routes(tenant)
                pipe.hset(routes_key, mapping={escape_name(r): r for r in routes})
                pipe.expire(routes_key, names_ttl)
        for (tenant, family), (blob, ttl_s) in blobs.items():
            pipe.set(self.keys.fingerprints(tenant, family), blob, ex=max(1, int(ttl_s)))
        await pipe.execute()

    async def read(self, tenant: str, first_minute: int, last_minute: int) -> dict[str, Fields]:
        raw_routes = await self.client.hgetall(self.keys.routes(tenant))
        routes = sorted(v.decode("utf-8", "surrogateescape") for v in raw_routes.values())
        targets = [(r, m) for r in routes for m in range(first_minute, last_minute + 1)]
        merged: dict[str, Fields] = {}
        for start in range(0, len(targets), _READ_CHUNK):
            chunk = targets[start : start + _READ_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for route, minute in chunk:
                pipe.hgetall(self.keys.bucket(tenant, route, minute))
            replies: list[dict[Any, Any]] = await pipe.execute()
            for (route, _), reply in zip(chunk, replies):
                if reply:
                    fields = {
                        n.decode(): parse_field_value(n.decode(), v) for n, v in reply.items()
                    }
                    merge_fields(merged.setdefault(route, {}), fields)
        return merged

    async def tenants(self) -> list[str]:
        names = await self.client.hvals(self.keys.tenants())
        return sorted(n.decode("utf-8", "surrogateescape") for n in names)

    async def get_blob(self, tenant: str, family: str) -> bytes | None:
        return await self.client.get(self.keys.fingerprints(tenant, family))

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                            OSError, asyncio.TimeoutError)):
            return True
        return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(
            RETRYABLE_REPLIES)

    async def aclose(self) -> None:
        await self.client.aclose()

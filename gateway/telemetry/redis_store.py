"""The shared store: counters in Redis hashes, one per tenant, route, client API and minute.

A batch is one MULTI/EXEC pipeline: per tenant, one script that updates all of that tenant's
buckets, its route names and the APIs it used, then the tenant names and the blobs. On Redis
Cluster (keys carry `{t=...}` hash tags, so a tenant's keys share a slot) the batch is a plain
pipeline split by node, and each tenant's script is still atomic.

A batch is applied at most once. The writer numbers its batches and retries a failed one with
the same number, and each tenant's script first compares that number with the tenant's marker
key for this writer (`applied`, same hash tag), skipping work already done and otherwise
recording the number. So a batch retried after a timeout that came after EXEC, or after a
cluster node failed while others applied their part, does not count twice. Markers live
`MARKER_TTL_S` (refreshed on every write, one key per tenant and writer process); only a batch
whose retries outlast that could count twice.

A key of the wrong type (a string where a bucket hash lives, say) loses only itself: every
script checks `TYPE` before touching a key and reports the key instead of failing, and the
pipeline is read command by command (`raise_on_error=False`), so one failed command never
makes the writer re-send the commands that did apply. Each such key is logged by name, at most
once per `PROBLEM_LOG_EVERY_S`. Only transient failures (connection, timeout, OOM, READONLY,
LOADING, BUSY, cluster failover) make `write` raise, and the writer then retries the same
batch. The client's own retries are off: the batch writer owns retrying, with backoff, and a
short socket timeout keeps a hung Redis from holding it for long.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .aggregate import Aggregate, Fields, merge_fields, parse_stored_fields
from .event import APIS
from .keys import KeySpace, escape_name
from .store import (
    ADVICE_BUCKET_S,
    ADVICE_FAMILIES_PER_TENANT,
    ADVICE_RETENTION_S,
    Advice,
    BatchId,
    Blobs,
    RouteApi,
    StepKey,
    per_route,
)

log = logging.getLogger("firsttoken.telemetry")

_READ_CHUNK = 240  # commands per read pipeline: the loop serves others between them
MARKER_TTL_S = 86400  # how long a writer's "batch n applied" marker outlives its last write
PROBLEM_LOG_EVERY_S = 300.0  # one log line per bad key and this period
_PROBLEM_KEYS_MAX = 1024  # keys remembered for that; the memory is cleared when full


def _is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


# One script per tenant and batch: one command per tenant instead of one per field (a batch
# touches few buckets but many fields, and each command costs the client far more than the
# server). KEYS: the batch marker, the tenant's route names hash, its APIs hash, its buckets.
# ARGV: batch number, marker TTL, names TTL, number of route name pairs, the pairs, number of
# API name pairs, the pairs (none for chat alone: the APIs hash is then left untouched), then
# per bucket: expire-at, number of integer pairs, number of float pairs, the integer pairs, the
# float pairs.
# Returns {applied (1, or 0 for a batch already applied), then key index and problem per key
# left alone}: a key that is not a hash is never touched, a field that cannot be incremented
# spoils only its bucket.
_APPLY_TENANT = """
local function usable(key)
  local t = redis.call('TYPE', key).ok
  if t == 'none' or t == 'hash' then return nil end
  return t
end
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'none' and t ~= 'string' then return {0, 1, t} end
local done = tonumber(redis.call('GET', KEYS[1]))
if done and done >= tonumber(ARGV[1]) then return {0} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local out = {1}
local i = 5
local last = i + 2 * tonumber(ARGV[4]) - 1
local wrong = usable(KEYS[2])
if wrong then
  out[#out + 1] = 2; out[#out + 1] = wrong
else
  for j = i, last, 2 do redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
i = last + 1
last = i + 2 * tonumber(ARGV[i])
if last > i then
  wrong = usable(KEYS[3])
  if wrong then
    out[#out + 1] = 3; out[#out + 1] = wrong
  else
    for j = i + 1, last, 2 do redis.call('HSET', KEYS[3], ARGV[j], ARGV[j + 1]) end
    redis.call('EXPIRE', KEYS[3], ARGV[3])
  end
end
i = last + 1
for k = 4, #KEYS do
  local key = KEYS[k]
  local expire_at = ARGV[i]
  local last_int = i + 2 + 2 * tonumber(ARGV[i + 1])
  last = last_int + 2 * tonumber(ARGV[i + 2])
  wrong = usable(key)
  if wrong then
    out[#out + 1] = k; out[#out + 1] = wrong
  else
    local spoilt = nil
    for j = i + 3, last, 2 do
      local op = j <= last_int and 'HINCRBY' or 'HINCRBYFLOAT'
      local reply = redis.pcall(op, key, ARGV[j], ARGV[j + 1])
      if type(reply) == 'table' and reply.err then spoilt = reply.err end
    end
    redis.call('EXPIREAT', key, expire_at)
    if spoilt then out[#out + 1] = k; out[#out + 1] = 'field: ' .. spoilt end
  end
  i = last + 1
end
return out
"""

# The tenant names hash (no hash tag: it names every tenant). Idempotent, so it needs no
# marker. ARGV: TTL, then name pairs. Returns '' or the type found instead of a hash.
_ADD_NAMES = """
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'none' and t ~= 'hash' then return t end
for j = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return ''
"""


# The cache advisor's counters for one tenant, family and bucket, and the tenant's family index
# (same hash tag, so one slot). KEYS: the bucket hash, the families sorted set. ARGV: expire-at,
# family name, bucket (its score), families kept, index TTL, then field/amount pairs. The index
# keeps the newest ADVICE_FAMILIES_PER_TENANT families; a dropped family's buckets expire.
# Returns '' or the type found where a hash or sorted set belongs (that key is left alone).
_ADD_ADVICE = """
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'none' and t ~= 'hash' then return t end
local z = redis.call('TYPE', KEYS[2]).ok
if z ~= 'none' and z ~= 'zset' then return z end
for j = 6, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[j], ARGV[j + 1]) end
redis.call('EXPIREAT', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -1 - tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[2], ARGV[5])
return ''
"""


# Server replies that mean "not now", after which the same batch may be retried whole.
RETRYABLE_REPLIES = (
    "OOM",
    "READONLY",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
)
_TRANSIENT_TYPES = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
    asyncio.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


def reply_code(exc: BaseException) -> str:
    """The error code of a Redis reply (`WRONGTYPE`), without redis-py's pipeline preamble."""
    text = str(exc)
    marker = "caused error: "
    if marker in text:
        text = text.split(marker, 1)[1]
    return text.split(" ", 1)[0]


def is_transient(exc: BaseException) -> bool:
    """True for a failure after which the same batch may be retried whole."""
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and reply_code(exc) in RETRYABLE_REPLIES


def connect(url: str, *, timeout_s: float = 1.0, cluster: bool = False) -> Any:
    """A client for the telemetry store: short timeouts, no hidden retries. With `cluster`, a
    Redis Cluster client that routes each key by its hash tag."""
    retry = Retry(NoBackoff(), 0)
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry
        )
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=retry,
        health_check_interval=0,
    )


class _ProblemLog:
    """One log line per bad key and period, so a poisoned key cannot flood the log."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < PROBLEM_LOG_EVERY_S:
            return
        if len(self._last) >= _PROBLEM_KEYS_MAX:
            self._last.clear()
        self._last[key] = now
        log.error(message, key, *args)


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


class RedisStore:
    kind = "redis"

    def __init__(self, client: Any, keys: KeySpace, retention_s: int) -> None:
        self.client = client
        self.keys = keys
        self.retention_s = retention_s
        # A cluster pipeline cannot be one MULTI/EXEC (its keys live on several nodes): each
        # tenant's script is still atomic, and batch markers keep a retried batch from counting
        # twice where a failed one was partly applied.
        self.transactional = not _is_cluster(client)
        self._own_writer = uuid.uuid4().hex[:16]  # for writes that come without a batch id
        self._own_seq = itertools.count(1)
        self._problem = _ProblemLog()

    async def write(self, aggregate: Aggregate, blobs: Blobs, batch: BatchId | None = None) -> None:
        """Apply the batch at most once per batch id. Keys of the wrong type are logged and
        left out; raises (for the writer to retry the same batch) only on transient errors."""
        if not aggregate and not blobs:
            return
        writer, seq = batch if batch is not None else (self._own_writer, next(self._own_seq))
        pipe = self.client.pipeline(transaction=self.transactional)
        names_ttl = self.retention_s + 120  # outlive the newest bucket they name
        per_tenant: dict[str, list[tuple[str, str, int, Any]]] = {}
        for (tenant, route, api, minute), fields in aggregate.items():
            per_tenant.setdefault(tenant, []).append((route, api, minute, fields))
        sent: list[tuple[str, list[str], str]] = []  # per command: kind, its keys, key to log
        for tenant, buckets in per_tenant.items():
            routes = {escape_name(r): r for r, _, _, _ in buckets}
            apis = sorted({a for _, a, _, _ in buckets} - {"chat"})
            keys = [
                self.keys.batch_marker(tenant, writer),
                self.keys.routes(tenant),
                self.keys.apis(tenant),
            ]
            args: list[Any] = [seq, MARKER_TTL_S, names_ttl, len(routes)]
            for pair in routes.items():
                args.extend(pair)
            args.append(len(apis))
            for api in apis:
                args.extend((api, api))
            for route, api, minute, fields in buckets:
                ints: list[Any] = []
                floats: list[Any] = []
                for name, amount in fields.items():
                    (floats if isinstance(amount, float) else ints).extend((name, amount))
                keys.append(self.keys.bucket(tenant, route, minute, api))
                args.extend(
                    (
                        (minute + 1) * 60 + self.retention_s,
                        len(ints) // 2,
                        len(floats) // 2,
                        *ints,
                        *floats,
                    )
                )
            pipe.eval(_APPLY_TENANT, len(keys), *keys, *args)
            sent.append(("tenant", keys, keys[1]))
        if per_tenant:
            names: list[Any] = [names_ttl]
            for tenant in per_tenant:
                names.extend((escape_name(tenant), tenant))
            pipe.eval(_ADD_NAMES, 1, self.keys.tenants(), *names)
            sent.append(("names", [], self.keys.tenants()))
        for (tenant, family), (blob, ttl_s) in blobs.items():
            key = self.keys.fingerprints(tenant, family)
            pipe.set(key, blob, ex=max(1, int(ttl_s)))
            sent.append(("blob", [], key))
        replies = await pipe.execute(raise_on_error=False)
        retry: BaseException | None = None
        for (what, keys, named), reply in zip(sent, replies, strict=False):
            if isinstance(reply, BaseException):
                if is_transient(reply):
                    retry = retry or reply
                else:
                    self._problem(
                        named,
                        "telemetry: writing %s failed, that part of the batch is lost: %s",
                        _text(reply),
                    )
            elif what == "tenant":
                self._note_skipped(keys, reply[1:])
            elif what == "names" and reply:
                self._wrong_type(named, reply, "written")
        if retry is not None:
            raise retry

    def _note_skipped(self, keys: list[str], skipped: list[Any]) -> None:
        for index, problem in zip(skipped[::2], skipped[1::2], strict=False):
            key, problem = keys[int(index) - 1], _text(problem)
            if problem.startswith("field: "):
                self._not_counters(key, problem[len("field: ") :], "written")
            else:
                self._wrong_type(key, problem, "written")

    def _wrong_type(self, key: str, found: Any, verb: str) -> None:
        self._problem(
            key,
            "telemetry: key %s is not a hash (%s), so it is not "
            + verb
            + " (delete the key to recover)",
            _text(found),
        )

    def _not_counters(self, key: str, why: Any, verb: str) -> None:
        self._problem(
            key,
            "telemetry: bucket %s holds a field that is not a counter (%s), so "
            "it is not " + verb + " (delete the key to recover)",
            _text(why),
        )

    async def read(self, tenant: str, first_minute: int, last_minute: int) -> dict[str, Fields]:
        return per_route(await self.read_split(tenant, first_minute, last_minute))

    async def read_split(
        self, tenant: str, first_minute: int, last_minute: int
    ) -> dict[RouteApi, Fields]:
        merged: dict[RouteApi, Fields] = {}
        async for route, api, _, fields in self._buckets(tenant, first_minute, last_minute):
            merge_fields(merged.setdefault((route, api), {}), fields)
        return merged

    async def read_steps(
        self, tenant: str, first_minute: int, last_minute: int, step_minutes: int
    ) -> dict[StepKey, Fields]:
        merged: dict[StepKey, Fields] = {}
        async for route, api, minute, fields in self._buckets(tenant, first_minute, last_minute):
            step = minute - minute % step_minutes
            merge_fields(merged.setdefault((route, api, step), {}), fields)
        return merged

    async def _buckets(
        self, tenant: str, first_minute: int, last_minute: int
    ) -> AsyncIterator[tuple[str, str, int, Fields]]:
        """Every readable bucket of a tenant in `[first, last]`: one round trip for its route and
        API names, then pipelined HGETALLs, `_READ_CHUNK` per round trip, so neither side holds
        an unbounded pipeline and the loop serves other requests between round trips (a long
        window's replies, parsed in one go, would hold it for tens of milliseconds)."""
        routes_key, apis_key = self.keys.routes(tenant), self.keys.apis(tenant)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(routes_key)
        pipe.hgetall(apis_key)
        raw_routes, raw_apis = await pipe.execute(raise_on_error=False)
        route_names = self._names(routes_key, raw_routes)
        if not route_names:
            return
        # Names read from a shared store: only the four known APIs, so a stray field can
        # neither add reads nor put an unchecked name into a key.
        used = {_text(a) for a in self._names(apis_key, raw_apis)} & set(APIS)
        apis = ["chat", *(a for a in APIS if a in used and a != "chat")]
        routes = sorted(v.decode("utf-8", "surrogateescape") for v in route_names)
        minutes = range(first_minute, last_minute + 1)
        targets = [(r, a, m) for r in routes for a in apis for m in minutes]
        for start in range(0, len(targets), _READ_CHUNK):
            chunk = targets[start : start + _READ_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for route, api, minute in chunk:
                pipe.hgetall(self.keys.bucket(tenant, route, minute, api))
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            for (route, api, minute), reply in zip(chunk, replies, strict=False):
                fields = self._bucket_fields(self.keys.bucket(tenant, route, minute, api), reply)
                if fields:
                    yield route, api, minute, fields

    def _names(self, key: str, reply: Any) -> list[Any]:
        """The values of a names hash; none, logged, for a key that is not a hash."""
        if isinstance(reply, BaseException):
            if is_transient(reply):
                raise reply
            self._wrong_type(key, reply_code(reply), "read")
            return []
        return list(reply.values())

    def _bucket_fields(self, key: str, reply: Any) -> Fields | None:
        """One bucket's counters; None, logged, for a key that is not a readable counter hash."""
        if isinstance(reply, BaseException):
            if is_transient(reply):
                raise reply
            self._wrong_type(key, reply_code(reply), "read")
            return None
        try:
            return parse_stored_fields(reply)
        except (ValueError, UnicodeDecodeError) as exc:
            self._not_counters(key, exc, "read")
            return None

    async def tenants(self) -> list[str]:
        try:
            names = await self.client.hvals(self.keys.tenants())
        except redis.exceptions.ResponseError as exc:
            if is_transient(exc):
                raise
            self._wrong_type(self.keys.tenants(), reply_code(exc), "read")
            return []
        return sorted(n.decode("utf-8", "surrogateescape") for n in names)

    async def get_blob(self, tenant: str, family: str) -> bytes | None:
        key = self.keys.fingerprints(tenant, family)
        try:
            return await self.client.get(key)
        except redis.exceptions.ResponseError as exc:
            if is_transient(exc):
                raise
            self._problem(
                key,
                "telemetry: key %s is not a string blob, so it is not read: %s",
                reply_code(exc),
            )
            return None

    async def write_advice(self, advice: Advice) -> None:
        """Add the cache advisor's counter deltas: one script per (tenant, family, bucket), in
        one pipeline. Raises on transient failures (the writer keeps the deltas and retries:
        these counters are advisory, so a retry after a lost reply may count twice)."""
        if not advice:
            return
        retention = min(self.retention_s, ADVICE_RETENTION_S)
        pipe = self.client.pipeline(transaction=False)
        named: list[str] = []
        for (tenant, family, bucket), fields in advice.items():
            key = self.keys.advice(tenant, family, bucket)
            args: list[Any] = [
                (bucket + 1) * ADVICE_BUCKET_S + retention,
                family,
                bucket,
                ADVICE_FAMILIES_PER_TENANT,
                retention + ADVICE_BUCKET_S,
            ]
            for pair in fields.items():
                args.extend(pair)
            pipe.eval(_ADD_ADVICE, 2, key, self.keys.advice_families(tenant), *args)
            named.append(key)
        replies = await pipe.execute(raise_on_error=False)
        retry: BaseException | None = None
        for key, reply in zip(named, replies, strict=False):
            if isinstance(reply, BaseException):
                if is_transient(reply):
                    retry = retry or reply
                else:
                    self._problem(key, "telemetry: writing advice %s failed: %s", _text(reply))
            elif reply:
                self._wrong_type(key, reply, "written")
        if retry is not None:
            raise retry

    async def read_advice(
        self, tenant: str, first_bucket: int, last_bucket: int
    ) -> dict[str, dict[str, int]]:
        """Per prefix family (the newest `ADVICE_FAMILIES_PER_TENANT`), a tenant's advisor
        counters summed over buckets in the range, from every gateway process."""
        index = self.keys.advice_families(tenant)
        try:
            raw = await self.client.zrevrange(index, 0, ADVICE_FAMILIES_PER_TENANT - 1)
        except redis.exceptions.ResponseError as exc:
            if is_transient(exc):
                raise
            self._wrong_type(index, reply_code(exc), "read")
            return {}
        families = [_text(name) for name in raw]
        targets = [
            (family, bucket)
            for family in families
            for bucket in range(first_bucket, last_bucket + 1)
        ]
        out: dict[str, dict[str, int]] = {}
        for start in range(0, len(targets), _READ_CHUNK):
            chunk = targets[start : start + _READ_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for family, bucket in chunk:
                pipe.hgetall(self.keys.advice(tenant, family, bucket))
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            for (family, bucket), reply in zip(chunk, replies, strict=False):
                if isinstance(reply, BaseException):
                    if is_transient(reply):
                        raise reply
                    self._wrong_type(self.keys.advice(tenant, family, bucket), reply, "read")
                    continue
                for name, amount in reply.items():
                    try:
                        value = int(amount)
                    except ValueError:
                        continue
                    summed = out.setdefault(family, {})
                    field = _text(name)
                    summed[field] = summed.get(field, 0) + value
        return out

    async def ping(self) -> None:
        await self.client.ping()

    def is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    async def aclose(self) -> None:
        await self.client.aclose()

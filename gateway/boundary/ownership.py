"""Tenant-owned objects: in tenant mode every object created through the gateway belongs to the
tenant that created it, and no other tenant can reach it.

All tenants share the route's upstream account, so the upstream itself cannot tell them apart.
The gateway records `(tenant, object id) -> route` when a create succeeds (a POST to an object
collection, a streamed `response.created` event, the file an upload completes into, the output
files of a batch or fine-tuning job the tenant reads) and checks the record before any request
reaches the upstream:

- a path naming another tenant's id (`/v1/files/{id}`, `/v1/threads/{id}/runs`, ...) is a 404;
- a body referencing ids by key name (`file_id`, `input_file_id`, `previous_response_id`,
  `vector_store_ids`, ... anywhere in the JSON, bounded walk) must reference owned ids only;
- a list (`GET /v1/files`) shows only the tenant's own objects: a page may hold fewer items
  than `limit`, even none while `has_more` is true;
- a successful `DELETE /v1/{collection}/{id}` removes the record.

Records live in the telemetry store: Redis when configured (one small string per object under
`<prefix>:obj:{t=<tenant>}:<id>`, so a tenant's records share a Redis Cluster slot), otherwise in
this process, bounded per tenant. If the store cannot be reached, object requests fail closed
with a 503; chat is unaffected. In open mode (no tenant keys) nothing is recorded or checked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gateway.errors import GatewayError
from gateway.paths import PassPath
from gateway.telemetry.keys import escape_name

if TYPE_CHECKING:
    from gateway.boundary.offload import HeavyWork

log = logging.getLogger("firsttoken.ownership")

# Body keys whose string values (or lists of strings) name objects, on every door (Anthropic's
# `file` sources and `container` too). `conversation` and `container` may also be {"id": ...}.
# Keys under `metadata` are the client's own names and are not read.
REFERENCE_KEYS = frozenset(
    {
        "assistant_id",
        "batch_id",
        "container",
        "container_id",
        "conversation",
        "conversation_id",
        "file_id",
        "file_ids",
        "input_file_id",
        "part_ids",
        "previous_response_id",
        "response_id",
        "thread_id",
        "training_file",
        "upload_id",
        "validation_file",
        "vector_store_id",
        "vector_store_ids",
        "eval_id",
        "video_id",
        "remix_video_id",
    }
)
# Ids an owned object's answer hands to its owner: a batch's or fine-tuning job's output files,
# the thread that `POST /v1/threads/runs` created.
ADOPT_KEYS = ("output_file_id", "error_file_id", "result_files", "thread_id")
# Creates under an owned object whose new ids are used by name later (`part_ids`, remix).
CREATING_ACTIONS = frozenset({("uploads", "parts"), ("videos", "remix")})
# Action paths whose POST creates a top-level object (`/v1/threads/runs` makes a thread and a
# run; the thread arrives as `thread_id` and is adopted).
COLLECTION_CREATES = frozenset({("threads", "runs")})
SKIPPED_KEYS = frozenset({"metadata"})
# Reference keys whose value may be an object holding the id (`{"id": ...}`): a Responses
# `conversation`, an Anthropic `container` (with its `skills`).
ID_OBJECT_KEYS = frozenset({"conversation", "container"})
# Stored responses expire upstream after 30 days; their records follow.
TTL_S = {"responses": 30 * 86400}

MAX_ID_CHARS = 256
MAX_WALK_VALUES = 200_000
MAX_REFERENCES = 1024
STORE_TIMEOUT_S = 2.0
MEMORY_MAX_OBJECTS = 100_000  # per tenant, in-process store only
MEMORY_MAX_BYTES = 16 * 1024 * 1024  # per tenant, in-process store only


def might_reference(raw: bytes) -> bool:
    """Cheap pre-check on a raw JSON body: False means it cannot reference an object by id.

    Every reference key contains `_id`, `_file`, `container` or `conversation`, and a key spelt
    with `\\u` escapes may hide any of them, so one pass of substring searches suffices."""
    return (
        b"_id" in raw
        or b"_file" in raw
        or b"container" in raw
        or b"conversation" in raw
        or b"\\u" in raw
    )


def not_found(object_id: str | None = None) -> GatewayError:
    what = f"No such object: '{object_id[:MAX_ID_CHARS]}'." if object_id else "No such object."
    return GatewayError(404, what, code="object_not_found")


def find_references(body: Any) -> list[str]:
    """Every id the body names under a reference key, in a walk bounded by MAX_WALK_VALUES."""
    found: list[str] = []
    if not isinstance(body, (dict, list)):
        return found
    stack = [body]
    budget = MAX_WALK_VALUES
    while stack:
        node = stack.pop()
        budget -= len(node)
        if budget < 0:
            raise GatewayError(
                400, "The request body has too many JSON values to check.", code="body_too_complex"
            )
        if isinstance(node, dict):
            for key, value in node.items():
                if key in REFERENCE_KEYS:
                    _collect(value, found, key in ID_OBJECT_KEYS)
                if isinstance(value, (dict, list)) and key not in SKIPPED_KEYS:
                    stack.append(value)
        else:
            stack.extend(v for v in node if isinstance(v, (dict, list)))
        if len(found) > MAX_REFERENCES:
            raise GatewayError(
                400,
                f"The request body references more than {MAX_REFERENCES} objects.",
                code="too_many_references",
            )
    return found


def _collect(value: Any, found: list[str], dict_with_id: bool) -> None:
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, list):
        found.extend(v for v in value if isinstance(v, str))
    elif dict_with_id and isinstance(value, dict) and isinstance(value.get("id"), str):
        found.append(value["id"])


def adoptable(payload: dict) -> list[str]:
    """Ids an owned object's answer makes its owner's (see ADOPT_KEYS)."""
    ids: list[str] = []
    for key in ADOPT_KEYS:
        _collect(payload.get(key), ids, False)
    file = payload.get("file")
    if payload.get("object") == "upload" and isinstance(file, dict):
        _collect(file.get("id"), ids, False)
    return ids


class Records(Protocol):
    async def get(self, tenant: str, ids: list[str]) -> list[str | None]:
        """The route recorded for each id of this tenant, None where it holds no record."""

    async def put(self, tenant: str, ids: Iterable[str], route: str, ttl_s: int | None) -> None: ...

    async def delete(self, tenant: str, object_id: str) -> None: ...


class MemoryRecords:
    """One process's records, oldest evicted first past a per-tenant count or byte bound (an
    evicted object becomes unreachable through the gateway: the safe side)."""

    def __init__(
        self, max_objects: int = MEMORY_MAX_OBJECTS, max_bytes: int = MEMORY_MAX_BYTES
    ) -> None:
        self.max_objects = max_objects
        self.max_bytes = max_bytes
        self._tenants: dict[str, OrderedDict[str, tuple[str, float]]] = {}
        self._bytes: dict[str, int] = {}

    async def get(self, tenant: str, ids: list[str]) -> list[str | None]:
        records: Mapping[str, tuple[str, float]] = self._tenants.get(tenant, {})
        now = time.time()
        out: list[str | None] = []
        for object_id in ids:
            entry = records.get(object_id)
            out.append(entry[0] if entry is not None and entry[1] > now else None)
        return out

    async def put(self, tenant: str, ids: Iterable[str], route: str, ttl_s: int | None) -> None:
        records = self._tenants.setdefault(tenant, OrderedDict())
        expires = time.time() + ttl_s if ttl_s else float("inf")
        size = self._bytes.get(tenant, 0)
        for object_id in ids:
            if object_id in records:
                records.move_to_end(object_id)
            else:
                size += len(object_id) + len(route) + 64
            records[object_id] = (route, expires)
        evicted = 0
        while records and (len(records) > self.max_objects or size > self.max_bytes):
            old_id, (old_route, _) = records.popitem(last=False)
            size -= len(old_id) + len(old_route) + 64
            evicted += 1
        if evicted:
            log.warning(
                "tenant %r holds more objects than the in-process store keeps; the %d "
                "oldest records were dropped (use Redis to keep them all)",
                tenant,
                evicted,
            )
        self._bytes[tenant] = size

    async def delete(self, tenant: str, object_id: str) -> None:
        records = self._tenants.get(tenant)
        entry = records.pop(object_id, None) if records is not None else None
        if entry is not None:
            self._bytes[tenant] -= len(object_id) + len(entry[0]) + 64


class RedisRecords:
    """Records in Redis: one string per object, keyed under the tenant's hash tag."""

    def __init__(self, client: Any, prefix: str) -> None:
        import redis.exceptions  # only with a Redis store (its client imported it already)

        self.client = client
        self.prefix = prefix
        self.unavailable = (redis.exceptions.RedisError, OSError, asyncio.TimeoutError)

    def key(self, tenant: str, object_id: str) -> str:
        return f"{self.prefix}:obj:{{t={escape_name(tenant)}}}:{escape_name(object_id)}"

    async def get(self, tenant: str, ids: list[str]) -> list[str | None]:
        if not ids:
            return []
        values = await self.client.mget([self.key(tenant, i) for i in ids])
        return [v.decode("utf-8", "replace") if v is not None else None for v in values]

    async def put(self, tenant: str, ids: Iterable[str], route: str, ttl_s: int | None) -> None:
        pipe = self.client.pipeline(transaction=False)
        for object_id in ids:
            pipe.set(self.key(tenant, object_id), route, ex=ttl_s)
        await pipe.execute()

    async def delete(self, tenant: str, object_id: str) -> None:
        await self.client.delete(self.key(tenant, object_id))


class Ownership:
    """Checks and records which tenant owns which object; `enabled` only in tenant mode."""

    def __init__(self, records: Records | None) -> None:
        self.records = records
        self.enabled = records is not None

    @classmethod
    def create(cls, store: Any, enabled: bool) -> Ownership:
        """Over the telemetry store's Redis client when it has one, else in process."""
        if not enabled:
            return cls(None)
        client, keys = getattr(store, "client", None), getattr(store, "keys", None)
        if client is not None and keys is not None:
            return cls(RedisRecords(client, keys.prefix))
        return cls(MemoryRecords())

    async def _call(self, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, STORE_TIMEOUT_S)
        except getattr(self.records, "unavailable", (OSError, asyncio.TimeoutError)) as exc:
            log.warning("object ownership store unavailable: %s", type(exc).__name__)
            raise GatewayError(
                503,
                "The object ownership store is unavailable; try again shortly.",
                code="ownership_store_unavailable",
            ) from None

    async def routes_of(self, tenant: str, ids: list[str]) -> list[str]:
        """The recorded route of each id, or a 404 naming the first id the tenant does not own."""
        records = self.records  # None exactly when not `enabled`
        if records is None or not ids:
            return []
        for object_id in ids:
            if not object_id or len(object_id) > MAX_ID_CHARS:
                raise not_found(object_id)
        routes = await self._call(records.get(tenant, ids))
        for object_id, route in zip(ids, routes, strict=False):
            if route is None:
                raise not_found(object_id)
        return routes

    async def check_references(
        self, tenant: str, raw: bytes, body: Any, heavy_work: HeavyWork | None = None
    ) -> None:
        """Raise a 404 GatewayError if `body` (parsed from `raw`) references an object `tenant`
        does not own; a store that cannot be reached is a 503.

        Cheap on the chat hot path: nothing in open mode, one substring pass over `raw` when
        no reference key occurs in it; else a bounded walk of the body (on `heavy_work`'s
        pool when given, for a big body) and one store round trip when it found ids."""
        if not self.enabled or not might_reference(raw):
            return
        ids = (
            await heavy_work.run(tenant, find_references, body)
            if heavy_work is not None
            else find_references(body)
        )
        await self.routes_of(tenant, ids)

    async def check_request(
        self, tenant: str, path: PassPath, method: str, body: Any
    ) -> str | None:
        """Before a passthrough request: the path's object, the body's and the query's
        references must be the tenant's own (else 404). Returns the route they were created
        through, if any, so that a read goes to the account that holds the object."""
        if not self.enabled:
            return None
        if _tenant_blocked(path, method):
            raise GatewayError(
                404, f"{method} {path.display()} is not available to tenants.", code="unknown_url"
            )
        ids = [path.object_id] if path.object_id is not None else []
        ids.extend(v for k, v in path.query if k in REFERENCE_KEYS)
        if isinstance(body, (dict, list)):
            ids.extend(find_references(body))
        routes = await self.routes_of(tenant, ids)
        return routes[0] if routes else None

    async def after_response(
        self, tenant: str, path: PassPath, method: str, route: str, payload: Any
    ) -> Any:
        """After a 2xx JSON answer: record what a create made, adopt the output files of owned
        objects, forget a deleted object, and filter a collection's list. Returns the payload
        the client gets."""
        records = self.records  # None exactly when not `enabled`
        if records is None or path.collection is None or not isinstance(payload, dict):
            return payload
        deleted_id = path.object_id if path.is_object else None  # set exactly when `is_object`
        if method == "DELETE" and deleted_id is not None:
            if payload.get("deleted") is False:
                return payload
            await self._call(records.delete(tenant, deleted_id))
            return payload
        if method == "GET" and path.is_collection and isinstance(payload.get("data"), list):
            return await self._filter_list(records, tenant, payload, route)
        ids = adoptable(payload)
        if method == "POST" and isinstance(payload.get("id"), str) and self._creates(path):
            ids.append(payload["id"])
        await self.record(tenant, path.family, route, ids)
        return payload

    async def record(self, tenant: str, family: str, route: str, ids: list[str]) -> None:
        ids = [i for i in ids if i and len(i) <= MAX_ID_CHARS]
        if self.records is not None and ids:
            await self._call(self.records.put(tenant, ids, route, TTL_S.get(family)))

    @staticmethod
    def _creates(path: PassPath) -> bool:
        prefix = path.collection or ()
        return (
            path.is_collection
            or path.segments in COLLECTION_CREATES
            or (
                len(path.segments) == len(prefix) + 2
                and (path.family, path.segments[-1]) in CREATING_ACTIONS
            )
        )

    async def _filter_list(self, records: Records, tenant: str, payload: dict, route: str) -> dict:
        items = payload["data"]
        ids = [item.get("id") if isinstance(item, dict) else None for item in items]
        wanted = [i for i in ids if isinstance(i, str) and 0 < len(i) <= MAX_ID_CHARS]
        owned = set()
        if wanted:
            routes = await self._call(records.get(tenant, wanted))
            owned = {i for i, r in zip(wanted, routes, strict=False) if r is not None}
        kept = [item for item, i in zip(items, ids, strict=False) if i in owned]
        adopt = [i for item in kept for i in adoptable(item)]
        if adopt:
            await self.record(tenant, "", route, adopt)
        out = {**payload, "data": kept}
        for key, index in (("first_id", 0), ("last_id", -1)):
            if key in out:
                out[key] = kept[index]["id"] if kept else None
        return out


def _tenant_blocked(path: PassPath, method: str) -> bool:
    """Account-wide writes no tenant owns: deleting a (fine-tuned) model, and the permissions
    of fine-tuned checkpoints."""
    if path.family == "models":
        return method != "GET"
    return path.family == "fine_tuning" and path.segments[1:2] == ("checkpoints",)

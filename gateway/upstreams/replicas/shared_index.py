"""Several gateway processes agree on where prefixes live, through Redis Pub/Sub.

Each process keeps its own prefix index per replica (the balancer reads it on every request,
so it must be local). What one process sends where is published, batched every
`FLUSH_INTERVAL_S`, on one channel per key prefix; every process applies the others'
placements to its own indexes. Nothing waits on Redis on the request path, and a Redis outage
only makes the processes disagree until it is back (each still routes on what it saw itself).
New prefixes need no message to agree: the balancer places them by a rendezvous hash.

Messages come from a shared service and are parsed defensively: bounded in size, names checked
against the configured routes and replicas, block hashes checked for their length.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.upstreams.replicas.prefix_index import DIGEST_BYTES

if TYPE_CHECKING:
    from gateway.upstreams.replicas.balancer import ReplicaState

log = logging.getLogger("firsttoken.replicas")

FLUSH_INTERVAL_S = 0.05
MAX_PENDING = 2048  # placements waiting for the next flush; past it new ones are dropped
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_BLOCKS = 4096  # per placement (1 MiB of prompt at 256 characters a block)
DIGEST_HEX = 2 * DIGEST_BYTES
RECONNECT_S = 1.0


class Placed(Protocol):
    """A server whose prefix index learns the other processes' placements (a pool `Member`)."""

    @property
    def state(self) -> ReplicaState: ...


class PlacingFleet(Protocol):
    """A route with several servers, as shared placements see it (a replicated route or a pd
    route): its servers by the names placements carry, and where it reports its own. Defined
    here, not next to the routes, because the routes' modules build on this one."""

    placements: SharedPlacements | None

    @property
    def members(self) -> Mapping[str, Placed]: ...


class SharedPlacements:
    """Publishes this process's placements and applies the others'."""

    def __init__(self, client: Any, key_prefix: str, fleets: Mapping[str, PlacingFleet]):
        self.client = client
        self.channel = f"{key_prefix}:affinity"
        self.fleets = fleets
        self.origin = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._pending: list[list[Any]] = []
        self._tasks: list[asyncio.Task] = []
        self.applied = 0
        self.dropped = 0

    def start(self) -> None:
        for fleet in self.fleets.values():
            fleet.placements = self
        self._tasks = [
            asyncio.ensure_future(self._flush_loop()),
            asyncio.ensure_future(self._listen_loop()),
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.client.aclose()

    def placed(self, route: str, replica: str, blocks: list[bytes]) -> None:
        """Called by a fleet when it sent a request: O(1), no I/O."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append([route, replica, b"".join(blocks[:MAX_BLOCKS]).hex()])

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            if not self._pending:
                continue
            batch, self._pending = self._pending, []
            message = orjson.dumps({"o": self.origin, "p": batch})
            try:
                await self.client.publish(self.channel, message)
            except Exception as exc:  # noqa: BLE001  # a Redis outage costs agreement, not requests
                log.debug("publishing placements failed: %s", type(exc).__name__)

    async def _listen_loop(self) -> None:
        while True:
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.channel)
                async for message in pubsub.listen():
                    data = message.get("data") if isinstance(message, dict) else None
                    if isinstance(data, bytes):
                        self.apply(data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # resubscribe after an outage
                log.debug("placement subscription failed: %s", type(exc).__name__)
                await asyncio.sleep(RECONNECT_S)

    def apply(self, data: bytes) -> int:
        """Apply another process's placements; returns how many were applied."""
        if len(data) > MAX_MESSAGE_BYTES:
            return 0
        try:
            message = orjson.loads(data)
        except orjson.JSONDecodeError:
            return 0
        if not isinstance(message, dict) or message.get("o") == self.origin:
            return 0
        batch = message.get("p")
        applied = 0
        for item in batch if isinstance(batch, list) else ():
            if not (isinstance(item, list) and len(item) == 3):
                continue
            route, replica, hexed = item
            fleet = self.fleets.get(route) if isinstance(route, str) else None
            member = fleet.members.get(replica) if fleet and isinstance(replica, str) else None
            if member is None or not isinstance(hexed, str) or len(hexed) % DIGEST_HEX:
                continue
            try:
                raw = bytes.fromhex(hexed)
            except ValueError:
                continue
            size = DIGEST_BYTES
            blocks = [raw[i : i + size] for i in range(0, min(len(raw), MAX_BLOCKS * size), size)]
            member.state.index.add(blocks)
            applied += 1
        self.applied += applied
        return applied

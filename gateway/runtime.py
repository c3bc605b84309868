"""The running gateway's parts, built once from `Settings`, and their life: start, ready, close.

Construction lives here and nowhere on the request path: the app hands each door the parts it
uses (`Admission`, `ChatPipeline`, `Preparation`, ...), never this object.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
from typing import TYPE_CHECKING

from gateway.boundary.admit import Admission
from gateway.boundary.auth import KeyRing
from gateway.boundary.offload import HeavyWork
from gateway.boundary.ownership import Ownership
from gateway.config.routes import OPENAI_BODY_KINDS, Route, RouteTable
from gateway.config.settings import Settings
from gateway.doors.passthrough import Passthrough
from gateway.pipeline.big_bodies import BigBodyWorkers, dumps_settings, worker_init
from gateway.pipeline.chat import ChatPipeline
from gateway.pipeline.policies import PolicyRunner
from gateway.pipeline.prepare import Preparation
from gateway.pipeline.proxy import Proxy
from gateway.upstreams.pd.metrics import PDCollector
from gateway.upstreams.pd.router import PDUpstream
from gateway.upstreams.registry import Upstreams
from gateway.upstreams.replicas.fleet import ReplicatedUpstream
from gateway.upstreams.replicas.metrics import FleetCollector
from gateway.upstreams.replicas.shared_index import SharedPlacements
from policies.tokens import warm_up as warm_up_tokens

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry

log = logging.getLogger("firsttoken")


def engine_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def embedded_default_routes(settings: Settings) -> list[Route]:
    """With no route and no provider key, the bundled engine serves every model name."""
    if not engine_installed():
        return []
    return [
        Route(
            name="local",
            models=("*",),
            kind="local",
            model_path=settings.engine_model,
            demo=not settings.engine_model,
        )
    ]


class Runtime:
    """Every component of one gateway process, from `settings` alone (nothing here reads the
    environment)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = KeyRing(settings.tenant_keys, settings.admin_keys)
        table = RouteTable(settings.routes or embedded_default_routes(settings))
        self.upstreams = Upstreams(table, settings)
        self.policies = PolicyRunner(settings, table.routes)
        self.telemetry = _telemetry(settings)
        self.fleets: dict[str, ReplicatedUpstream | PDUpstream] = {
            name: upstream
            for name, upstream in self.upstreams.by_route.items()
            if isinstance(upstream, ReplicatedUpstream | PDUpstream)
        }
        if self.fleets and self.telemetry.enabled:
            registry = self.telemetry.metrics.registry
            registry.register(FleetCollector(self.fleets))
            routers = {n: u for n, u in self.fleets.items() if isinstance(u, PDUpstream)}
            if routers:
                registry.register(PDCollector(routers))
        self.objects = Ownership.create(self.telemetry.store, enabled=not self.keys.open)
        self.offload = HeavyWork(
            settings.policy_thread_min_bytes,
            process_min_bytes=settings.big_body_bytes,
            process_workers=(
                settings.big_body_workers
                if any(r.kind in OPENAI_BODY_KINDS for r in table.routes)
                else 0
            ),
            process_init=(
                worker_init,
                (
                    dumps_settings(settings),
                    [r.model_dump(mode="json") for r in table.routes],
                    os.getpid(),
                ),
            ),
        )
        self.placements = _shared_placements(settings, self.fleets)
        big_bodies = BigBodyWorkers(
            self.offload,
            find_references=self.objects.enabled,
            fingerprints=self.telemetry.enabled,
        )
        self.admission = Admission(settings, self.keys, self.upstreams, big_bodies)
        self.preparation = Preparation(self.policies, self.offload, self.telemetry)
        self.pipeline = ChatPipeline(
            self.preparation,
            Proxy(settings, self.upstreams.by_route),
            self.objects,
            self.telemetry,
            settings.max_messages,
        )
        self.passthrough = Passthrough(settings, self.objects, self.upstreams, self.telemetry)
        self.started_at = 0.0  # Unix time of start(): the `created` of configured model names
        self._started: list[asyncio.Task] = []
        self._warmups: list[asyncio.Task] = []
        self._processes_started: asyncio.Future | None = None

    # lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.started_at = time.time()
        await self.telemetry.start()
        self._warmups.append(asyncio.ensure_future(asyncio.to_thread(warm_up_tokens)))
        self._started = self.upstreams.start()
        self._processes_started = asyncio.ensure_future(self._start_processes())
        if self.placements is not None:
            self.placements.start()

    async def _start_processes(self) -> None:
        """The big-body workers start once the gateway is ready, so that their start does not
        delay readiness; they are not a condition of it (a big body that comes first waits)."""
        await asyncio.gather(*self._started, *self._warmups, return_exceptions=True)
        await self.offload.start_processes()

    def ready(self) -> bool:
        tasks = [*self._started, *self._warmups]
        return (
            bool(self.upstreams)
            and bool(tasks)
            and all(t.done() and not t.cancelled() and t.exception() is None for t in tasks)
        )

    def fleet_states(self) -> dict[str, dict]:
        """Each replicated route's replicas: state, load, ejections, affinity hits, hedges."""
        return {name: fleet.snapshot() for name, fleet in self.fleets.items()}

    def replica_health(self) -> dict[str, dict[str, str]]:
        """Each replica's state alone (`healthy`, `ejected`), for unauthenticated `/readyz`:
        nothing there says how much traffic anyone sends."""
        return {
            name: {r["name"]: r["state"] for r in fleet.snapshot()["replicas"]}
            for name, fleet in self.fleets.items()
        }

    async def aclose(self) -> None:
        for task in self._warmups:
            task.cancel()
        if self._processes_started is not None:
            self._processes_started.cancel()
        await self.upstreams.aclose()
        await self.telemetry.aclose()
        await self.offload.aclose()
        if self.placements is not None:
            await self.placements.aclose()


def _telemetry(settings: Settings) -> Telemetry:
    from gateway.telemetry import Telemetry

    redis_url = settings.effective_redis_url()
    if redis_url and settings.telemetry:
        from gateway.telemetry.redis_check import check_redis_url

        check_redis_url(redis_url, settings.redis_url_variable(), cluster=settings.redis_cluster)
    return Telemetry.from_settings(settings, redis_url)


def _shared_placements(
    settings: Settings, fleets: dict[str, ReplicatedUpstream | PDUpstream]
) -> SharedPlacements | None:
    """With Redis (and not a cluster: Pub/Sub is per node there), replicated routes' prefix
    indexes are shared with the other gateway processes; without it each keeps its own."""
    redis_url = settings.effective_redis_url()
    if not fleets or not redis_url or settings.redis_cluster:
        return None
    from gateway.telemetry.redis_store import connect

    return SharedPlacements(connect(redis_url, timeout_s=5.0), settings.metrics_key_prefix, fleets)

"""The running gateway: routes, upstreams, keys, policies and telemetry, built once from
settings."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.types import ASGIApp

from gateway.boundary.auth import KeyRing
from gateway.boundary.body import parse_request, read_body
from gateway.boundary.offload import HeavyWork
from gateway.boundary.ownership import Ownership
from gateway.boundary.request_id import next_request_id
from gateway.config.routes import Route, RouteTable
from gateway.config.settings import Settings
from gateway.errors import GatewayError
from gateway.pipeline.big_bodies import Prepared, Refused, dumps_settings, prepare, worker_init
from gateway.pipeline.policies import (
    POLICY_HEADER,
    PolicyRunner,
    prepared_report_headers,
    report_headers,
)
from gateway.pipeline.prepared import EncodedBodies, PolicyBodies, PreparedRequest, RouteBodies
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.stream_relay import StreamRelay
from gateway.telemetry.record import RequestTiming
from gateway.upstreams.base import EncodedBody, Upstream
from gateway.upstreams.build import build_upstream
from gateway.upstreams.pd.metrics import PDCollector
from gateway.upstreams.pd.router import PDUpstream
from gateway.upstreams.replicas.fleet import ReplicatedUpstream
from gateway.upstreams.replicas.metrics import FleetCollector
from gateway.upstreams.replicas.shared_index import SharedPlacements
from policies.chain import PolicyResult
from policies.tokens import warm_up as warm_up_tokens

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry

log = logging.getLogger("firsttoken")

NO_ROUTE_HELP = (
    "No route is configured. Set OPENAI_API_KEY, ANTHROPIC_API_KEY or DEEPSEEK_API_KEY, or "
    "FIRSTTOKEN_ROUTES (a JSON list of routes), or install the local engine "
    "(pip install 'firsttoken[engine]') to serve a local model."
)


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


class Gateway:
    def __init__(self, settings: Settings) -> None:
        """Everything comes from `settings` (see `load_settings`); nothing reads the environment."""
        self.settings = settings
        self.keys = KeyRing(settings.tenant_keys, settings.admin_keys)
        table = RouteTable(settings.routes or embedded_default_routes(settings))
        self.table = table
        self.upstreams: dict[str, Upstream] = {
            r.name: build_upstream(r, settings) for r in table.routes
        }
        self.proxy = Proxy(settings, self.upstreams)
        self.policies = PolicyRunner(settings, table.routes)
        self.telemetry = self._telemetry(settings)
        self.fleets: dict[str, ReplicatedUpstream | PDUpstream] = {
            name: upstream
            for name, upstream in self.upstreams.items()
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
            process_workers=settings.big_body_workers if table.first_of_kind("openai") else 0,
            process_init=(
                worker_init,
                (dumps_settings(settings), [r.model_dump(mode="json") for r in table.routes]),
            ),
        )
        self.placements = self._shared_placements(settings)
        self._started: dict[str, asyncio.Task] = {}
        self._warmups: list[asyncio.Task] = []
        self._processes_started: asyncio.Future | None = None

    def _shared_placements(self, settings: Settings) -> SharedPlacements | None:
        """With Redis (and not a cluster: Pub/Sub is per node there), replicated routes' prefix
        indexes are shared with the other gateway processes; without it each keeps its own."""
        redis_url = settings.effective_redis_url()
        if not self.fleets or not redis_url or settings.redis_cluster:
            return None
        from gateway.telemetry.redis_store import connect

        return SharedPlacements(
            connect(redis_url, timeout_s=5.0), settings.metrics_key_prefix, self.fleets
        )

    @staticmethod
    def _telemetry(settings: Settings):
        from gateway.telemetry import Telemetry

        redis_url = settings.effective_redis_url()
        if redis_url and settings.telemetry:
            from gateway.telemetry.redis_check import check_redis_url

            check_redis_url(
                redis_url, settings.redis_url_variable(), cluster=settings.redis_cluster
            )
        return Telemetry.from_settings(settings, redis_url)

    # lifecycle -----------------------------------------------------------------------------

    started_at: float = 0.0  # Unix time of start(): the `created` of configured model names

    async def start(self) -> None:
        self.started_at = time.time()
        await self.telemetry.start()
        self._warmups.append(asyncio.ensure_future(asyncio.to_thread(warm_up_tokens)))
        self._processes_started = asyncio.ensure_future(self._start_processes())
        if self.placements is not None:
            self.placements.start()
        for name, upstream in self.upstreams.items():
            self._started[name] = asyncio.ensure_future(self._start_upstream(upstream))

    async def _start_processes(self) -> None:
        """The big-body workers start once the gateway is ready, so that their start does not
        delay readiness; they are not a condition of it (a big body that comes first waits)."""
        await asyncio.gather(*self._started.values(), *self._warmups, return_exceptions=True)
        await self.offload.start_processes()

    async def _start_upstream(self, upstream: Upstream) -> None:
        """Start one route; a failure is logged here (for the operator) and kept on the task,
        which `/readyz` reports and requests for the route answer with a 503."""
        name = upstream.route.name
        try:
            await upstream.start()
        except Exception as exc:
            log.error("route %s failed to start: %s: %s", name, type(exc).__name__, exc)
            raise
        try:
            await upstream.warm_up()
        except Exception as exc:  # noqa: BLE001  # a cold route is slower, not down
            log.warning("warm-up of route %s failed: %s", name, type(exc).__name__)

    async def upstream_ready(self, name: str) -> None:
        task = self._started.get(name)
        if task is None:
            return
        try:
            await asyncio.shield(task)  # a client that leaves must not cancel the start-up
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  # whatever broke the start-up, the route is down
            raise GatewayError(
                503, f"route {name!r} failed to start ({type(exc).__name__})"
            ) from None

    async def _usable(self, route: Route) -> bool:
        """A fallback that failed to start is skipped rather than failing the request."""
        try:
            await self.upstream_ready(route.name)
        except GatewayError:
            return False
        return True

    def route_states(self) -> dict[str, str]:
        states = {}
        for name, task in self._started.items():
            if not task.done():
                states[name] = "starting"
            elif task.cancelled() or task.exception() is not None:
                reason = "cancelled" if task.cancelled() else type(task.exception()).__name__
                states[name] = f"failed: {reason}"
            else:
                states[name] = "ready"
        return states

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

    def ready(self) -> bool:
        tasks = [*self._started.values(), *self._warmups]
        return (
            bool(self.upstreams)
            and bool(tasks)
            and all(t.done() and not t.cancelled() and t.exception() is None for t in tasks)
        )

    async def aclose(self) -> None:
        for task in [*self._started.values(), *self._warmups]:
            task.cancel()
        if self._processes_started is not None:
            self._processes_started.cancel()
        await asyncio.gather(*(u.aclose() for u in self.upstreams.values()), return_exceptions=True)
        await self.telemetry.aclose()
        await self.offload.aclose()
        if self.placements is not None:
            await self.placements.aclose()

    # requests ------------------------------------------------------------------------------

    async def handle(
        self,
        request: Request,
        endpoint: str,
        *,
        raw: bytes | None = None,
        api: str | None = None,
        arrival: float | None = None,
    ) -> ASGIApp:
        """The answer to one chat or completions request: a whole response, or a stream relay
        that starts the upstream request when the server runs it.

        A door of another API (`responses`, `messages`) that translated its request to chat
        passes the chat body as `raw`, its own name as `api` and the time its request came."""
        if arrival is None:
            arrival = time.perf_counter()
        wall_arrival = time.time()
        request_id = next_request_id()
        try:
            tenant = self.keys.tenant_for(request)
            settings = self.settings
            if raw is None:
                raw = await read_body(request, settings.max_body_bytes)
            big = (
                await self._prepare_big(request, endpoint, tenant, raw)
                if self.offload.is_big(len(raw))
                else None
            )
            if big is not None:
                model, body, stream = big.model, None, big.stream
            else:
                body, model = parse_request(raw, endpoint, settings)
                stream = bool(body.get("stream"))
            chain = await self.chain_for(model)
            timing = RequestTiming(
                tenant=tenant,
                model=model,
                stream=stream,
                arrival=arrival,
                wall_arrival=wall_arrival,
                api=api or endpoint,
            )
            call = Call(request, request_id, endpoint, timing, chain)
            if big is not None:
                if self.objects.enabled:  # a `file` part names an upload
                    await self.objects.routes_of(tenant, big.references)
                plan = self._prepare_encoded(call, big)
            else:
                assert body is not None
                heavy = self.offload.is_heavy(len(raw))
                await self.objects.check_references(
                    tenant, raw, body, self.offload if heavy else None
                )
                plan = await self._prepare(call, body, heavy)
        except GatewayError as exc:
            return exc.to_response(request_id)
        if stream:
            return StreamRelay(self.proxy, plan, timing)
        return await self.proxy.complete(plan, timing, request.receive)

    async def chain_for(self, model: str) -> list[Route]:
        """The route serving `model` and its fallbacks that started; 404 when none serves it."""
        route = self.table.match(model)
        if route is None:
            if not self.table.routes:
                raise GatewayError(503, NO_ROUTE_HELP, code="no_route_configured")
            raise GatewayError(
                404,
                f"The model '{model}' is not served by any route.",
                param="model",
                code="model_not_found",
            )
        await self.upstream_ready(route.name)
        return [route, *[r for r in self.table.chain(route)[1:] if await self._usable(r)]]

    async def _prepare_big(
        self, request: Request, endpoint: str, tenant: str, raw: bytes
    ) -> Prepared | None:
        """A big body's parse, checks and policies, done by a worker process; None when its
        routes need it parsed here (see `gateway.pipeline.big_bodies`)."""
        outcome = await self.offload.run_in_process(
            tenant,
            prepare,
            raw,
            endpoint,
            tenant,
            request.headers.get(POLICY_HEADER),
            self.objects.enabled,
            self.telemetry.enabled,
        )
        if isinstance(outcome, Refused):
            raise outcome.error()
        return outcome if isinstance(outcome, Prepared) else None

    def _prepare_encoded(self, call: Call, big: Prepared) -> PreparedRequest:
        """The request for a big body that a worker process parsed, checked and encoded."""
        timing, tenant = call.timing, call.timing.tenant
        bodies = {
            name: EncodedBody(b.encoded, b.upstream_model, big.stream)
            for name, b in big.bodies.items()
        }
        report = None
        if big.applied is not None:
            timing.prompt_tokens_saved = big.tokens_saved or 0
            report = asyncio.ensure_future(
                prepared_report_headers(
                    self.telemetry,
                    tenant,
                    big.tokens_saved,
                    big.cache_key,
                    big.fingerprints,
                    self.offload,
                )
            )
        applied = ",".join(big.applied) if big.applied is not None else "none"
        return call.prepared(
            EncodedBodies(bodies), big.client_wants_usage, applied, report, self.telemetry
        )

    async def _prepare(self, call: Call, body: dict, heavy: bool) -> PreparedRequest:
        """The request with the first route's policies applied (on the heavy-work pool for a
        big body, so that its policy work does not hold the loop from other tenants)."""
        timing, tenant, chain = call.timing, call.timing.tenant, call.chain
        names = self.policies.names_for(chain[0], call.request.headers.get(POLICY_HEADER))
        bodies = PolicyBodies(
            self.policies,
            names,
            body,
            endpoint=call.endpoint,
            tenant=tenant,
            model=timing.model,
            stream=timing.stream,
        )
        if heavy:
            await self.offload.run(tenant, bodies.for_route, chain[0])
        else:
            bodies.for_route(chain[0])
        primary = bodies.results[chain[0].name]
        report = None
        if primary is not None:
            # Token counts and prefix diagnostics run while the upstream request is in flight.
            report = asyncio.ensure_future(
                report_headers(self.telemetry, tenant, primary, self.offload if heavy else None)
            )
            report.add_done_callback(lambda _: _note_saved(timing, primary))
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        applied = ",".join(primary.applied) if primary else "none"
        return call.prepared(bodies, wants_usage, applied, report, self.telemetry)


@dataclass(slots=True)
class Call:
    """A chat or completions request once its body is read and its route chain known."""

    request: Request
    request_id: str
    endpoint: str
    timing: RequestTiming  # holds the tenant, the model as asked and `stream`
    chain: list[Route]

    def prepared(
        self,
        bodies: RouteBodies,
        client_wants_usage: bool,
        applied: str,
        report: asyncio.Future[dict[str, str]] | None,
        telemetry: Telemetry,
    ) -> PreparedRequest:
        return PreparedRequest(
            endpoint=self.endpoint,
            tenant=self.timing.tenant,
            request_id=self.request_id,
            model=self.timing.model,
            chain=self.chain,
            bodies=bodies,
            client_wants_usage=client_wants_usage,
            telemetry=telemetry,
            response_headers={"x-firsttoken-policies": applied},
            forward_headers=_forwardable(self.request),
            report=report,
        )


def _note_saved(timing: RequestTiming, result: PolicyResult) -> None:
    if result.measured:
        timing.prompt_tokens_saved = max(0, result.prompt_tokens_saved)


FORWARDED_HEADERS = frozenset({"openai-beta", "anthropic-beta"})


def _forwardable(request: Request) -> dict[str, str]:
    """Client headers that change what the upstream does. Never its key, nor account headers
    (organization, project) that belong to the client's account, not the route's."""
    headers = request.headers
    return {name: headers[name] for name in FORWARDED_HEADERS if name in headers}

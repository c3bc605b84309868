"""The running gateway: routes, upstreams, keys, policies and telemetry, built once from settings."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import os
import time
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import KeyRing, parse_admin_keys, parse_tenant_keys
from gateway.big_bodies import PreEncoded, Prepared, Refused, dumps_settings, prepare, worker_init
from gateway.errors import GatewayError
from gateway.offload import HeavyWork
from gateway.ownership import Ownership, find_references, might_reference
from gateway.policy_runner import (
    POLICY_HEADER,
    PolicyRunner,
    prepared_report_headers,
    report_headers,
)
from gateway.proxy import Plan, Proxy
from gateway.request_body import parse_request, read_body, upstream_body
from gateway.routes import Route, RouteTable, load_routes
from gateway.settings import ENV_PREFIX, Settings, SettingsError, policy_options
from gateway.timing import RequestTiming
from gateway.upstreams import Upstream, build_upstream
from policies import PolicyContext
from policies.tokens import warm_up as warm_up_tokens

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
    def __init__(self, settings: Settings, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.settings = settings
        try:
            self.keys = KeyRing(
                parse_tenant_keys(settings.tenant_keys), parse_admin_keys(settings.admin_keys)
            )
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        table = load_routes(settings.routes, environ)
        if not table.routes:
            table = RouteTable(embedded_default_routes(settings))
        self.table = table
        self.upstreams: dict[str, Upstream] = {
            r.name: build_upstream(r, settings, environ) for r in table.routes
        }
        self.proxy = Proxy(settings, self.upstreams)
        self.policies = PolicyRunner(settings, table.routes, environ)
        self.telemetry = self._telemetry(settings, environ)
        self.objects = Ownership.create(self.telemetry.store, enabled=not self.keys.open)
        self.offload = HeavyWork(
            settings.policy_thread_min_bytes,
            process_min_bytes=settings.big_body_bytes,
            process_workers=settings.big_body_workers if table.first_of_kind("openai") else 0,
            process_init=(
                worker_init,
                (
                    dumps_settings(settings),
                    [r.model_dump(mode="json") for r in table.routes],
                    {ENV_PREFIX + k: v for k, v in policy_options(environ).items()},
                ),
            ),
        )
        self._started: dict[str, asyncio.Task] = {}
        self._warmups: list[asyncio.Task] = []
        self._processes_started: asyncio.Future | None = None

    @staticmethod
    def _telemetry(settings: Settings, environ: Mapping[str, str]):
        from gateway.telemetry import Telemetry

        redis_url = settings.effective_redis_url(environ)
        if redis_url and settings.telemetry:
            from gateway.telemetry.redis_check import check_redis_url

            variable = "FIRSTTOKEN_REDIS_URL" if settings.redis_url else "REDIS_URL"
            check_redis_url(redis_url, variable, cluster=settings.redis_cluster)
        return Telemetry.create(
            redis_url=redis_url,
            key_prefix=settings.metrics_key_prefix,
            retention_s=settings.metrics_retention,
            buffer_max=settings.telemetry_buffer,
            max_tenants=settings.metrics_max_tenants,
            slo_default_ms=settings.ttft_slo_ms,
            slo_tenants=settings.slo_targets(),
            slo_objective=settings.ttft_slo_objective,
            enabled=settings.telemetry,
            redis_cluster=settings.redis_cluster,
        )

    # lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.telemetry.start()
        self._warmups.append(asyncio.ensure_future(asyncio.to_thread(warm_up_tokens)))
        self._processes_started = asyncio.ensure_future(self._start_processes())
        for name, upstream in self.upstreams.items():
            self._started[name] = asyncio.ensure_future(self._start_upstream(upstream))

    async def _start_processes(self) -> None:
        """The big-body workers start once the gateway is ready, so that their start does not
        delay readiness; they are not a condition of it (a big body that comes first waits)."""
        await asyncio.gather(*self._started.values(), *self._warmups, return_exceptions=True)
        await self.offload.start_processes()

    async def _start_upstream(self, upstream: Upstream) -> None:
        await upstream.start()
        await upstream.warm_up()

    async def upstream_ready(self, name: str) -> None:
        task = self._started.get(name)
        if task is None:
            return
        try:
            await asyncio.shield(task)  # a client that leaves must not cancel the start-up
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise GatewayError(503, f"route {name!r} failed to start: {exc}") from None

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

    # requests ------------------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        arrival, wall_arrival = time.perf_counter(), time.time()
        try:
            tenant = self.keys.tenant_for(request)
            settings = self.settings
            raw = await read_body(request, settings.max_body_bytes)
            big = (
                await self._prepare_big(request, endpoint, tenant, raw)
                if self.offload.is_big(len(raw))
                else None
            )
            if big is not None:
                model, body = big.model, None
            else:
                body, model = parse_request(raw, endpoint, settings)
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
            chain = [route, *[r for r in self.table.chain(route)[1:] if await self._usable(r)]]
            stream = big.stream if big is not None else bool(body.get("stream"))
            timing = RequestTiming(
                tenant=tenant,
                model=model,
                stream=stream,
                arrival=arrival,
                wall_arrival=wall_arrival,
            )
            if big is not None:
                if self.objects.enabled:  # a `file` part names an upload
                    await self.objects.routes_of(tenant, big.references)
                plan = self._plan_big(request, endpoint, tenant, big, chain, timing)
            else:
                heavy = self.offload.is_heavy(len(raw))
                if self.objects.enabled and might_reference(raw):
                    ids = (
                        await self.offload.run(tenant, find_references, body)
                        if heavy
                        else find_references(body)
                    )
                    await self.objects.routes_of(tenant, ids)  # 404 unless all are the tenant's
                plan = await self._plan(
                    request, endpoint, tenant, body, model, chain, stream, timing, heavy
                )
        except GatewayError as exc:
            return exc.to_response()
        if stream:
            return self.proxy.stream(plan, timing)
        return await self.proxy.complete(plan, timing, request.receive)

    async def _prepare_big(
        self, request: Request, endpoint: str, tenant: str, raw: bytes
    ) -> Prepared | None:
        """A big body's parse, checks and policies, done by a worker process; None when its
        routes need it parsed here (see `gateway.big_bodies`)."""
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

    def _plan_big(
        self,
        request: Request,
        endpoint: str,
        tenant: str,
        big: Prepared,
        chain: list[Route],
        timing: RequestTiming,
    ) -> Plan:
        bodies = {
            name: PreEncoded(b.encoded, b.upstream_model, big.stream)
            for name, b in big.bodies.items()
        }
        applied = ",".join(big.applied) if big.applied is not None else "none"
        late = None
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

            def late():
                return report

        telemetry = self.telemetry
        return Plan(
            endpoint=endpoint,
            tenant=tenant,
            request_id=next_request_id(),
            chain=chain,
            bodies=lambda route: bodies[route.name],
            client_wants_usage=big.client_wants_usage,
            response_headers={"x-firsttoken-policies": applied},
            late_headers=late,
            forward_headers=_forwardable(request),
            on_finish=lambda t: telemetry.record(t.to_event()),
        )

    async def _plan(
        self,
        request: Request,
        endpoint: str,
        tenant: str,
        body: dict,
        model: str,
        chain: list[Route],
        stream: bool,
        timing: RequestTiming,
        heavy: bool,
    ) -> Plan:
        names = self.policies.names_for(chain[0], request.headers.get(POLICY_HEADER))
        client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        bodies: dict[str, dict] = {}
        results = {}

        def body_for(route: Route) -> dict:
            cached = bodies.get(route.name)
            if cached is not None:
                return cached
            upstream_model = route.upstream_model(model)
            ctx = PolicyContext(
                endpoint=endpoint, route_kind=route.kind, model=upstream_model, tenant=tenant
            )
            result = self.policies.apply(names, body, ctx)
            results[route.name] = result
            out = upstream_body(result.body if result is not None else body, upstream_model, stream)
            bodies[route.name] = out
            return out

        if heavy:  # a big body: its policy work must not hold the loop from other tenants
            await self.offload.run(tenant, body_for, chain[0])
        else:
            body_for(chain[0])
        primary = results[chain[0].name]
        headers = {"x-firsttoken-policies": ",".join(primary.applied) if primary else "none"}
        late = None
        if primary is not None:
            # Token counts and prefix diagnostics run while the upstream request is in flight.
            report = asyncio.ensure_future(
                report_headers(self.telemetry, tenant, primary, self.offload if heavy else None)
            )
            report.add_done_callback(lambda _: _note_saved(timing, primary))

            def late():
                return report

        telemetry = self.telemetry
        return Plan(
            endpoint=endpoint,
            tenant=tenant,
            request_id=next_request_id(),
            chain=chain,
            bodies=body_for,
            client_wants_usage=client_wants_usage,
            response_headers=headers,
            late_headers=late,
            forward_headers=_forwardable(request),
            on_finish=lambda t: telemetry.record(t.to_event()),
        )


def _note_saved(timing: RequestTiming, result) -> None:
    if result.measured:
        timing.prompt_tokens_saved = max(0, result.prompt_tokens_saved)


_REQUEST_IDS = itertools.count()
_PROCESS_TAG = os.urandom(4).hex()


def next_request_id() -> str:
    """Unique per process and cheap (no syscall per request, unlike uuid4)."""
    return f"{_PROCESS_TAG}{next(_REQUEST_IDS):x}"


FORWARDED_HEADERS = frozenset({"openai-beta", "anthropic-beta"})


def _forwardable(request: Request) -> dict[str, str]:
    """Client headers that change what the upstream does. Never its key, nor account headers
    (organization, project) that belong to the client's account, not the route's."""
    headers = request.headers
    return {name: headers[name] for name in FORWARDED_HEADERS if name in headers}

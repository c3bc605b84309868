"""The upstream body, made once per route: the route's policies on the client's body, under the
route's model name.

`prepare_body` is the one function that does it, wherever the work runs: inline on the event
loop, on the heavy-work thread pool for a big body, or in a big-body worker process
(`gateway.pipeline.big_bodies`). Chat and completions bodies also ask a stream for its usage
(the relay drops that chunk again if the client did not ask); a body that goes upstream in its
client's own API (Responses to an `openai` route, Messages to an `anthropic` route) gets
nothing added, and goes as the client's bytes when no policy ran and the model keeps its name.

The policies' report (tokens saved, prefix-break diagnostics) is measured while the upstream
request is in flight, and its headers join the answer's when the status line goes out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson

from gateway.boundary.admit import AdmittedRequest
from gateway.boundary.offload import HeavyWork
from gateway.config.routes import Route
from gateway.errors import GatewayError
from gateway.pipeline.policies import (
    POLICY_HEADER,
    PolicyRunner,
    prepared_report_headers,
    report_headers,
)
from gateway.telemetry.record import RequestRecord
from gateway.upstreams.base import EncodedBody, UpstreamBody
from policies import PolicyContext

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry
    from policies.chain import PolicyResult

# The client APIs whose body is OpenAI's chat or completions shape.
CHAT_APIS = frozenset({"chat", "completions"})


@dataclass(slots=True)
class PreparedBody:
    body: UpstreamBody
    result: PolicyResult | None  # None: no policy ran (or the chain failed and degraded)


def prepare_body(
    runner: PolicyRunner,
    names: tuple[str, ...],
    body: dict,
    route: Route,
    *,
    api: str,
    tenant: str,
    model: str,
    stream: bool,
) -> PreparedBody:
    """`body` as `route`'s upstream gets it. The same in every place it runs."""
    upstream_model = route.upstream_model(model)
    ctx = PolicyContext(
        endpoint=api,
        route_kind=route.kind,
        model=upstream_model,
        tenant=tenant,
        base_url=route.base_url,
        cache_family=route.cache_family,
    )
    result = runner.apply(names, body, ctx)
    out = dict(result.body if result is not None else body)
    out["model"] = upstream_model
    if stream and api in CHAT_APIS:
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return PreparedBody(out, result)


class PolicyBodies:
    """Bodies with each route's policies applied, built when a route is first tried: a
    fallback's body costs nothing unless the chain gets that far."""

    def __init__(
        self,
        runner: PolicyRunner,
        names: tuple[str, ...],
        body: dict,
        *,
        api: str,
        tenant: str,
        model: str,
        stream: bool,
    ) -> None:
        self._runner = runner
        self._names = names
        self._body = body
        self._api = api
        self._tenant = tenant
        self._model = model
        self._stream = stream
        self._bodies: dict[str, UpstreamBody] = {}
        self.results: dict[str, PolicyResult | None] = {}

    def for_route(self, route: Route) -> UpstreamBody:
        cached = self._bodies.get(route.name)
        if cached is not None:
            return cached
        prepared = prepare_body(
            self._runner,
            self._names,
            self._body,
            route,
            api=self._api,
            tenant=self._tenant,
            model=self._model,
            stream=self._stream,
        )
        self.results[route.name] = prepared.result
        self._bodies[route.name] = prepared.body
        return prepared.body


class EncodedBodies:
    """Bodies a big-body worker process already built and encoded, one per route."""

    def __init__(self, bodies: dict[str, EncodedBody]) -> None:
        self._bodies = bodies

    def for_route(self, route: Route) -> UpstreamBody:
        return self._bodies[route.name]


@dataclass
class NativeBody:
    """A body in its client's own API: the bytes to send and the policy headers of the answer."""

    data: bytes
    applied: str = "none"
    report: asyncio.Future[dict[str, str]] | None = field(default=None, repr=False)

    async def headers(self) -> dict[str, str]:
        """Waited for only when the status line is about to go out."""
        own = {POLICY_HEADER: self.applied}
        if self.report is None:
            return own
        return {**own, **await self.report}


class Preparation:
    """Prepares admitted requests' upstream bodies, and starts their policy reports."""

    def __init__(self, runner: PolicyRunner, offload: HeavyWork, telemetry: Telemetry) -> None:
        self.runner = runner
        self.offload = offload
        self.telemetry = telemetry

    def names_for(self, admitted: AdmittedRequest, route: Route) -> tuple[str, ...]:
        """The policy chain for the request: the route's, or the client's header if allowed."""
        return self.runner.names_for(route, admitted.headers.get(POLICY_HEADER))

    async def chat(
        self, admitted: AdmittedRequest, body: dict
    ) -> tuple[PolicyBodies, PolicyResult | None]:
        """The chat or completions bodies of the chain, the first route's made now (on the
        heavy-work pool for a big body, so that its policy work does not hold the loop from
        other tenants), and the first route's policy result."""
        chain = admitted.chain
        bodies = PolicyBodies(
            self.runner,
            self.names_for(admitted, chain[0]),
            body,
            api=admitted.api if admitted.api in CHAT_APIS else "chat",
            tenant=admitted.tenant,
            model=admitted.model,
            stream=admitted.stream,
        )
        heavy = self.offload.is_heavy(len(admitted.raw))
        if heavy:
            await self.offload.run(admitted.tenant, bodies.for_route, chain[0])
        else:
            bodies.for_route(chain[0])
        primary = bodies.results[chain[0].name]
        return bodies, primary

    async def native(
        self, admitted: AdmittedRequest, record: RequestRecord, *, policies: bool = True
    ) -> NativeBody:
        """The admitted body for its first route in the client's own API, policies applied
        (none for `policies=False`: count_tokens is not a generation)."""
        assert admitted.body is not None
        route, raw, body = admitted.route, admitted.raw, admitted.body
        names = self.names_for(admitted, route) if policies else ()
        heavy = self.offload.is_heavy(len(raw))

        def prepare() -> PreparedBody:
            return prepare_body(
                self.runner,
                names,
                body,
                route,
                api=admitted.api,
                tenant=admitted.tenant,
                model=admitted.model,
                stream=admitted.stream,
            )

        prepared = (
            await self.offload.run(admitted.tenant, prepare) if heavy and names else prepare()
        )
        result = prepared.result
        if result is None and route.upstream_model(admitted.model) == admitted.model:
            return NativeBody(raw)
        try:
            data = orjson.dumps(prepared.body)
        except orjson.JSONEncodeError as exc:
            message = f"The request body cannot be encoded as JSON ({exc})."
            raise GatewayError(400, message) from None
        if result is None:
            return NativeBody(data)
        return NativeBody(data, ",".join(result.applied), self.report(admitted, result, record))

    def native_offloaded(self, admitted: AdmittedRequest, record: RequestRecord) -> NativeBody:
        """The first route's body that a big-body worker built in the client's own API."""
        big = admitted.offloaded
        data = big.bodies[admitted.route.name].encoded
        if big.applied is None:
            return NativeBody(data)
        record.prompt_tokens_saved = big.tokens_saved or 0
        report = asyncio.ensure_future(
            prepared_report_headers(
                self.telemetry,
                admitted.tenant,
                big.tokens_saved,
                big.cache_key,
                big.fingerprints,
                self.offload,
            )
        )
        return NativeBody(data, ",".join(big.applied), report)

    def report(
        self, admitted: AdmittedRequest, result: PolicyResult, record: RequestRecord
    ) -> asyncio.Future[dict[str, str]]:
        """Token counts and prefix diagnostics, measured while the upstream request is in
        flight; the tokens saved join the request's record. They run on the heavy-work threads
        for a big body, and for one whose long text is counted for the first time (a new
        system prompt: milliseconds that every other stream's events would wait for)."""
        heavy = self.offload.is_heavy(len(admitted.raw)) or result.counts_new_text()
        report = asyncio.ensure_future(
            report_headers(self.telemetry, admitted.tenant, result, self.offload if heavy else None)
        )
        report.add_done_callback(lambda _: _note_saved(record, result))
        return report


def _note_saved(record: RequestRecord, result: PolicyResult) -> None:
    if result.measured:
        record.prompt_tokens_saved = max(0, result.prompt_tokens_saved)

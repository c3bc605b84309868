"""The chat path: one admitted request, prepared once, proxied along its route chain, relayed
as it streams, recorded once.

Every generation that reaches an upstream as chat or completions goes through `ChatPipeline.
serve`: the chat and completions doors, and the Messages and Responses doors on routes that
do not speak their API (their request translated to chat, their answer converted back from
each upstream event by their `AnswerFormat`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.types import ASGIApp

from gateway.boundary.admit import AdmittedRequest
from gateway.boundary.body import validate_chat
from gateway.boundary.ownership import Ownership
from gateway.pipeline.answer import CHAT, AnswerFormat
from gateway.pipeline.big_bodies import Prepared
from gateway.pipeline.policies import prepared_report_headers
from gateway.pipeline.prepare import CHAT_APIS, EncodedBodies, Preparation
from gateway.pipeline.prepared import PreparedRequest, RouteBodies
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.stream_relay import StreamRelay
from gateway.telemetry.record import RequestRecord
from gateway.upstreams.base import EncodedBody

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry

# Client headers that change what the upstream does. Never its key, nor account headers
# (organization, project) that belong to the client's account, not the route's.
FORWARDED_HEADERS = frozenset({"openai-beta", "anthropic-beta"})


class ChatPipeline:
    """Serves admitted requests on the chat path."""

    def __init__(
        self,
        preparation: Preparation,
        proxy: Proxy,
        objects: Ownership,
        telemetry: Telemetry,
        max_messages: int,
    ) -> None:
        self.preparation = preparation
        self.proxy = proxy
        self.objects = objects
        self.telemetry = telemetry
        self.max_messages = max_messages

    def record_for(self, admitted: AdmittedRequest) -> RequestRecord:
        """The request's one record, which its answer finishes."""
        return RequestRecord(
            tenant=admitted.tenant,
            model=admitted.model,
            stream=admitted.stream,
            arrival=admitted.arrival,
            wall_arrival=admitted.wall_arrival,
            api=admitted.api,
            request_id=admitted.request_id,
            telemetry=self.telemetry,
        )

    async def serve(
        self,
        admitted: AdmittedRequest,
        chat_body: dict | None = None,
        answer: AnswerFormat = CHAT,
    ) -> ASGIApp:
        """The answer to `admitted`: a whole response, or a stream relay that starts the
        upstream request when the server runs it. `chat_body`: the request translated to chat
        by a door of another API (else the admitted body is chat's own). A GatewayError is the
        door's to answer in its own shape."""
        record = self.record_for(admitted)
        if admitted.offloaded is not None:
            plan = await self._offloaded(admitted, admitted.offloaded, record)
        else:
            body = chat_body if chat_body is not None else admitted.body
            assert body is not None
            if chat_body is not None:
                validate_chat(body, self.max_messages)  # the translator's output, checked alike
            plan = await self._prepare(admitted, body, record)
        if admitted.stream:
            return StreamRelay(self.proxy, plan, record, answer)
        request = admitted.request
        return await self.proxy.complete(plan, record, request.scope, request.receive, answer)

    async def _prepare(
        self, admitted: AdmittedRequest, body: dict, record: RequestRecord
    ) -> PreparedRequest:
        tenant = admitted.tenant
        heavy = self.preparation.offload.is_heavy(len(admitted.raw))
        await self.objects.check_references(
            tenant, admitted.raw, body, self.preparation.offload if heavy else None
        )
        bodies, primary = await self.preparation.chat(admitted, body)
        report = None
        if primary is not None:
            report = self.preparation.report(admitted, primary, record)
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        applied = ",".join(primary.applied) if primary else "none"
        return self._plan(admitted, bodies, wants_usage, applied, report)

    async def _offloaded(
        self, admitted: AdmittedRequest, big: Prepared, record: RequestRecord
    ) -> PreparedRequest:
        """The request for a big body that a worker process parsed, checked and prepared."""
        if self.objects.enabled:  # a `file` part names an upload
            await self.objects.routes_of(admitted.tenant, big.references)
        bodies = {
            name: EncodedBody(b.encoded, b.upstream_model, big.stream)
            for name, b in big.bodies.items()
        }
        report = None
        if big.applied is not None:
            record.prompt_tokens_saved = big.tokens_saved or 0
            report = asyncio.ensure_future(
                prepared_report_headers(
                    self.telemetry,
                    admitted.tenant,
                    big.tokens_saved,
                    big.cache_key,
                    big.fingerprints,
                    self.preparation.offload,
                )
            )
        applied = ",".join(big.applied) if big.applied is not None else "none"
        return self._plan(admitted, EncodedBodies(bodies), big.client_wants_usage, applied, report)

    def _plan(
        self,
        admitted: AdmittedRequest,
        bodies: RouteBodies,
        client_wants_usage: bool,
        applied: str,
        report: asyncio.Future[dict[str, str]] | None,
    ) -> PreparedRequest:
        headers = admitted.headers
        return PreparedRequest(
            endpoint=admitted.api if admitted.api in CHAT_APIS else "chat",
            tenant=admitted.tenant,
            request_id=admitted.request_id,
            model=admitted.model,
            chain=admitted.chain,
            bodies=bodies,
            client_wants_usage=client_wants_usage,
            response_headers={"x-firsttoken-policies": applied},
            forward_headers={name: headers[name] for name in FORWARDED_HEADERS if name in headers},
            report=report,
            own_id=admitted.own_id or admitted.request_id,
        )

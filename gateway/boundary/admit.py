"""Admission: the one step every door starts with.

`Admission.begin` names the request (its id and arrival); `admit` then decides who sent it (the
tenant, from its key), reads its body within the byte limit, parses it within the JSON limits,
checks what the door needs to route it, and finds its route chain. Each happens once per
request: a door that translates the request into chat hands the `AdmittedRequest` on, it never
re-encodes the body to be admitted again.

A big chat, completions or Messages body is parsed (and prepared) in a worker process instead
of on the event loop (`gateway.pipeline.big_bodies`), behind the `BigBodies` seam, so admission
does not depend on the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.requests import Request

from gateway.boundary.auth import KeyRing
from gateway.boundary.body import (
    declared_length,
    parse_request,
    read_body,
    read_body_into,
    strip_reserved,
)
from gateway.boundary.body_files import BodyFile
from gateway.boundary.request_id import client_request_id, next_request_id
from gateway.config.routes import Route
from gateway.config.settings import Settings
from gateway.errors import GatewayError
from gateway.upstreams.registry import Upstreams


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """What a door's parser found: the body, the model it names, and whether it streams."""

    body: dict
    model: str
    stream: bool


# A door's check of its own body shape: a 400 (GatewayError) naming what is wrong.
BodyParser = Callable[[bytes, Settings], ParsedBody]


class Offloaded(Protocol):
    """A big body parsed and prepared in a worker process."""

    @property
    def model(self) -> str: ...

    @property
    def stream(self) -> bool: ...


class BigBodies(Protocol):
    """Parses a big body away from the event loop (the pipeline's worker processes)."""

    def takes(self, api: str, size: int) -> bool: ...

    async def parse(
        self, admitted: AdmittedRequest, parser: BodyParser, file: BodyFile | None = None
    ) -> Offloaded | None:
        """The worker's result, or None when the body's routes need it parsed here. `parser`
        is the door's own (a native API's body is parsed with it in the worker). `file`: the
        body as it was read, when it was read into a memory file instead of `admitted.raw`."""


@dataclass(slots=True, eq=False)
class AdmittedRequest:
    """One request past the trust boundary. Built once by `Admission`; doors and the pipeline
    read it and never read, parse or route the request again."""

    request: Request
    api: str  # chat | completions | responses | messages | count_tokens | passthrough | ...
    request_id: str  # what answers and logs name: the client's own when well-formed
    arrival: float
    wall_arrival: float
    tenant: str = ""
    raw: bytes = b""
    body: dict | None = None  # None for a big body parsed in a worker (see `offloaded`)
    model: str = ""
    stream: bool = False
    chain: list[Route] = field(default_factory=list)
    offloaded: Any = None  # the worker's parse and preparation of a big body
    own_id: str = ""  # the gateway's id, unique: what upstreams pair on (never the client's)

    @property
    def route(self) -> Route:
        """The route that serves the request first (the chain holds its fallbacks)."""
        return self.chain[0]

    @property
    def headers(self) -> Any:
        return self.request.headers


def parse_chat(raw: bytes, settings: Settings) -> ParsedBody:
    body, model = parse_request(raw, "chat", settings)
    return ParsedBody(body, model, bool(body.get("stream")))


def parse_completion(raw: bytes, settings: Settings) -> ParsedBody:
    body, model = parse_request(raw, "completions", settings)
    return ParsedBody(body, model, bool(body.get("stream")))


class Admission:
    """Request id, tenant, bounded body, parse, route chain: once per request."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyRing,
        upstreams: Upstreams,
        big_bodies: BigBodies | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.upstreams = upstreams
        self.big_bodies = big_bodies

    def begin(self, request: Request, api: str) -> AdmittedRequest:
        """The request named: its id and arrival (every answer carries the id, errors too; see
        `gateway.boundary.request_id` for when the client's own is kept)."""
        own = next_request_id()
        return AdmittedRequest(
            request=request,
            api=api,
            request_id=client_request_id(request.headers.get("x-request-id")) or own,
            arrival=time.perf_counter(),
            wall_arrival=time.time(),
            own_id=own,
        )

    def authenticate(self, admitted: AdmittedRequest) -> AdmittedRequest:
        """The tenant of the request's key (a 401 for a missing or unknown one)."""
        admitted.tenant = self.keys.tenant_for(admitted.request)
        return admitted

    @property
    def open(self) -> bool:
        """No tenant keys: everyone is tenant `default`."""
        return self.keys.open

    def is_admin(self, request: Request) -> bool:
        return self.keys.is_admin(request)

    def reader(
        self, request: Request, asked: str | None, what: str = "metrics"
    ) -> tuple[str, bool]:
        """For the read endpoints: (the tenant to read, whether the caller is an admin). A
        tenant reads only itself (a 403 for another, never an empty success), an admin any
        tenant or `*` (`default` unless asked)."""
        if self.keys.is_admin(request):
            return asked or "default", True
        tenant = self.keys.tenant_for(request)
        if asked is not None and asked != tenant:
            raise GatewayError(
                403,
                f"A tenant may read only its own {what}.",
                param="tenant",
                code="forbidden_tenant",
            )
        return tenant, False

    async def admit(self, admitted: AdmittedRequest, parse: BodyParser) -> AdmittedRequest:
        """Authenticate, read, parse and route `admitted`, each once."""
        self.authenticate(admitted)
        settings = self.settings
        big = self.big_bodies
        file = None if big is None else self._file_for(admitted, big)
        if big is not None and file is not None:
            await self._admit_in_file(admitted, big, parse, file)
        else:
            admitted.raw = await read_body(admitted.request, settings.max_body_bytes)
            if big is not None and big.takes(admitted.api, len(admitted.raw)):
                admitted.offloaded = await big.parse(admitted, parse)
        if admitted.offloaded is not None:
            admitted.model, admitted.stream = admitted.offloaded.model, admitted.offloaded.stream
        else:
            parsed = parse(admitted.raw, settings)
            admitted.body, admitted.model, admitted.stream = (
                parsed.body,
                parsed.model,
                parsed.stream,
            )
            if strip_reserved(parsed.body):  # a door may forward the client's bytes as sent
                admitted.raw = orjson.dumps(parsed.body)
        admitted.chain = await self.upstreams.chain_for(admitted.model)
        return admitted

    @staticmethod
    def _file_for(admitted: AdmittedRequest, big: BigBodies) -> BodyFile | None:
        """A memory file for a body declared big enough for a worker (None for any other, or
        where there are no memory files)."""
        declared = declared_length(admitted.request)
        if declared is None or not big.takes(admitted.api, declared):
            return None
        return BodyFile.create()

    async def _admit_in_file(
        self, admitted: AdmittedRequest, big: BigBodies, parse: BodyParser, file: BodyFile
    ) -> None:
        """The body is read into `file` as it arrives and handed to a worker in it;
        `admitted.raw` is filled only when it must be parsed here after all (its routes need
        the parsed body in this process)."""
        try:
            await read_body_into(admitted.request, self.settings.max_body_bytes, file)
            admitted.offloaded = await big.parse(admitted, parse, file)
            if admitted.offloaded is None:
                admitted.raw = await file.read_all()
        finally:
            file.close()

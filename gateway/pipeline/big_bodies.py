"""Big chat and completions bodies are parsed, checked and transformed in worker processes.

orjson parses a 16 MB body in 60-160 ms and holds the interpreter all along, so on the event loop
(or on a thread: the GIL is the same) one tenant's big body would stall every other tenant's
stream for that long. A body of at least `FIRSTTOKEN_BIG_BODY_BYTES` therefore goes, as bytes,
to a small process pool that does what the loop would have done: parse within the limits,
validate, find object references, run the policy chain for each route of the model's chain and
encode each upstream body, measure the policy report. The loop gets back bytes and a few facts.
The body and the upstream bodies cross in a memory file (`gateway.boundary.body_files`), not in
the pool's pipe, whose pickling would hold the interpreter lock for every copy.

Chat bodies take this path on chains of `openai` and `azure` routes: their upstream body is the
encoded JSON as it is; so does a Messages body for an `anthropic` route and a Responses body for an
`openai` one (their native APIs, `NATIVE_KIND`), with the same per-tenant queue and so the same
memory bound. A body that must be translated (chat to an Anthropic or local route, Messages to
an OpenAI one, Responses to an Anthropic one) needs the parsed body in this process; it stays
on the thread path (`gateway.boundary.offload`). Worker functions take and return only plain
data, so nothing of the gateway's state crosses the process boundary besides what
`worker_init` receives.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gateway.boundary.body_files import (
    BodyFile,
    FileRef,
    Span,
    read_in_worker,
    write_in_worker,
)
from gateway.config.routes import OPENAI_BODY_KINDS
from gateway.config.settings import SECRET_FIELDS, Settings
from gateway.pipeline.policies import POLICY_HEADER

if TYPE_CHECKING:
    from gateway.boundary.admit import AdmittedRequest
    from gateway.boundary.offload import HeavyWork
from gateway.errors import GatewayError

log = logging.getLogger("firsttoken.big_bodies")

# Set in each worker process by `worker_init`.
_WORKER: dict[str, Any] = {}
WORKER_NICE = 19  # a worker yields the CPU to the serving loop whenever both want it


@dataclass(frozen=True)
class RouteBody:
    encoded: bytes  # the upstream request body (empty while it is in the body file at `span`)
    upstream_model: str
    span: Span | None = None


@dataclass(frozen=True)
class Prepared:
    """What the loop needs from a big body."""

    model: str
    stream: bool
    client_wants_usage: bool
    references: list[str]
    bodies: dict[str, RouteBody]  # per route name of the chain
    applied: list[str] | None  # None: no policy ran (or the chain failed)
    tokens_saved: int | None
    cache_key: str | None
    fingerprints: bytes | None


@dataclass(frozen=True)
class Refused:
    """A GatewayError, as plain data (its keyword-only constructor does not pickle)."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    def error(self) -> GatewayError:
        return GatewayError(
            self.status, self.message, type=self.type, param=self.param, code=self.code
        )


@dataclass(frozen=True)
class Unreadable:
    """The worker could not read the body's memory file (no `/proc`, say): the gateway sends
    the body in the pickle instead."""

    reason: str


@dataclass(frozen=True)
class NotHere:
    """The body's chain needs the parsed body in the gateway process (a route that is neither
    `openai` nor `azure`)."""

    reason: str = field(default="route kind")


def worker_init(settings_data: dict, routes_data: list[dict], gateway_pid: int = 0) -> None:
    """Build, once per worker, the settings, route table and policy chains it needs, from
    `dumps_settings` (the policy options included) and the gateway's routes; `gateway_pid`:
    the process it must not outlive (its parent when it was started)."""
    from gateway.config.routes import Route, RouteTable
    from gateway.pipeline.policies import PolicyRunner

    try:
        os.nice(WORKER_NICE)
    except OSError:
        pass
    _exit_with_parent(gateway_pid or os.getppid())
    settings = Settings.model_validate(settings_data)
    routes = [Route.model_validate(data) for data in routes_data]
    _WORKER.update(
        settings=settings,
        table=RouteTable(routes),
        policies=PolicyRunner(settings, routes),
    )


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """A gateway killed outright (SIGKILL, OOM) cannot stop its workers. On Linux the kernel
    kills each the moment its parent goes (PR_SET_PDEATHSIG); everywhere, and should that
    parent be a thread that ended, each also watches for its parent to go and exits, instead of
    holding its memory forever. `parent` is the gateway's pid as it passed it: a gateway killed
    while this worker was still starting is no longer the parent when this runs."""
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it went before the prctl (or the watch) took effect
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# The client APIs whose big bodies go to a worker when their route speaks that API natively
# (the body goes upstream as the client's own JSON): Messages to an `anthropic` route,
# Responses to an `openai` one.
NATIVE_KIND = {"messages": "anthropic", "responses": "openai"}


def prepare(
    raw: bytes,
    endpoint: str,
    tenant: str,
    policy_header: str | None,
    find_refs: bool,
    fingerprints: bool,
    parser: Callable[[bytes, Settings], Any] | None = None,
) -> Prepared | Refused | NotHere:
    """In a worker: everything the loop would do with `raw` before the upstream call. A native
    API's body is parsed with its door's own `parser` (a module-level function: it pickles)."""
    try:
        if endpoint in NATIVE_KIND:
            assert parser is not None
            return _prepare_native(raw, endpoint, tenant, policy_header, find_refs, parser)
        return _prepare(raw, endpoint, tenant, policy_header, find_refs, fingerprints)
    except GatewayError as exc:
        return Refused(exc.status, exc.message, exc.type, exc.param, exc.code)


def prepare_from_file(ref: FileRef, *args: Any) -> Prepared | Refused | NotHere | Unreadable:
    """`prepare` (with `args`, the rest of its arguments) for a body in the gateway's memory
    file (`body_files`): the upstream bodies go back in the same file, and only their spans in
    the answer."""
    try:
        fd, raw = read_in_worker(ref)
    except OSError as exc:
        return Unreadable(f"{type(exc).__name__}: {exc}")
    try:
        outcome = prepare(raw, *args)
        if not isinstance(outcome, Prepared):
            return outcome
        names = list(outcome.bodies)
        try:
            spans = write_in_worker(fd, [outcome.bodies[name].encoded for name in names])
        except OSError:
            return outcome  # the bodies travel in the pickle
        bodies = {
            name: RouteBody(b"", outcome.bodies[name].upstream_model, span)
            for name, span in zip(names, spans, strict=True)
        }
        return replace(outcome, bodies=bodies)
    finally:
        os.close(fd)


def _prepare_native(
    raw: bytes,
    endpoint: str,
    tenant: str,
    policy_header: str | None,
    find_refs: bool,
    parser: Callable[[bytes, Settings], Any],
) -> Prepared | NotHere:
    """A Messages body for an `anthropic` route or a Responses body for an `openai` one:
    parsed, checked, its policies run and encoded here; a body whose route would translate it
    is parsed on the loop instead."""
    import orjson

    from gateway.boundary.body import strip_reserved
    from gateway.boundary.ownership import find_references, might_reference
    from gateway.pipeline.prepare import prepare_body

    settings, table, policies = _WORKER["settings"], _WORKER["table"], _WORKER["policies"]
    parsed = parser(raw, settings)
    body, model, stream = parsed.body, parsed.model, parsed.stream
    stripped = strip_reserved(body)
    route = table.match(model)
    if route is None:
        return NotHere("no route")
    if route.kind != NATIVE_KIND[endpoint]:
        return NotHere()
    names = policies.names_for(route, policy_header)
    out = prepare_body(
        policies, names, body, route, api=endpoint, tenant=tenant, model=model, stream=stream
    )
    result = out.result
    if result is None and not stripped and route.upstream_model(model) == model:
        encoded = raw
    else:
        try:
            encoded = orjson.dumps(out.body)
        except orjson.JSONEncodeError as exc:
            raise GatewayError(
                400, f"The request body cannot be encoded as JSON ({exc})."
            ) from None
    tokens_saved = blob = None
    if result is not None:
        try:
            result.measure(fingerprints=False)
            tokens_saved = max(0, result.prompt_tokens_saved)
        except Exception:  # noqa: BLE001  # the report degrades, never the request
            tokens_saved = None
    return Prepared(
        model=model,
        stream=stream,
        client_wants_usage=False,
        references=find_references(body) if find_refs and might_reference(raw) else [],
        bodies={route.name: RouteBody(encoded, out.body["model"])},
        applied=list(result.applied) if result is not None else None,
        tokens_saved=tokens_saved,
        cache_key=result.cache_key if result is not None else None,
        fingerprints=blob,
    )


def _prepare(
    raw: bytes,
    endpoint: str,
    tenant: str,
    policy_header: str | None,
    find_refs: bool,
    fingerprints: bool,
) -> Prepared | NotHere:
    from gateway.boundary.body import parse_request
    from gateway.boundary.ownership import find_references, might_reference
    from gateway.pipeline.prepare import PolicyBodies
    from gateway.upstreams.base import UpstreamError, encode_body

    settings, table, policies = _WORKER["settings"], _WORKER["table"], _WORKER["policies"]
    body, model = parse_request(raw, endpoint, settings)
    route = table.match(model)
    if route is None:
        return NotHere("no route")  # the loop answers with its own 404/503
    chain = table.chain(route)
    if any(r.kind not in OPENAI_BODY_KINDS for r in chain):
        return NotHere()
    names = policies.names_for(route, policy_header)
    stream = bool(body.get("stream"))
    per_route = PolicyBodies(
        policies, names, body, api=endpoint, tenant=tenant, model=model, stream=stream
    )
    bodies = {}
    for r in chain:
        out = per_route.for_route(r)
        try:
            encoded = encode_body(out)
        except UpstreamError as exc:  # the client's body cannot be written as JSON
            raise GatewayError(400, exc.message, code="invalid_body") from None
        bodies[r.name] = RouteBody(encoded, out["model"])
    primary = per_route.results[route.name]
    tokens_saved = blob = None
    if primary is not None:
        try:
            primary.measure(fingerprints=fingerprints)
            tokens_saved = max(0, primary.prompt_tokens_saved)
            blob = primary.fingerprints.to_bytes() if primary.fingerprints is not None else None
        except Exception:  # noqa: BLE001  # the report degrades, never the request
            tokens_saved = blob = None
    options = body.get("stream_options")
    return Prepared(
        model=model,
        stream=stream,
        client_wants_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        references=find_references(body) if find_refs and might_reference(raw) else [],
        bodies=bodies,
        applied=list(primary.applied) if primary is not None else None,
        tokens_saved=tokens_saved,
        cache_key=primary.cache_key if primary is not None else None,
        fingerprints=blob,
    )


def dumps_settings(settings: Settings) -> dict:
    """Settings as plain data for `worker_init`: JSON types only, and no key (a worker
    authenticates nobody and calls no upstream)."""
    return settings.model_dump(mode="json", exclude=set(SECRET_FIELDS))


class BigBodyWorkers:
    """The worker processes as admission's `BigBodies`: a big chat or completions body is
    parsed, checked and prepared there instead of on the event loop."""

    def __init__(self, offload: HeavyWork, find_references: bool, fingerprints: bool) -> None:
        self.offload = offload
        self.find_references = find_references
        self.fingerprints = fingerprints
        self.unreadable = 0  # bodies whose worker could not read their memory file

    def takes(self, api: str, size: int) -> bool:
        return api in ("chat", "completions", *NATIVE_KIND) and self.offload.is_big(size)

    async def parse(
        self,
        admitted: AdmittedRequest,
        parser: Callable[[bytes, Settings], Any] | None = None,
        file: BodyFile | None = None,
    ) -> Prepared | None:
        """The worker's preparation of `admitted`'s body (in `file` when admission read it
        into one, else `admitted.raw`); the body crosses in a memory file where there is one,
        else in the pickle."""
        args = (
            admitted.api,
            admitted.tenant,
            admitted.headers.get(POLICY_HEADER),
            self.find_references,
            self.fingerprints,
            parser if admitted.api in NATIVE_KIND else None,
        )
        own = file is None
        if own:
            file = await BodyFile.write(admitted.raw)
        try:
            outcome = await self._in_file(admitted.tenant, file, args) if file is not None else None
            if outcome is None:  # no memory file, or the worker could not read it
                raw = await file.read_all() if file is not None and not own else admitted.raw
                outcome = await self.offload.run_in_process(admitted.tenant, prepare, raw, *args)
        finally:
            if own and file is not None:
                file.close()
        if isinstance(outcome, Refused):
            raise outcome.error()
        return outcome if isinstance(outcome, Prepared) else None

    async def _in_file(
        self, tenant: str, file: BodyFile, args: tuple[Any, ...]
    ) -> Prepared | Refused | NotHere | None:
        """The worker's outcome for the body in `file`, its upstream bodies read back; None
        when the worker could not read the file."""
        outcome = await self.offload.run_in_process(tenant, prepare_from_file, file.ref, *args)
        if isinstance(outcome, Unreadable):
            self._note_unreadable(outcome)
            return None
        if isinstance(outcome, Prepared):
            return await _bodies_read(file, outcome)
        return outcome

    def _note_unreadable(self, outcome: Unreadable) -> None:
        if not self.unreadable:
            log.warning(
                "a big-body worker could not read the body's memory file (%s); big bodies "
                "are sent to the workers in the pool's pipe, which stalls the loop longer",
                outcome.reason,
            )
        self.unreadable += 1


async def _bodies_read(file: BodyFile, prepared: Prepared) -> Prepared:
    """`prepared` with the upstream bodies the worker left in `file` read back."""
    spans = {name: body.span for name, body in prepared.bodies.items() if body.span is not None}
    if not spans:
        return prepared
    names = list(spans)
    data = await file.read(list(spans.values()))
    bodies = dict(prepared.bodies)
    for name, encoded in zip(names, data, strict=True):
        bodies[name] = RouteBody(encoded, bodies[name].upstream_model)
    return replace(prepared, bodies=bodies)

"""The gateway's side of the policies: which chain runs for a request, and the prefix-break
diagnostics that need the telemetry store. The policies themselves are pure (`policies/`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback
from collections.abc import Sequence

from gateway.advisor import bucket_of, observe_cache_advice
from gateway.advisor.advice import TOTALS_FAMILY
from gateway.boundary.offload import HeavyWork
from gateway.config.routes import Route
from gateway.config.settings import Settings, SettingsError
from gateway.errors import GatewayError
from policies import (
    PolicyChain,
    PolicyConfigError,
    PolicyContext,
    PolicyResult,
    PolicyShapeError,
    build_chain,
    parse_policy_list,
)
from policies.config import ENV_PREFIX
from policies.diagnostics import PrefixFingerprints
from policies.prefix_breaks import FamilyBreak, decode_history, encode_history, family_break

log = logging.getLogger("firsttoken.policies")

POLICY_HEADER = "x-firsttoken-policies"
LOG_INTERVAL_S = 60.0


class LimitedLog:
    """A failure any tenant can cause on every request is logged as one short line per kind per
    `interval_s`, never a traceback per request: the line names the kind, where it happened
    (the innermost frame, never the body's text) and how many were held back since the last."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str) -> bool:
        """Log `message` unless a line of `kind` went out within the interval; whether it did.
        `kind` comes from a fixed set (the callers'), so the table stays small."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        more = f" ({held} more since the last such line)" if held else ""
        self.logger.warning("%s%s", message, more)
        return True

    def forget(self) -> None:
        """Start over (tests): the next line of every kind goes out."""
        self._last.clear()
        self._held.clear()

    def failure(self, kind: str, what: str, exc: BaseException) -> bool:
        return self.warning(kind, f"{what}: {type(exc).__name__} at {_where(exc)}")


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"


limited = LimitedLog(log)


def is_extension_panic(exc: BaseException) -> bool:
    """A Rust extension's panic (pyo3's PanicException, e.g. from the tokenizer) derives from
    BaseException, not Exception; a broken policy must still degrade itself, not the request."""
    return type(exc).__name__ == "PanicException"


class PolicyRunner:
    """Builds each distinct chain once, at start-up, so that a bad route policy fails the start,
    not a request."""

    def __init__(self, settings: Settings, routes: Sequence[Route]) -> None:
        self.allow_client = settings.allow_client_policies
        self._options = settings.policy_options
        self.default_names = settings.policies
        self._chains: dict[tuple[str, ...], PolicyChain] = {}
        self._chain(self.default_names)  # names and options were validated with the settings
        for route in routes:
            if route.policies is not None:
                try:
                    self._chain(tuple(route.policies))
                except PolicyConfigError as exc:
                    reason = str(exc).removeprefix(f"{ENV_PREFIX}POLICIES: ")
                    raise SettingsError(
                        f"{ENV_PREFIX}ROUTES: route {route.name!r} policies: {reason}"
                    ) from None

    def _chain(self, names: tuple[str, ...]) -> PolicyChain:
        chain = self._chains.get(names)
        if chain is None:
            chain = self._chains[names] = build_chain(names, self._options)
        return chain

    def names_for(self, route: Route, header: str | None) -> tuple[str, ...]:
        if header is not None:
            if not self.allow_client:
                raise GatewayError(
                    403,
                    f"The {POLICY_HEADER} header is disabled on this gateway.",
                    param=POLICY_HEADER,
                    code="policy_override_forbidden",
                )
            try:
                return parse_policy_list(header)
            except PolicyConfigError as exc:
                raise GatewayError(400, f"{POLICY_HEADER}: {exc}", param=POLICY_HEADER) from None
        return tuple(route.policies) if route.policies is not None else self.default_names

    def apply(self, names: tuple[str, ...], body: dict, ctx: PolicyContext) -> PolicyResult | None:
        """Transform only; the result's report is measured later, off the first-token path.
        None when no policy runs or a policy fails: a broken policy degrades itself, not the
        request."""
        if not names:
            return None
        try:
            return self._chain(names).transform(body, ctx)
        except PolicyConfigError:
            raise
        except PolicyShapeError as exc:  # the upstream judges the body, as without us
            limited.warning(
                "shape", f"policies skipped on a {ctx.endpoint} body: {exc}; forwarded unchanged"
            )
            return None
        except Exception as exc:  # noqa: BLE001  # logged, limited: the request goes on
            limited.failure("chain", f"policy chain {names} failed; forwarded unchanged", exc)
            return None
        except BaseException as exc:
            if not is_extension_panic(exc):
                raise
            limited.failure("chain", f"policy chain {names} panicked; forwarded unchanged", exc)
            return None


async def report_headers(
    telemetry, tenant: str, result: PolicyResult, offload: HeavyWork | None = None
) -> dict[str, str]:
    """Measure what the policies did and compare this request's prefix fingerprints with the
    family's last ones, then store these. Runs while the upstream request is in flight;
    degrades to fewer headers rather than fail a request. With `offload` (a big body), the
    counting and comparing run on the heavy-work pool instead of the event loop."""
    # Yield once first: the task is created before the upstream request, and on Python < 3.12
    # aiohttp writes the request body from a task of its own, queued after this one. Going to
    # the back of the queue lets the request leave before the counting starts.
    await asyncio.sleep(0)
    measure = functools.partial(result.measure, fingerprints=telemetry.enabled)
    try:
        if offload is not None:
            await offload.run(tenant, measure)
        else:
            measure()
    except Exception as exc:  # noqa: BLE001  # logged, limited: the request goes on
        limited.failure("measure", "measuring the policy result failed", exc)
        return {}
    except BaseException as exc:
        if not is_extension_panic(exc):
            raise
        limited.failure("measure", "measuring the policy result panicked", exc)
        return {}
    headers = {"x-firsttoken-prompt-tokens-saved": str(max(0, result.prompt_tokens_saved))}
    if result.fingerprints is not None and result.cache_key:
        headers.update(
            await _prefix_break(telemetry, tenant, result.cache_key, result.fingerprints, offload)
        )
    # Shadow cache advice: a task of its own that nothing awaits; it never raises.
    observe_cache_advice(telemetry, tenant, result)
    return headers


async def _prefix_break(
    telemetry,
    tenant: str,
    cache_key: str,
    fingerprints: PrefixFingerprints,
    offload: HeavyWork | None,
) -> dict[str, str]:
    try:
        previous_blob = await telemetry.get_fingerprints(tenant, cache_key)
        compare = functools.partial(_compare, previous_blob, fingerprints)
        found, blob = await offload.run(tenant, compare) if offload is not None else compare()
        telemetry.put_fingerprints(tenant, cache_key, blob)
        if found is None:
            return {}
        if found.breaks:
            count_breaks(telemetry, tenant, found)
            return {"x-firsttoken-prefix-break": found.header}
        return {"x-firsttoken-prefix-stable-tokens": str(found.stable_tokens)}
    except Exception as exc:  # noqa: BLE001  # logged, limited: the request goes on
        limited.failure("diagnostics", "prefix-break diagnostics failed", exc)
        return {}


def count_breaks(telemetry, tenant: str, found: FamilyBreak) -> None:
    """The one place a break is counted: Prometheus by kind, and the tenant's advice totals by
    class (the dashboard's table), once per request and class, as the header names them."""
    classes: set[str] = set()
    for block in found.breaks:
        if block.kind_class not in classes:
            classes.add(block.kind_class)
            telemetry.record_prefix_break(tenant, block.kind)
    fields = {f"break:{name}": 1 for name in classes}
    telemetry.put_advice(tenant, TOTALS_FAMILY, bucket_of(time.time()), fields)


async def prepared_report_headers(
    telemetry,
    tenant: str,
    tokens_saved: int | None,
    cache_key: str | None,
    blob: bytes | None,
    offload: HeavyWork,
) -> dict[str, str]:
    """`report_headers` for a big body whose report a worker process measured: the prefix
    comparison with the family's last fingerprints still needs the telemetry store."""
    headers = (
        {} if tokens_saved is None else {"x-firsttoken-prompt-tokens-saved": str(tokens_saved)}
    )
    if blob is not None and cache_key:
        try:
            fingerprints = await offload.run(tenant, PrefixFingerprints.from_bytes, blob)
        except Exception as exc:  # noqa: BLE001  # logged, limited: the request goes on
            limited.failure("fingerprints", "reading a worker's prefix fingerprints failed", exc)
            return headers
        headers.update(await _prefix_break(telemetry, tenant, cache_key, fingerprints, offload))
    return headers


def _compare(
    previous_blob: bytes | None, current: PrefixFingerprints
) -> tuple[FamilyBreak | None, bytes]:
    """The break judged against the family's recorded requests, and its new history blob."""
    history = decode_history(previous_blob)
    found, recorded = family_break(history, current)
    return found, encode_history([*history, recorded])

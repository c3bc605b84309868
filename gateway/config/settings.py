"""Every setting is a `FIRSTTOKEN_*` environment variable, validated once at start-up.

`load_settings()` is the one door: it reads the environment once (and an optional TOML file with
the same keys, lower-case and without the prefix; the environment wins), validates everything
into typed values (routes, key tables, SLO targets, policy options) and captures the few
variables outside the prefix that configuration depends on: the provider keys that derive the
default routes, each route's `api_key_env`, `REDIS_URL`. Nothing after it reads the environment.

An invalid value is a `SettingsError` with one message per variable
(`FIRSTTOKEN_MAX_BODY_BYTES: Input should be a valid integer ...`), so an operator knows what to
fix without reading a traceback. A variable nobody reads, or a route key variable that is not
set, is a warning on the `firsttoken` logger.

`Settings(...)` built directly (tests, benches) reads nothing: it holds its arguments and the
defaults. Pass `captured_env` for what the environment would have held, or call
`load_settings(environ={...}, **overrides)`.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from gateway.config.errors import SettingsError
from gateway.config.file import read_config_file
from gateway.config.keys import parse_admin_keys, parse_tenant_keys, tenants_holding
from gateway.config.routes import PROVIDER_KEY_VARIABLES, Route, check_routes, default_routes
from policies.config import (
    DEFAULT_POLICIES,
    ENV_PREFIX,
    POLICY_NAMES,
    POLICY_OPTION_PREFIXES,
    PolicyOptions,
    option_docs,
    parse_options,
    parse_policy_list,
)

log = logging.getLogger("firsttoken")

# While `load_settings` validates: the fields whose value came from the config file, with the
# file's key and path, so that an error names what the operator wrote.
_FILE_SOURCES: ContextVar[Mapping[str, tuple[str, str]] | None] = ContextVar(
    "file_sources", default=None
)

REDIS_URL_FALLBACK = "REDIS_URL"
# FIRSTTOKEN_* variables that are not settings of the gateway but are read elsewhere, so never
# "unknown": the demo model's cache folder (engine_backend/demo.py), and the switch of the
# compiled build (setup.py), which a shell that built the gateway may still export.
OTHER_VARIABLES = frozenset({"CACHE_DIR", "MYPYC"})
# Fields that are not a variable of their own: the policy options come from one variable per
# option (FIRSTTOKEN_SLIM_MINIFY_JSON, ...), `captured_env` from outside the prefix.
NOT_VARIABLES = frozenset({"policy_options", "captured_env"})
# Fields that hold keys (or their digests): never dumped, never sent to another process.
SECRET_FIELDS = frozenset({"tenant_keys", "admin_keys", "captured_env"})


class Settings(BaseModel):
    # hide_input_in_errors: a validation error must never echo a key it was given.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    # Routing and upstreams
    routes: tuple[Route, ...] | None = Field(
        default=None,
        description="JSON list of routes; unset: from provider keys, else the local engine",
    )
    timeout_s: float = Field(default=600.0, gt=0, description="default whole-request timeout")
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="TCP connect timeout to upstreams"
    )
    first_token_timeout_s: float | None = Field(
        default=None, gt=0, description="default time to the first upstream event before a retry"
    )
    retry_attempts: int = Field(
        default=2, ge=1, le=10, description="attempts per route before its fallbacks"
    )
    keepalive_s: float = Field(
        default=10.0, gt=0, description="SSE keepalive comment interval while no event came"
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, gt=0, description="largest JSON request body (413)"
    )
    pool_size: int = Field(default=256, ge=1, description="connections per upstream")

    # Limits on what a client sends (checked before parsing; see README, "Security model")
    max_request_line_bytes: int = Field(
        default=8 * 1024, ge=256, description="method + target + version (414)"
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, description="request line and headers (431)"
    )
    max_headers: int = Field(default=100, ge=8, description="header fields per request (431)")
    max_pipelined_requests: int = Field(
        default=64, ge=1, description="requests waiting for their answers on one connection (429)"
    )
    client_head_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds a client may take to begin, and then to send, a request head (408)",
    )
    client_body_timeout_s: float = Field(
        default=60.0, gt=0, description="seconds a request body may pause between two reads (408)"
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="client connections held at once (503 past it); unset: half the "
        "open-file limit",
    )
    max_json_depth: int = Field(
        default=64, ge=4, le=200, description="nesting of the JSON body (400)"
    )
    max_json_containers: int = Field(
        default=100_000, ge=100, description="'{' and '[' in a JSON body, strings included (400)"
    )
    max_messages: int = Field(default=4096, ge=1, description="messages in one chat request (400)")
    max_model_chars: int = Field(default=256, ge=8, description="length of 'model' (400)")
    max_upload_bytes: int = Field(
        default=512 * 1024 * 1024,
        gt=0,
        description="non-JSON passthrough bodies (file uploads, 413) and downloads",
    )
    policy_thread_min_bytes: int = Field(
        default=64 * 1024,
        ge=0,
        description="bodies at least this big run their policies off the event loop",
    )
    big_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1,
        description="bodies at least this big are parsed in worker processes",
    )
    big_body_workers: int = Field(
        default=2, ge=0, le=16, description="worker processes for big bodies; 0: none"
    )

    # Limits on what an upstream sends back
    max_event_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="one upstream SSE event"
    )
    max_response_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="one non-streaming upstream body (502)"
    )

    # Tenants: kept as SHA-256 digests only (see gateway.config.keys), and out of every repr.
    tenant_keys: dict[bytes, str] = Field(
        default_factory=dict,
        repr=False,
        description="tenant:key,...; unset: open, tenant 'default'",
    )
    admin_keys: frozenset[bytes] = Field(
        default_factory=frozenset,
        repr=False,
        description="key,... that may read every tenant's metrics and /metrics",
    )

    # Policies
    policies: tuple[str, ...] = Field(
        default=DEFAULT_POLICIES, description="ordered policy chain; 'none' for none"
    )
    allow_client_policies: bool = Field(
        default=True, description="honour the x-firsttoken-policies request header"
    )
    # From FIRSTTOKEN_SLIM_*, FIRSTTOKEN_CANONICALIZE_*, FIRSTTOKEN_CACHE_HINTS_* (policies.config).
    policy_options: PolicyOptions = Field(
        default_factory=PolicyOptions, description="the per-policy option variables"
    )

    # Telemetry
    redis_url: str | None = Field(
        default=None, description="telemetry store; unset: $REDIS_URL, else in process"
    )
    redis_cluster: bool = Field(
        default=False, description="the Redis URL names a Redis Cluster node"
    )
    telemetry: bool = Field(default=True, description="record TTFT at all")
    metrics_key_prefix: str = Field(
        default="ft", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Redis key prefix"
    )
    metrics_retention: int = Field(
        default=7 * 86400, gt=0, description="seconds a metrics bucket is kept"
    )
    metrics_max_tenants: int = Field(
        default=100, ge=1, description="Prometheus tenant labels before folding into 'other'"
    )
    metrics_max_models: int = Field(
        default=10, ge=1, description="Prometheus model labels per tenant before 'other'"
    )
    telemetry_buffer: int = Field(
        default=10_000, ge=1, description="events buffered while Redis is unreachable"
    )
    ttft_slo_ms: float = Field(default=1000.0, gt=0, description="default TTFT target")
    ttft_slo_tenants: dict[str, float] = Field(
        default_factory=dict, description="tenant:ms,... per-tenant TTFT targets"
    )
    ttft_slo_objective: float = Field(
        default=0.99, gt=0, lt=1, description="share of requests that should meet the target"
    )

    # Local engine
    engine_model: str | None = Field(
        default=None, description="model for the default local route; unset: the demo"
    )
    engine_device: str | None = Field(default=None, description="cuda or cpu; unset: auto")
    engine_dtype: str | None = Field(
        default=None,
        description="auto, float32, bfloat16 or float16; unset or auto: bf16 on CUDA and on "
        "CPUs with AVX-512 BF16 or AMX, float32 on other CPUs",
    )
    engine_max_num_batched_tokens: int | None = Field(
        default=None,
        ge=16,
        description="engine per-step token budget (chunked prefill); unset: the engine's own",
    )
    engine_isolate_tenants: bool | None = Field(
        default=None,
        description="tenants never share prefix-cache blocks; unset: on when tenant keys are set",
    )

    log_level: str = Field(default="info", description="critical, error, warning, info or debug")

    # Variables outside FIRSTTOKEN_* that the configuration depends on, read once by
    # load_settings: the provider keys, each route's api_key_env, REDIS_URL. Secret throughout.
    captured_env: dict[str, SecretStr] = Field(default_factory=dict, repr=False)

    def __init__(self, **values: Any) -> None:
        """Built directly (tests, benches), a bad value is the same `SettingsError` naming the
        variable that `load_settings` raises."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_problems(exc, _FILE_SOURCES.get())) from None

    # -- validators --------------------------------------------------------------------------

    @field_validator("routes", mode="before")
    @classmethod
    def _routes_from_json(cls, value: object) -> object:
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON ({exc})") from None
        if value is not None and (not isinstance(value, list | tuple) or not value):
            raise ValueError("expected a non-empty JSON list of routes")
        return value

    @field_validator("routes")
    @classmethod
    def _routes_consistent(cls, routes: tuple[Route, ...] | None) -> tuple[Route, ...] | None:
        if routes is not None:
            check_routes(routes)
        return routes

    @field_validator("tenant_keys", mode="before")
    @classmethod
    def _tenant_table(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_tenant_keys(value, f"{ENV_PREFIX}TENANT_KEYS")
        if isinstance(value, Mapping) and all(isinstance(k, bytes) for k in value):
            return value  # already a digest table
        raise ValueError("expected 'tenant:key,tenant:key'")

    @field_validator("admin_keys", mode="before")
    @classmethod
    def _admin_set(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_admin_keys(value)
        if isinstance(value, set | frozenset) and all(isinstance(k, bytes) for k in value):
            return value
        raise ValueError("expected 'key,key'")

    @field_validator("policies", mode="before")
    @classmethod
    def _policy_list(cls, value: object) -> object:
        if isinstance(value, list | tuple):  # a TOML array
            value = ",".join(str(name) for name in value)
        return parse_policy_list(value if isinstance(value, str) else None)

    @field_validator("policy_options", mode="before")
    @classmethod
    def _policy_option_strings(cls, value: object) -> object:
        """Option variables (SLIM_MINIFY_JSON=true, ...) are parsed by the policies; a mapping
        keyed by policy name is the parsed form (a worker's copy) and is validated as it is."""
        if isinstance(value, Mapping) and not set(value) <= set(POLICY_NAMES):
            return parse_options(value)
        return value

    @field_validator("ttft_slo_tenants", mode="before")
    @classmethod
    def _slo_targets(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        targets: dict[str, float] = {}
        for item in value.split(","):
            if not item.strip():
                continue
            tenant, sep, ms = item.rpartition(":")
            try:
                targets[tenant.strip()] = float(ms)
            except ValueError:
                sep = ""
            if not sep or not tenant.strip():
                raise ValueError(f"expected 'tenant:ms' entries, got {item.strip()!r}")
        return targets

    @field_validator("ttft_slo_tenants")
    @classmethod
    def _slo_targets_positive(cls, targets: dict[str, float]) -> dict[str, float]:
        for tenant, ms in targets.items():
            if not ms > 0:
                raise ValueError(f"tenant {tenant!r}: the target must be above 0 ms")
        return targets

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.lower() not in {"critical", "error", "warning", "info", "debug"}:
            raise ValueError("expected one of critical, error, warning, info, debug")
        return value.lower()

    @model_validator(mode="after")
    def _whole(self) -> Settings:
        shared = tenants_holding(self.tenant_keys, self.admin_keys)
        if shared:
            raise ValueError(
                f"{ENV_PREFIX}ADMIN_KEYS: an admin key is also the tenant key of "
                f"{', '.join(map(repr, shared))} in {ENV_PREFIX}TENANT_KEYS; "
                "give admins keys of their own"
            )
        if self.routes is None:
            derived = default_routes(self.captured_env)
            if derived:
                self.routes = tuple(derived)
        return self

    # -- derived values ----------------------------------------------------------------------

    def isolate_engine_tenants(self) -> bool:
        """Cross-tenant prefix-cache hits are a timing side channel, so tenant mode isolates."""
        if self.engine_isolate_tenants is not None:
            return self.engine_isolate_tenants
        return bool(self.tenant_keys)

    def captured(self, variable: str) -> str | None:
        """A captured variable's value (a key: keep it out of logs), None when unset or empty."""
        secret = self.captured_env.get(variable)
        return (secret.get_secret_value() or None) if secret is not None else None

    def route_api_key(self, route: Route) -> str | None:
        return self.captured(route.api_key_env) if route.api_key_env else None

    def effective_redis_url(self) -> str | None:
        return self.redis_url or self.captured(REDIS_URL_FALLBACK)

    def redis_url_variable(self) -> str:
        """The variable the effective Redis URL came from, for error messages."""
        return f"{ENV_PREFIX}REDIS_URL" if self.redis_url else REDIS_URL_FALLBACK


# -- the one door ----------------------------------------------------------------------------


def load_settings(
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
    **overrides: object,
) -> Settings:
    """Read `environ` (default: the process environment) once, over `config_file`, under
    `overrides`, and validate. Raises `SettingsError`; logs a warning for each variable or file
    key nobody reads and for each route key variable that is not set."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    options: dict[str, object] = {}
    unknown: list[str] = []
    sources: dict[str, tuple[str, str]] = {}  # field -> (file key, file) for the file's values
    near_misses: list[str] = []
    if config_file is not None:
        for key, value in read_config_file(config_file).items():
            where = f"{key!r} in {config_file}"
            _sort_in(str(key).upper(), value, values, options, unknown, where, "")
            sources[str(key).lower()] = (str(key), str(config_file))
            _check_near_miss(str(key).upper(), near_misses, where, "")
    for name, value in environ.items():
        upper = name.upper()
        if upper.startswith(ENV_PREFIX):
            key = upper[len(ENV_PREFIX) :]
            _sort_in(key, value, values, options, unknown, name, ENV_PREFIX)
            sources.pop(key.lower(), None)  # the variable overrides the file
            _check_near_miss(key, near_misses, name, ENV_PREFIX)
    values.update(overrides)
    for name in overrides:
        sources.pop(name, None)
    if options:
        values.setdefault("policy_options", options)
    wanted = {*PROVIDER_KEY_VARIABLES, REDIS_URL_FALLBACK}
    values.setdefault("captured_env", _capture(environ, wanted))
    for message in unknown:  # before validation: a typo may be why a value is missing
        log.warning(message)
    if near_misses:  # a gateway that cannot read its keys would serve everyone: never start
        raise SettingsError("; ".join(near_misses))
    token = _FILE_SOURCES.set(sources)  # a bad value is named where it came from
    try:
        settings = Settings(**values)
    finally:
        _FILE_SOURCES.reset(token)
    if "captured_env" not in overrides:  # now that the routes are known, their keys too
        route_variables = {
            v for r in settings.routes or () for v in r.key_variables() | r.credential_variables()
        }
        settings.captured_env = _capture(environ, wanted | route_variables)
    for route in settings.routes or ():
        for variable in sorted(route.key_variables()):
            if settings.captured(variable) is None:
                log.warning(
                    "%sROUTES: route %r reads a key from %s, which is not set; "
                    "its requests go without a key",
                    ENV_PREFIX,
                    route.name,
                    variable,
                )
    return settings


def _sort_in(
    key: str,
    value: object,
    values: dict[str, object],
    options: dict[str, object],
    unknown: list[str],
    where: str,
    prefix: str,
) -> None:
    """File the value of one variable (or file key) `key`, without the prefix."""
    if key.lower() in Settings.model_fields and key.lower() not in NOT_VARIABLES:
        values[key.lower()] = value
    elif key.startswith(POLICY_OPTION_PREFIXES):
        options[key] = value  # the policies validate these, a typo included
    elif key not in OTHER_VARIABLES:
        unknown.append(f"{where}: no such setting, ignored{_suggestion(key, prefix)}")


# The settings that close the gateway to strangers. A variable that looks like one of them but is
# not one (`FIRSTTOKEN_TENANT_KEY`, `tenant_key` in a file) stops the start: read as "unknown,
# ignored", it would leave the gateway open to everyone.
KEY_SETTINGS = ("TENANT_KEYS", "ADMIN_KEYS")
NEAR_MISS_CUTOFF = 0.75
BARE_KEY_NAMES = frozenset({"KEY", "KEYS", "API_KEY", "API_KEYS", "AUTH_KEY", "AUTH_KEYS"})


def looks_like_key_setting(key: str) -> str | None:
    """The key setting that `key` (upper case, no prefix, not itself a setting) seems meant to
    be, or None."""
    if key in BARE_KEY_NAMES:  # the gateway's own key, as a user would guess its name
        return "TENANT_KEYS"
    close = difflib.get_close_matches(key, KEY_SETTINGS, n=1, cutoff=NEAR_MISS_CUTOFF)
    if close:
        return close[0]
    if "KEY" in key:
        for setting in KEY_SETTINGS:
            if setting.split("_", 1)[0] in key:  # TENANT or ADMIN with KEY: a key setting
                return setting
    return None


def _check_near_miss(key: str, near_misses: list[str], where: str, prefix: str) -> None:
    if key.lower() in Settings.model_fields or key.startswith(POLICY_OPTION_PREFIXES):
        return
    meant = looks_like_key_setting(key)
    if meant is not None:
        name = f"{prefix}{meant}" if prefix else meant.lower()
        near_misses.append(
            f"{where}: no such setting, and it looks like a key setting (did you mean {name}?); "
            "the gateway does not start with a key setting it cannot read, since it would "
            "then admit everyone"
        )


def variable_keys() -> list[str]:
    """Every variable name without the prefix: the Settings fields, then the policy options."""
    fields = [name.upper() for name in Settings.model_fields if name not in NOT_VARIABLES]
    return [*fields, *(key for key, _, _ in option_docs())]


def _suggestion(key: str, prefix: str) -> str:
    names = variable_keys()
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {prefix}{close[0] if prefix else close[0].lower()}?)"


def _capture(environ: Mapping[str, str], names: Iterable[str]) -> dict[str, SecretStr]:
    return {name: SecretStr(environ[name]) for name in names if environ.get(name)}


def _problems(exc: ValidationError, sources: Mapping[str, tuple[str, str]] | None = None) -> str:
    return "; ".join(_describe(error, sources or {}) for error in exc.errors())


def _describe(error: ErrorDetails, sources: Mapping[str, tuple[str, str]]) -> str:
    """One pydantic error as `FIRSTTOKEN_ROUTES[0].kind: Input should be ...`, or, for a value
    from the config file, under the file's own key: `routes[0].kind in firsttoken.toml: ...`."""
    message = error["msg"].removeprefix("Value error, ")
    loc = error["loc"]
    if not loc:
        return message
    field = str(loc[0])
    variable = f"{ENV_PREFIX}{field.upper()}"
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
    source = sources.get(field)
    if source is None:
        return message if message.startswith(ENV_PREFIX) else f"{variable}{where}: {message}"
    key, file = source
    if message.startswith(variable):  # a validator's message that names the variable itself
        path, colon, detail = message[len(variable) :].partition(":")
        return f"{key}{path} in {file}{colon}{detail}"
    return f"{key}{where} in {file}: {message}"


# -- what there is to set --------------------------------------------------------------------

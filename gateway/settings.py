"""Every setting is a `FIRSTTOKEN_*` environment variable, validated once at start-up.

`load_settings()` turns pydantic's validation errors into one message per variable
(`FIRSTTOKEN_MAX_BODY_BYTES: Input should be a valid integer ...`) so an operator knows what
to fix without reading a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "FIRSTTOKEN_"

# Prefixes of per-policy option variables (FIRSTTOKEN_SLIM_MINIFY_JSON, ...); validated by policies.
POLICY_OPTION_PREFIXES = ("SLIM_", "CANONICALIZE_", "CACHE_HINTS_")


class SettingsError(ValueError):
    """A start-up configuration error whose message names the variable at fault."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", case_sensitive=False)

    # Routing and upstreams
    routes: str | None = Field(
        None, description="JSON list of routes; unset: derived from provider keys"
    )
    timeout_s: float = Field(600.0, gt=0, description="default whole-request upstream timeout")
    connect_timeout_s: float = Field(10.0, gt=0)
    first_token_timeout_s: float | None = Field(
        None, gt=0, description="default time to first event"
    )
    retry_attempts: int = Field(2, ge=1, le=10, description="attempts per route before a fallback")
    keepalive_s: float = Field(10.0, gt=0, description="SSE comment interval while no event came")
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    pool_size: int = Field(256, ge=1, description="max connections per upstream")

    # Limits on what a client sends (checked before parsing; see README, "Security model")
    max_request_line_bytes: int = Field(
        8 * 1024, ge=256, description="method + target + version (414)"
    )
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line and headers (431)")
    max_headers: int = Field(100, ge=8, description="header fields per request (431)")
    max_json_depth: int = Field(64, ge=4, le=200, description="nesting of the JSON body (400)")
    max_json_containers: int = Field(
        100_000, ge=100, description="'{' and '[' in a JSON body, strings included (400)"
    )
    max_messages: int = Field(4096, ge=1, description="messages in one chat request (400)")
    max_model_chars: int = Field(256, ge=8, description="length of 'model' (400)")
    max_upload_bytes: int = Field(
        512 * 1024 * 1024, gt=0, description="non-JSON passthrough bodies (file uploads, 413)"
    )
    policy_thread_min_bytes: int = Field(
        64 * 1024,
        ge=0,
        description="bodies at least this big run their policies off the event loop",
    )
    big_body_bytes: int = Field(
        1024 * 1024, ge=1, description="bodies at least this big are parsed in worker processes"
    )
    big_body_workers: int = Field(
        2, ge=0, le=16, description="worker processes for big bodies; 0: none"
    )

    # Limits on what an upstream sends back
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="one upstream SSE event")
    max_response_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="one non-streaming upstream body"
    )

    # Tenants
    tenant_keys: str = Field("", description="tenant:key,tenant:key; unset: open, tenant 'default'")
    admin_keys: str = ""

    # Policies
    policies: str | None = Field(None, description="ordered policy names; unset: the safe default")
    allow_client_policies: bool = Field(True, description="honour x-firsttoken-policies")

    # Telemetry
    redis_url: str | None = None
    redis_cluster: bool = Field(False, description="the Redis URL names a Redis Cluster node")
    telemetry: bool = True
    metrics_key_prefix: str = Field("ft", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    metrics_retention: int = Field(7 * 86400, gt=0)
    metrics_max_tenants: int = Field(100, ge=1)
    telemetry_buffer: int = Field(10_000, ge=1)
    ttft_slo_ms: float = Field(1000.0, gt=0)
    ttft_slo_tenants: str = ""
    ttft_slo_objective: float = Field(0.99, gt=0, lt=1)

    # Local engine
    engine_model: str | None = None
    engine_device: str | None = None
    engine_dtype: str | None = None
    engine_max_num_batched_tokens: int = Field(512, ge=16)
    engine_isolate_tenants: bool | None = Field(
        None,
        description="tenants never share prefix-cache blocks; unset: on when tenant keys are set",
    )

    log_level: str = "info"

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.lower() not in {"critical", "error", "warning", "info", "debug"}:
            raise ValueError("expected one of critical, error, warning, info, debug")
        return value.lower()

    def isolate_engine_tenants(self) -> bool:
        """Cross-tenant prefix-cache hits are a timing side channel, so tenant mode isolates."""
        if self.engine_isolate_tenants is not None:
            return self.engine_isolate_tenants
        return bool(self.tenant_keys.strip())

    def effective_redis_url(self, environ: Mapping[str, str] | None = None) -> str | None:
        environ = os.environ if environ is None else environ
        return self.redis_url or environ.get("REDIS_URL") or None

    def slo_targets(self) -> dict[str, float]:
        targets: dict[str, float] = {}
        for item in self.ttft_slo_tenants.split(","):
            if not item.strip():
                continue
            tenant, sep, ms = item.rpartition(":")
            try:
                targets[tenant.strip()] = float(ms)
            except ValueError:
                sep = ""
            if not sep or not tenant.strip():
                raise SettingsError(
                    f"{ENV_PREFIX}TTFT_SLO_TENANTS: expected 'tenant:ms' entries, got {item.strip()!r}"
                )
        return targets


def policy_options(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The raw per-policy option variables, keyed without the FIRSTTOKEN_ prefix."""
    environ = os.environ if environ is None else environ
    options = {}
    for name, value in environ.items():
        upper = name.upper()
        if upper.startswith(ENV_PREFIX):
            key = upper[len(ENV_PREFIX) :]
            if key.startswith(POLICY_OPTION_PREFIXES):
                options[key] = value
    return options


def load_settings(**overrides: object) -> Settings:
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = ".".join(str(p) for p in error["loc"]) or "?"
            problems.append(f"{ENV_PREFIX}{field.upper()}: {error['msg']}")
        raise SettingsError("; ".join(problems)) from None

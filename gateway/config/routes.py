"""Routes: which upstream serves which model.

`FIRSTTOKEN_ROUTES` is a JSON list; the first route whose `models` match serves a request.
Without it, routes are derived from the provider keys present in the environment, and with
none of those the local engine is the default (see `default_routes`). The settings validate the
list (`gateway.config.settings`); a route's key is read with the settings, never from here.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
from collections.abc import Container, Sequence
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.paths import AZURE_FAMILIES, FAMILIES, is_azure_api_version, is_azure_deployment
from policies.provider_limits import LOCAL

# What an `anthropic` route's `passthrough` may name: Anthropic's Files API.
ANTHROPIC_FAMILIES = frozenset({"files"})

RouteKind = Literal["openai", "anthropic", "local", "azure", "gemini", "vertex", "bedrock"]
# The kinds whose upstream takes OpenAI's request body as it is (a big body's worker process
# may encode it), and whose origin serves OpenAI's other /v1 paths (files, embeddings, ...).
OPENAI_BODY_KINDS = frozenset({"openai", "azure"})
PASSTHROUGH_KINDS = OPENAI_BODY_KINDS
MATCH_CACHE_SIZE = 4096
MATCH_CACHE_BYTES = 256 * 1024  # model names are client input: bound the cache by bytes too
MATCH_CACHE_NAME_CHARS = 256  # and never keep a long one
# vertex only: a Google Cloud project id and a region (or `global`); both become URL parts.
GOOGLE_CREDENTIALS_VARIABLE = "GOOGLE_APPLICATION_CREDENTIALS"  # google-auth's ADC file
GCP_PROJECT = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
GCP_REGION = re.compile(r"[a-z]+(-[a-z]+[0-9]+)?")
# bedrock only: an AWS region name; it becomes part of a host name, so nothing else may pass.
AWS_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]{1,2}")


BalanceMode = Literal["prefix_affinity", "least_loaded", "round_robin"]


class Replica(BaseModel):
    """One server of a replicated `openai` route (vLLM, SGLang, `firsttoken engine`, ...)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str
    name: str | None = Field(default=None, min_length=1, max_length=64)
    weight: float = Field(default=1.0, gt=0, le=1000)
    api_key_env: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    # sglang pd prefill servers only: their --disaggregation-bootstrap-port (None: 8998)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)


class PDPools(BaseModel):
    """Prefill/decode separation (`gateway/pd`) over vLLM's disaggregated-serving protocol
    (`vllm`) or SGLang's bootstrap protocol (`sglang`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: tuple[Replica, ...] = Field(min_length=1)
    decode: tuple[Replica, ...] = Field(min_length=1)
    prefill_timeout_s: float = Field(default=30.0, gt=0)
    protocol: Literal["vllm", "sglang"] = "vllm"


class Route(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    models: tuple[str, ...] = Field(min_length=1)
    kind: RouteKind
    base_url: str | None = None
    api_key_env: str | None = None
    fallbacks: tuple[str, ...] = ()
    timeout_s: float | None = Field(default=None, gt=0)
    first_token_timeout_s: float | None = Field(default=None, gt=0)
    model_map: dict[str, str] = Field(default_factory=dict)
    policies: tuple[str, ...] | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    # the /v1 path families forwarded (None: all of FAMILIES, []: none): openai and azure;
    # anthropic: files only
    passthrough: tuple[str, ...] | None = None
    # azure only: Azure OpenAI's `api-version` (e.g. "2024-10-21"), or "v1" for /openai/v1/
    api_version: str | None = None
    # local engine only
    model_path: str | None = None
    demo: bool = False
    # openai only: several servers behind one route (see gateway/replicas)
    replicas: tuple[Replica, ...] = ()
    balance: BalanceMode = "prefix_affinity"
    affinity_per_tenant: bool = True  # tenants' prefixes never count for each other
    affinity_index_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024)
    eject_s: float = Field(default=1.0, gt=0)
    max_eject_s: float = Field(default=60.0, gt=0)
    probe_interval_s: float = Field(default=5.0, gt=0)
    # the replicas' own /metrics (queue length, KV cache usage), read every load_interval_s
    load_metrics: Literal["vllm", "sglang"] | None = None
    load_interval_s: float = Field(default=1.0, gt=0)
    # hedged first token: ms without a first token before a second replica is asked
    hedge_after_ms: float | Literal["p95"] | None = None
    hedge_max_ratio: float = Field(default=0.1, ge=0, le=1)
    # a slow replica's warm conversations hand their shared prefix to the replica the tenant's
    # next conversation will take (gateway/upstreams/replicas/hand_over.py); None: on where
    # load_metrics is set (servers of one's own, where a prefill costs no bill)
    prefix_hand_over: bool | None = None
    # openai only: prefill and decode servers (vLLM P/D pools, `firsttoken engine --role`)
    pd: PDPools | None = None
    # vertex only: the Google Cloud project
    project: str | None = None
    # vertex: the Google Cloud region (`global` for the global endpoint); bedrock: the AWS
    # region (base_url default: https://bedrock-runtime.{region}.amazonaws.com)
    region: str | None = None

    @model_validator(mode="after")
    def _needs_target(self) -> Route:
        if self.pd is not None:
            self._check_pd()
        elif self.replicas:
            self._check_replicas()
        elif self.kind in ("openai", "anthropic", "azure") and not self.base_url:
            raise ValueError(f"route {self.name!r}: kind {self.kind!r} needs base_url")
        self._check_google()
        if self.kind == "bedrock":
            self._check_bedrock()
        if self.kind == "azure":
            self._check_azure()
        elif self.api_version is not None:
            raise ValueError(f"route {self.name!r}: api_version applies to azure routes only")
        if self.base_url is not None and not _is_http_url(self.base_url):
            raise ValueError(
                f"route {self.name!r}: base_url must be an http:// or https:// URL with a host, "
                f"got {_shown_url(self.base_url)}"
            )
        if self.prefix_hand_over and not self.replicas:
            raise ValueError(f"route {self.name!r}: prefix_hand_over applies to replicas only")
        if isinstance(self.hedge_after_ms, float | int) and self.hedge_after_ms <= 0:
            raise ValueError(f"route {self.name!r}: hedge_after_ms must be > 0 or 'p95'")
        if self.passthrough:
            if self.kind == "anthropic" and set(self.passthrough) - ANTHROPIC_FAMILIES:
                raise ValueError(
                    f"route {self.name!r}: an anthropic route passes through files only"
                )
            if self.kind not in PASSTHROUGH_KINDS and self.kind != "anthropic":
                raise ValueError(
                    f"route {self.name!r}: passthrough applies to openai, azure and anthropic "
                    "routes only"
                )
            unknown = sorted(set(self.passthrough) - FAMILIES)
            if unknown:
                raise ValueError(
                    f"route {self.name!r}: unknown passthrough families {unknown}; "
                    f"known: {', '.join(sorted(FAMILIES))}"
                )
        return self

    @property
    def cache_family(self) -> str:
        """The prompt-cache family the policies follow on this route ("": the one its kind,
        model and base URL say). A route that names its servers' kind (`load_metrics`) runs
        vLLM or SGLang servers of one's own: their prefix caches are automatic and take no
        marker (OpenAI's `prompt_cache_key` is a field they ignore), as the bundled engine's."""
        return LOCAL if self.load_metrics is not None else ""

    @property
    def hands_over_prefixes(self) -> bool:
        """Whether a slow replica's warm conversations hand their prefix over (see the field)."""
        wanted = (
            self.load_metrics is not None
            if self.prefix_hand_over is None
            else self.prefix_hand_over
        )
        return wanted and self.balance == "prefix_affinity"

    def _check_google(self) -> None:
        """A vertex route names its project and region, each a plain URL segment; no other
        kind takes a project, and only bedrock (checked apart) a region."""
        if self.kind != "vertex":
            if self.project is not None:
                raise ValueError(f"route {self.name!r}: project applies to vertex only")
            if self.region is not None and self.kind != "bedrock":
                raise ValueError(f"route {self.name!r}: region applies to vertex and bedrock only")
            return
        if self.project is None or not GCP_PROJECT.fullmatch(self.project):
            raise ValueError(
                f"route {self.name!r}: a vertex route needs 'project', a Google Cloud project "
                "id (lower-case letters, digits and hyphens)"
            )
        if self.region is None or len(self.region) > 40 or not GCP_REGION.fullmatch(self.region):
            raise ValueError(
                f"route {self.name!r}: a vertex route needs 'region', e.g. 'us-east5' or 'global'"
            )

    def _check_bedrock(self) -> None:
        if self.region is None or not AWS_REGION.fullmatch(self.region):
            raise ValueError(
                f"route {self.name!r}: kind 'bedrock' needs region, an AWS region such as "
                "'us-east-1'"
            )
        if importlib.util.find_spec("botocore") is None:
            raise ValueError(
                f"route {self.name!r}: bedrock routes need botocore; "
                "install it with: pip install 'firsttoken[bedrock]'"
            )

    def _check_azure(self) -> None:
        if self.replicas or self.pd is not None:
            raise ValueError(f"route {self.name!r}: replicas and pd apply to openai routes only")
        if self.api_version is None or not is_azure_api_version(self.api_version):
            raise ValueError(
                f"route {self.name!r}: an azure route needs api_version, a dated Azure OpenAI "
                'api-version like "2024-10-21" or "v1"'
            )
        bad = sorted(name for name in self.model_map.values() if not is_azure_deployment(name))
        if bad:
            raise ValueError(
                f"route {self.name!r}: model_map names deployments that are not valid Azure "
                f"deployment names (letters, digits, '-', '_', '.'; up to 64): {bad[:3]}"
            )

    def _check_replicas(self) -> None:
        if self.kind != "openai":
            raise ValueError(f"route {self.name!r}: replicas apply to openai routes only")
        if self.base_url:
            raise ValueError(f"route {self.name!r}: give base_url or replicas, not both")
        for replica in self.replicas:
            if not _is_http_url(replica.base_url):
                raise ValueError(
                    f"route {self.name!r}: a replica's base_url must be an http:// or https:// "
                    f"URL with a host, got {_shown_url(replica.base_url)}"
                )
        names = self.replica_names()
        if len(set(names)) != len(names):
            raise ValueError(f"route {self.name!r}: replica names must be unique")

    def _check_pd(self) -> None:
        assert self.pd is not None
        if self.kind != "openai":
            raise ValueError(f"route {self.name!r}: pd applies to openai routes only")
        if self.base_url or self.replicas:
            raise ValueError(f"route {self.name!r}: give pd, replicas or base_url, only one")
        for pool, replicas in (("prefill", self.pd.prefill), ("decode", self.pd.decode)):
            for replica in replicas:
                if not _is_http_url(replica.base_url):
                    raise ValueError(
                        f"route {self.name!r}: a {pool} server's base_url must be an http:// "
                        f"or https:// URL with a host, got {_shown_url(replica.base_url)}"
                    )
            names = pool_names(replicas)
            if len(set(names)) != len(names):
                raise ValueError(f"route {self.name!r}: {pool} server names must be unique")

    def replica_names(self) -> list[str]:
        """Each replica's name: its own, else its position (`0`, `1`, ...). Never its URL,
        which may carry a host an operator does not want in metrics."""
        return pool_names(self.replicas)

    def key_variables(self) -> set[str]:
        """Every variable this route reads a key from (its own, its replicas')."""
        found = {self.api_key_env} if self.api_key_env else set()
        servers = [*self.replicas, *(self.pd.prefill + self.pd.decode if self.pd else ())]
        return found | {r.api_key_env for r in servers if r.api_key_env}

    def credential_variables(self) -> set[str]:
        """Variables besides keys that this route's credentials come from, when set."""
        return {GOOGLE_CREDENTIALS_VARIABLE} if self.kind == "vertex" else set()

    def serves_anthropic_files(self) -> bool:
        """Whether this route serves Anthropic's Files API (`anthropic` routes, unless their
        `passthrough` leaves `files` out)."""
        return self.kind == "anthropic" and (
            self.passthrough is None or "files" in self.passthrough
        )

    def allows_passthrough(self, family: str) -> bool:
        """Whether this route forwards `/v1/<family>/...` (only `openai` routes, and `azure`
        ones for the families Azure serves, forward any)."""
        if self.kind == "azure" and family not in AZURE_FAMILIES:
            return False
        return self.kind in PASSTHROUGH_KINDS and (
            self.passthrough is None or family in self.passthrough
        )

    def matches(self, model: str) -> bool:
        return any(p == model or fnmatch.fnmatchcase(model, p) for p in self.models)

    def upstream_model(self, model: str) -> str:
        return self.model_map.get(model, model)


def pool_names(replicas: Sequence[Replica]) -> list[str]:
    """Each server's name: its own, else its position (`0`, `1`, ...)."""
    return [r.name or str(i) for i, r in enumerate(replicas)]


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # e.g. a malformed IPv6 literal
        return False


def _shown_url(url: str) -> str:
    """The URL for an error message, unless it may carry credentials (user:password@)."""
    return "a URL with credentials in it" if "@" in url else repr(url)


def check_routes(routes: Sequence[Route]) -> None:
    """Names are unique and every fallback names a route; raises ValueError saying which."""
    names: set[str] = set()
    for route in routes:
        if route.name in names:
            raise ValueError(f"route name {route.name!r} is used twice")
        names.add(route.name)
    for route in routes:
        for fallback in route.fallbacks:
            if fallback not in names:
                raise ValueError(f"route {route.name!r} names unknown fallback {fallback!r}")


class RouteTable:
    """Ordered routes with lookup by model and by name."""

    def __init__(self, routes: Sequence[Route]) -> None:
        check_routes(routes)
        self.routes = list(routes)
        self.by_name = {r.name: r for r in routes}
        self._chains = {r.name: tuple(_chain(r, self.by_name)) for r in routes}
        self._matched: dict[str, Route | None] = {}
        self._matched_bytes = 0

    def match(self, model: str) -> Route | None:
        try:
            return self._matched[model]
        except KeyError:
            pass
        route = next((r for r in self.routes if r.matches(model)), None)
        # Model names are few in practice, but they are client input: bound entries and bytes.
        if (
            len(model) <= MATCH_CACHE_NAME_CHARS
            and len(self._matched) < MATCH_CACHE_SIZE
            and self._matched_bytes + len(model) <= MATCH_CACHE_BYTES
        ):
            self._matched[model] = route
            self._matched_bytes += len(model)
        return route

    def chain(self, route: Route) -> list[Route]:
        """The route followed by its fallbacks, each once (worked out once, at start-up)."""
        known = self._chains.get(route.name)
        return list(known) if known is not None else _chain(route, self.by_name)

    def first_of_kind(self, kind: str) -> Route | None:
        return next((r for r in self.routes if r.kind == kind), None)


def _chain(route: Route, by_name: dict[str, Route]) -> list[Route]:
    seen, out = set(), []
    for r in [route, *(by_name[f] for f in route.fallbacks)]:
        if r.name not in seen:
            seen.add(r.name)
            out.append(r)
    return out


PROVIDER_DEFAULTS = (
    (
        "OPENAI_API_KEY",
        Route(
            name="openai",
            models=("*",),
            kind="openai",
            base_url="https://api.openai.com/v1",
            api_key_env="OPENAI_API_KEY",
        ),
    ),
    (
        "ANTHROPIC_API_KEY",
        Route(
            name="anthropic",
            models=("claude-*",),
            kind="anthropic",
            base_url="https://api.anthropic.com/v1",
            api_key_env="ANTHROPIC_API_KEY",
        ),
    ),
    (
        "GEMINI_API_KEY",
        Route(name="gemini", models=("gemini-*",), kind="gemini", api_key_env="GEMINI_API_KEY"),
    ),
    (
        "DEEPSEEK_API_KEY",
        Route(
            name="deepseek",
            models=("deepseek-*",),
            kind="openai",
            base_url="https://api.deepseek.com/v1",
            api_key_env="DEEPSEEK_API_KEY",
        ),
    ),
)


def default_routes(present: Container[str]) -> list[Route]:
    """Routes for the provider key variables `present` (set and not empty); OpenAI's catch-all
    goes last so specific patterns win."""
    routes = [route for variable, route in PROVIDER_DEFAULTS if variable in present]
    routes.sort(key=lambda r: r.models == ("*",))
    return routes


PROVIDER_KEY_VARIABLES: tuple[str, ...] = tuple(variable for variable, _ in PROVIDER_DEFAULTS)

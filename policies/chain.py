"""The policy chain: run the configured policies in order and report what they did.

Built once at start-up by ``build_chain`` (where every option is validated), then called on
every request. Pure and synchronous: no I/O, and the input body is never mutated. The output is a
new top-level dict; objects a policy did not change may be shared with the input, so treat both
as read-only.

Anthropic Messages and OpenAI Responses bodies are lifted into a chat-shaped view, run through
the same policies and lowered back (``policies.shapes``); token counts and fingerprints are taken
on the views, so the reports mean the same for every shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from policies.cache_hints import CacheHintsPolicy, prefix_family_key
from policies.canonicalize import CanonicalizePolicy
from policies.config import POLICY_NAMES, PolicyConfigError, PolicyOptions, parse_options
from policies.diagnostics import PrefixFingerprints
from policies.provider_limits import cache_family
from policies.readable import unreadable
from policies.shapes import lift, lower
from policies.slim import SlimPolicy
from policies.tokens import (
    TOKENS_FOR_REPLY,
    count_message,
    count_request_tokens,
    has_uncounted_text,
)
from policies.volatile import is_volatile_note


@dataclass(frozen=True)
class PolicyContext:
    """Where a request goes. ``cache_family`` (``policies.provider_limits``) is derived from the
    route kind, the model and the route's ``base_url`` unless given."""

    endpoint: str  # "chat" | "completions" | "messages" | "responses"
    route_kind: str  # "openai" | "anthropic" | "local" | "azure" | ...
    model: str  # the model name as the upstream will see it
    tenant: str
    base_url: str | None = None
    cache_family: str = ""

    def __post_init__(self) -> None:
        if not self.cache_family:
            family = cache_family(self.route_kind, self.model, self.base_url)
            object.__setattr__(self, "cache_family", family)


@dataclass
class PolicyResult:
    """What a chain did. ``transform`` fills the body and cache key; the report (token counts,
    fingerprints) is computed by ``measure``, which a gateway may run after it has sent the
    body upstream, so that counting never delays the first token.

    ``body`` is what to send, in the client's shape; ``view`` and ``original_view`` are the
    chat-shaped views after and before the policies (the bodies themselves for chat), which
    ``measure`` reads.

    ``cache_key`` names the prefix family in the diagnostics store: the client's (or a
    policy's) ``prompt_cache_key``, else the family key of ``view`` for ``family`` (tenant,
    model), derived when first read. Only the report reads it, and deriving it masks and digests
    the whole system prompt (0.2 ms for a 2,000-word one seen the first time), so a request
    whose body does not carry the key no longer waits for it before it is sent."""

    body: dict
    applied: list[str]
    prompt_tokens_before: int = 0
    prompt_tokens_after: int = 0
    given_cache_key: str | None = None
    family: tuple[str, str] | None = field(default=None, repr=False)
    fingerprints: PrefixFingerprints | None = None
    notes: dict = field(default_factory=dict)
    original: dict | None = field(default=None, repr=False)
    view: dict | None = field(default=None, repr=False)
    original_view: dict | None = field(default=None, repr=False)
    measured: bool = False

    @property
    def prompt_tokens_saved(self) -> int:
        return self.prompt_tokens_before - self.prompt_tokens_after

    @property
    def cache_key(self) -> str | None:
        if self.given_cache_key is None and self.family is not None:
            tenant, model = self.family
            view = self.view if self.view is not None else self.body
            self.given_cache_key = prefix_family_key(view, tenant, model)
        return self.given_cache_key

    def counts_new_text(self) -> bool:
        """Whether `measure` would count a long text for the first time (milliseconds of
        tokenizing, worth running off an event loop)."""
        return not self.measured and has_uncounted_text(self._before())

    def _before(self) -> dict:
        """The chat-shaped body before the policies (the body itself when none was kept)."""
        if self.original_view is not None:
            return self.original_view
        if self.original is not None:
            return self.original
        return self.view if self.view is not None else self.body

    def measure(self, *, fingerprints: bool = True) -> PolicyResult:
        """Count tokens before and after, and fingerprint the prefix (idempotent)."""
        if not self.measured:
            after = self.view if self.view is not None else self.body
            self.prompt_tokens_before = count_request_tokens(self._before())
            self.fingerprints = PrefixFingerprints.from_body(after) if fingerprints else None
            self.prompt_tokens_after = _tokens_after(after, self.fingerprints)
            _ = self.cache_key  # derived here, with the rest of the report
            self.measured = True
        return self


MAX_CACHE_KEY_CHARS = 64


def bounded_cache_key(key: str) -> str:
    """A client's `prompt_cache_key` names a prefix family in the diagnostics store; a long one
    is hashed so that a client cannot make the gateway hold (or Redis key) megabytes per family."""
    if len(key) <= MAX_CACHE_KEY_CHARS:
        return key
    return "h-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:40]


class Policy(Protocol):
    name: str

    def apply(self, body: dict, ctx: PolicyContext) -> tuple[dict, dict]: ...


class PolicyChain:
    """An ordered list of policies with their validated options."""

    def __init__(self, policies: Sequence[Policy], options: PolicyOptions) -> None:
        self.policies = tuple(policies)
        self.names: tuple[str, ...] = tuple(policy.name for policy in self.policies)
        self.options = options

    def __repr__(self) -> str:
        return f"PolicyChain({', '.join(self.names) or 'none'})"

    def transform(self, body: dict, ctx: PolicyContext) -> PolicyResult:
        """Transform ``body`` (what the upstream needs); the report waits for ``measure``.
        Raises ``PolicyShapeError`` for a body whose containers the policies cannot read."""
        view = lift(body, ctx.endpoint)
        problem = unreadable(view)
        if problem is not None:
            raise problem
        current = dict(view)
        notes: dict[str, Any] = {}
        for policy in self.policies:
            current, policy_notes = policy.apply(current, ctx)
            if policy_notes:
                notes[policy.name] = policy_notes
        client_key = current.get("prompt_cache_key")
        given = (
            bounded_cache_key(client_key) if isinstance(client_key, str) and client_key else None
        )
        return PolicyResult(
            body=lower(current, body, ctx.endpoint),
            applied=list(self.names),
            given_cache_key=given,
            family=None if given else (ctx.tenant, ctx.model),
            notes=notes,
            original=body,
            view=current,
            original_view=view,
        )

    def apply(self, body: dict, ctx: PolicyContext, *, fingerprints: bool = True) -> PolicyResult:
        """Transform ``body`` and measure the result; ``fingerprints=False`` skips the
        diagnostics fingerprints."""
        return self.transform(body, ctx).measure(fingerprints=fingerprints)


def _tokens_after(body: dict, prints: PrefixFingerprints | None) -> int:
    """``count_request_tokens(body)``, reusing the per-block counts the fingerprints hold."""
    messages = body.get("messages")
    if prints is None or not isinstance(messages, list):
        return count_request_tokens(body)
    counted = sum(block.tokens for block in prints.blocks if block.kind != "params")
    notes = sum(count_message(message) for message in messages if is_volatile_note(message))
    return TOKENS_FOR_REPLY + counted + notes


def build_chain(names: Sequence[str], options: PolicyOptions | Mapping[str, object]) -> PolicyChain:
    """Build the chain from parsed options, or from environment-style strings (keys without
    FIRSTTOKEN_), which are validated first."""
    parsed = options if isinstance(options, PolicyOptions) else parse_options(options)
    policies: list[Policy] = []
    for name in names:
        if name == "slim":
            policies.append(SlimPolicy(parsed.slim))
        elif name == "canonicalize":
            policies.append(CanonicalizePolicy(parsed.canonicalize))
        elif name == "cache_hints":
            policies.append(CacheHintsPolicy(parsed.cache_hints.head_ttl))
        else:
            known = ", ".join(POLICY_NAMES)
            raise PolicyConfigError(
                f"FIRSTTOKEN_POLICIES: unknown policy {name!r} (known: {known})"
            )
    if len(set(names)) != len(names):
        raise PolicyConfigError(f"FIRSTTOKEN_POLICIES: a policy is listed twice in {list(names)}")
    return PolicyChain(policies, parsed)

"""The request as each opt-in would have rewritten it: the advisor's shadow transforms.

A variant runs the request's own chain (minus ``cache_hints``, whose markers and cache key are
not part of a fingerprint) over the ORIGINAL chat-shaped view, with the gateway's options plus
one opt-in (or all of them), and fingerprints the result like the diagnostics do. Pure and
synchronous: the caller runs it off the event loop. Nothing here touches what is sent.

Most requests give an opt-in nothing to act on (no JSON, no passages, no tools, no volatile
value in a system message): such a variant IS the observed request, so it is not run at all
(`active_opt_ins`); only what an opt-in could change costs a transform and fingerprints.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from policies import PolicyChain, PolicyContext, PolicyResult, build_chain, prefix_family_key
from policies.chain import bounded_cache_key
from policies.config import PolicyOptions
from policies.diagnostics import PrefixFingerprints
from policies.passages import has_passage
from policies.provider_limits import CACHE_FAMILIES
from policies.request import (
    SYSTEM_ROLES,
    content_texts,
    messages_of,
    role_of,
    tool_function_name,
    tools_of,
)
from policies.volatile import has_volatile, is_volatile_note

# opt-in option name (as in FIRSTTOKEN_<name>) -> (policy, field of its options)
OPT_INS: dict[str, tuple[str, str]] = {
    "SLIM_MINIFY_JSON": ("slim", "minify_json"),
    "SLIM_DEDUPE_PASSAGES": ("slim", "dedupe_passages"),
    "CANONICALIZE_SORT_TOOLS": ("canonicalize", "sort_tools"),
    "CANONICALIZE_SORT_SCHEMA_KEYS": ("canonicalize", "sort_schema_keys"),
    "CANONICALIZE_SORT_PASSAGES": ("canonicalize", "sort_passages"),
    "CANONICALIZE_VOLATILE": ("canonicalize", "volatile"),
}
ALL_OPT_INS = "all_opt_ins"
OBSERVED = "observed"
VARIANTS: tuple[str, ...] = (*OPT_INS, ALL_OPT_INS)
_SHADOW_POLICIES = ("slim", "canonicalize")


def variant_options(base: PolicyOptions, variant: str) -> PolicyOptions:
    """``base`` with one opt-in (or, for ``all_opt_ins``, every opt-in) turned on."""
    names = tuple(OPT_INS) if variant == ALL_OPT_INS else (variant,)
    options = base
    for name in names:
        policy, field = OPT_INS[name]
        part = dataclasses.replace(getattr(options, policy), **{field: True})
        options = dataclasses.replace(options, **{policy: part})
    return options


@dataclass(frozen=True)
class RouteGuess:
    """What the advisor knows of the route: ``report_headers`` gets the chain's result only.

    ``kind`` is the route's cache family (``policies.provider_limits``), as ``cache_hints``
    noted it; without that policy it is guessed from the endpoint (Messages: anthropic, else
    openai rules). ``model`` is the model name in the body, which is the client's (an alias
    may hide the upstream's)."""

    kind: str
    endpoint: str
    model: str


def guess_route(result: PolicyResult) -> RouteGuess:
    original = result.original if result.original is not None else result.body
    native = result.original_view is not None and result.original_view is not original
    endpoint = ("responses" if "input" in original else "messages") if native else "chat"
    hints = result.notes.get("cache_hints") or {}
    view = result.view if result.view is not None else result.body
    family = hints.get("family")
    if isinstance(family, str) and family in CACHE_FAMILIES:
        kind = family
    elif "prompt_cache_key" in hints:
        kind = "openai"
    elif "breakpoints" in hints or "client_breakpoints" in hints:
        kind = "anthropic"
    else:
        kind = "anthropic" if endpoint == "messages" else "openai"
    model = view.get("model") if isinstance(view.get("model"), str) else ""
    return RouteGuess(kind, endpoint, model or "")


def active_opt_ins(original: dict, observed: dict) -> frozenset[str] | None:
    """The opt-ins that could change this request; None where its shape is not a chat body
    (then any may). The test of each is a superset of what the opt-in acts on, so an opt-in
    left out leaves the request exactly as the chain did.

    Slim's opt-ins read the client's texts, canonicalize's the slimmed ones (slim runs first),
    which are the observed request's: ``cache_hints`` after them moves no text."""
    original_messages, observed_messages = messages_of(original), messages_of(observed)
    if original_messages is None or observed_messages is None:
        return None
    texts = [t for body in (original_messages, observed_messages) for t in _texts(body)]
    tools = tools_of(observed) or ()
    active = set()
    if any("{" in text or "[" in text for text in texts):  # a JSON document or block
        active.add("SLIM_MINIFY_JSON")
    if any(has_passage(text) for text in texts):
        active.update(("SLIM_DEDUPE_PASSAGES", "CANONICALIZE_SORT_PASSAGES"))
    names = [tool_function_name(tool) for tool in tools]
    if any(a > b for a, b in itertools.pairwise(names)):  # sorting would move one
        active.add("CANONICALIZE_SORT_TOOLS")
    if tools:
        active.add("CANONICALIZE_SORT_SCHEMA_KEYS")
    if any(has_volatile(text) for text in _system_texts(observed_messages)):
        active.add("CANONICALIZE_VOLATILE")
    return frozenset(active)


def _texts(messages: list) -> list[str]:
    return [t for m in messages if isinstance(m, dict) for t in content_texts(m.get("content"))]


def _system_texts(messages: list) -> list[str]:
    return [
        text
        for message in messages
        if role_of(message) in SYSTEM_ROLES and not is_volatile_note(message)
        for text in content_texts(message.get("content"))
    ]


class ShadowChains:
    """Chains for each (policy names, variant), built once: ``build_chain`` validates."""

    def __init__(self, base: PolicyOptions | None = None) -> None:
        self.base = base or PolicyOptions()
        self._chains: dict[tuple[tuple[str, ...], str], PolicyChain] = {}
        # Each variant's options, and the first variant with the same ones (made once: a
        # request's evaluation only looks them up).
        options = {variant: variant_options(self.base, variant) for variant in VARIANTS}
        first: dict[PolicyOptions, str] = {self.base: OBSERVED}
        self._same_as = {
            variant: first.setdefault(options[variant], variant) for variant in VARIANTS
        }

    def chain(self, names: tuple[str, ...], variant: str) -> PolicyChain:
        key = (names, variant)
        chain = self._chains.get(key)
        if chain is None:
            chain = build_chain(names, variant_options(self.base, variant))
            self._chains[key] = chain
        return chain

    def fingerprints(
        self, result: PolicyResult, route: RouteGuess, tenant: str
    ) -> tuple[str, dict[str, PrefixFingerprints]]:
        """The advisor's family, and the fingerprints: ``observed`` (the chain's own) and one
        entry per variant. A variant whose options equal the gateway's (the opt-in is on
        already) reuses ``observed``."""
        observed = result.fingerprints
        if observed is None:
            raise ValueError("the policy result was measured without fingerprints")
        names = tuple(name for name in result.applied if name in _SHADOW_POLICIES)
        view = result.original_view if result.original_view is not None else result.original
        if view is None:
            raise ValueError("the policy result holds no original body")
        ctx = PolicyContext(
            route.endpoint, route.kind, route.model, tenant, cache_family=route.kind
        )
        observed_view = result.view if result.view is not None else view
        out = {OBSERVED: observed}
        seen: dict[str, tuple[PrefixFingerprints, dict]] = {OBSERVED: (observed, observed_view)}
        active = active_opt_ins(view, observed_view)
        same_as = self._same_as
        if active is not None:
            same_as = {
                variant: OBSERVED
                if (not active if variant == ALL_OPT_INS else variant not in active)
                else same
                for variant, same in same_as.items()
            }
        for variant in VARIANTS:
            same = same_as[variant]
            done = seen.get(same)
            if done is None:
                current = dict(view)
                for policy in self.chain(names, variant).policies:
                    current, _ = policy.apply(current, ctx)
                done = seen[same] = (PrefixFingerprints.from_body(current), current)
            out[variant] = done[0]
        family = advisor_family(result, seen[same_as[ALL_OPT_INS]][1], tenant, route.model)
        return family, out


def advisor_family(result: PolicyResult, all_opt_ins_view: dict, tenant: str, model: str) -> str:
    """The family the advisor counts a request in: the client's ``prompt_cache_key`` when it set
    one, else the prefix family of the request as all opt-ins would have rewritten it.

    Not the chain's own ``cache_key``: that hashes the passage tags in the order the client sent
    them, so a client that shuffles its retrieved passages gets a new family every request,
    which is exactly the sloppiness the advisor has to see through."""
    original = result.original_view if result.original_view is not None else result.original
    client_key = (original or {}).get("prompt_cache_key")
    if isinstance(client_key, str) and client_key:
        return bounded_cache_key(client_key)
    return prefix_family_key(all_opt_ins_view, tenant, model)

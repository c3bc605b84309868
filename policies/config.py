"""Policy names and option parsing, validated once at start-up.

Every setting reaches us as a raw environment string. Parsing it here, before the first request,
means a typo such as ``FIRSTTOKEN_SLIM_MINIFY_JSN`` stops the gateway with a message that names
the variable, instead of silently running without the opt-in.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

# The one definition of the variables' prefix: the gateway imports it from here, since the
# policies may not import the gateway.
ENV_PREFIX = "FIRSTTOKEN_"
POLICY_NAMES: tuple[str, ...] = ("slim", "canonicalize", "cache_hints")
# Every policy in the default chain runs only its safe parts unless an opt-in is set.
DEFAULT_POLICIES: tuple[str, ...] = ("slim", "canonicalize", "cache_hints")
_NO_POLICIES = "none"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
CACHE_TTLS = ("5m", "1h")


class PolicyConfigError(ValueError):
    """A policy setting is invalid; the message names the variable and what is wrong."""


@dataclass(frozen=True)
class SlimOptions:
    minify_json: bool = False
    dedupe_passages: bool = False
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class CanonicalizeOptions:
    sort_tools: bool = False
    sort_schema_keys: bool = False
    volatile: bool = False
    sort_passages: bool = False


@dataclass(frozen=True)
class CacheHintsOptions:
    # TTL of the Anthropic breakpoints on tools and system prompt; messages always use 5m.
    head_ttl: str = "5m"


@dataclass(frozen=True)
class PolicyOptions:
    slim: SlimOptions = SlimOptions()
    canonicalize: CanonicalizeOptions = CanonicalizeOptions()
    cache_hints: CacheHintsOptions = CacheHintsOptions()


# option key (without FIRSTTOKEN_) -> (policy, field, kind, what it does)
_OPTION_SPECS: dict[str, tuple[str, str, str, str]] = {
    "SLIM_MINIFY_JSON": (
        "slim",
        "minify_json",
        "bool",
        "opt-in: minify JSON in tool results and json blocks",
    ),
    "SLIM_DEDUPE_PASSAGES": (
        "slim",
        "dedupe_passages",
        "bool",
        "opt-in: replace repeated <passage> bodies",
    ),
    "SLIM_MAX_PROMPT_TOKENS": (
        "slim",
        "max_prompt_tokens",
        "positive_int",
        "opt-in: trim history to this many prompt tokens",
    ),
    "CANONICALIZE_SORT_TOOLS": (
        "canonicalize",
        "sort_tools",
        "bool",
        "opt-in: sort tools by name",
    ),
    "CANONICALIZE_SORT_SCHEMA_KEYS": (
        "canonicalize",
        "sort_schema_keys",
        "bool",
        "opt-in: sort object keys in tool definitions",
    ),
    "CANONICALIZE_VOLATILE": (
        "canonicalize",
        "volatile",
        "bool",
        "opt-in: move clocks and ids out of the system prompt",
    ),
    "CANONICALIZE_SORT_PASSAGES": (
        "canonicalize",
        "sort_passages",
        "bool",
        "opt-in: stable order for adjacent <passage> runs",
    ),
    "CACHE_HINTS_HEAD_TTL": (
        "cache_hints",
        "head_ttl",
        "ttl",
        "TTL of Anthropic breakpoints on tools and system (5m or 1h)",
    ),
}
KNOWN_OPTIONS: tuple[str, ...] = tuple(_OPTION_SPECS)
# Every variable that starts with one of these belongs to a policy (FIRSTTOKEN_SLIM_...).
POLICY_OPTION_PREFIXES: tuple[str, ...] = tuple(name.upper() + "_" for name in POLICY_NAMES)


def option_docs() -> list[tuple[str, object, str]]:
    """(option key, default, what it does) for every policy option, for help texts."""
    defaults = PolicyOptions()
    return [
        (key, getattr(getattr(defaults, policy), field), doc)
        for key, (policy, field, _, doc) in _OPTION_SPECS.items()
    ]


def parse_policy_list(
    value: str | None, *, source: str = f"{ENV_PREFIX}POLICIES"
) -> tuple[str, ...]:
    """Parse an ordered, comma-separated policy list; ``None`` means unset (the default chain).

    ``source`` names where the value came from (the variable, a route, a header) for the error.
    """
    if value is None:
        return DEFAULT_POLICIES
    names = [part.strip().lower() for part in value.split(",")]
    names = [name for name in names if name]
    if not names or names == [_NO_POLICIES]:
        return ()
    seen: list[str] = []
    for name in names:
        if name == _NO_POLICIES:
            raise PolicyConfigError(
                f"{source}: 'none' cannot be combined with other policies, got {value!r}"
            )
        if name not in POLICY_NAMES:
            known = ", ".join(POLICY_NAMES)
            raise PolicyConfigError(
                f"{source}: unknown policy {name!r} (known: {known}), got {value!r}"
            )
        if name in seen:
            raise PolicyConfigError(f"{source}: policy {name!r} listed twice, got {value!r}")
        seen.append(name)
    return tuple(seen)


def parse_options(options: Mapping[str, object]) -> PolicyOptions:
    """Validate every policy option in ``options`` (keys without the FIRSTTOKEN_ prefix).

    Keys that belong to no policy are ignored (the caller may pass the whole environment);
    keys that start with a policy's prefix but name no known option are rejected as typos.
    """
    fields: dict[str, dict[str, object]] = {name: {} for name in POLICY_NAMES}
    for raw_key, raw_value in options.items():
        key = raw_key.upper()
        if key.startswith(ENV_PREFIX):
            key = key[len(ENV_PREFIX) :]
        spec = _OPTION_SPECS.get(key)
        if spec is None:
            if key.startswith(POLICY_OPTION_PREFIXES):
                raise PolicyConfigError(f"{ENV_PREFIX}{key}: unknown policy option{_hint(key)}")
            continue
        policy, field, kind, _ = spec
        fields[policy][field] = _parse_value(ENV_PREFIX + key, raw_value, kind)
    # Each value was parsed to its field's kind above; the dict's type cannot say which.
    return PolicyOptions(
        slim=SlimOptions(**fields["slim"]),  # type: ignore[arg-type]
        canonicalize=CanonicalizeOptions(**fields["canonicalize"]),  # type: ignore[arg-type]
        cache_hints=CacheHintsOptions(**fields["cache_hints"]),  # type: ignore[arg-type]
    )


def _hint(key: str) -> str:
    close = difflib.get_close_matches(key, KNOWN_OPTIONS, n=1)
    if close:
        return f" (did you mean {ENV_PREFIX}{close[0]}?)"
    return f" (known: {', '.join(ENV_PREFIX + k for k in KNOWN_OPTIONS)})"


def _parse_value(variable: str, raw: object, kind: str) -> object:
    text = str(raw).strip()
    if kind == "bool":
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise PolicyConfigError(f"{variable}: expected true or false, got {raw!r}")
    if kind == "positive_int":
        if text == "":
            return None
        try:
            number = int(text)
        except ValueError:
            number = 0
        if number <= 0:
            raise PolicyConfigError(f"{variable}: expected a positive integer, got {raw!r}")
        return number
    if kind == "ttl":
        if text not in CACHE_TTLS:
            raise PolicyConfigError(
                f"{variable}: expected one of {', '.join(CACHE_TTLS)}, got {raw!r}"
            )
        return text
    raise AssertionError(f"unknown option kind {kind}")

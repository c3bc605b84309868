"""Parsing the gateway's keys (`FIRSTTOKEN_TENANT_KEYS`, `FIRSTTOKEN_ADMIN_KEYS`) into digests.

Keys are kept only as SHA-256 digests from the moment they are read, so no key can leak through
logs, errors, metrics or a dump of the settings. It lives with the configuration, which parses
them, rather than with `gateway.boundary.auth`, which looks requests up by the same `digest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Set

from policies.config import ENV_PREFIX


def digest(key: str) -> bytes:
    """The form in which a key is stored and looked up."""
    return hashlib.sha256(key.encode()).digest()


def parse_tenant_keys(value: str, variable: str = f"{ENV_PREFIX}TENANT_KEYS") -> dict[bytes, str]:
    """`tenant:key,tenant:key` -> {sha256(key): tenant}. The key may itself contain ':'.
    A tenant may have several keys (rotation); a key that names two tenants is refused, and
    the message names the tenants, never the key."""
    table: dict[bytes, str] = {}
    if not value.strip(" ,\t\n"):
        raise ValueError(_no_key(variable))
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        if not sep or not tenant.strip() or not key.strip():
            raise ValueError(
                f"{variable}: expected 'tenant:key' entries, got an entry without both parts"
            )
        if tenant.strip() == "*":
            raise ValueError(f"{variable}: '*' is not a tenant name (it means all tenants)")
        key_digest, tenant = digest(key.strip()), tenant.strip()
        other = table.setdefault(key_digest, tenant)
        if other != tenant:
            first, second = sorted((other, tenant))
            raise ValueError(
                f"{variable}: tenants {first!r} and {second!r} share a key; "
                "each key must belong to one tenant"
            )
    return table


def parse_admin_keys(value: str, variable: str = f"{ENV_PREFIX}ADMIN_KEYS") -> frozenset[bytes]:
    """`key,key` -> their digests. A list that is set but holds no key is refused: whoever set
    it meant to have keys, and `' ,'` would otherwise pass as none at all."""
    keys = frozenset(digest(k.strip()) for k in value.split(",") if k.strip())
    if not keys:
        raise ValueError(_no_key(variable))
    return keys


def _no_key(variable: str) -> str:
    return f"{variable}: set, but holds no key; give at least one, or unset it"


def tenants_holding(tenant_keys: Mapping[bytes, str], keys: Set[bytes]) -> list[str]:
    """The tenants whose key is also in `keys` (say, an admin key), sorted."""
    return sorted({tenant for key_digest, tenant in tenant_keys.items() if key_digest in keys})

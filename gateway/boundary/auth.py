"""Gateway keys -> tenants.

Keys are kept only as SHA-256 digests and looked up by digest, so no key can leak through logs,
errors, metrics or a dump of the settings, and lookup time says nothing about a key's bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Set

from starlette.requests import Request

from gateway.errors import GatewayError
from policies.config import ENV_PREFIX

DEFAULT_TENANT = "default"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_tenant_keys(value: str, variable: str = f"{ENV_PREFIX}TENANT_KEYS") -> dict[bytes, str]:
    """`tenant:key,tenant:key` -> {sha256(key): tenant}. The key may itself contain ':'.
    A tenant may have several keys (rotation); a key that names two tenants is refused, and
    the message names the tenants, never the key."""
    table: dict[bytes, str] = {}
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
        digest, tenant = _digest(key.strip()), tenant.strip()
        other = table.setdefault(digest, tenant)
        if other != tenant:
            first, second = sorted((other, tenant))
            raise ValueError(
                f"{variable}: tenants {first!r} and {second!r} share a key; "
                "each key must belong to one tenant"
            )
    return table


def parse_admin_keys(value: str) -> frozenset[bytes]:
    return frozenset(_digest(k.strip()) for k in value.split(",") if k.strip())


def tenants_holding(tenant_keys: Mapping[bytes, str], keys: Set[bytes]) -> list[str]:
    """The tenants whose key is also in `keys` (say, an admin key), sorted."""
    return sorted({tenant for digest, tenant in tenant_keys.items() if digest in keys})


def bearer_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


class KeyRing:
    """Resolves a request's bearer key to its tenant, and tells whether it is an admin key."""

    def __init__(self, tenant_keys: Mapping[bytes, str], admin_keys: Set[bytes]) -> None:
        self._tenants = tenant_keys
        self._admins = admin_keys

    @property
    def open(self) -> bool:
        """With no tenant keys configured the gateway runs open as tenant `default`."""
        return not self._tenants

    def tenant_for(self, request: Request) -> str:
        if self.open:
            return DEFAULT_TENANT
        key = bearer_key(request)
        if key is None:
            raise GatewayError(
                401, "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        tenant = self._tenants.get(_digest(key))
        if tenant is None:
            raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant

    def is_admin(self, request: Request) -> bool:
        key = bearer_key(request)
        return key is not None and _digest(key) in self._admins

"""Gateway keys -> tenants.

Keys are kept only as SHA-256 digests and looked up by digest, so no key can leak through logs,
errors, metrics or a dump of the settings, and lookup time says nothing about a key's bytes.
The configuration parses them into digests (`gateway.config.keys`); this module looks requests up.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from starlette.requests import Request

from gateway.config.keys import digest
from gateway.errors import GatewayError

DEFAULT_TENANT = "default"


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
        tenant = self._tenants.get(digest(key))
        if tenant is None:
            raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant

    def is_admin(self, request: Request) -> bool:
        key = bearer_key(request)
        return key is not None and digest(key) in self._admins

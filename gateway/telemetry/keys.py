"""Redis key names: hash-tagged per tenant, with names escaped so no input escapes its keys.

A tenant or route name goes into a key only in a safe form: verbatim when it is a
short run of `[A-Za-z0-9._-]`, otherwise `%` plus a hash of it. `%` is outside the
verbatim alphabet, so an escaped name can never equal a verbatim one, and no name
can put `:`, `{`, `}`, `*`, whitespace or unbounded length into a key. The real
names live as values in small name hashes, where any bytes are harmless.

A bucket of the `chat` API keeps the key it had before buckets were kept per API, so
figures recorded by an earlier version read as chat's; another API's bucket adds `:<api>`,
one of four fixed names (`event.APIS`), so a tenant's keys grow at most fourfold.

Every key of one tenant carries the same hash tag `{t=<tenant>}`, so Redis Cluster
keeps a tenant's buckets on one slot.
"""

from __future__ import annotations

import hashlib
import re

_VERBATIM = re.compile(r"[A-Za-z0-9._-]{1,64}")


def escape_name(name: str) -> str:
    """A key-safe, collision-free stand-in for an arbitrary tenant or route name."""
    if _VERBATIM.fullmatch(name):
        return name
    return "%" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class KeySpace:
    """All key names under one prefix (the prefix itself must be key-safe)."""

    def __init__(self, prefix: str) -> None:
        if not _VERBATIM.fullmatch(prefix):
            raise ValueError(
                f"telemetry key prefix must match [A-Za-z0-9._-]{{1,64}}, got {prefix!r}"
            )
        self.prefix = prefix

    def tenants(self) -> str:
        """Hash: escaped tenant -> tenant name."""
        return f"{self.prefix}:tenants"

    def _tag(self, tenant: str) -> str:
        return "{t=" + escape_name(tenant) + "}"

    def routes(self, tenant: str) -> str:
        """Hash: escaped route -> route name, for one tenant."""
        return f"{self.prefix}:routes:{self._tag(tenant)}"

    def apis(self, tenant: str) -> str:
        """Hash: api -> api, the APIs other than `chat` one tenant has buckets of (chat is
        always read, so a chat-only tenant has no such key)."""
        return f"{self.prefix}:apis:{self._tag(tenant)}"

    def bucket(self, tenant: str, route: str, minute: int, api: str = "chat") -> str:
        """Hash of counters for one tenant, route, minute and client API."""
        key = f"{self.prefix}:ttft:{self._tag(tenant)}:{escape_name(route)}:{minute}"
        return key if api == "chat" else f"{key}:{escape_name(api)}"

    def batch_marker(self, tenant: str, writer: str) -> str:
        """String: the newest batch number of one writer applied to a tenant (see redis_store)."""
        if not _VERBATIM.fullmatch(writer):
            raise ValueError(f"writer id must match [A-Za-z0-9._-]{{1,64}}, got {writer!r}")
        return f"{self.prefix}:applied:{self._tag(tenant)}:{writer}"

    def fingerprints(self, tenant: str, family: str) -> str:
        """String: the last prompt-prefix fingerprints of a tenant and model family."""
        return f"{self.prefix}:fp:{self._tag(tenant)}:{escape_name(family)}"

    def advice(self, tenant: str, family: str, bucket: int) -> str:
        """Hash of the cache advisor's counters for one tenant, prefix family and time bucket."""
        return f"{self.prefix}:adv:{self._tag(tenant)}:{escape_name(family)}:{bucket}"

    def advice_families(self, tenant: str) -> str:
        """Sorted set: a tenant's advised prefix families, scored by their newest bucket."""
        return f"{self.prefix}:advf:{self._tag(tenant)}"

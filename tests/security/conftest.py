"""Shared fixtures for the adversarial suite: two tenants and an admin in front of real loopback
servers (`mock_upstream` and `make_gateway` come from tests/conftest.py). Each
test file owns one class of attack; see the file names."""

from __future__ import annotations

import pytest

TENANT_A_KEY = "sk-acme-tenant-key-1"
TENANT_B_KEY = "sk-globex-tenant-key-2"
ADMIN_KEY = "sk-admin-key-3"
UPSTREAM_KEY = "sk-upstream-secret"  # what make_gateway puts in MOCK_KEY
TENANT_KEYS = f"acme:{TENANT_A_KEY},globex:{TENANT_B_KEY}"
SECRETS = (TENANT_A_KEY, TENANT_B_KEY, ADMIN_KEY, UPSTREAM_KEY)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def tenant_settings() -> dict:
    """Settings for a gateway in tenant mode (pass as **kwargs to make_gateway)."""
    return {"tenant_keys": TENANT_KEYS, "admin_keys": ADMIN_KEY}


@pytest.fixture
def hostile():
    """A hostile upstream on loopback whose answers each test scripts."""
    from tests.security.hostile_upstream import HostileServer

    with HostileServer() as server:
        yield server


@pytest.fixture
def witness():
    """A second loopback server: where a redirect points. It must never hear from us."""
    from tests.security.hostile_upstream import HostileServer

    with HostileServer() as server:
        yield server

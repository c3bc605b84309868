"""The mock Google server for the gemini and vertex route tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.mock_google import GoogleBehaviour, MockGoogle
from bench.mock_openai import ThreadedServer


@pytest.fixture
def google() -> Iterator[ThreadedServer]:
    """The mock Google server on a loopback port; `.mock` is its `MockGoogle`."""
    with ThreadedServer(MockGoogle(GoogleBehaviour())) as server:
        yield server

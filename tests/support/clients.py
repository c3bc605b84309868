"""The OpenAI SDK as an application uses it, pointed at a server under test."""

from __future__ import annotations

from typing import Any, Protocol

import openai


class Served(Protocol):
    @property
    def url(self) -> str: ...


def sdk_client(
    server: Served | str, key: str = "client-key", *, timeout: float = 20, **options: Any
) -> openai.OpenAI:
    """An `openai.OpenAI` for `server` (its root URL, or anything with a `.url`), `/v1` added.

    The SDK's own retries are off so that a test sees every answer the server gives, and the
    timeout is short so that a hang fails the test instead of stalling the run. `options`
    go to the SDK as they are (`default_headers`, `http_client`, ...)."""
    root = server if isinstance(server, str) else server.url
    return openai.OpenAI(
        base_url=root + "/v1", api_key=key, max_retries=0, timeout=timeout, **options
    )

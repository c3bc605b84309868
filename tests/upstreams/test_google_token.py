"""Vertex's access tokens: google-auth fetches them from a mock OAuth token endpoint with a JWT
grant signed by a service-account key made here; a background task refreshes them ahead of
expiry, so a request reads the token from memory and waits only when none is valid."""

from __future__ import annotations

import asyncio
import time

from gateway.upstreams.google_token import GoogleTokenSource
from tests.upstreams.google_support import service_account_file

DEADLINE_S = 20.0  # far past any refresh here (about 1 s), far short of a hang


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_token_is_refreshed_in_the_background_before_it_expires(google, tmp_path):
    path, _ = service_account_file(tmp_path, google)

    async def run() -> None:
        # Tokens last an hour; a margin of 3599 s makes the refresh due a second after each.
        source = GoogleTokenSource(str(path), margin_s=3599.0)
        await source.start()
        try:
            assert await source.token() == "ya29.mock-1"
            await until(lambda: source.refreshes >= 2, "a background refresh")
            left = source.seconds_left()
            assert left is not None and left > 3000  # the new token, well before expiry
            assert await source.token() == google.mock.tokens_issued[-1] != "ya29.mock-1"
            assert source.waited == 0  # no request ever waited on a refresh
        finally:
            await source.aclose()

    asyncio.run(run())


def test_a_request_does_not_wait_for_a_refresh_in_flight(google, tmp_path):
    path, _ = service_account_file(tmp_path, google)
    hold = asyncio.Event()
    google.mock.behaviour.hold_token = hold  # every grant after the first waits for it

    async def run() -> None:
        source = GoogleTokenSource(str(path), margin_s=3599.0)
        await source.start()
        try:
            await until(lambda: google.mock.token_requests >= 2, "the background refresh")
            # The refresh is held at the token endpoint; the valid token is served meanwhile.
            assert await asyncio.wait_for(source.token(), DEADLINE_S) == "ya29.mock-1"
            assert source.waited == 0 and source.refreshes == 1
            google.call(hold.set)
            await until(lambda: source.refreshes >= 2, "the held refresh to finish")
            assert await source.token() == "ya29.mock-2"
        finally:
            google.call(hold.set)
            await source.aclose()

    asyncio.run(run())


def test_without_a_valid_token_the_request_waits_for_one(google, tmp_path):
    path, _ = service_account_file(tmp_path, google)
    google.mock.behaviour.token_expires_in = 0  # every token is already expired

    async def run() -> None:
        source = GoogleTokenSource(str(path), margin_s=0.0)
        await source.start()
        try:
            token = await source.token()
            assert token in google.mock.tokens_issued and source.waited == 1
        finally:
            await source.aclose()

    asyncio.run(run())

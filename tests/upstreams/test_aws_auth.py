"""When `AwsSigner` waits for refreshed credentials and when it signs with those it holds."""

from __future__ import annotations

import asyncio
import threading

from botocore.credentials import ReadOnlyCredentials

from gateway.upstreams.aws_auth import MUST_REFRESH_S, AwsSigner

OLD = ReadOnlyCredentials("AKIDOLD", "old-secret", None)
NEW = ReadOnlyCredentials("AKIDNEW", "new-secret", "new-token")


class Expiring:
    """Refreshable credentials whose remaining life the test sets; a refresh blocks (on the
    worker thread) until the test releases it."""

    def __init__(self, seconds_left: float) -> None:
        self.seconds_left = seconds_left
        self.release = threading.Event()
        self.refreshes = 0
        self.loop_thread = threading.get_ident()
        self.refreshed_on: int | None = None

    def refresh_needed(self, refresh_in: float | None = None) -> bool:
        return self.seconds_left < (900 if refresh_in is None else refresh_in)

    def get_frozen_credentials(self) -> ReadOnlyCredentials:
        self.refreshes += 1
        self.refreshed_on = threading.get_ident()
        assert self.release.wait(10)
        return NEW


def signer_with(credentials: Expiring) -> AwsSigner:
    signer = AwsSigner("us-east-1")
    signer._credentials, signer._frozen = credentials, OLD
    return signer


async def test_advisory_refresh_signs_with_the_old_credentials_meanwhile():
    credentials = Expiring(seconds_left=300)  # inside botocore's advisory window only
    signer = signer_with(credentials)
    assert await signer.credentials() is OLD  # not waiting for the blocked refresh
    assert await signer.credentials() is OLD  # and one refresh at a time
    credentials.release.set()
    assert signer._refresh is not None
    assert await signer._refresh is NEW
    assert credentials.refreshes == 1 and credentials.refreshed_on != credentials.loop_thread
    credentials.seconds_left = 3600
    assert await signer.credentials() is NEW


async def test_credentials_about_to_expire_are_waited_for():
    credentials = Expiring(seconds_left=MUST_REFRESH_S / 2)
    signer = signer_with(credentials)
    waiting = asyncio.ensure_future(signer.credentials())
    await asyncio.sleep(0)
    assert not waiting.done()
    credentials.release.set()
    assert await waiting is NEW


async def test_signed_headers_carry_the_session_token_and_never_log_the_secret(caplog):
    caplog.set_level("DEBUG")
    credentials = Expiring(seconds_left=3600)
    signer = signer_with(credentials)
    signer._frozen = NEW
    headers = await signer.sign(
        "https://bedrock-runtime.us-east-1.amazonaws.com/model/m/converse",
        b"{}",
        {"content-type": "application/json"},
    )
    assert headers["X-Amz-Security-Token"] == "new-token"
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDNEW/")
    assert "/us-east-1/bedrock/aws4_request" in headers["Authorization"]
    signature = headers["Authorization"].rsplit("Signature=", 1)[1]
    assert not any(
        signature in r.getMessage() or "new-secret" in r.getMessage() for r in caplog.records
    )

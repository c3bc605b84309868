"""AWS credentials and SigV4 signatures for `bedrock` routes, both botocore's own.

The credentials come from botocore's standard chain (environment variables including
AWS_SESSION_TOKEN, the shared config and credentials files and their profiles, container and
instance roles); every request is signed by `botocore.auth.SigV4Auth` over an `AWSRequest`, and
the signed headers go on the gateway's own aiohttp request. Refreshable credentials (a role,
SSO, a process) are refreshed on a worker thread, never on the event loop: botocore's refresh
talks to an endpoint synchronously.

Nothing here logs a credential: botocore writes the canonical request and the signature to its
`botocore.auth` logger at DEBUG, so that logger is held at INFO unless the operator set it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import botocore.session
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials

log = logging.getLogger("firsttoken.upstream")

SIGNING_NAME = "bedrock"  # the service model's `signingName` (its endpoint prefix differs)
# Fewer seconds than this left on refreshable credentials: a request waits for the refresh.
MUST_REFRESH_S = 60
# Loggers that would write the signature, the canonical request or a refreshed credential.
QUIET_LOGGERS = ("botocore.auth", "botocore.credentials", "botocore.utils")


class NoAwsCredentials(RuntimeError):
    """botocore's chain found no credentials: the route cannot sign, so it does not start."""


def quiet_botocore() -> None:
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


class AwsSigner:
    """SigV4 signatures for one region with the credentials of botocore's chain.

    `start` resolves the chain once (off the loop: it may ask an instance-metadata endpoint);
    `sign` then costs a hash of the body and a few HMACs. A refresh that botocore asks for
    runs on a thread, one at a time; requests meanwhile sign with the credentials still valid,
    and wait only when botocore says they must not be used any more."""

    def __init__(self, region: str) -> None:
        quiet_botocore()
        self.region = region
        # botocore's Credentials or RefreshableCredentials (untyped library)
        self._credentials: Any = None
        self._frozen: ReadOnlyCredentials | None = None
        self._refresh: asyncio.Task[ReadOnlyCredentials] | None = None

    async def start(self) -> None:
        self._credentials = await asyncio.to_thread(self._resolve)
        self._frozen = await asyncio.to_thread(self._credentials.get_frozen_credentials)

    def _resolve(self) -> Any:
        """botocore's chain, as the AWS CLI walks it (AWS_PROFILE chooses the profile)."""
        session = botocore.session.Session()
        credentials = session.get_credentials()
        if credentials is None:
            raise NoAwsCredentials(
                "no AWS credentials found (environment, shared config/credentials files, "
                "container or instance role)"
            )
        return credentials

    async def credentials(self) -> ReadOnlyCredentials:
        """Frozen credentials for one request, refreshed off the loop when botocore asks."""
        credentials, frozen = self._credentials, self._frozen
        if credentials is None or frozen is None:
            raise NoAwsCredentials("the route's AWS credentials are not loaded yet")
        needs = getattr(credentials, "refresh_needed", None)
        if needs is None or not needs():
            return frozen
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(
                asyncio.to_thread(credentials.get_frozen_credentials)
            )
            self._refresh.add_done_callback(self._refreshed)
        if needs(MUST_REFRESH_S):
            return await asyncio.shield(self._refresh)
        return frozen

    def _refreshed(self, task: asyncio.Task[ReadOnlyCredentials]) -> None:
        if task.cancelled():
            return
        failure = task.exception()
        if failure is None:
            self._frozen = task.result()
        else:  # the credentials held stay in use; the next request asks again
            log.warning("refreshing the AWS credentials failed: %s", type(failure).__name__)

    async def sign(self, url: str, body: bytes, headers: Mapping[str, str]) -> dict[str, str]:
        """`headers` plus X-Amz-Date, X-Amz-Security-Token (with a session token) and the
        Authorization of a POST of `body` to `url`; every header given is signed."""
        frozen = await self.credentials()
        request = AWSRequest(method="POST", url=url, data=body, headers=dict(headers))
        SigV4Auth(frozen, SIGNING_NAME, self.region).add_auth(request)
        return dict(request.headers.items())

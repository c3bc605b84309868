"""OAuth access tokens for Vertex AI from Application Default Credentials, through google-auth.

google-auth finds the credentials (a service-account file named by
GOOGLE_APPLICATION_CREDENTIALS, gcloud's user credentials, or the metadata server of the machine
it runs on) and refreshes them; its refresh is blocking HTTP, so it runs in a thread. A
background task refreshes the token `margin_s` before it expires, so a request reads a valid
token from memory and never waits on a refresh, unless no valid token exists (the first
request after start-up failed to get one, or every background attempt since failed).

google-auth is imported only here, and only when a vertex route is built: it is the optional
extra `firsttoken[vertex]`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

log = logging.getLogger("firsttoken.upstream")

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
DEFAULT_MARGIN_S = 300.0  # refresh five minutes before expiry
RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # waits between failed background refreshes
MIN_REFRESH_GAP_S = 1.0  # a token endpoint that grants less than `margin_s` is not hammered
EXTRA_HINT = "pip install 'firsttoken[vertex]'"


class TokenUnavailable(Exception):
    """No valid token, and a refresh failed; the message names the exception type only (a
    token endpoint's answer may echo what it was sent)."""


def google_auth_installed() -> bool:
    try:
        import google.auth
        import google.auth.transport.requests  # noqa: F401
    except ImportError:
        return False
    return True


def _from_file(path: str, scopes: list[str]) -> Any:
    """Credentials from an ADC file, loaded by its own type's loader where it names one
    google-auth has (a service account, a gcloud user), else by google-auth's generic one."""
    import json

    import google.auth
    from google.oauth2 import credentials as user_credentials
    from google.oauth2 import service_account

    with open(path, "rb") as file:
        info = json.loads(file.read(1024 * 1024))
    kind = info.get("type") if isinstance(info, dict) else None
    if kind == "service_account":
        return service_account.Credentials.from_service_account_info(info, scopes=scopes)
    if kind == "authorized_user":
        return user_credentials.Credentials.from_authorized_user_info(info, scopes=scopes)
    credentials, _ = google.auth.load_credentials_from_file(path, scopes=scopes)
    return credentials


class GoogleTokenSource:
    """One set of credentials and its current token, refreshed ahead of expiry off the request
    path. `credentials_file`: a service-account (or other ADC) JSON file; None: ADC's search."""

    def __init__(
        self,
        credentials_file: str | None = None,
        *,
        margin_s: float = DEFAULT_MARGIN_S,
        scopes: tuple[str, ...] = SCOPES,
    ) -> None:
        self.credentials_file = credentials_file
        self.margin_s = margin_s
        self.scopes = scopes
        self.refreshes = 0  # completed refreshes (each one a call to the token endpoint)
        self.waited = 0  # requests that had to wait for a refresh (no valid token)
        self._credentials: Any = None
        self._request: Any = None
        self._refreshing: asyncio.Task | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Load the credentials and get a first token; start the background refresher."""
        if self._credentials is None:
            self._credentials, self._request = await asyncio.to_thread(self._load)
        failures = 0
        try:
            await self._refresh()
        except TokenUnavailable as exc:  # the route starts; requests wait for the next try
            failures = 1
            log.warning("vertex token: %s; retrying in the background", exc)
        if self._task is None:
            self._task = asyncio.create_task(self._keep_fresh(failures))

    def _load(self) -> tuple[Any, Any]:
        import google.auth
        import google.auth.transport.requests

        if self.credentials_file:
            credentials = _from_file(self.credentials_file, list(self.scopes))
        else:
            credentials, _ = google.auth.default(scopes=list(self.scopes))
        return credentials, google.auth.transport.requests.Request()

    async def aclose(self) -> None:
        for task in (self._task, self._refreshing):
            if task is not None:
                task.cancel()
        self._task = None

    def seconds_left(self) -> float | None:
        """Seconds until the current token expires (None: no token, or no expiry given)."""
        credentials = self._credentials
        if credentials is None or not getattr(credentials, "token", None):
            return None
        expiry = credentials.expiry
        if expiry is None:
            return None
        # google-auth keeps expiry as a naive UTC datetime
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        return (expiry - now).total_seconds()

    def _usable(self) -> bool:
        left = self.seconds_left()
        if left is None:
            return self._credentials is not None and bool(getattr(self._credentials, "token", ""))
        return left > 0

    async def token(self) -> str:
        """The current access token, from memory; a refresh is awaited only when none is valid."""
        if self._credentials is not None and self._usable():
            return self._credentials.token
        self.waited += 1
        await self._refresh()
        return self._credentials.token

    async def _refresh(self) -> None:
        """One refresh at a time: concurrent callers share the one in flight."""
        if self._credentials is None:
            raise TokenUnavailable("the Google credentials are not loaded")
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh_once())
        await asyncio.shield(self._refreshing)

    async def _refresh_once(self) -> None:
        try:
            await asyncio.to_thread(self._credentials.refresh, self._request)
        except Exception as exc:  # noqa: BLE001  # whatever google-auth raised, no token
            raise TokenUnavailable(
                f"refreshing the Google access token failed ({type(exc).__name__})"
            ) from None
        self.refreshes += 1

    def _next_refresh_in(self) -> float:
        left = self.seconds_left()
        if left is None:
            return 3000.0  # no expiry known: check again in 50 minutes
        return max(0.0, left - self.margin_s)

    async def _keep_fresh(self, failures: int) -> None:
        while True:
            wait = (
                self._next_refresh_in()
                if failures == 0
                else RETRY_S[min(failures, len(RETRY_S)) - 1]
            )
            await asyncio.sleep(max(wait, MIN_REFRESH_GAP_S))
            try:
                await self._refresh()
            except TokenUnavailable as exc:
                failures += 1
                log.warning("vertex token: %s; %d failures in a row", exc, failures)
            else:
                failures = 0

"""A start-up check of the telemetry Redis URL: a wrong URL is a settings error, not silence.

What can only be a mistake in the settings stops the gateway with a message that names the
variable: a URL that does not parse, a password the server refuses (or one it needs and did not
get), a database index it does not have, a cluster flag that does not match the server. A
server that does not answer is not a settings error (it may start later, or be restarted): the
check logs a warning and the gateway starts with telemetry degraded, buffering events and
showing the state in `/readyz` until Redis answers. The URL is never echoed with its password.
"""

from __future__ import annotations

import logging
import re

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.config.settings import SettingsError

log = logging.getLogger("firsttoken.telemetry")

_QUERY_SECRET = re.compile(r"(?i)(password|username)=[^&]*")


def redact_url(url: str) -> str:
    """The URL with any user, password or password query parameter replaced by `***`."""
    head, sep, tail = url.partition("//")
    if sep:
        authority, slash, rest = tail.partition("/")
        if "@" in authority:
            authority = "***@" + authority.rpartition("@")[2]
        url = f"{head}//{authority}{slash}{rest}"
    elif "@" in url:
        url = "***@" + url.rpartition("@")[2]
    return _QUERY_SECRET.sub(r"\1=***", url)


def check_redis_url(
    url: str, variable: str, timeout_s: float = 1.0, cluster: bool | None = None
) -> None:
    """Raise `SettingsError` naming `variable` if `url` cannot be a usable telemetry Redis;
    warn and return if the server is unreachable. With `cluster` given, also check that the
    server's cluster mode matches it. Blocks for at most a few `timeout_s`."""
    shown = redact_url(url)

    def wrong(reason: str) -> SettingsError:
        return SettingsError(f"{variable}={shown}: {reason}")

    if url.startswith(("redis://", "rediss://")):
        db = url.split("//", 1)[1].split("?", 1)[0].partition("/")[2]
        if db and not db.isdigit():  # redis-py would silently use database 0
            raise wrong(f"the database {db!r} in the URL path is not a number")
    try:
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
    except (ValueError, TypeError) as exc:
        raise wrong(f"not a valid Redis URL ({exc})") from None
    try:
        client.ping()
        if cluster is not None:
            _check_cluster_mode(client, cluster, wrong)
    except (TypeError, ValueError) as exc:  # an option in the query string redis-py rejects
        raise wrong(f"not a valid Redis URL ({exc})") from None
    except redis.exceptions.AuthenticationError as exc:
        raise wrong(f"Redis refused the credentials ({exc})") from None
    except redis.exceptions.BusyLoadingError:
        log.warning(
            "telemetry: Redis at %s (%s) is loading its data; telemetry starts "
            "degraded and catches up when it is ready",
            shown,
            variable,
        )
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        log.warning(
            "telemetry: Redis at %s (%s) is unreachable (%s); the gateway starts with "
            "telemetry degraded and buffers events until it answers",
            shown,
            variable,
            type(exc).__name__,
        )
    except redis.exceptions.ResponseError as exc:
        # DB index out of range, NOAUTH, NOPERM, SELECT in cluster mode: the server answered,
        # and it will answer the same way to every write.
        raise wrong(f"Redis refused the connection settings ({exc})") from None
    except redis.exceptions.RedisError as exc:  # e.g. an HTTP server on that port
        raise wrong(f"the server does not answer as Redis ({type(exc).__name__})") from None
    finally:
        client.close()


def _check_cluster_mode(client: redis.Redis, cluster: bool, wrong) -> None:
    try:
        enabled = bool(client.info("cluster").get("cluster_enabled"))
    except redis.exceptions.ResponseError:  # INFO renamed or not permitted: cannot tell
        return
    if enabled and not cluster:
        raise wrong("this Redis is a cluster node; set FIRSTTOKEN_REDIS_CLUSTER=true")
    if cluster and not enabled:
        raise wrong("FIRSTTOKEN_REDIS_CLUSTER is set but this Redis is not in cluster mode")

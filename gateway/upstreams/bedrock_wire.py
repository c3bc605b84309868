"""The Bedrock runtime's wire facts that need no botocore: which API a model speaks, its
request paths, and its errors (HTTP and in-stream) as the gateway's `UpstreamError`s.

Paths follow botocore's `bedrock-runtime` service model: `/model/{modelId}/invoke`,
`/invoke-with-response-stream`, `/converse`, `/converse-stream`, the model id one URI label,
percent-encoded like botocore's serializer does it (every byte but letters, digits and `-_.~`,
so an ARN's `:` and `/` travel as `%3A` and `%2F`).
"""

from __future__ import annotations

import re
from urllib.parse import quote

import orjson

from gateway.errors import error_body
from gateway.upstreams.base import UpstreamError, UpstreamTimeout

ANTHROPIC_VERSION = "bedrock-2023-05-31"
EVENT_STREAM = "application/vnd.amazon.eventstream"
# Cross-region inference profiles prefix a model id with a geography (`us.anthropic...`).
_GEO_PREFIXES = ("us.", "eu.", "apac.", "global.", "us-gov.", "jp.", "au.", "ca.")
# botocore's model-id pattern allows at most 2048 characters of this alphabet.
MODEL_ID_MAX_CHARS = 2048
_MODEL_ID = re.compile(r"[A-Za-z0-9._:/\-+]{1,2048}")
# What a Bedrock error body or header may add to a message: a short excerpt only.
MESSAGE_MAX_CHARS = 500


def is_anthropic_model(model_id: str) -> bool:
    """Claude on Bedrock (`anthropic.claude-...`, `us.anthropic...`, an ARN naming one):
    spoken through InvokeModel with Anthropic's own body; every other model through Converse."""
    name = model_id.rsplit("/", 1)[-1] if model_id.startswith("arn:") else model_id
    for prefix in _GEO_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name.startswith("anthropic.")


def model_path(model_id: str, action: str) -> str:
    """`/model/{modelId}/{action}`, the id validated and encoded as botocore puts it on the
    wire; a 400 for an id that is no Bedrock model id (never a path of its own)."""
    if not _MODEL_ID.fullmatch(model_id):
        raise UpstreamError(
            "the model id is not a valid Bedrock model id",
            status=400,
            retryable=False,
            body=orjson.dumps(
                error_body("not a valid Bedrock model id", "invalid_request_error", "model")
            ),
            content_type="application/json",
        )
    return f"/model/{quote(model_id, safe='-_.~')}/{action}"


# Bedrock's exception name -> (client status, OpenAI error type, retried before the first byte).
# Names are compared lower-cased: HTTP errors say `ThrottlingException`, stream events
# `throttlingException`.
ERRORS: dict[str, tuple[int, str, bool]] = {
    "throttlingexception": (429, "rate_limit_error", True),
    "servicequotaexceededexception": (429, "insufficient_quota", False),
    "validationexception": (400, "invalid_request_error", False),
    "accessdeniedexception": (403, "permission_error", False),
    "resourcenotfoundexception": (404, "not_found_error", False),
    "modelnotreadyexception": (503, "server_error", True),
    "serviceunavailableexception": (503, "server_error", True),
    "modeltimeoutexception": (504, "timeout_error", True),
    "internalserverexception": (502, "server_error", True),
    "modelstreamerrorexception": (502, "server_error", True),
    "modelerrorexception": (502, "server_error", True),
}


def exception_name(error_type: str | None) -> str:
    """`ThrottlingException:http://internal.amazon.com/...` -> `throttlingexception`."""
    return (error_type or "").split(":", 1)[0].strip().lower()


def error_message(payload: bytes) -> str:
    """The `message` (or `Message`) of a Bedrock error body, an excerpt of anything else."""
    try:
        parsed = orjson.loads(payload) if payload else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        message = parsed.get("message") or parsed.get("Message")
        if isinstance(message, str) and message:
            return message[:MESSAGE_MAX_CHARS]
    return payload[:MESSAGE_MAX_CHARS].decode("utf-8", "replace").strip()


def bedrock_error(
    route: str,
    status: int,
    error_type: str | None,
    payload: bytes,
    *,
    retry_after: float | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> UpstreamError:
    """A Bedrock error as an `UpstreamError` with an OpenAI body: the status and retry choice
    from the exception's name where it is known, else from the HTTP status."""
    name = exception_name(error_type)
    known = ERRORS.get(name)
    message = error_message(payload) or f"Bedrock answered {status}"
    label = error_type.split(":", 1)[0] if error_type else f"HTTP {status}"
    text = f"route {route!r}: Bedrock {label}: {message}"
    if known is None:
        mine = status if 400 <= status < 500 else 502
        kind = "invalid_request_error" if mine < 500 else "server_error"
        known = (mine, kind, status >= 500 or status == 429)
    mine, kind, retryable = known
    if mine == 504:
        timeout = UpstreamTimeout(text)
        timeout.headers = headers
        return timeout
    return UpstreamError(
        text,
        status=mine,
        retryable=retryable,
        body=orjson.dumps(error_body(text, kind, code=name or None)) if mine < 500 else None,
        content_type="application/json",
        retry_after=retry_after,
        headers=headers,
    )

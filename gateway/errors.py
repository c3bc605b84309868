"""OpenAI-shaped errors.

Clients use the OpenAI SDK, which turns `{"error": {...}}` bodies with the right status into typed
exceptions (`BadRequestError`, `AuthenticationError`, ...). Every error the gateway itself raises
goes through `GatewayError` so the shape and the status always agree and nothing internal leaks.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error that becomes an OpenAI-style JSON response with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "api_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def to_response(self, request_id: str | None = None) -> Response:
        headers = {"x-request-id": request_id} if request_id else None
        return Response(
            orjson.dumps(self.to_dict()),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


def error_body(
    message: str, type: str = "api_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse_error_event(message: str, type: str = "upstream_error", code: str | None = None) -> bytes:
    """An in-stream error, for failures after the client has seen output (no retry then)."""
    return b"data: " + orjson.dumps(error_body(message, type, None, code)) + b"\n\n"


# -- an upstream's own error, in the client's API ----------------------------------------------

# What is read of an upstream's error body: enough for any provider's message, never a 50 MB page.
ERROR_BODY_BYTES = 64 * 1024
# What is kept of a message that is not JSON (a proxy's text or HTML page).
ERROR_MESSAGE_CHARS = 2000


def upstream_error_parts(status: int, body: bytes | None, default_type: str) -> dict:
    """An upstream's error body (untrusted: any bytes, maybe cut at ERROR_BODY_BYTES) as the
    fields of an error object: its own object when it sent OpenAI's `{"error": {...}}` or
    Anthropic's `{"type": "error", "error": {...}}` (unknown fields kept), its text as the
    message otherwise; `message` and `type` (else `default_type`) are always strings."""
    parsed: object = None
    if body:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
    inner = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(inner, dict):
        parts = dict(inner)
    elif isinstance(inner, str):  # {"error": "message"}, as some servers send it
        parts = {"message": inner}
    elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        parts = {"message": parsed["message"]}
    elif isinstance(parsed, dict) and isinstance(parsed.get("detail"), str):
        parts = {"message": parsed["detail"]}  # FastAPI's shape (vLLM's and SGLang's servers)
    else:
        text = (body or b"")[: ERROR_MESSAGE_CHARS * 4].decode("utf-8", "replace").strip()
        parts = {"message": text[:ERROR_MESSAGE_CHARS]}
    message = parts.get("message")
    if not isinstance(message, str) or not message.strip():
        parts["message"] = f"upstream returned HTTP {status}"
    if not isinstance(parts.get("type"), str) or not parts["type"]:
        parts["type"] = default_type
    return parts


def openai_error_from_upstream(status: int, body: bytes | None) -> bytes:
    """An upstream's error body in OpenAI's shape, its message kept. A body that already has
    that shape (an object `error` with a string `message` and `type`) goes as it came."""
    if body and len(body) < ERROR_BODY_BYTES and _well_formed_openai(body):
        return body
    default = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "api_error")
    parts = upstream_error_parts(status, body, default)
    parts.setdefault("param", None)
    parts.setdefault("code", None)
    return orjson.dumps({"error": parts})


def _well_formed_openai(body: bytes) -> bool:
    if not body.lstrip().startswith(b"{"):
        return False
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    inner = parsed.get("error") if isinstance(parsed, dict) else None
    return (
        isinstance(inner, dict)
        and isinstance(inner.get("message"), str)
        and isinstance(inner.get("type"), str)
    )

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

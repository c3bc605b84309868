"""A chat answer converted, event by event, into the API the client spoke.

`POST /v1/messages` on an `openai` or `local` route and `POST /v1/responses` on an `anthropic`
or `local` route are served by the chat pipeline (policies, retries, fallbacks, TTFT,
telemetry: all of it), fed the translated request. `TranslatedFormat` is the pipeline's
`AnswerFormat` for them:

- each upstream event is converted from its payload the moment it arrives (nothing is held
  back, so the first token leaves as it would on chat); a keepalive becomes the API's own
  keepalive, an in-stream error its error event;
- a whole answer (a completion or an error) is converted once complete: it is bounded by the
  upstream's response limit.

The payloads came from an upstream: the translators take nothing on trust
(see `gateway.translation`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import orjson

from gateway.config.routes import Route
from gateway.errors import GatewayError
from gateway.sse import KEEPALIVE
from gateway.translation.chat_to_anthropic import TranslationError
from gateway.translation.messages_chat import (
    ChatToMessagesStream,
    Translated,
    chat_completion_to_message,
    chat_error_to_messages,
)
from gateway.translation.responses_chat import (
    ChatToResponsesStream,
    chat_completion_to_response,
    chat_error_to_responses,
)
from gateway.upstreams.base import OutEvent

log = logging.getLogger("firsttoken.translated")

NOTES_HEADER = b"x-firsttoken-translation"


def translate_request(
    translate: Callable[[dict], Translated], body: dict, model: str, route: Route
) -> Translated:
    """The chat request for `body`; what cannot be translated is a 400 naming the route."""
    try:
        return translate(body)
    except TranslationError as exc:
        raise GatewayError(
            400,
            f"{exc.message} (model '{model}' is served by route {route.name!r}, kind {route.kind})",
            param=exc.param,
            code="unsupported_on_route",
        ) from None


class AnswerShape(Protocol):
    """How one client API's answers are built from chat's."""

    @property
    def request_id_names(self) -> Sequence[bytes]: ...
    def whole(self, completion: dict) -> dict: ...
    def error(self, status: int, error: dict) -> dict: ...
    def feed(self, chunk: dict) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...
    def stream_error(self, error: dict) -> bytes: ...
    def keepalive(self) -> bytes: ...


class MessagesShape:
    """Anthropic's Messages API."""

    request_id_names = (b"request-id",)  # the header Anthropic's SDK reads as `_request_id`

    def __init__(self, model: str) -> None:
        self.model = model
        self._stream = ChatToMessagesStream(model)

    def whole(self, completion: dict) -> dict:
        return chat_completion_to_message(completion, self.model)

    def error(self, status: int, error: dict) -> dict:
        return chat_error_to_messages(status, error)

    def feed(self, chunk: dict) -> list[bytes]:
        return self._stream.feed(chunk)

    def finish(self) -> list[bytes]:
        return self._stream.finish()

    def stream_error(self, error: dict) -> bytes:
        detail = chat_error_to_messages(502, error)
        return b"event: error\ndata: " + orjson.dumps(detail) + b"\n\n"

    def keepalive(self) -> bytes:
        return b'event: ping\ndata: {"type":"ping"}\n\n'


class ResponsesShape:
    """OpenAI's Responses API (its errors are OpenAI's, as chat's are)."""

    request_id_names: tuple[bytes, ...] = ()

    def __init__(self, request: dict, model: str) -> None:
        self.request = request
        self.model = model
        self._stream = ChatToResponsesStream(request, model)

    def whole(self, completion: dict) -> dict:
        return chat_completion_to_response(completion, self.request, self.model)

    def error(self, status: int, error: dict) -> dict:
        return chat_error_to_responses(error)

    def feed(self, chunk: dict) -> list[bytes]:
        return self._stream.feed(chunk)

    def finish(self) -> list[bytes]:
        return self._stream.finish()

    def stream_error(self, error: dict) -> bytes:
        found = error.get("error")
        detail: dict = found if isinstance(found, dict) else {}
        event = {
            "type": "error",
            "code": detail.get("code") or detail.get("type"),
            "message": detail.get("message") or "The upstream stream failed.",
            "param": detail.get("param"),
        }
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"

    def keepalive(self) -> bytes:
        return KEEPALIVE


class TranslatedFormat:
    """The chat pipeline's answer, in `shape`'s API (see `gateway.pipeline.answer`)."""

    def __init__(self, shape: AnswerShape, notes: Sequence[str] = ()) -> None:
        self.shape = shape
        self.finished = False
        joined = "; ".join(notes)
        self.headers = [(NOTES_HEADER, joined.encode("latin-1", "replace"))] if joined else []
        self.request_id_names = shape.request_id_names

    def events(self, batch: list[OutEvent], keep_usage: bool) -> bytes:
        out: list[bytes] = []
        for event in batch:
            if self.finished:
                break
            if event.done:
                out.append(self.done())
                continue
            chunk = event.payload()
            if chunk is None:
                if event.malformed:
                    log.warning("an upstream event that is not JSON was left out of a translation")
                continue
            if event.error:
                self.finished = True
                out.append(self.shape.stream_error(chunk))
                continue
            out.extend(self.shape.feed(chunk))
        return b"".join(out)

    def keepalive(self) -> bytes:
        return self.shape.keepalive()

    def done(self) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        return b"".join(self.shape.finish())

    def failure(self, message: str, type: str) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        return self.shape.stream_error({"error": {"message": message, "type": type}})

    def whole(self, status: int, body: bytes) -> bytes:
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return body
        if not isinstance(parsed, dict):
            return body
        converted = self.shape.whole(parsed) if status == 200 else self.shape.error(status, parsed)
        return orjson.dumps(converted)

"""A chat answer rewritten, on its way out, into the API the client spoke.

`POST /v1/messages` on an `openai` or `local` route and `POST /v1/responses` on an `anthropic`
or `local` route are served by the gateway's chat path (policies, retries, fallbacks, TTFT,
telemetry: all of it), fed a translated request. `TranslatedAnswer` wraps that path's ASGI
answer and translates what it sends:

- an event stream event by event, each chat chunk turned into the client API's events the
  moment it is sent (nothing is held back, so the first token leaves as it would on chat);
  a keepalive comment becomes the API's own keepalive, an in-stream error its error event;
- a whole answer (a completion or an error) once complete: the gateway built it, within its
  own limits, so holding it is bounded.

The chat answer is the gateway's own output, but its content came from an upstream: the
translators take nothing on trust (see `gateway.translation`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config.routes import Route
from gateway.errors import GatewayError
from gateway.sse import DONE_DATA, KEEPALIVE, SSEParser
from gateway.translation.chat_to_anthropic import TranslationError
from gateway.translation.messages_chat import (
    ChatToMessagesStream,
    Translated,
    chat_completion_to_message,
    chat_error_to_messages,
)
from gateway.translation.responses_chat import ChatToResponsesStream, chat_completion_to_response

if TYPE_CHECKING:
    from gateway.runtime import Gateway

log = logging.getLogger("firsttoken.translated")

NOTES_HEADER = b"x-firsttoken-translation"
# The gateway's own chunks are small; this bounds a (buggy) one all the same.
MAX_CHAT_EVENT_BYTES = 16 * 1024 * 1024


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


async def serve_as_chat(
    gateway: Gateway,
    request: Request,
    translated: Translated,
    api: str,
    shape: AnswerShape,
    arrival: float,
) -> ASGIApp:
    """The chat path's answer to the translated request, in `shape`'s API."""
    chat = orjson.dumps(translated.body)
    inner = await gateway.handle(request, "chat", raw=chat, api=api, arrival=arrival)
    return TranslatedAnswer(inner, shape, translated.notes)


class AnswerShape(Protocol):
    """How one client API's answers are built from chat's."""

    def whole(self, completion: dict) -> dict: ...
    def error(self, status: int, error: dict) -> dict: ...
    def feed(self, chunk: dict) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...
    def stream_error(self, error: dict) -> bytes: ...
    def keepalive(self) -> bytes: ...


class MessagesShape:
    """Anthropic's Messages API."""

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

    def __init__(self, request: dict, model: str) -> None:
        self.request = request
        self.model = model
        self._stream = ChatToResponsesStream(request, model)

    def whole(self, completion: dict) -> dict:
        return chat_completion_to_response(completion, self.request, self.model)

    def error(self, status: int, error: dict) -> dict:
        return error

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


class TranslatedAnswer:
    """The ASGI answer `inner` (a chat answer), sent in `shape`'s API."""

    def __init__(self, inner: ASGIApp, shape: AnswerShape, notes: tuple[str, ...] = ()) -> None:
        self.inner = inner
        self.shape = shape
        self.notes = "; ".join(notes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.inner(scope, receive, _Translating(send, self.shape, self.notes).send)


class _Translating:
    def __init__(self, send: Send, shape: AnswerShape, notes: str) -> None:
        self._send = send
        self.shape = shape
        self.notes = notes
        self.start: Message | None = None
        self.streaming = False
        self.finished = False
        self.parser = SSEParser(MAX_CHAT_EVENT_BYTES)
        self.held: list[bytes] = []

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers", ()))
            media = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            self.streaming = message["status"] == 200 and media.startswith(b"text/event-stream")
            if self.notes:
                headers.append((NOTES_HEADER, self.notes.encode("latin-1", "replace")))
            self.start = {**message, "headers": headers}
            if self.streaming:
                await self._send(self.start)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        more = bool(message.get("more_body", False))
        if self.streaming:
            out = self._events(message.get("body", b""))
            if not more and not self.finished:
                self.finished = True
                out += b"".join(self.shape.finish())
            await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self.held.append(message.get("body", b""))
        if not more:
            await self._whole(b"".join(self.held))

    def _events(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for event in self.parser.feed(data):
            if event.data is None:
                if event.raw == KEEPALIVE:
                    out.append(self.shape.keepalive())
                continue
            if event.data == DONE_DATA:
                if not self.finished:
                    self.finished = True
                    out.extend(self.shape.finish())
                continue
            try:
                chunk = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                log.warning("a chat event that is not JSON was dropped from a translated stream")
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                self.finished = True
                out.append(self.shape.stream_error(chunk))
                continue
            out.extend(self.shape.feed(chunk))
        return b"".join(out)

    async def _whole(self, body: bytes) -> None:
        assert self.start is not None
        status = self.start["status"]
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            translated = (
                self.shape.whole(parsed) if status == 200 else self.shape.error(status, parsed)
            )
            body = orjson.dumps(translated)
        headers = [
            (name, value)
            for name, value in self.start.get("headers", ())
            if name.lower() != b"content-length"
        ]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self.start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

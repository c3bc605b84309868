"""Reading and checking the client's JSON body: size limit first, then just enough validation
to route the request. Everything else in the body passes through untouched.

Each input has a cheap cap (body bytes, JSON objects and depth, message count, model length),
so a big or odd body is refused with a 4xx naming the limit before any policy or upstream work.
"""

from __future__ import annotations

import gc

import orjson
from starlette.requests import Request
from starlette.types import Message

from gateway.boundary.body_files import BodyFile
from gateway.config.settings import Settings
from gateway.errors import GatewayError


def declared_length(request: Request) -> int | None:
    """The Content-Length the client declared, when it declared a plain number."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


def _refuse_declared_over(request: Request, max_bytes: int) -> None:
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)


async def read_body(request: Request, max_bytes: int) -> bytes:
    _refuse_declared_over(request, max_bytes)
    # Straight from ASGI `receive` (no stream wrapper): this is on every request's path.
    chunks, size = [], 0
    while True:
        message = await request.receive()
        chunk = _chunk_of(message)
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_body_into(request: Request, max_bytes: int, file: BodyFile) -> None:
    """`read_body` for a body bound for a worker process: each piece goes into `file` as it
    arrives, so the whole body is never joined into one object here (a copy of up to
    `max_bytes` that holds the interpreter lock: 8-30 ms of a 16 MB body on a busy 2-core
    machine, in which no other request's stream moves)."""
    _refuse_declared_over(request, max_bytes)
    while True:
        message = await request.receive()
        chunk = _chunk_of(message)
        if file.size + len(chunk) > max_bytes:
            raise _too_large(max_bytes)
        try:
            file.append(chunk)
        except OSError:
            raise GatewayError(
                503, "The gateway has no memory for this request body now; try again."
            ) from None
        if not message.get("more_body", False):
            return


def _chunk_of(message: Message) -> bytes:
    if message["type"] == "http.disconnect":
        raise GatewayError(400, "The client closed the connection mid-request.")
    return message.get("body", b"")


def _too_large(max_bytes: int) -> GatewayError:
    return GatewayError(
        413,
        f"Request body exceeds the limit of {max_bytes} bytes (FIRSTTOKEN_MAX_BODY_BYTES).",
        code="request_too_large",
    )


def parse_json(raw: bytes, max_depth: int, max_containers: int) -> dict:
    """The body as a JSON object, or a 400 naming the limit it breaks.

    Parsing runs on the event loop and holds it (orjson keeps the GIL), so the number of
    objects and arrays is capped first, on the bytes: a count of `{` and `[` (strings
    included, so it can only over-count) costs about a millisecond for 16 MB, while parsing
    three million nested objects costs seconds."""
    if len(raw) > 2 * max_containers and raw.count(b"{") + raw.count(b"[") > max_containers:
        raise GatewayError(
            400,
            f"Request body holds more than {max_containers} JSON objects "
            "and arrays (FIRSTTOKEN_MAX_JSON_CONTAINERS).",
            code="json_too_large",
        )
    try:
        body = orjson.loads(raw)  # itself refuses nesting past 1024
    except orjson.JSONDecodeError as exc:
        raise GatewayError(
            400, f"Request body is not valid JSON: {exc.msg}.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise GatewayError(400, "Request body must be a JSON object.", code="invalid_json")
    # Each level takes two bytes at least, so a short body cannot be too deep.
    if len(raw) > 2 * max_depth and nested_deeper_than(body, max_depth):
        raise GatewayError(
            400,
            f"Request body nests JSON deeper than {max_depth} levels (FIRSTTOKEN_MAX_JSON_DEPTH).",
            code="json_too_deep",
        )
    return body


_referents = gc.get_referents
_tracked = gc.is_tracked
_CONTAINERS = frozenset((dict, list))


def nested_deeper_than(obj: dict | list, limit: int) -> bool:
    """Whether parsed JSON nests more than `limit` containers deep (`{}` is 1 deep).

    orjson accepts 1024 levels but serializes only 254, and policies walk bodies recursively,
    so depth is capped here. The walk goes level by level in C: `gc.get_referents` lists a
    level's children and `gc.is_tracked` keeps the containers that can have container children
    (CPython does not track a dict holding only strings and numbers: a message, typically). So
    a common chat body costs a few microseconds, and the worst case is linear in its containers.
    """
    level = [obj]
    for _ in range(limit - 1):
        level = list(filter(_tracked, _referents(*level)))
        if not level:
            return False
    return not _CONTAINERS.isdisjoint(map(type, _referents(*level)))


# Fields that tell a vLLM or SGLang server where to pull (or push) KV blocks: only the gateway's
# own pd router (`gateway.upstreams.pd`) may set them, never a client, on any door or route kind.
RESERVED_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


def strip_reserved(body: dict) -> bool:
    """Remove the reserved top-level fields from a client's parsed body; whether any was there
    (then the client's bytes must not be forwarded as they are). Four dict lookups: a body
    without them costs nothing more, and is never re-encoded."""
    found = False
    for name in RESERVED_FIELDS:
        if name in body:
            del body[name]
            found = True
    return found


def require_model(body: dict, max_chars: int) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise GatewayError(
            400,
            "'model' is required and must be a non-empty string.",
            param="model",
            code="invalid_model" if "model" in body else "missing_model",
        )
    if len(model) > max_chars:
        raise GatewayError(
            400,
            f"'model' is longer than {max_chars} characters (FIRSTTOKEN_MAX_MODEL_CHARS).",
            param="model",
            code="model_too_long",
        )
    return model


def validate_chat(body: dict, max_messages: int) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(
            400, "'messages' is required and must be a non-empty array.", param="messages"
        )
    if len(messages) > max_messages:
        raise GatewayError(
            400,
            f"'messages' has more than {max_messages} entries (FIRSTTOKEN_MAX_MESSAGES).",
            param="messages",
            code="too_many_messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise GatewayError(
                400,
                f"messages[{i}] must be an object with a string 'role'.",
                param=f"messages[{i}]",
            )
    _validate_stream(body)


def validate_completion(body: dict) -> None:
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
        raise GatewayError(
            400,
            "'prompt' is required (a string, or an array of strings or tokens).",
            param="prompt",
        )
    _validate_stream(body)


def _validate_stream(body: dict) -> None:
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise GatewayError(400, "'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "'stream_options' must be an object.", param="stream_options")


def parse_request(raw: bytes, endpoint: str, settings: Settings) -> tuple[dict, str]:
    """A chat or completions body, parsed within the limits and checked enough to route it:
    (body, model). The same on the loop and in a big-body worker process."""
    body = parse_json(raw, settings.max_json_depth, settings.max_json_containers)
    strip_reserved(body)  # a chat body is always encoded again from the dict, never forwarded
    model = require_model(body, settings.max_model_chars)
    if endpoint == "chat":
        validate_chat(body, settings.max_messages)
    else:
        validate_completion(body)
    return body, model


def upstream_body(transformed: dict, upstream_model: str, stream: bool) -> dict:
    """The body a route's upstream gets: the policies' output under the route's model name,
    asking for usage on streams (the proxy removes it again if the client did not ask)."""
    out = dict(transformed)
    out["model"] = upstream_model
    if stream:
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out

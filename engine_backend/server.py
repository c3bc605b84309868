"""The engine's own OpenAI-compatible HTTP server (Starlette + uvicorn).

`firsttoken engine --model PATH | --demo` runs this: one process, one model, no gateway.
Streams are written event by event as the engine produces them, never buffered. `--role`
makes it a prefill or decode server of a disaggregated deployment (engine_backend.pd);
the default, `both`, takes either kind of PD request as well as ordinary ones.
`firsttoken engine --disaggregate` runs one prefill and N decode servers as child processes behind
the gateway's `pd` route instead (gateway.run.disaggregate: it runs the gateway, which this package
never imports); its flags are on this parser all the same (engine_backend.disaggregate).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_backend import disaggregate
from engine_backend.engine_thread import EngineClosedError, RequestFailedError
from engine_backend.openai_api import EngineRequestError, LocalEngine
from engine_backend.openai_response import CHAT, COMPLETIONS, Endpoint, error_body
from engine_backend.pd.holds import KVHoldLimitError
from engine_backend.pd.node import LOOPBACK_HOSTS, ROLES, PDConfig

logger = logging.getLogger(__name__)

# The same as the gateway's: no proxy may buffer or transform an event stream.
SSE_HEADERS = {
    "cache-control": "no-cache, no-transform",
    "x-accel-buffering": "no",
    "connection": "keep-alive",
}
SSE_DONE = b"data: [DONE]\n\n"

# Errors from one request that the server answers (400, 500 or 503), never a crash.
ENGINE_ERRORS = (EngineRequestError, EngineClosedError, RequestFailedError, KVHoldLimitError)


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def sse_event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _tenant(request: Request) -> str | None:
    """Without a gateway in front, the API key is the tenant (hashed: never kept as is)."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:16]
    return None


async def _json_body(request: Request) -> dict:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise EngineRequestError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise EngineRequestError("the request body must be a JSON object")
    return body


def engine_error_response(exc: Exception) -> Response:
    """A request error is the client's (400); one request failing inside the engine is a 500
    for that request alone; an engine that stopped is a 503."""
    if isinstance(exc, EngineRequestError):
        return error_response(400, exc.message, param=exc.param)
    if isinstance(exc, EngineClosedError):
        return error_response(
            503, "the engine is not running", type_="server_error", code="engine_closed"
        )
    if isinstance(exc, KVHoldLimitError):  # the router serves it colocated instead
        return error_response(503, str(exc), type_="server_error", code="kv_hold_limit")
    logger.error("request failed in the engine: %s", exc)
    return error_response(500, f"engine error: {exc}", type_="server_error")  # our own message


async def _stream_response(chunks: AsyncGenerator[dict, None]) -> Response:
    """Start the stream, turning an error raised before the first chunk into an HTTP error."""
    try:
        first: dict | None = await anext(chunks)
    except ENGINE_ERRORS as e:
        return engine_error_response(e)
    except StopAsyncIteration:
        first = None

    async def events() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield sse_event(first)
            async for chunk in chunks:
                yield sse_event(chunk)
        except Exception as e:  # output has started: report in-stream, never retry
            if isinstance(e, RequestFailedError):  # its message was written for the client
                message = f"engine error: {e}"
            elif isinstance(e, EngineClosedError):
                message = "engine error: the engine stopped"
            else:
                logger.exception("stream failed")
                message = f"engine error: {type(e).__name__}"
            yield sse_event(error_body(message, "server_error"))
        finally:
            await chunks.aclose()
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _endpoint(
    local_engine: LocalEngine, endpoint: Endpoint
) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        try:
            body = await _json_body(request)
            tenant = _tenant(request)
            if body.get("stream") is True:
                chunks = local_engine.stream(body, endpoint=endpoint, tenant=tenant)
                return await _stream_response(chunks)
            return JSONResponse(await local_engine.complete(body, endpoint=endpoint, tenant=tenant))
        except ENGINE_ERRORS as e:
            return engine_error_response(e)

    return handle


def create_app(local_engine: LocalEngine) -> Starlette:
    """The ASGI app; its lifespan starts and stops the engine thread."""

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": local_engine.model_cards()})

    async def get_model(request: Request) -> Response:
        for card in local_engine.model_cards():
            if card["id"] == request.path_params["model_id"]:
                return JSONResponse(card)
        return error_response(
            404,
            f"model {request.path_params['model_id']!r} not found",
            param="model",
            code="model_not_found",
        )

    async def health(request: Request) -> Response:
        running = local_engine.thread.is_running
        return JSONResponse(
            {"status": "ok" if running else "stopped"}, status_code=200 if running else 503
        )

    async def pd_status(request: Request) -> Response:
        node = local_engine.pd
        if node is None:
            return error_response(404, "prefill/decode separation is off", code="404")
        try:
            return JSONResponse(await local_engine.thread.call(node.status))
        except EngineClosedError as e:
            return engine_error_response(e)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # registered for HTTPException only
        return error_response(exc.status_code, exc.detail or "error", code=str(exc.status_code))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(500, "internal server error", type_="server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await local_engine.start()
        try:
            yield
        finally:
            await local_engine.aclose()

    routes = [
        Route(
            "/v1/chat/completions",
            _endpoint(local_engine, CHAT),
            methods=["POST"],
        ),
        Route(
            "/v1/completions",
            _endpoint(local_engine, COMPLETIONS),
            methods=["POST"],
        ),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/healthz", health, methods=["GET"]),
        Route("/pd/status", pd_status, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="firsttoken engine",
        description="Serve a model with firsttoken's engine on an OpenAI-compatible API.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model folder or Hugging Face id")
    source.add_argument(
        "--demo",
        action="store_true",
        help="the built-in demo model (random weights, for trying things)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="cuda, cpu, cuda:1 ... (default: auto)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto (default): bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else float32",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: one per core; with --disaggregate: each engine's, "
        "default the cores split evenly among them)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (chunked prefill; default: EngineConfig's)",
    )
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--isolate-tenants",
        action="store_true",
        help="never share prefix-cache blocks between API keys",
    )
    pd = parser.add_argument_group("prefill/decode separation (vLLM's kv_transfer_params)")
    pd.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="prefill: hold prompts' KV for decode servers; decode: pull it; both: either",
    )
    pd.add_argument(
        "--pd-host", default="127.0.0.1", help="the KV side channel's address (announced)"
    )
    pd.add_argument("--pd-port", type=int, default=0, help="the KV side channel's port (0: any)")
    pd.add_argument(
        "--pd-hold-s", type=float, default=30.0, help="free held KV nobody pulled after this"
    )
    pd.add_argument(
        "--pd-max-held-blocks",
        type=int,
        default=None,
        help="bound on KV blocks held for decode servers; past it, 503 (default: half the pool)",
    )
    pd.add_argument(
        "--pd-pull-hosts",
        default=",".join(LOOPBACK_HOSTS),
        help="comma-separated hosts a decode server may pull KV from (default: loopback)",
    )
    pd.add_argument("--pd-pull-timeout-s", type=float, default=10.0)
    disaggregate.add_arguments(parser)
    parser.add_argument("--log-level", default="info")
    return parser


def pd_config(args: argparse.Namespace) -> PDConfig:
    """The PD part of the command line (ValueError for a bad value)."""
    return PDConfig(
        role=args.role,
        kv_host=args.pd_host,
        kv_port=args.pd_port,
        hold_s=args.pd_hold_s,
        max_held_blocks=args.pd_max_held_blocks,
        pull_hosts=tuple(h.strip() for h in args.pd_pull_hosts.split(",") if h.strip()),
        pull_timeout_s=args.pd_pull_timeout_s,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    problem = disaggregate.check_arguments(args)
    if problem is not None:
        print(f"firsttoken engine: {problem}", file=sys.stderr)
        return 2
    if args.disaggregate:
        print(
            "firsttoken engine: --disaggregate puts the gateway in front of the engines; "
            "run it as `firsttoken engine --disaggregate ...`, not with this module",
            file=sys.stderr,
        )
        return 2
    if args.parent_pid is not None:
        disaggregate.exit_with_parent(args.parent_pid)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        local_engine = LocalEngine.from_model(
            args.model,
            demo=args.demo,
            isolate_tenants=args.isolate_tenants,
            pd=pd_config(args),
            device=args.device,
            dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
        )
    except (ValueError, OSError) as e:
        print(f"firsttoken engine: {e}", file=sys.stderr)
        return 2
    import uvicorn

    logger.info("serving %s on http://%s:%d/v1", local_engine.model_name, args.host, args.port)
    uvicorn.run(
        create_app(local_engine), host=args.host, port=args.port, log_level=args.log_level.lower()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`firsttoken serve | engine | metrics`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import server_config
    from gateway.settings import SettingsError, load_settings

    try:
        settings = load_settings()
        app = create_app(settings)
    except SettingsError as exc:
        print(f"firsttoken: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Objects alive at start-up live for the whole process: keep the cyclic GC from scanning
    # them again and again on the request path.
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(
        server_config(
            app,
            settings,
            host=args.host,
            port=args.port,
            log_level=settings.log_level,
            access_log=args.access_log,
            loop="auto",
            lifespan="on",
            timeout_keep_alive=75,
        )
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        from engine_backend.server import main as engine_main

        return engine_main(argv[1:])
    if argv[:1] == ["metrics"]:
        from gateway.telemetry.cli import metrics_main

        return metrics_main(argv[1:])
    parser = argparse.ArgumentParser(prog="firsttoken", description="The firsttoken LLM gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--access-log", action="store_true", help="log every request (slower)")
    sub.add_parser(
        "engine",
        help="run the bundled engine's own OpenAI-compatible server "
        "(see `firsttoken engine --help`)",
    )
    sub.add_parser(
        "metrics", help="print TTFT figures from Redis (see `firsttoken metrics --help`)"
    )
    args = parser.parse_args(argv)
    return _serve(args)


if __name__ == "__main__":
    raise SystemExit(main())

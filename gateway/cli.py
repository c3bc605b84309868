"""`firsttoken serve | engine | metrics`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from importlib import metadata

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import server_config
    from gateway.settings import SettingsError, load_settings

    # Configured before the settings load, so that their start-up warnings are formatted too.
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    try:
        settings = load_settings(config_file=args.config)
        app = create_app(settings)
    except SettingsError as exc:
        print(f"firsttoken: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.log_level.upper())
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


def version() -> str:
    try:
        return metadata.version("firsttoken")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def settings_help() -> str:
    """Every variable with its default and what it does, from the settings themselves."""
    from gateway.settings_help import settings_variables

    lines = [
        "settings (environment variables; with --config, the same keys in lower case without",
        "FIRSTTOKEN_, e.g. timeout_s = 30; a variable overrides the file):",
    ]
    for variable in settings_variables():
        lines.append(f"  {variable.name}  (default: {variable.default})")
        if variable.description:
            lines.append(f"      {variable.description}")
    lines += [
        "",
        "Besides these: OPENAI_API_KEY, ANTHROPIC_API_KEY, DEEPSEEK_API_KEY derive the default",
        "routes when FIRSTTOKEN_ROUTES is unset; REDIS_URL is the telemetry store when",
        "FIRSTTOKEN_REDIS_URL is unset; each route's api_key_env names its key's variable.",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="firsttoken", description="The firsttoken LLM gateway.")
    parser.add_argument("--version", action="version", version=f"firsttoken {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway. Every setting is an environment variable, listed below.",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--access-log", action="store_true", help="log every request (slower)")
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings (YAML too, with PyYAML installed); variables override it",
    )
    sub.add_parser(
        "engine",
        help="run the bundled engine's own OpenAI-compatible server "
        "(see `firsttoken engine --help`)",
    )
    sub.add_parser(
        "metrics", help="print TTFT figures from Redis (see `firsttoken metrics --help`)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        from engine_backend.server import main as engine_main

        return engine_main(argv[1:])
    if argv[:1] == ["metrics"]:
        from gateway.telemetry.cli import metrics_main

        return metrics_main(argv[1:])
    args = build_parser().parse_args(argv)
    return _serve(args)


if __name__ == "__main__":
    raise SystemExit(main())

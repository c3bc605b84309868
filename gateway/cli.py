"""`firsttoken serve | engine | metrics`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The cyclic GC's generation thresholds while serving. At CPython's default (700 new objects) a
# gateway relaying dozens of streams collects after every few events, since each stream keeps
# a few hundred objects alive; almost everything a request allocates is freed by reference
# counting anyway. Measured in bench/gateway_overhead.py (CPU per request at 64 streams).
SERVING_GC_THRESHOLDS = (50_000, 20, 10)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.config.settings import SettingsError, load_settings
    from gateway.run.server import QuietServer, raise_open_file_limit, server_config

    worker = args.worker_index is not None  # one of `--workers N` processes (gateway.run.workers)
    # Configured before the settings load, so that their start-up warnings are formatted too.
    logging.basicConfig(
        level=logging.WARNING,
        format=_worker_log_format(args.worker_index) if worker else LOG_FORMAT,
    )
    try:
        settings = _load_settings(args, worker, load_settings)
        if args.workers > 1 and not worker:
            from gateway.run.workers import check_workers, serve_workers

            check_workers(settings, args.workers)
            logging.getLogger().setLevel(settings.log_level.upper())
            return serve_workers(
                settings,
                workers=args.workers,
                host=args.host,
                port=args.port,
                config=args.config,
                access_log=args.access_log,
            )
        from gateway.app import create_app

        app = create_app(settings)
    except SettingsError as exc:
        print(f"firsttoken: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.log_level.upper())
    options = {}
    sockets = None
    if worker:
        from gateway.run.workers import worker_log_config, worker_socket

        options["log_config"] = worker_log_config(args.worker_index)
        try:
            sockets = [worker_socket(args.host, args.port, args.worker_fd)]
        except OSError as exc:
            print(f"firsttoken: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
    # Objects alive at start-up live for the whole process: keep the cyclic GC from scanning
    # them again and again on the request path.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    raise_open_file_limit()
    config = server_config(
        app,
        settings,
        host=args.host,
        port=args.port,
        log_level=settings.log_level,
        access_log=args.access_log,
        loop="auto",
        lifespan="on",
        timeout_keep_alive=75,
        **options,
    )
    if worker and args.worker_heartbeat_fd is not None:
        from gateway.run.health import HeartbeatServer

        server: uvicorn.Server = HeartbeatServer(config, args.worker_heartbeat_fd)
    else:
        server = QuietServer(config)
    if worker and args.worker_parent is not None:
        from gateway.run import workers
        from gateway.run.supervision import exit_with_parent

        exit_with_parent(
            args.worker_parent,
            lambda: setattr(server, "should_exit", True),
            workers.log,
            what="worker",
            grace_s=workers.GRACE_S,
            poll_s=workers.PARENT_POLL_S,
        )
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
    return 0 if server.started else 1


def _engine(argv: list[str]) -> int:
    """`firsttoken engine ...`, read by the engine's own parser (its `--help` lists every flag):
    the engine's server, or with `--disaggregate` engines behind the gateway's pd route, which
    the gateway assembles because the engine never imports the gateway."""
    from engine_backend.server import build_parser
    from engine_backend.server import main as engine_main

    args = build_parser().parse_args(argv)
    if not args.disaggregate:
        return engine_main(argv)
    from gateway.run.disaggregate import serve_disaggregated

    return serve_disaggregated(args, LOG_FORMAT)


def _load_settings(
    args: argparse.Namespace, worker: bool, load: Callable[..., Settings]
) -> Settings:
    if not worker:
        return load(config_file=args.config)
    from gateway.run.workers import quiet_warnings

    # The supervisor logged the settings' warnings once, for every worker.
    with quiet_warnings(logging.getLogger("firsttoken")):
        return load(config_file=args.config)


def _worker_log_format(index: int) -> str:
    from gateway.run.workers import worker_tag

    return LOG_FORMAT.replace("%(name)s:", f"%(name)s {worker_tag(index)}:")


def version() -> str:
    try:
        return metadata.version("firsttoken")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def settings_help() -> str:
    """Every variable with its default and what it does, from the settings themselves."""
    from gateway.config.help import settings_variables

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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


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
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s, this machine only; 0.0.0.0: every "
        "interface)",
    )
    serve.add_argument(
        "--port", type=int, default=8080, help="TCP port to listen on (default: %(default)s)"
    )
    serve.add_argument("--access-log", action="store_true", help="log every request (slower)")
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings (YAML too, with PyYAML installed); variables override it",
    )
    serve.add_argument(
        "--workers",
        type=_positive,
        default=1,
        metavar="N",
        help="gateway processes serving the port, one core each (see README, 'Several cores')",
    )
    # Set by the supervisor of `--workers N` for each worker it starts (gateway.run.workers).
    serve.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--worker-parent", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--worker-heartbeat-fd", type=int, help=argparse.SUPPRESS)
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
        return _engine(argv[1:])
    if argv[:1] == ["metrics"]:
        from gateway.telemetry.cli import metrics_main

        return metrics_main(argv[1:])
    args = build_parser().parse_args(argv)
    return _serve(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine's side of `firsttoken engine --disaggregate`: its flags, and the parent watch of
each engine it starts.

The deployment itself (one prefill and N decode engines as child processes, the gateway's `pd`
route in front) is assembled by the gateway, in `gateway.run.disaggregate`, because it runs the
gateway and the engine imports nothing from the gateway. The flags stay on the engine's parser
all the same, so that `firsttoken engine --help` lists them with the rest; `firsttoken engine`
parses the command line with that parser and hands `--disaggregate` to the gateway.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

PARENT_GRACE_S = 15.0  # for an engine's in-flight requests once its supervisor is gone
PARENT_POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "one-machine disaggregated deployment (prefill and decode engines behind a PD router)"
    )
    group.add_argument(
        "--disaggregate",
        action="store_true",
        help="run one prefill engine and --decoders decode engines as child processes, "
        "with the gateway's pd route in front of them on --port",
    )
    group.add_argument(
        "--decoders", type=int, default=None, metavar="N", help="decode engines (default: 1)"
    )
    group.add_argument(
        "--devices",
        default=None,
        help="comma-separated: the prefill engine's device, then the decode engines' in turn "
        "(e.g. cuda:0,cuda:1); default: --device for all",
    )
    group.add_argument(
        "--start-timeout-s",
        type=float,
        default=600.0,
        help="how long the engines may take to load before the deployment gives up",
    )
    # Set by `--disaggregate` on each engine it starts: the engine stops if this pid goes away.
    group.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line's disaggregation flags, or None."""
    if args.threads is not None and args.threads < 1:
        return "--threads must be at least 1"
    if not args.disaggregate:
        if args.decoders is not None or args.devices is not None:
            return "--decoders and --devices go with --disaggregate"
        return None
    if args.role != "both":
        return "--disaggregate starts its own prefill and decode engines; leave out --role"
    if args.decoders is not None and args.decoders < 1:
        return "--decoders must be at least 1"
    if args.devices is not None:
        if args.device is not None:
            return "give --device (every engine) or --devices (one each), not both"
        if not split_devices(args.devices):
            return "--devices names no device"
    if args.start_timeout_s <= 0:
        return "--start-timeout-s must be positive"
    return None


def split_devices(devices: str) -> list[str]:
    """`--devices cuda:0, cuda:1` -> ["cuda:0", "cuda:1"]."""
    return [d.strip() for d in devices.split(",") if d.strip()]


def exit_with_parent(parent_pid: int, grace_s: float = PARENT_GRACE_S) -> None:
    """Stop this engine (SIGTERM to itself, then at once after `grace_s`) once `parent_pid` is
    no longer its parent: a supervisor killed outright would leave it serving nobody. The
    gateway's own processes watch theirs with `gateway.run.supervision.exit_with_parent`; the
    engine keeps this small copy because it imports nothing from the gateway."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.warning("the supervisor (pid %d) is gone; this engine stops", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

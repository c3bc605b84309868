"""`firsttoken serve --workers N`: N gateway processes serving one host:port.

One gateway process runs one event loop, so it uses one core. With `--workers N` the `serve`
process becomes a supervisor that starts N workers, each a whole gateway (its own loop, upstream
pools, policies, telemetry writer), and accepts no connection itself.

How they share the port. On Linux each worker binds its own listening socket to the address with
SO_REUSEPORT once its app is built, and the kernel spreads new connections over the listening
workers by a hash of the connection's addresses: a worker joins only when it can serve, and one
that dies leaves the group (connections still waiting in its accept queue are reset). The
supervisor first binds the address plainly, so that a port already in use, by another gateway
too, is an error rather than silently shared, then keeps it reserved with a bound socket that
never listens (it takes no connection, but nothing else can take the port while a worker
restarts). Elsewhere (macOS and the BSDs do not balance SO_REUSEPORT) the supervisor binds one
listening socket and every worker inherits it.

uvicorn's own `workers` option is not used: it takes an import string and builds its own
`Config`, which would drop the front-door protocol and its head limits (`gateway.run.server`).

Supervision (the rules in `gateway.run.supervision`, shared with `engine --disaggregate`). A worker
that dies is started again after a short backoff that doubles while it keeps dying; more than
`RESTART_LIMIT` deaths of one worker within `RESTART_WINDOW_S` stop the server with an error (a
crash loop is a bug or a broken host, not something to hide). A worker that refuses its
configuration (exit 2) stops it at once. SIGTERM or SIGINT to the supervisor
sends SIGTERM to each worker by pid, waits up to `GRACE_S` for open streams to finish, kills what
is left, and exits 0; a second signal kills at once. Each worker watches the supervisor and
shuts down if it disappears (even killed outright), so no worker is left holding the port; a
worker's big-body processes die with it the same way (`gateway.pipeline.big_bodies`). A worker
that stops answering without dying (SIGSTOP, a hung loop) is found by its health probe, a
heartbeat on a private pipe (`gateway.run.health`), killed after `HANG_S` of silence and started
again like one that died.

Every worker gets the same environment (inherited) and the same `--config` content: the
supervisor copies the file once, at start, into a private temporary folder, so a worker
restarted after the file was edited still agrees with the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config.settings import Settings, SettingsError
from gateway.run import supervision
from gateway.run.health import HANG_S, Pulse
from gateway.run.supervision import Child, Restarts, StopSignals, stop_children

log = logging.getLogger("firsttoken.workers")

REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
GRACE_S = 30.0  # for open streams to finish after SIGTERM, before SIGKILL
PARENT_POLL_S = 1.0  # how often a worker checks that the supervisor is still there
BACKLOG = 2048  # uvicorn's default


# -- checks and notes, in the supervisor ------------------------------------------------------


def check_workers(settings: Settings, workers: int) -> None:
    """Refuse several workers with a `local` route: the bundled engine holds its model in the
    process that serves it, so each worker would load (and keep) its own copy."""
    if workers <= 1:
        return
    local = [r.name for r in settings.routes or () if r.kind == "local"]
    if settings.routes is None:
        from gateway.runtime import engine_installed  # the default route is the local engine

        if engine_installed():
            local = ["local (the default with no route configured)"]
    if local:
        raise SettingsError(
            f"--workers {workers}: route {local[0]!r} is a local route; the bundled engine "
            "holds its model in the memory of the process that serves it, so each worker would "
            "load its own copy. Run it with --workers 1, or run `firsttoken engine` apart and "
            "route to it with kind 'openai'."
        )


def shares_state(settings: Settings) -> bool:
    """Telemetry, prefix fingerprints and object records live in Redis (shared by workers)
    exactly when a Redis URL is set and telemetry is on; otherwise in each process."""
    return bool(settings.effective_redis_url()) and settings.telemetry


def per_worker_warning(settings: Settings, workers: int) -> str | None:
    """What each worker keeps to itself when nothing is shared; None with Redis."""
    if workers <= 1 or shares_state(settings):
        return None
    why = (
        "FIRSTTOKEN_TELEMETRY=false keeps the store in process"
        if settings.effective_redis_url()
        else "no Redis is configured (FIRSTTOKEN_REDIS_URL)"
    )
    kept = []
    if settings.telemetry:
        kept.append(
            "TTFT figures (/v1/metrics/ttft and `firsttoken metrics` show only the worker that "
            "answered)"
        )
        kept.append(
            "prefix-break diagnostics (a session whose turns reach different workers is "
            "compared with each worker's own last request)"
        )
    if settings.tenant_keys:
        kept.append(
            "stored-object ownership (a response, file or batch created through one worker is "
            "a 404 object_not_found through the others)"
        )
    if not kept:
        return None
    return (
        f"--workers {workers} and {why}: each worker keeps its own "
        + "; its own ".join(kept)
        + ". Set FIRSTTOKEN_REDIS_URL to share them. /metrics and /readyz are per worker."
    )


# -- sockets ------------------------------------------------------------------------------------


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides


def reserve_address(host: str, port: int) -> tuple[socket.socket, int]:
    """In the supervisor: check that nothing listens on `host:port`, and hold it (resolving
    port 0). With SO_REUSEPORT the socket is bound but never listens; without, it is the one
    listening socket the workers inherit. Raises OSError when the address is taken."""
    family = _family(host)
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))  # no SO_REUSEPORT: fails on any listener, a gateway's too
        if not REUSE_PORT:
            probe.listen(BACKLOG)
            probe.set_inheritable(True)
            return probe, probe.getsockname()[1]
        port = probe.getsockname()[1]
    except BaseException:
        probe.close()
        raise
    probe.close()
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host, port))
    except BaseException:
        held.close()
        raise
    return held, port


def worker_socket(host: str, port: int, inherited_fd: int | None) -> socket.socket:
    """In a worker: the inherited listening socket, or a SO_REUSEPORT socket of its own on the
    supervisor's address (uvicorn makes it listen once the app has started)."""
    if inherited_fd is not None:
        return socket.socket(fileno=inherited_fd)
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


# -- in a worker -------------------------------------------------------------------------------


def worker_tag(index: int) -> str:
    return f"[worker {index}, pid {os.getpid()}]"


def worker_log_config(index: int) -> dict[str, Any]:
    """uvicorn's logging configuration with the worker's tag in every line, access lines too."""
    from uvicorn.config import LOGGING_CONFIG

    config = deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = formatter["fmt"].replace(
            "%(levelprefix)s ", f"%(levelprefix)s {worker_tag(index)} ", 1
        )
    return config


@contextlib.contextmanager
def quiet_warnings(logger: logging.Logger) -> Iterator[None]:
    """Drop `logger`'s warnings for a while: the supervisor already logged the same ones, from
    the same environment and file (unknown variables, unset key variables)."""

    def drop(record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# -- the supervisor ----------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Slot(Child):
    index: int
    pulse: Pulse | None = None  # its health probe, when the supervisor watches for hangs


class Supervisor:
    """Starts `count` workers (`command(index)` is a worker's argv, index from 1), restarts the
    ones that die within the crash-loop bound, and stops them all on SIGTERM or SIGINT."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        count: int,
        *,
        pass_fds: Sequence[int] = (),
        restart_limit: int = supervision.RESTART_LIMIT,
        restart_window_s: float = supervision.RESTART_WINDOW_S,
        backoff_s: float = supervision.BACKOFF_S,
        grace_s: float = GRACE_S,
        hang_s: float | None = HANG_S,
    ) -> None:
        self.command = command
        self.slots = [_Slot(index=i, label=f"worker {i}") for i in range(1, count + 1)]
        self.pass_fds = tuple(pass_fds)
        self.restarts = Restarts(restart_limit, restart_window_s, backoff_s)
        self.grace_s = grace_s
        self.hang_s = hang_s  # None: no health probe (the worker's argv gets no pipe)
        self.signals = StopSignals()

    def run(self) -> int:
        """Serve until a signal (0), a crash loop (1) or a worker refusing its configuration (2)."""
        with self.signals:
            try:
                for slot in self.slots:
                    self._start(slot)
                return self._supervise()
            finally:
                stop_children(self.slots, self.grace_s, log, forced=lambda: self.signals.force)
                for slot in self.slots:
                    if slot.pulse is not None:
                        slot.pulse.close()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc is not None and s.alive()]

    def _start(self, slot: _Slot) -> None:
        argv, pass_fds = self.command(slot.index), self.pass_fds
        if slot.pulse is not None:
            slot.pulse.close()
            slot.pulse = None
        beat_w = None
        if self.hang_s is not None:
            beat_r, beat_w = os.pipe()
            slot.pulse = Pulse(beat_r)
            argv, pass_fds = [*argv, "--worker-heartbeat-fd", str(beat_w)], (*pass_fds, beat_w)
        try:
            slot.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=pass_fds)
        finally:
            if beat_w is not None:
                os.close(beat_w)  # the worker holds the only write end
        log.info("worker %d started (pid %d)", slot.index, slot.proc.pid)

    def _replace_hung(self, now: float) -> None:
        """Kill each worker silent on its health probe for `hang_s` (SIGKILL: a stopped
        process takes no other signal); the restart rules then start it again."""
        assert self.hang_s is not None
        for slot in self.slots:
            if slot.pulse is None or slot.proc is None or not slot.alive():
                continue
            silent = slot.pulse.silent_for(now)
            if silent > self.hang_s:
                log.warning(
                    "worker %d (pid %d) has not answered its health probe for %.1f s "
                    "(stopped or hung); replacing it",
                    slot.index,
                    slot.proc.pid,
                    silent,
                )
                slot.proc.kill()
                slot.pulse.last = None

    def _supervise(self) -> int:
        while self.signals.signum is None:
            if self.hang_s is not None:
                self._replace_hung(time.monotonic())
            status = self.restarts.tend(self.slots, self._start, time.monotonic(), log)
            if status is not None:
                return status
            time.sleep(supervision.POLL_S)
        log.info("%s: stopping the workers", self.signals.name)
        return 0


# -- `serve --workers N` -----------------------------------------------------------------------


@contextlib.contextmanager
def config_snapshot(path: str | None) -> Iterator[str | None]:
    """A private copy of the configuration file for the workers, removed at exit."""
    if path is None:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="firsttoken-config-")  # mode 0700
    try:
        copy = Path(folder) / Path(path).name  # the same suffix: TOML or YAML
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(Path(path).read_bytes())
        yield str(copy)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def worker_command(
    index: int,
    *,
    host: str,
    port: int,
    config: str | None,
    access_log: bool,
    inherited_fd: int | None,
) -> list[str]:
    """The argv of worker `index`: `serve` with the supervisor's address and options, plus the
    worker's own (hidden) ones."""
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--host", host, "--port", str(port)]
    if config is not None:
        argv += ["--config", config]
    if access_log:
        argv.append("--access-log")
    argv += ["--worker-index", str(index), "--worker-parent", str(os.getpid())]
    if inherited_fd is not None:
        argv += ["--worker-fd", str(inherited_fd)]
    return argv


def serve_workers(
    settings: Settings,
    *,
    workers: int,
    host: str,
    port: int,
    config: str | None,
    access_log: bool,
) -> int:
    """Run the supervisor of `workers` gateway processes on `host:port`; its exit status."""
    warning = per_worker_warning(settings, workers)
    if warning:
        log.warning(warning)
    elif workers > 1:
        log.info("%d workers share telemetry and object records through Redis", workers)
    try:
        held, port = reserve_address(host, port)
    except OSError as exc:
        print(f"firsttoken: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    inherited = None if REUSE_PORT else held.fileno()
    try:
        with config_snapshot(config) as snapshot:
            log.info(
                "serving http://%s:%d with %d workers (%s)",
                host,
                port,
                workers,
                "SO_REUSEPORT" if REUSE_PORT else "one shared socket",
            )
            supervisor = Supervisor(
                lambda index: worker_command(
                    index,
                    host=host,
                    port=port,
                    config=snapshot,
                    access_log=access_log,
                    inherited_fd=inherited,
                ),
                workers,
                pass_fds=() if inherited is None else (inherited,),
            )
            return supervisor.run()
    finally:
        held.close()

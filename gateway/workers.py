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
`Config`, which would drop the front-door protocol and its head limits (`gateway.server`).

Supervision. A worker that dies is started again after a short backoff that doubles while it
keeps dying; more than `RESTART_LIMIT` deaths of one worker within `RESTART_WINDOW_S` stop the
server with an error (a crash loop is a bug or a broken host, not something to hide). A worker
that refuses its configuration (exit 2) stops it at once. SIGTERM or SIGINT to the supervisor
sends SIGTERM to each worker by pid, waits up to `GRACE_S` for open streams to finish, kills what
is left, and exits 0; a second signal kills at once. Each worker watches the supervisor and
shuts down if it disappears (even killed outright), so no worker is left holding the port.

Every worker gets the same environment (inherited) and the same `--config` content: the
supervisor copies the file once, at start, into a private temporary folder, so a worker
restarted after the file was edited still agrees with the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.settings import Settings, SettingsError

log = logging.getLogger("firsttoken.workers")

REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
RESTART_LIMIT = 5  # deaths of one worker within the window that stop the server
RESTART_WINDOW_S = 60.0
BACKOFF_S = 0.5  # before the first restart; doubles per recent death
MAX_BACKOFF_S = 8.0
GRACE_S = 30.0  # for open streams to finish after SIGTERM, before SIGKILL
POLL_S = 0.1
PARENT_POLL_S = 1.0
REFUSED = 2  # the exit status of `serve` when it refuses its configuration
BACKLOG = 2048  # uvicorn's default


# -- checks and notes, in the supervisor ------------------------------------------------------


def check_workers(settings: Settings, workers: int) -> None:
    """Refuse several workers with a `local` route: the bundled engine holds its model in the
    process that serves it, so each worker would load (and keep) its own copy."""
    if workers <= 1:
        return
    local = [r.name for r in settings.routes or () if r.kind == "local"]
    if settings.routes is None:
        from gateway.service import engine_installed  # the default route is the local engine

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


def exit_with_parent(parent: int, shut_down: Callable[[], None], grace_s: float = GRACE_S) -> None:
    """Shut this worker down (gracefully, then at once after `grace_s`) if the supervisor goes
    away without stopping it, even killed outright: nobody would restart or stop it after."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.warning("the supervisor (pid %d) is gone; this worker stops", parent)
        shut_down()
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


# -- the supervisor ----------------------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None


def describe_exit(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"


class Supervisor:
    """Starts `count` workers (`command(index)` is a worker's argv, index from 1), restarts the
    ones that die within the crash-loop bound, and stops them all on SIGTERM or SIGINT."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        count: int,
        *,
        pass_fds: Sequence[int] = (),
        restart_limit: int = RESTART_LIMIT,
        restart_window_s: float = RESTART_WINDOW_S,
        backoff_s: float = BACKOFF_S,
        grace_s: float = GRACE_S,
    ) -> None:
        self.command = command
        self.slots = [_Slot(i) for i in range(1, count + 1)]
        self.pass_fds = tuple(pass_fds)
        self.restart_limit = restart_limit
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.grace_s = grace_s
        self._stop_signal: int | None = None
        self._force = False

    def run(self) -> int:
        """Serve until a signal (0), a crash loop (1) or a worker refusing its configuration (2)."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        status = 0
        try:
            for slot in self.slots:
                self._start(slot)
            status = self._supervise()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc is not None and s.proc.poll() is None]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_signal is not None:
            self._force = True
        self._stop_signal = signum

    def _start(self, slot: _Slot) -> None:
        slot.restart_at = None
        slot.proc = subprocess.Popen(
            self.command(slot.index), stdin=subprocess.DEVNULL, pass_fds=self.pass_fds
        )
        log.info("worker %d started (pid %d)", slot.index, slot.proc.pid)

    def _supervise(self) -> int:
        while self._stop_signal is None:
            now = time.monotonic()
            for slot in self.slots:
                proc = slot.proc
                if proc is not None and proc.poll() is not None:
                    status = proc.returncode
                    slot.proc = None
                    if status == REFUSED:
                        log.error(
                            "worker %d (pid %d) refused its configuration (see its message); "
                            "stopping",
                            slot.index,
                            proc.pid,
                        )
                        return REFUSED
                    if not self._schedule_restart(slot, now, proc.pid, status):
                        return 1
                if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                    self._start(slot)
            time.sleep(POLL_S)
        log.info("%s: stopping the workers", signal.Signals(self._stop_signal).name)
        return 0

    def _schedule_restart(self, slot: _Slot, now: float, pid: int, status: int) -> bool:
        """Note a death; False when it makes a crash loop."""
        slot.deaths.append(now)
        while slot.deaths and slot.deaths[0] < now - self.restart_window_s:
            slot.deaths.popleft()
        recent = len(slot.deaths)
        if recent > self.restart_limit:
            log.error(
                "worker %d died %d times within %.0f s (last: pid %d, %s); stopping the server",
                slot.index,
                recent,
                self.restart_window_s,
                pid,
                describe_exit(status),
            )
            return False
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (recent - 1))
        log.warning(
            "worker %d (pid %d) died (%s); starting it again in %.1f s",
            slot.index,
            pid,
            describe_exit(status),
            delay,
        )
        slot.restart_at = now + delay
        return True

    def _stop_all(self) -> None:
        """SIGTERM to each live worker by pid, a bounded wait, then SIGKILL to what is left."""
        live = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while not self._force and time.monotonic() < deadline:
            if all(proc.poll() is not None for proc in live):
                break
            time.sleep(POLL_S)
        for proc in live:
            if proc.poll() is None:
                log.warning("worker pid %d did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.wait(10)
        for slot in self.slots:
            slot.proc = None


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

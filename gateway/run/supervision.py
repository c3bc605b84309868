"""Keeping a fixed set of child processes alive, for `serve --workers N` (`gateway.run.workers`) and
`engine --disaggregate` (`gateway.run.disaggregate`).

Both commands supervise the same way, so the rules live here once: a child that dies is started
again after a backoff that doubles while it keeps dying; more than a limit of deaths within a
window is a crash loop, which ends the supervision (a bug or a broken host, not something to
hide); a child refusing its configuration (`REFUSED`) ends it at once; SIGTERM or SIGINT asks the
supervisor to stop and a second one withdraws the grace; children are stopped by pid, SIGTERM
then SIGKILL after the grace; and a child watches its supervisor so that one killed outright
leaves nothing behind. What a child is, how it starts and when it is ready stay with each command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, TypeVar

RESTART_LIMIT = 5  # deaths of one child within RESTART_WINDOW_S that make a crash loop
RESTART_WINDOW_S = 60.0
BACKOFF_S = 0.5  # before the first restart; doubles with each recent death
MAX_BACKOFF_S = 8.0
POLL_S = 0.1
REFUSED = 2  # the exit status of a child that refuses its configuration
CRASH_LOOP = 1  # the supervisor's status after a crash loop


def describe_exit(status: int) -> str:
    """A Popen return code in words: "exit status 3", "killed by SIGKILL"."""
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"


@dataclass(kw_only=True)
class Child:
    """One supervised place: its process (None while it waits to be started again), its recent
    deaths and when it is due to start. `label` names it in log lines ("worker 2")."""

    label: str
    proc: subprocess.Popen[bytes] | None = None
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self) -> subprocess.Popen[bytes] | None:
        """The process if it has exited since the last look; the place is empty after."""
        proc = self.proc
        if proc is None or proc.poll() is None:
            return None
        self.proc = None
        return proc

    def due(self, now: float) -> bool:
        return self.proc is None and self.restart_at is not None and now >= self.restart_at


C = TypeVar("C", bound=Child)


@dataclass(frozen=True)
class Restarts:
    """The restart rules: backoff, and the crash-loop bound."""

    limit: int = RESTART_LIMIT
    window_s: float = RESTART_WINDOW_S
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def tend(
        self,
        children: Iterable[C],
        start: Callable[[C], None],
        now: float,
        log: logging.Logger,
        *,
        refusal_ends: bool = True,
    ) -> int | None:
        """One look at every child: note each exit and start again each one whose backoff is
        over; the status to end the supervision with, or None to go on."""
        for child in children:
            proc = child.reap()
            if proc is not None:
                status = self.after_exit(child, proc, now, log, refusal_ends=refusal_ends)
                if status is not None:
                    return status
            if child.due(now):
                child.restart_at = None
                start(child)
        return None

    def after_exit(
        self,
        child: Child,
        proc: subprocess.Popen[bytes],
        now: float,
        log: logging.Logger,
        *,
        refusal_ends: bool = True,
    ) -> int | None:
        """Schedule the restart of `child`, whose `proc` exited; `REFUSED` when it refused its
        configuration (and `refusal_ends`), `CRASH_LOOP` past the bound, else None."""
        status = proc.returncode
        if status == REFUSED and refusal_ends:
            log.error(
                "%s (pid %d) refused its configuration (see its message); stopping",
                child.label,
                proc.pid,
            )
            return REFUSED
        child.deaths.append(now)
        while child.deaths and child.deaths[0] < now - self.window_s:
            child.deaths.popleft()
        recent = len(child.deaths)
        if recent > self.limit:
            log.error(
                "%s died %d times within %.0f s (last: pid %d, %s); stopping",
                child.label,
                recent,
                self.window_s,
                proc.pid,
                describe_exit(status),
            )
            return CRASH_LOOP
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (recent - 1))
        log.warning(
            "%s (pid %d) died (%s); starting it again in %.1f s",
            child.label,
            proc.pid,
            describe_exit(status),
            delay,
        )
        child.restart_at = now + delay
        return None


class StopSignals:
    """SIGTERM and SIGINT while in use (a `with` block, in the main thread): the first asks the
    supervisor to stop (`signum`), a second to stop without grace (`force`)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.force = False
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self.force = True
        self.signum = signum


def stop_children(
    children: Sequence[Child],
    grace_s: float,
    log: logging.Logger,
    *,
    forced: Callable[[], bool] = lambda: False,
) -> None:
    """SIGTERM to each live child by its pid, up to `grace_s` for all to exit (cut short once
    `forced()`), then SIGKILL to what is left; every place is empty after."""
    live = [(c.label, c.proc) for c in children if c.proc is not None and c.proc.poll() is None]
    for _, proc in live:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while not forced() and time.monotonic() < deadline:
        if all(proc.poll() is not None for _, proc in live):
            break
        time.sleep(POLL_S)
    for label, proc in live:
        if proc.poll() is None:
            log.warning("%s (pid %d) did not stop in time; killing it", label, proc.pid)
            proc.kill()
            proc.wait(10)
    for child in children:
        child.proc = None


def exit_with_parent(
    parent_pid: int,
    shut_down: Callable[[], None],
    log: logging.Logger,
    *,
    what: str,
    grace_s: float,
    poll_s: float = 1.0,
) -> None:
    """In a child: once `parent_pid` is no longer the parent (the supervisor went away, even
    killed outright, and nobody would stop or restart this process), call `shut_down`, then
    exit at once after `grace_s`."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("the supervisor (pid %d) is gone; this %s stops", parent_pid, what)
        shut_down()
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

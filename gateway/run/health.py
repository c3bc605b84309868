"""A worker's health probe, for `serve --workers N`: a heartbeat on a private pipe.

A worker that dies is seen by its exit; one that stops answering is not: stopped (SIGSTOP), or
its event loop hung, it keeps its listening socket, so the kernel keeps handing it connections
that time out. So each worker's event loop writes one byte every `HEARTBEAT_S` to a pipe only
its supervisor reads (its write end passed as `--worker-heartbeat-fd`), and the supervisor kills
and replaces a worker that has been silent for `HANG_S` once it beat at all (start-up, which
may load routes or warm connections, is not timed: a worker that never starts is the restart
rules' business). The beat comes from the loop itself, not a thread, so a loop that cannot run
its tasks stops it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import uvicorn

from gateway.run.server import QuietServer

HEARTBEAT_S = 0.5
HANG_S = 10.0  # silence after which a worker that beat before is replaced


async def heartbeat(fd: int, interval_s: float = HEARTBEAT_S) -> None:
    """Beat on `fd` until the supervisor's end closes. A full pipe (a supervisor that is slow
    to read) drops a beat rather than block the loop."""
    os.set_blocking(fd, False)
    while True:
        try:
            os.write(fd, b".")
        except BlockingIOError:
            pass
        except OSError:  # the supervisor is gone: its parent watch stops this worker
            return
        await asyncio.sleep(interval_s)


class HeartbeatServer(QuietServer):
    """The gateway's server, beating on `beat_fd` from its event loop once it has started."""

    def __init__(self, config: uvicorn.Config, beat_fd: int) -> None:
        super().__init__(config)
        self.beat_fd = beat_fd
        self._beat: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self._beat = asyncio.get_running_loop().create_task(heartbeat(self.beat_fd))


class Pulse:
    """The supervisor's end of one worker's pipe: whether it beat lately."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.last: float | None = None  # None until the first beat

    def silent_for(self, now: float) -> float:
        """Seconds since the last beat (0 before the first), reading what has arrived."""
        beat = False
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.fd, 4096):
                beat = True
                if len(chunk) < 4096:
                    break
        if beat:
            self.last = now
        return 0.0 if self.last is None else now - self.last

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

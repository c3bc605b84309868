"""Big bodies cross to and from the worker processes in anonymous memory files.

Through the process pool's own pipes, a 16 MB body is pickled by a helper thread of the gateway
and the worker's encoded upstream body is unpickled by another: copies made while holding the
interpreter lock, and the pool's `submit` waits on its wake-up pipe meanwhile; joining the
body's pieces into one object first is another such copy. On a shared 2-core machine each was a
stall of 8-80 ms for every other request on the event loop (a profile of
`bench/isolation.py`'s deep phase). Here admission writes the body's pieces into a memory file
(`memfd_create`) as they arrive, a few hundred KB at a time that the kernel copies in well
under a millisecond; the worker opens the same file through `/proc`, reads the body, and writes
the encoded upstream bodies back into it; a thread of low priority reads them out, the kernel
copying with the lock released.

The file has no name: it is freed when its last descriptor closes, so a gateway or worker
killed mid-request leaves nothing behind. A worker opens it by descriptor number, which the
gateway may reuse once it has closed its own (a request given up while its job still waits),
so the worker checks the file's identity (device and inode) before reading a byte: a reused
number never shows one tenant's body to another's job. Where memory files are not available
(not Linux) the body travels in the pickle as before.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

Span = tuple[int, int]  # offset, length


@dataclass(frozen=True)
class FileRef:
    """What a worker needs to find the gateway's body file: plain data, so it pickles."""

    path: str
    size: int
    device: int
    inode: int


class BodyFile:
    """The gateway's side: one body, written as it arrives (or at once), read back as the
    worker left it. Its descriptor is closed only once no thread of ours uses it any more: a
    number closed under a running `pread` could be reused for another request's socket or file
    before the call."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._busy: asyncio.Future | None = None
        self.size = 0
        status = os.fstat(fd)
        self._identity = (status.st_dev, status.st_ino)

    @classmethod
    def create(cls) -> BodyFile | None:
        """A new, empty memory file, or None where there are none."""
        create = getattr(os, "memfd_create", None)
        if create is None:
            return None
        try:
            return cls(create("firsttoken-body", os.MFD_CLOEXEC))
        except OSError:
            return None

    @classmethod
    async def write(cls, raw: bytes) -> BodyFile | None:
        """`raw` in a new memory file, or None where there are none (or no memory for one)."""
        file = cls.create()
        if file is None:
            return None
        try:
            await file._in_thread(_write_all, raw, 0)
        except OSError:
            file.close()
            return None
        except BaseException:
            file.close()
            raise
        file.size = len(raw)
        return file

    def append(self, chunk: bytes) -> None:
        """One piece of a body as it arrives, written on the caller's thread: a read off a
        socket is at most a few hundred KB, which the kernel copies in well under a
        millisecond, so the whole body is never one object in this process. OSError: no
        memory for it."""
        _write_all(self._fd, chunk, self.size)
        self.size += len(chunk)

    @property
    def ref(self) -> FileRef:
        device, inode = self._identity
        return FileRef(f"/proc/{os.getpid()}/fd/{self._fd}", self.size, device, inode)

    async def read(self, spans: list[Span]) -> list[bytes]:
        """The byte ranges `spans` of the file, each a bytes object of its own."""
        return await self._in_thread(_read_spans, spans)

    async def read_all(self) -> bytes:
        """The whole body, for a caller that must parse it in this process after all."""
        return (await self.read([(0, self.size)]))[0]

    async def _in_thread(self, fn, *args):
        loop = asyncio.get_running_loop()
        self._busy = loop.run_in_executor(_copier(), fn, self._fd, *args)
        return await asyncio.shield(self._busy)

    def close(self) -> None:
        """Close the descriptor now, or when the thread still using it is done."""
        busy, self._busy = self._busy, None
        if busy is not None and not busy.done():
            busy.add_done_callback(self._close_after)
        elif self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _close_after(self, done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: it was the given-up caller's, and is dropped with it
        self.close()


COPIER_NICE = 19  # as the workers: the loop's thread takes the core whenever it wants it
_copiers: list[ThreadPoolExecutor] = []


def _copier() -> ThreadPoolExecutor:
    """The thread that copies bodies in and out of memory files, at the workers' low priority:
    the kernel's copy of 16 MB is ~5-10 ms of a core that the event loop's thread would
    otherwise wait for."""
    if not _copiers:
        _copiers.append(
            ThreadPoolExecutor(1, thread_name_prefix="firsttoken-body-copy", initializer=_lower)
        )
    return _copiers[0]


def _lower() -> None:
    try:  # a thread's own priority, on Linux (elsewhere the process's: not done)
        if sys.platform == "linux":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPIER_NICE)
    except OSError:
        pass


# A body is written a slice at a time, the thread yielding the core between slices: on a
# machine with a core or two, a 16 MB copy in one call held the core from the loop for ~5 ms.
SLICE_BYTES = 1 << 20


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view[:SLICE_BYTES], offset)
        offset += written
        view = view[written:]
        if view:
            _yield_core()


def _read_spans(fd: int, spans: list[Span]) -> list[bytes]:
    # One call per body: a bytes object cannot be filled a slice at a time without first
    # zeroing (or copying) all of it while holding the interpreter lock.
    out = []
    for offset, length in spans:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"body file ended at {offset + len(data)}, expected {offset + length}")
        out.append(data)
    return out


def _yield_core() -> None:
    if hasattr(os, "sched_yield"):
        os.sched_yield()


class WrongFile(OSError):
    """The descriptor named no longer holds the body it was given for."""


def read_in_worker(ref: FileRef) -> tuple[int, bytes]:
    """In a worker: open the gateway's file, check it is the one meant, read the body. Returns
    the open descriptor (for `write_in_worker`) and the body."""
    fd = os.open(ref.path, os.O_RDWR | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        if (status.st_dev, status.st_ino) != (ref.device, ref.inode) or status.st_size < ref.size:
            raise WrongFile(f"{ref.path} is not the body file it was given for")
        raw = _read_sliced(fd, ref.size)
    except BaseException:
        os.close(fd)
        raise
    return fd, raw


def _read_sliced(fd: int, size: int) -> bytes:
    """`size` bytes from the file's start, a slice per call: in a worker, where holding the
    interpreter for the copies costs nobody, but a long copy in the kernel still holds a core
    that the gateway's loop may share."""
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        got = os.preadv(fd, [view[done : done + SLICE_BYTES]], done)
        if not got:
            raise WrongFile(f"the body file holds {done} of {size} bytes")
        done += got
        _yield_core()
    return bytes(data)


def write_in_worker(fd: int, bodies: list[bytes]) -> list[Span]:
    """In a worker: the encoded bodies one after another from the file's start (the client's
    body is read by then), where the gateway reads them; their spans."""
    spans, offset = [], 0
    for body in bodies:
        spans.append((offset, len(body)))
        offset += len(body)
    os.ftruncate(fd, offset)
    for (start, _), body in zip(spans, bodies, strict=True):
        _write_all(fd, body, start)
    return spans

"""Big bodies cross to the worker processes and back in memory files: the same outcome as
through the pool's pipe, never another request's bytes, and a descriptor closed only once no
thread uses it."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from types import SimpleNamespace

import orjson
import pytest

from gateway.boundary.body_files import BodyFile, FileRef, WrongFile, read_in_worker
from gateway.boundary.offload import HeavyWork
from gateway.config.settings import Settings
from gateway.pipeline import big_bodies
from gateway.pipeline.big_bodies import (
    BigBodyWorkers,
    Prepared,
    dumps_settings,
    prepare,
    prepare_from_file,
    worker_init,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="memory files are Linux's"
)

ROUTES = [
    {"name": "mock", "models": ["*"], "kind": "openai", "base_url": "http://x/v1"},
    {"name": "spare", "models": ["spare-model"], "kind": "openai", "base_url": "http://y/v1"},
]


def chat_body(text: str) -> bytes:
    return orjson.dumps(
        {
            "model": "mock-1",
            "messages": [
                {"role": "system", "content": "Background.   \n\n\n\n" + text},
                {"role": "user", "content": "hi"},
            ],
        }
    )


@pytest.fixture
def work():
    routes = [{**ROUTES[0], "fallbacks": ["spare"]}, ROUTES[1]]
    heavy = HeavyWork(
        0,
        process_min_bytes=1,
        process_workers=1,
        process_init=(worker_init, (dumps_settings(Settings()), routes)),
    )
    yield heavy
    heavy.close()


def admitted(raw: bytes) -> SimpleNamespace:
    return SimpleNamespace(raw=raw, api="chat", tenant="acme", headers={})


async def test_a_body_goes_to_its_worker_and_back_in_a_memory_file(work):
    raw = chat_body("lorem ipsum " * 5000)
    file = await BodyFile.write(raw)
    assert file is not None
    try:
        outcome = await work.run_in_process(
            "acme", prepare_from_file, file.ref, "chat", "acme", None, False, True
        )
        assert isinstance(outcome, Prepared)
        # only spans come back in the pickle, one per route of the chain
        assert {name: body.encoded for name, body in outcome.bodies.items()} == {
            "mock": b"",
            "spare": b"",
        }
        assert all(body.span is not None for body in outcome.bodies.values())
    finally:
        file.close()
    piped = await work.run_in_process("acme", prepare, raw, "chat", "acme", None, False, True)
    workers = BigBodyWorkers(work, find_references=False, fingerprints=True)
    through_file = await workers.parse(admitted(raw))
    assert isinstance(piped, Prepared) and isinstance(through_file, Prepared)
    assert through_file == piped  # the same bodies, read back from the file
    assert b"\n\n\n\n" not in through_file.bodies["mock"].encoded  # the worker's policies ran
    assert workers.unreadable == 0 and work.jobs == 3


async def test_a_reused_descriptor_never_shows_another_body():
    first = await BodyFile.write(b"tenant A's body")
    assert first is not None
    old = first.ref
    first.close()
    second = await BodyFile.write(b"tenant B's body")
    assert second is not None
    try:
        # the descriptor number the job was given now names another request's file
        reused = FileRef(second.ref.path, old.size, old.device, old.inode)
        with pytest.raises(WrongFile):
            read_in_worker(reused)
        fd, raw = read_in_worker(second.ref)
        os.close(fd)
        assert raw == b"tenant B's body"
    finally:
        second.close()


async def test_a_descriptor_stays_open_until_the_thread_using_it_is_done():
    file = await BodyFile.write(b"x" * 1000)
    assert file is not None
    fd = int(file.ref.path.rsplit("/", 1)[1])
    release = threading.Event()

    def slow_read(descriptor: int) -> bytes:
        release.wait(10)
        return os.pread(descriptor, 10, 0)

    reading = asyncio.ensure_future(file._in_thread(slow_read))
    await asyncio.sleep(0.01)
    reading.cancel()  # the request is given up while its copy runs
    with pytest.raises(asyncio.CancelledError):
        await reading
    file.close()
    os.fstat(fd)  # still open: the thread may be inside a pread on it
    release.set()
    for _ in range(500):
        await asyncio.sleep(0.01)
        try:
            os.fstat(fd)
        except OSError:
            break
    else:
        pytest.fail("the descriptor was never closed")


async def test_a_worker_that_cannot_read_the_file_gets_the_body_in_the_pipe(
    work, monkeypatch, caplog
):
    class Unopenable(BodyFile):
        @property
        def ref(self) -> FileRef:
            return FileRef("/proc/self/fd/nonexistent", self.size, 0, 0)

    monkeypatch.setattr(big_bodies, "BodyFile", Unopenable)
    workers = BigBodyWorkers(work, find_references=False, fingerprints=True)
    raw = chat_body("lorem ipsum " * 100)
    for _ in range(2):
        outcome = await workers.parse(admitted(raw))
        assert isinstance(outcome, Prepared)
        assert orjson.loads(outcome.bodies["mock"].encoded)["messages"][1]["content"] == "hi"
    assert workers.unreadable == 2 and work.jobs == 4  # each tried the file, then the pipe
    warnings = [r for r in caplog.records if "memory file" in r.getMessage()]
    assert len(warnings) == 1  # said once, not per body

"""`QuietServer`: uvicorn's server waking once a tick, and at once when asked to exit."""

from __future__ import annotations

import asyncio
import threading

import uvicorn

from gateway.run.server import QuietServer


async def _app(scope, receive, send) -> None:  # never called: only the main loop runs
    raise AssertionError("no request is served here")


async def test_each_tick_counts_a_second_so_the_date_header_is_refreshed_every_tick():
    server = QuietServer(uvicorn.Config(_app), tick_s=0.001)
    counters: list[int] = []

    async def on_tick(counter: int) -> bool:
        counters.append(counter)
        return len(counters) == 4

    server.on_tick = on_tick  # type: ignore[method-assign]
    await asyncio.wait_for(server.main_loop(), 30)
    # uvicorn refreshes the Date header when the count of tenths is a multiple of ten
    assert counters == [0, 10, 20, 30]


async def test_a_request_to_exit_from_another_thread_wakes_it_at_once():
    server = QuietServer(uvicorn.Config(_app), tick_s=3600)
    counters: list[int] = []

    async def on_tick(counter: int) -> bool:
        counters.append(counter)
        return server.should_exit

    server.on_tick = on_tick  # type: ignore[method-assign]
    running = asyncio.ensure_future(server.main_loop())
    while not counters:
        await asyncio.sleep(0)
    setter = threading.Thread(target=setattr, args=(server, "should_exit", True))
    setter.start()
    setter.join()
    await asyncio.wait_for(running, 30)  # an hour's tick otherwise
    assert counters == [0, 10] and server.should_exit

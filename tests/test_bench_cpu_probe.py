"""`bench/cpu_probe.py`: stages clocked in thread CPU time, task steps by coroutine, and the
ledger's snapshots turned into figures per request."""

import asyncio
import importlib
import sys
import time
import types

import pytest

from bench.cpu_probe import PER_REQUEST_KEY, STAGES, per_request, task_factory, wrap


def burn(seconds: float) -> int:
    end, n = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        n += 1
    return n


@pytest.fixture
def module(monkeypatch):
    """A throwaway module with a function, a copy of it imported by name elsewhere, and a class
    with a method, a static method and a class method."""
    mod = types.ModuleType("probe_target")

    def work(x):
        burn(0.002)
        return x + 1

    class Thing:
        def method(self, x):
            return x * 2

        @staticmethod
        def static(x):
            return x * 3

        @classmethod
        def klass(cls, x):
            return (cls.__name__, x)

    mod.work, mod.Thing = work, Thing
    user = types.ModuleType("probe_user")
    user.work = work  # as `from probe_target import work` leaves it
    monkeypatch.setitem(sys.modules, "probe_target", mod)
    monkeypatch.setitem(sys.modules, "probe_user", user)
    return mod, user


def test_wrapped_stages_count_calls_and_cpu_and_answer_the_same(module):
    mod, user = module
    ledger: dict = {}
    for name in ("work", "Thing.method", "Thing.static", "Thing.klass"):
        wrap(ledger, "probe_target", name)
    assert mod.work(1) == 2
    assert user.work(2) == 3  # the copy imported by name is clocked too
    thing = mod.Thing()
    assert thing.method(4) == 8
    assert mod.Thing.static(5) == 15 and thing.static(1) == 3
    assert mod.Thing.klass(6) == ("Thing", 6)
    assert ledger["probe_target.work"][0] == 2
    assert ledger["probe_target.work"][1] >= 0.003  # two calls of 2 ms of CPU each
    assert ledger["probe_target.Thing.method"][0] == 1
    assert ledger["probe_target.Thing.static"][0] == 2
    assert ledger["probe_target.Thing.klass"][0] == 1


def test_every_stage_names_something_the_gateway_has():
    """A renamed stage would go unclocked (the probe only warns): the list follows the code."""
    for module_name, qualname in STAGES:
        owner = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        assert callable(getattr(owner, attr)), (module_name, qualname)


def test_task_steps_are_clocked_by_their_coroutine():
    ledger: dict = {}

    async def busy():
        for _ in range(3):
            burn(0.002)
            await asyncio.sleep(0)

    async def idle():
        await asyncio.sleep(0.01)

    async def main():
        asyncio.get_running_loop().set_task_factory(task_factory(ledger))
        await asyncio.gather(asyncio.ensure_future(busy()), asyncio.ensure_future(idle()))

    asyncio.run(main())
    by_name = {name.rsplit(".", 1)[-1]: entry for name, entry in ledger.items()}
    (busy_calls, busy_cpu), (idle_calls, idle_cpu) = by_name["busy"], by_name["idle"]
    assert busy_calls == 4  # three yields: four steps
    assert busy_cpu >= 0.005
    assert idle_calls >= 2 and idle_cpu < busy_cpu


def snapshot(requests: int, cpu: float, stage_calls: int, stage_cpu: float) -> dict:
    return {
        PER_REQUEST_KEY: [requests, 0.001 * requests],
        "base.OutEvent.resolve": [stage_calls, stage_cpu],
        "_process_cpu_s": cpu,
    }


def test_figures_are_per_request_over_the_window_requests_flowed_in():
    lines = [
        snapshot(0, 1.0, 0, 0.0),
        snapshot(0, 1.1, 0, 0.0),  # idle: the window starts here, the last one before requests
        snapshot(10, 1.2, 200, 0.02),
        snapshot(40, 1.4, 800, 0.08),
    ]
    result = per_request(lines)
    assert result["requests"] == 40
    assert result["process_cpu_ms_per_request"] == pytest.approx(1000 * 0.3 / 40)
    resolve = result["stages"]["base.OutEvent.resolve"]
    assert resolve["calls_per_request"] == pytest.approx(20.0)
    assert resolve["cpu_ms_per_request"] == pytest.approx(2.0)
    assert next(iter(result["stages"])) == "base.OutEvent.resolve"  # the costliest first


def test_no_requests_is_an_error_not_a_table():
    with pytest.raises(ValueError):
        per_request([snapshot(5, 1.0, 0, 0.0), snapshot(5, 1.1, 0, 0.0)])
    with pytest.raises(ValueError):
        per_request([snapshot(0, 1.0, 0, 0.0)])


def test_the_probe_runs_the_fleet_workload_with_its_answer_length():
    import argparse

    from bench import fleet_http
    from bench.cpu_probe import fleet_argv

    probe = argparse.Namespace(quick=True, answer_tokens=1)
    fleet = fleet_http.parse_args(fleet_argv(probe))
    assert (fleet.answer_tokens, fleet.quick, fleet.cpu_breakdown) == (1, True, True)
    assert fleet_http.make_workload(fleet).answer_tokens == 1
    full = fleet_http.parse_args(fleet_argv(argparse.Namespace(quick=False, answer_tokens=16)))
    assert (full.answer_tokens, full.quick) == (16, False)

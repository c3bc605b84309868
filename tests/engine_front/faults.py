"""Faults injected into a running engine, to prove one request's failure stays its own."""

from __future__ import annotations

from collections.abc import Callable

from engine_backend import LocalEngine


def break_sampling(local_engine: LocalEngine, seed: int) -> Callable[[], None]:
    """Make the sampler fail on any batch holding a request with `seed`, as a value no check
    foresaw would; returns the undo."""
    llm = local_engine.llm
    real = llm.sampler

    class Breaking:
        def __getattr__(self, name):
            return getattr(real, name)

        def sample(self, logits, params, generators):
            if any(p.seed == seed for p in params):
                raise RuntimeError("injected sampling failure")
            return real.sample(logits, params, generators)

    llm.sampler = Breaking()

    def restore() -> None:
        llm.sampler = real

    return restore

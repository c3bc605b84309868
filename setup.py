"""Build hook: `FIRSTTOKEN_MYPYC=1` compiles the `policies` package to C with mypyc.

The policies are the gateway's biggest block of per-request Python (the transform, the token
counts, fingerprints and prefix-break comparison, the advisor's shadow variants), pure and
fully typed, which is what mypyc compiles well: `bench/turns_cpu.py --compiled --pairs N`
measures the difference beside the interpreted gateway. Without the variable (the default, and
every editable install) nothing is compiled and the package is plain Python. A compiled build
needs a C compiler, and mypy with the packages the policies import in the build environment
(mypyc type-checks before it compiles), so the plain install comes first:

    pip install -U . "mypy==2.4.*" setuptools
    FIRSTTOKEN_MYPYC=1 pip install --no-build-isolation --force-reinstall --no-deps .

`FIRSTTOKEN_MYPYC_OPT` sets the C compiler's optimisation level (mypyc's `opt_level`, 3 by
default): the test of the build takes 0, which compiles in about half the time.

`policies/config.py` stays interpreted: its option dataclasses are fields of the gateway's
pydantic `Settings`, which copies a dataclass through its `__dict__` (a compiled class has none),
and it runs once at start-up.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

INTERPRETED = {"config.py"}


def compiled_modules() -> list:
    if os.environ.get("FIRSTTOKEN_MYPYC", "").lower() not in ("1", "true", "yes"):
        return []
    from mypyc.build import mypycify

    here = Path(__file__).resolve().parent
    sources = sorted(
        str(path.relative_to(here))
        for path in (here / "policies").glob("*.py")
        if path.name not in INTERPRETED
    )
    return mypycify(sources, opt_level=os.environ.get("FIRSTTOKEN_MYPYC_OPT", "3"))


setup(ext_modules=compiled_modules())

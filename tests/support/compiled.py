"""Whether `policies` runs compiled (a `FIRSTTOKEN_MYPYC=1` build, see `setup.py`).

A compiled module calls its own functions directly and its classes take no new attributes, so a
test that counts calls by patching a function or method inside `policies` cannot see them
there; such a test is marked `patches_policies` and runs on the interpreted package (the
default; CI runs the rest of `tests/policies` on a compiled build too, `tests/test_compiled.py`).
"""

from __future__ import annotations

import pytest

import policies.tokens

POLICIES_COMPILED = not str(policies.tokens.__file__).endswith(".py")

patches_policies = pytest.mark.skipif(
    POLICIES_COMPILED,
    reason="patches a function inside `policies`, which a compiled build calls directly",
)

"""The compiled build (`setup.py` with `FIRSTTOKEN_MYPYC=1`): every module of `policies` but its
config compiles with mypyc, the compiled package is the one imported, and the policy tests pass
on it. The rest of the suite runs on the interpreted package."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import ROOT, compiled_copy

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or importlib.util.find_spec("mypyc") is None,
    reason="a compiled build needs a C compiler and mypy (the lint extra)",
)


@pytest.mark.timeout(900)
def test_the_policies_compile_and_pass_their_tests_compiled(tmp_path):
    # unoptimised C: what is tested is that it compiles and behaves, not how fast it runs
    copy = Path(compiled_copy(str(tmp_path / "copy"), opt_level="0"))
    compiled = sorted(path.name.split(".")[0] for path in (copy / "policies").glob("*.so"))
    interpreted = {"config"}
    expected = sorted(
        path.stem for path in (Path(ROOT) / "policies").glob("*.py") if path.stem not in interpreted
    )
    assert compiled == expected

    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import policies.slim, policies.config as c; print(policies.slim.__file__, c.__file__)",
        ],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert where[0].startswith(str(copy)) and where[0].endswith(".so")
    assert where[1].endswith("config.py")

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/policies", "-q", "-x", "-p", "no:cacheprovider"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" in run.stdout  # the patching tests skip there

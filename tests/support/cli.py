"""`firsttoken serve` as an operator starts it, for tests of what it refuses at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def serve_refusal(*args: str, env: Mapping[str, str] | None = None) -> str:
    """Run `firsttoken serve ARGS` with `env` added to a copy of the environment without any
    `FIRSTTOKEN_*` variable; assert it refused to start (exit 2, no traceback) and return its
    stderr, which should name what to fix."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("FIRSTTOKEN_")}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", "1", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr

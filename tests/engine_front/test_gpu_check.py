"""bench/gpu_check.sh without a GPU: it says so, then runs its steps small on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_falls_back_to_the_cpu_and_says_so(tmp_path) -> None:
    out_dir = tmp_path / "gpu_check"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # no GPU for this run, whatever the machine has
        "PYTHON": sys.executable,
        "OUT_DIR": str(out_dir),
        "CACHE_DIR": str(tmp_path / "models"),
    }
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "cuda requested but not available: running on cpu" in proc.stderr
    assert "== done on cpu: tests exit 0, bench exit 0" in proc.stdout
    assert "2 passed" in (out_dir / "tests.log").read_text()
    bench_log = (out_dir / "engine_ttft.log").read_text()
    assert "cuda requested but not available: running on cpu (tiny sizes)" in bench_log
    results = json.loads((out_dir / "engine_ttft.json").read_text())
    assert results["device"] == "cpu" and results["quick"] is True
    assert results["params_m"] < 1.0  # the tiny model, not the GPU's ~0.9B one
    assert [r["streams"] for r in results["throughput"]] == [1, 4, 16]

"""bench/engine_ttft.py runs end to end (tiny sizes) and writes every part to JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quick_run_writes_all_parts(tmp_path) -> None:
    out = tmp_path / "engine_ttft.json"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "engine_ttft.py"),
            "--quick",
            "--threads",
            "1",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "models"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - started < 60
    results = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in results["ttft"]] == [64, 128]
    for row in results["ttft"]:
        assert row["cold_s"] > 0 and row["transformers_s"] > 0
        # The 94%-shared prompt really hit the cache: all its full shared blocks.
        assert row["warm94"]["cached_tokens"] >= int(row["prompt_tokens"] * 0.94) // 16 * 16
        assert row["warm50"]["cached_tokens"] == row["prompt_tokens"] // 2 // 16 * 16
    cases = [r["case"] for r in results["gaps"]]
    assert cases == ["decoders alone", "budget 16", "budget 64", "unchunked"]
    assert all(r["num_gaps"] > 0 for r in results["gaps"])
    assert all(r["long_ttft_s"] > 0 for r in results["gaps"][1:])
    assert [r["streams"] for r in results["throughput"]] == [1, 4, 16]
    assert [r["tokens"] for r in results["throughput"]] == [8, 32, 128]
    assert {t["target"] for t in results["targets"]} >= {
        "p99 gap, smallest budget / unchunked",
        "decode tokens/s, 16 streams / 1",
    }
    assert "targets" in proc.stdout and "[4] decode throughput" in proc.stdout

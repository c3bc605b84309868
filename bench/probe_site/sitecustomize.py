"""Imported by any Python started with this folder on its PYTHONPATH: `bench/cpu_probe.py`
puts it there for the gateway it starts. It installs the CPU probe when FIRSTTOKEN_CPU_PROBE
names a file, and takes the variable out of the environment so that the processes the gateway
starts (its big-body workers) do not install it too."""

import os

_ledger = os.environ.pop("FIRSTTOKEN_CPU_PROBE", "")
if _ledger:
    from bench.cpu_probe import install

    install(_ledger, tasks=os.environ.pop("FIRSTTOKEN_CPU_PROBE_TASKS", "") == "1")

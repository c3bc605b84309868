"""The Docker image's promises, checked on its files (no Docker needed): it serves the demo with
no keys (engine extra, CPU torch at the Makefile's pin), runs as a numeric non-root user, and its
build context holds what it copies and nothing of .venv or .git."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# Continuation lines joined, so that each instruction is one line.
INSTRUCTIONS = [
    line.strip()
    for line in DOCKERFILE.replace("\\\n", " ").splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]


def final_stage() -> list[str]:
    starts = [i for i, line in enumerate(INSTRUCTIONS) if line.upper().startswith("FROM ")]
    return INSTRUCTIONS[starts[-1] :]


def build_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match, f"Dockerfile declares no ARG {name} with a default"
    return match.group(1)


def dockerignored(path: str) -> bool:
    """Docker's .dockerignore rule for one path: the last matching pattern wins, a `!` pattern
    re-includes, and a pattern that matches a folder matches everything under it."""
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        include = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = path.split("/")
        # A folder matches everything under it; `**/` also matches at any depth.
        starts = range(len(parts)) if pattern.startswith("**/") else [0]
        pattern = pattern.removeprefix("**/")
        candidates = {"/".join(parts[i : j + 1]) for i in starts for j in range(i, len(parts))}
        if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
            ignored = not include
    return ignored


def test_the_final_stage_runs_as_a_numeric_non_root_user():
    users = [
        line.split(maxsplit=1)[1] for line in final_stage() if line.upper().startswith("USER ")
    ]
    assert users, "the final stage sets no USER"
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), (
        f"USER {users[-1]}: Kubernetes' runAsNonRoot needs a numeric uid:gid, not 0"
    )


def test_torch_comes_from_the_cpu_index_at_the_makefile_pin_before_the_engine_extra():
    makefile_pin = re.search(r"^TORCH_PIN \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_pin, "the Makefile no longer pins torch"
    assert build_arg("TORCH_VERSION") == makefile_pin.group(1)
    assert build_arg("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(line for line in INSTRUCTIONS if line.upper().startswith("RUN "))
    torch_at = runs.find('pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"')
    engine_at = runs.find('pip install ".[engine]"')
    assert torch_at != -1, "torch is not installed from ${TORCH_INDEX_URL}"
    assert engine_at != -1, "the engine extra is not installed: with no key every request is a 503"
    assert torch_at < engine_at, "the engine extra first would pull torch (CUDA) from PyPI"


def test_the_build_context_holds_what_the_dockerfile_copies():
    sources = [
        source
        for line in INSTRUCTIONS
        if line.upper().startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    ]
    assert "gateway" in sources and "engine_backend" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        assert not dockerignored(source), f"COPY {source}: .dockerignore leaves it out"
    assert not dockerignored("gateway/app.py")


def test_the_build_context_leaves_out_the_venv_git_caches_and_tests():
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        ".env",
        "tests/test_docker.py",
        "bench/results/run.json",
        "firsttoken.egg-info/PKG-INFO",
        "gateway/__pycache__/app.cpython-311.pyc",
        "engine_backend/models/__pycache__/llama.cpython-311.pyc",
    ):
        assert dockerignored(path), f"{path} would be sent to the Docker daemon"

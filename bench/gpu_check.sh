#!/usr/bin/env bash
# The engine's first GPU run, in one go: the engine tests on the device, then
# bench/engine_ttft.py --device cuda on a ~0.9B random Llama in bf16 (cold and warm TTFT,
# prefill tokens/s and MFU against the GPU's bf16 peak, decode tokens/s at batch 1 and 32).
# Budget: under 8 minutes on one H100/H200 (tests ~3 min, bench ~3 min, each under a
# timeout). Without CUDA it says so and runs the same steps small, on the CPU.
#
#   bench/gpu_check.sh                 # results in bench/results/gpu_check/
#   PYTHON=/path/to/python OUT_DIR=/tmp/x CACHE_DIR=/tmp/models bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT_DIR=${OUT_DIR:-bench/results/gpu_check}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-240}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-330}
mkdir -p "$OUT_DIR"

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE=cuda
    TESTS=(tests/engine)
    "$PYTHON" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
else
    echo "cuda requested but not available: running on cpu (a tiny model, a few tests)" >&2
    DEVICE=cpu
    TESTS=(tests/engine/test_engine_exactness.py -k "cold_prompts and False-llama] or bf16 and qwen3")
fi

status=0
echo "== engine tests on $DEVICE"
timeout "$TEST_TIMEOUT_S" "$PYTHON" -m pytest "${TESTS[@]}" --device "$DEVICE" -q -x \
    -p no:cacheprovider 2>&1 | tee "$OUT_DIR/tests.log" | tail -n 15
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 0 ] || { echo "engine tests failed (exit $test_rc)" >&2; status=1; }

echo "== bench/engine_ttft.py --device cuda"
# --device cuda even on the fallback path: the bench prints its own fallback line.
timeout "$BENCH_TIMEOUT_S" "$PYTHON" bench/engine_ttft.py --device cuda \
    --time-limit $((BENCH_TIMEOUT_S - 30)) --out "$OUT_DIR/engine_ttft.json" \
    ${CACHE_DIR:+--cache-dir "$CACHE_DIR"} \
    2>&1 | tee "$OUT_DIR/engine_ttft.log"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || { echo "bench failed (exit $bench_rc)" >&2; status=1; }

echo "== done on $DEVICE: tests exit $test_rc, bench exit $bench_rc; logs in $OUT_DIR"
exit $status

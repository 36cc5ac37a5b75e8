#!/usr/bin/env bash
# One command for a lent GPU machine (PyTorch, transformers, accelerate preinstalled; no network):
# runs the GPU tests and the GPU benchmark, results as JSON under $OUT when it is set.
# Budget: well under 8 minutes on an H200; TEST_LIMIT and BENCH_LIMIT (seconds) and BENCH_ARGS size it to the
# device time left (BENCH_ARGS="--size-gb 4 --new-tokens 16" is the README's figure; add --profile to see
# where host time goes, --modes eager,fxoffload to skip accelerate). Last run 2026-12-04: all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_LIMIT:-240}" "$PY" -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_LIMIT:-300}" "$PY" benchmarks/bench_gpu_offload.py ${BENCH_ARGS:-} --out "$OUT/bench_gpu_offload.json" 2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, gpu bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))

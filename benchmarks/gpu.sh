#!/usr/bin/env bash
# The checks that need a GPU, as one script: the CUDA tests, then the CUDA benchmarks, results under $1
# (default benchmarks/results). Run from the repository root on a machine with a CUDA GPU:
#     bash benchmarks/gpu.sh [OUT]
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
status=0
python -m pytest -q -p no:cacheprovider -k "cuda or CUDA" tests 2>&1 | tee "$out/cuda-tests.txt" || status=1
python -m benchmarks.offload --device cuda --out "$out/offload-cuda.json" || status=1
python -m benchmarks.fit --device cuda --out "$out/fit-cuda.json" || status=1
python -m benchmarks --suite cuda --device cuda --repeats 15 --out "$out" || status=1
exit $status

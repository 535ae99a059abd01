#!/usr/bin/env bash
# The checks that need a GPU, as one script, results under OUT (default benchmarks/results). Run from the
# repository root on a machine with a CUDA GPU:
#     bash benchmarks/gpu.sh [OUT [STAGE ...]]
# Stages, in this order by default: fit (remat.fit against its peers, `benchmarks.fit --device cuda`),
# compiled (remat.fit under torch.compile against the partitioner's activation_memory_budget), tests (the
# CUDA tests), offload, suite (`python -m benchmarks --suite cuda`). Each is bounded by a time limit, in
# seconds, from the environment: FIT_S, COMPILED_S, TESTS_S, OFFLOAD_S, SUITE_S. PYTHON names the
# interpreter (default python3).
set -uo pipefail
out="${1:-benchmarks/results}"
shift || true
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(fit compiled tests offload suite)
py="${PYTHON:-python3}"
mkdir -p "$out"
status=0
"$py" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$out/gpu-environment.txt"
for stage in "${stages[@]}"; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  case "$stage" in
    fit) timeout "${FIT_S:-1800}" "$py" -m benchmarks.fit --device cuda --targets 4 --out "$out/fit-cuda.json" ;;
    compiled) timeout "${COMPILED_S:-1800}" "$py" -m benchmarks.fit --device cuda --compiled --targets 4 --out "$out/fit-compiled-cuda.json" ;;
    tests) timeout "${TESTS_S:-1800}" "$py" -m pytest -q -p no:cacheprovider -n 8 --timeout 300 -k "cuda or CUDA" tests 2>&1 | tee "$out/cuda-tests.txt" ;;
    offload) timeout "${OFFLOAD_S:-1800}" "$py" -m benchmarks.offload --device cuda --out "$out/offload-cuda.json" ;;
    suite) timeout "${SUITE_S:-1800}" "$py" -m benchmarks --suite cuda --device cuda --repeats 15 --out "$out" ;;
    *) echo "unknown stage: $stage"; false ;;
  esac || status=1
done
exit $status

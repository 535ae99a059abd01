#!/usr/bin/env bash
# The checks that need a GPU, as one script that runs as-is on a machine with one CUDA GPU (an H100 with
# torch 2.11 and Python 3.12 is what this project is lent), in under 8 minutes, results under OUT:
#     bash benchmarks/gpu.sh [--dry-run] [OUT [STAGE ...]]
# Stages, in this order by default, each bounded by a time limit in seconds from the environment:
#   tests (TESTS_S=150)  the CUDA tests and the quirk probes (`-k "cuda or CUDA or test_quirks"`), with
#                        `filterwarnings = error` kept: only two warnings that are not remat's are ignored,
#                        by message (cuBLAS setting the primary context itself; NumPy's deprecation of the
#                        generic timedelta unit, at import)
#   workspaces (WORKSPACES_S=30)  what cuBLAS, cuDNN and SDPA's kernels allocate beyond their outputs, held
#                        and transient, per kernel family (benchmarks/workspaces.py)
#   fit (FIT_S=90)       remat.fit against its peers and targets, peaks by `torch.cuda.max_memory_allocated`
#   step (STEP_S=190)    a GPT-style step at a GPU's size (bf16, d=2048, T=2048, 12 layers) under eager,
#                        torch.utils.checkpoint, SAC, torch_remat, torch.compile's activation_memory_budget,
#                        remat dots_saveable and remat.fit at two targets, side by side in one process
# and, named only: offload (OFFLOAD_S=300), offloading to host memory against its peers (docs/offload.md).
# --dry-run runs the same stages at a toy size on the CPU (the tests stage only collects the CUDA tests),
# so that the test suite checks the script cannot rot. PYTHON names the interpreter (default python3). What
# the machine's image lacks (optree, highspy, expecttest, pytest-randomly, pytest-timeout, torch-remat: about
# 4 MiB) travels as wheels for its Python (3.12), fetched here beforehand into WHEELS (default .wheels, which
# git ignores) and installed there first, without an index; remat itself is imported from the working tree:
#     bash benchmarks/gpu.sh --fetch-wheels          # here, with the network
#     bash benchmarks/gpu.sh "$OUT"                  # there (the device tool: carry .wheels)
set -uo pipefail
wheels="${WHEELS:-.wheels}"
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$wheels"
  PIP_CONFIG_FILE=/dev/null "${PYTHON:-python3}" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$wheels" \
    optree highspy expecttest pytest-randomly pytest-timeout torch-remat
  exit $?
fi
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
out="${1:-benchmarks/results/gpu}"
shift || true
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests workspaces fit step)
py="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry_run" -eq 0 ] && compgen -G "$wheels/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps "$wheels"/*.whl || exit 1
fi
status=0
if [ "$dry_run" -eq 1 ]; then
  "$py" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "(dry run, CPU)")'
else
  "$py" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
fi | tee "$out/gpu-environment.txt"
warnings=(
  -W "ignore:Attempting to run cuBLAS, but there was no current CUDA context:UserWarning"
  -W "ignore:The 'generic' unit for NumPy timedelta is deprecated:DeprecationWarning"
)
for stage in "${stages[@]}"; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  case "$stage:$dry_run" in
    tests:0) timeout "${TESTS_S:-150}" "$py" -m pytest -q -p no:cacheprovider -n 8 --timeout 120 "${warnings[@]}" \
      -k "cuda or CUDA or test_quirks" tests 2>&1 | tee "$out/cuda-tests.txt" ;;
    tests:1) timeout "${TESTS_S:-150}" "$py" -m pytest -q -p no:cacheprovider --collect-only "${warnings[@]}" \
      -k "cuda or CUDA or test_quirks" tests 2>&1 | tail -3 | tee "$out/cuda-tests.txt" ;;
    workspaces:0) timeout "${WORKSPACES_S:-30}" "$py" -m benchmarks.workspaces --device cuda \
      --out "$out/workspaces-cuda.json" ;;
    workspaces:1) timeout "${WORKSPACES_S:-30}" "$py" -m benchmarks.workspaces --dry-run --out "$out/workspaces-cpu.json" ;;
    fit:0) timeout "${FIT_S:-90}" "$py" -m benchmarks.fit --device cuda --models gpt resnet --targets 3 --repeats 3 \
      --batches 2 --out "$out/fit-cuda.json" ;;
    fit:1) timeout "${FIT_S:-90}" "$py" -m benchmarks.fit --device cpu --small --models gpt --targets 2 --repeats 1 \
      --batches 2 --out "$out/fit-cpu.json" ;;
    step:0) timeout "${STEP_S:-190}" "$py" -m benchmarks.gpu_step --device cuda --repeats 5 --out "$out/gpu-step-cuda.json" ;;
    step:1) timeout "${STEP_S:-190}" "$py" -m benchmarks.gpu_step --dry-run --repeats 1 --out "$out/gpu-step-cpu.json" ;;
    offload:0) timeout "${OFFLOAD_S:-300}" "$py" -m benchmarks.offload --device cuda --out "$out/offload-cuda.json" ;;
    offload:1) timeout "${OFFLOAD_S:-300}" "$py" -m benchmarks.offload --layers 1 --d 32 --heads 2 --seq 16 --repeats 1 \
      --out "$out/offload-cpu.json" ;;
    *) echo "unknown stage: $stage"; false ;;
  esac || status=1
done
echo "== done ($(date -u +%H:%M:%S)): exit $status"
exit $status

#!/usr/bin/env bash
# The GPU device check of issue 14, from the repository root, on a machine with an NVIDIA GPU,
# nvcc, CMake, a C++ compiler and PyTorch 2.x (no gRPC, protobuf, Abseil or GoogleTest needed,
# no network). About 8 minutes on one GPU.
#
#   bench/kernels/run_gpu_checks.sh [--wheel PATH] [--out DIR] [--build DIR]
#
#   --wheel PATH  (or HSBN_WHEEL) the self-contained hsbn wheel (issue 16): installed into a
#                 folder under the build dir (pip --no-deps --no-index), then LocalCluster trains
#                 a few steps in node and global scope on the GPU. Without it the check FAILS.
#   --out DIR     (or OUT; default ./gpu-check-out) results: at most 8 files, listed at the end.
#   --build DIR   (or BUILD; default build-gpu-check) the kernels-only CMake build.
#   HSBN_CUDA_ARCH  CMAKE_CUDA_ARCHITECTURES (default: native when a GPU is visible, else 90-real)
#
# Steps: configure + build the kernels-only targets (cmake -DHSBN_KERNELS_ONLY=ON) -> require a
# GPU -> CPU and CUDA kernel tests (HSBN_REQUIRE_GPU=1: a skipped CUDA test is a failure) ->
# compute-sanitizer memcheck and racecheck on the CUDA tests -> bandwidth benchmark
# (--device cuda) -> hsbn vs PyTorch, all four kernels, the issue's shapes -> hsbn.torch's
# module on the GPU with both op sets vs nn.BatchNorm2d, autocast, sync counts, GradScaler ->
# end to end with the wheel. Every step runs even after a failure; the exit status is 0 only
# when every step passed. Without a GPU it stops after the build with "FAIL: no CUDA device".
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"

WHEEL="${HSBN_WHEEL:-}"
OUT="${OUT:-$REPO/gpu-check-out}"
BUILD="${BUILD:-$REPO/build-gpu-check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) WHEEL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
[ -n "$WHEEL" ] && case "$WHEEL" in /*) ;; *) WHEEL="$PWD/$WHEEL" ;; esac
# The result files (8 at most).
SUMMARY="$OUT/summary.txt"        # every step's verdict, the device, versions
BUILD_LOG="$OUT/build.log"        # configure + build
TESTS_LOG="$OUT/tests.log"        # CPU and CUDA kernel tests, compute-sanitizer
BENCH_JSON="$OUT/bench.jsonl"     # bn_kernels_bench, one JSON object per measurement
COMPARE_JSON="$OUT/torch_compare.json"
MODULE_JSON="$OUT/module_check.json"
E2E_JSON="$OUT/e2e.json"
DETAILS_LOG="$OUT/details.log"    # the benchmark's and the Python checks' output
: > "$SUMMARY"; : > "$BUILD_LOG"; : > "$TESTS_LOG"; : > "$DETAILS_LOG"
rm -f "$BENCH_JSON" "$COMPARE_JSON" "$MODULE_JSON" "$E2E_JSON"

log() { echo "[$(date -u +%T)] $*" | tee -a "$SUMMARY"; }
STATUS=0
fail() { log "FAIL: $*"; STATUS=1; }
export PATH="/usr/local/cuda/bin:$PATH"
PY="${PYTHON:-python3}"
JOBS="$(nproc 2>/dev/null || echo 4)"

log "hsbn GPU check at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), out=$OUT"
for tool in cmake nvcc "$PY"; do
  command -v "$tool" > /dev/null || { fail "$tool not found"; exit 1; }
done
log "nvcc: $(nvcc --version | tail -1); cmake: $(cmake --version | head -1)"
log "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1)"

HAVE_GPU=0
if nvidia-smi -L > /dev/null 2>&1 && [ -n "$(nvidia-smi -L 2>/dev/null)" ]; then HAVE_GPU=1; fi
ARCH="${HSBN_CUDA_ARCH:-}"
if [ -z "$ARCH" ]; then if [ "$HAVE_GPU" = 1 ]; then ARCH=native; else ARCH=90-real; fi; fi

# 1. Kernels-only build: needs no gRPC, protobuf, prometheus-cpp; Abseil and GoogleTest are
# used when present, else kernels/compat and tests/kernels/minitest.
log "configure (kernels only, CUDA architectures $ARCH)"
if ! cmake -S . -B "$BUILD" -DHSBN_KERNELS_ONLY=ON -DHSBN_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" ${HSBN_CMAKE_ARGS:-} >> "$BUILD_LOG" 2>&1; then
  fail "configure (see build.log)"; exit 1
fi
grep "hsbn:" "$BUILD_LOG" | tee -a "$SUMMARY"
log "build"
if ! timeout 420 cmake --build "$BUILD" -j"$JOBS" --target bn_kernels_cuda_test \
    bn_kernels_cpu_test bn_kernels_bench hsbn_bn_bench >> "$BUILD_LOG" 2>&1; then
  fail "build (see build.log)"; exit 1
fi
KLIB="$BUILD/bench/kernels/libhsbn_bn_bench.so"
CUDA_TEST="$BUILD/tests/kernels/bn_kernels_cuda_test"

# 2. A GPU, or stop here.
if [ "$HAVE_GPU" != 1 ]; then
  fail "no CUDA device: nvidia-smi lists no GPU (the build above is all this machine can check)"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$SUMMARY"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  fail "PyTorch sees no CUDA device"; STATUS=1
fi

# 3. Kernel tests. A skipped CUDA test is a failure (HSBN_REQUIRE_GPU=1, and the count below).
export HSBN_REQUIRE_GPU=1
log "CPU kernel tests"
timeout 120 "$BUILD/tests/kernels/bn_kernels_cpu_test" >> "$TESTS_LOG" 2>&1 || fail "CPU kernel tests"
log "CUDA kernel tests"
if timeout 180 "$CUDA_TEST" > "$OUT/.cuda_test.txt" 2>&1; then :; else fail "CUDA kernel tests"; fi
cat "$OUT/.cuda_test.txt" >> "$TESTS_LOG"
SKIPPED=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$OUT/.cuda_test.txt" | tail -1)
SKIPPED="${SKIPPED:-0}"
PASSED=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$OUT/.cuda_test.txt" | tail -1)
log "CUDA kernel tests: ${PASSED:-0} passed, $SKIPPED skipped"
[ "$SKIPPED" = 0 ] || fail "$SKIPPED CUDA tests were skipped"
[ "${PASSED:-0}" -gt 0 ] || fail "no CUDA test passed"
rm -f "$OUT/.cuda_test.txt"

# 4. compute-sanitizer on the CUDA tests (memcheck, racecheck), a time limit each, without the
# two largest shapes (12.8 M and 300007 values per test: minutes under the sanitizers).
SANITIZER_FILTER='--gtest_filter=-*64x64x3136*:*1x1x300007*
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    log "compute-sanitizer --tool $tool"
    echo "=== compute-sanitizer --tool $tool" >> "$TESTS_LOG"
    if timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 99 "$CUDA_TEST" "$SANITIZER_FILTER" \
        >> "$TESTS_LOG" 2>&1; then :; else rc=$?
      if [ $rc = 124 ]; then fail "compute-sanitizer $tool timed out (150 s)"
      else fail "compute-sanitizer $tool (status $rc, see tests.log)"; fi
    fi
  done
else
  fail "compute-sanitizer not found"
fi

# 5. Bandwidth benchmark on the GPU (--device cuda: never the CPU).
log "kernel benchmark"
if timeout 120 "$BUILD/bench/kernels/bn_kernels_bench" --device cuda --json "$BENCH_JSON" \
    >> "$DETAILS_LOG" 2>&1; then :; else fail "kernel benchmark"; fi

# 6. hsbn vs PyTorch, all four kernels, the issue's shapes, NCHW and channels-last, 3 dtypes.
log "hsbn kernels vs PyTorch"
echo "=== torch_compare.py" >> "$DETAILS_LOG"
timeout 240 "$PY" bench/kernels/torch_compare.py --lib "$KLIB" --json "$COMPARE_JSON" \
  >> "$DETAILS_LOG" 2>&1 || fail "torch_compare.py (see details.log)"
grep -E "^(device|results|[0-9]+ measurements)" "$DETAILS_LOG" | tail -3 | tee -a "$SUMMARY"

# 7. The PyTorch module on the GPU, both op sets, autocast, sync counts, GradScaler.
log "hsbn.torch module on the GPU"
echo "=== gpu_module_check.py" >> "$DETAILS_LOG"
PYTHONPATH="$REPO/client/python${PYTHONPATH:+:$PYTHONPATH}" timeout 180 "$PY" \
  bench/kernels/gpu_module_check.py --kernels-lib "$KLIB" --json "$MODULE_JSON" \
  >> "$DETAILS_LOG" 2>&1 || fail "gpu_module_check.py (see details.log)"
grep "^module check" "$DETAILS_LOG" | tee -a "$SUMMARY"

# 8. End to end with the wheel: real aggregators, LocalCluster, node and global scope.
if [ -z "$WHEEL" ]; then
  fail "end to end NOT RUN: no wheel given (--wheel PATH or HSBN_WHEEL); this check is incomplete"
elif [ ! -f "$WHEEL" ]; then
  fail "end to end NOT RUN: $WHEEL does not exist"
else
  log "end to end with $(basename "$WHEEL")"
  SITE="$BUILD/wheel-site"
  rm -rf "$SITE"
  if "$PY" -m pip install --no-deps --no-index --target "$SITE" "$WHEEL" >> "$DETAILS_LOG" 2>&1 \
      || "$PY" -m pip install --no-deps --no-index --break-system-packages --target "$SITE" \
        "$WHEEL" >> "$DETAILS_LOG" 2>&1; then
    echo "=== gpu_e2e_check.py" >> "$DETAILS_LOG"
    (cd "$BUILD" && env -u HSBN_LIBRARY -u HSBN_AGGREGATOR PYTHONPATH="$SITE" timeout 300 "$PY" \
      "$REPO/bench/kernels/gpu_e2e_check.py" --json "$E2E_JSON") >> "$DETAILS_LOG" 2>&1 \
      || fail "end to end (see details.log)"
    grep "^end to end" "$DETAILS_LOG" | tee -a "$SUMMARY"
  else
    fail "pip could not install $WHEEL (see details.log)"
  fi
fi

if [ "$STATUS" = 0 ]; then log "PASS: every step passed"; else log "FAIL: see the lines above"; fi
log "results: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$STATUS"

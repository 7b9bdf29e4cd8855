#!/usr/bin/env bash
# The GPU device check (issues 14 and 27), from the repository root, on a machine with an NVIDIA
# GPU, a driver, PyTorch 2.x with numpy, and either nvcc + CMake >= 3.24 or a prebuilt folder
# (bench/kernels/prepare_gpu_check.sh makes one where no GPU is needed). No network.
#
#   bench/kernels/run_gpu_checks.sh [--wheel PATH] [--prebuilt DIR] [--out DIR] [--build DIR]
#   bench/kernels/run_gpu_checks.sh --summarize DIR    the verdict of a finished (or killed) run
#
#   --wheel PATH    (or HSBN_WHEEL; default: the one in --prebuilt's folder) the self-contained
#                   hsbn wheel (issue 16): pytest tests/python/test_cuda.py and the end-to-end
#                   check run with it. Without it those two steps are NOT RUN, and the check
#                   cannot PASS.
#   --prebuilt DIR  (or HSBN_PREBUILT) the kernels' test and benchmark binaries built elsewhere
#                   (prepare_gpu_check.sh): the build step checks them instead of building.
#   --out DIR       (or OUT; default ./gpu-check-out) the results, 8 files, listed at the end.
#   --build DIR     (or BUILD; default build-gpu-check) the kernels-only CMake build.
#   HSBN_CUDA_ARCH  CMAKE_CUDA_ARCHITECTURES (default: native when a GPU is visible, else 90-real)
#
# Steps, each recorded in steps.tsv as passed, failed or not-run with its reason:
#   prereqs        CMake >= 3.24, nvcc and the host compiler it accepts, Python with torch
#                  and numpy: what to install or set when one is missing
#   build          the kernels-only targets (cmake -DHSBN_KERNELS_ONLY=ON), or --prebuilt's
#   gpu            a GPU that PyTorch sees, a driver for the CUDA runtime the build used, free
#                  device memory (the > 2^32-element case becomes a NOTE when it cannot fit)
#   kernel_tests   CPU and CUDA kernel tests (HSBN_REQUIRE_GPU=1: a skipped CUDA test fails)
#   sanitizer      compute-sanitizer memcheck and racecheck on the CUDA kernel tests
#   bench          the bandwidth benchmark (--device cuda)
#   torch_compare  hsbn vs PyTorch, all four kernels, the issue's shapes
#   module         hsbn.torch's module on the GPU with both op sets vs nn.BatchNorm2d
#   pytest_cuda    pytest tests/python/test_cuda.py with the wheel's library
#   compile_cuda   pytest tests/python/test_compile.py -k cuda with the wheel: the custom ops
#                  on CUDA tensors under torch.compile (the opt-in of issue #35)
#   e2e            end to end with the wheel: LocalCluster, node and global scope, one device
#                  per local rank when there are several GPUs
# Every step runs even after another failed (unless it cannot: then it is not-run, with why).
# The summary says PASS only when every step ran and passed and left its output; the exit
# status is 0 only then.
set -uo pipefail

# name and the output a passed step must leave in OUT: "file" (non-empty), "file#marker" (a
# line "=== marker" in file) or "-" (nothing beyond its verdict).
STEPS=(
  "prereqs -"
  "build build.log"
  "gpu -"
  "kernel_tests tests.log#kernel_tests"
  "sanitizer tests.log#sanitizer"
  "bench bench.jsonl"
  "torch_compare torch_compare.json"
  "module module_check.json"
  "pytest_cuda tests.log#pytest_cuda"
  "compile_cuda tests.log#compile_cuda"
  "e2e e2e.json"
)

# The verdict of the run whose results are in $1, from its steps.tsv and output files alone.
# Prints one line per step and PASS or FAIL; returns 0 only for PASS.
summarize() {
  local dir="$1" entry name output verdict reason file marker bad=0
  local records="$dir/steps.tsv"
  echo "summary of $dir:"
  for entry in "${STEPS[@]}"; do
    name="${entry%% *}"
    output="${entry#* }"
    verdict=""
    reason=""
    if [ -f "$records" ]; then
      # The last record of the step wins (a step records once; a rerun appends).
      IFS=$'\t' read -r _ verdict reason < <(awk -F'\t' -v n="$name" '$1 == n' "$records" | tail -1)
    fi
    if [ "$verdict" = passed ] && [ "$output" != - ]; then
      file="$dir/${output%%#*}"
      marker=""
      [ "$output" != "${output#*#}" ] && marker="${output#*#}"
      if [ ! -s "$file" ]; then
        verdict=failed
        reason="recorded as passed, but its output ${output%%#*} is missing or empty"
      elif [ -n "$marker" ] && ! grep -qx "=== $marker" "$file"; then
        verdict=failed
        reason="recorded as passed, but ${output%%#*} has no '=== $marker' section"
      fi
    fi
    case "$verdict" in
      passed) printf '  %-14s passed%s\n' "$name" "${reason:+ ($reason)}" ;;
      failed) printf '  %-14s FAILED: %s\n' "$name" "${reason:-no reason recorded}"; bad=1 ;;
      not-run) printf '  %-14s NOT RUN: %s\n' "$name" "${reason:-no reason recorded}"; bad=1 ;;
      "") printf '  %-14s NOT RUN: no verdict recorded (the check stopped before it)\n' "$name"
          bad=1 ;;
      *) printf '  %-14s FAILED: unknown verdict %q\n' "$name" "$verdict"; bad=1 ;;
    esac
  done
  if [ -f "$records" ]; then
    # A record of a step this script does not run is a mistake in the script: it fails too.
    local known=" ${STEPS[*]%% *} " stray
    while IFS=$'\t' read -r stray _; do
      case "$known" in *" $stray "*) ;; *) echo "  unknown step '$stray' in steps.tsv"; bad=1 ;; esac
    done < "$records"
  fi
  if [ "$bad" = 0 ]; then echo "PASS: every step ran and passed"; return 0; fi
  echo "FAIL: not every step ran and passed (see above)"
  return 1
}

if [ "${1:-}" = --summarize ]; then
  [ $# = 2 ] || { echo "usage: $0 --summarize DIR" >&2; exit 2; }
  summarize "$2"
  exit
fi

cd "$(dirname "$0")/../.." || exit 2
REPO="$PWD"
WHEEL="${HSBN_WHEEL:-}"
PREBUILT="${HSBN_PREBUILT:-}"
OUT="${OUT:-$REPO/gpu-check-out}"
BUILD="${BUILD:-$REPO/build-gpu-check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) WHEEL="$2"; shift 2 ;;
    --prebuilt) PREBUILT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
abspath() { case "$1" in /*|"") echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
# A prebuilt folder carries its wheel (prepare_gpu_check.sh puts it there).
if [ -z "$WHEEL" ] && [ -n "$PREBUILT" ]; then
  WHEEL="$(ls "$PREBUILT"/hsbn-*.whl 2>/dev/null | head -1)"
fi
OUT="$(abspath "$OUT")"; BUILD="$(abspath "$BUILD")"
WHEEL="$(abspath "$WHEEL")"; PREBUILT="$(abspath "$PREBUILT")"
mkdir -p "$OUT" || exit 2
# The result files (8).
SUMMARY="$OUT/summary.txt"        # the run's log lines, the device, versions, the verdict
RECORDS="$OUT/steps.tsv"          # one line per step: name, verdict, reason
BUILD_LOG="$OUT/build.log"        # configure + build, or the prebuilt folder's manifest
TESTS_LOG="$OUT/tests.log"        # every step's console output, in sections "=== step"
BENCH_JSON="$OUT/bench.jsonl"     # bn_kernels_bench, one JSON object per measurement
COMPARE_JSON="$OUT/torch_compare.json"
MODULE_JSON="$OUT/module_check.json"
E2E_JSON="$OUT/e2e.json"
: > "$SUMMARY"; : > "$RECORDS"; : > "$TESTS_LOG"
rm -f "$BUILD_LOG" "$BENCH_JSON" "$COMPARE_JSON" "$MODULE_JSON" "$E2E_JSON"

log() { echo "[$(date -u +%T)] $*" | tee -a "$SUMMARY"; }
# record STEP VERDICT [REASON]: the step's verdict (passed, failed, not-run).
record() {
  printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >> "$RECORDS"
  log "$1: $2${3:+: $3}"
}
section() { echo "=== $1" >> "$TESTS_LOG"; }
# The steps not recorded yet get not-run with the reason $1.
skip_rest() {
  local entry name
  for entry in "${STEPS[@]}"; do
    name="${entry%% *}"
    awk -F'\t' -v n="$name" '$1 == n { found = 1 } END { exit !found }' "$RECORDS" \
      || record "$name" not-run "$1"
  done
}
finish() {
  summarize "$OUT" | tee -a "$SUMMARY"
  local status=${PIPESTATUS[0]}
  log "results: $(cd "$OUT" && ls | tr '\n' ' ')"
  exit "$status"
}

export PATH="/usr/local/cuda/bin:$PATH"
PY="${PYTHON:-python3}"
JOBS="$(nproc 2>/dev/null || echo 4)"
log "hsbn GPU check at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), out=$OUT"

# --- prereqs ---------------------------------------------------------------------------------
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
problems=()
if ! command -v "$PY" > /dev/null; then
  problems+=("$PY not found: install Python 3 with PyTorch, or set PYTHON")
else
  log "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)"
  "$PY" -c 'import torch' 2> /dev/null || problems+=("$PY cannot import torch: pip install torch")
  "$PY" -c 'import numpy' 2> /dev/null \
    || problems+=("$PY cannot import numpy (PyTorch 2.x wheels do not require it): pip install numpy")
fi
if [ -z "$PREBUILT" ]; then
  if ! command -v cmake > /dev/null; then
    problems+=("cmake not found: pip install 'cmake>=3.24'")
  else
    cmake_version="$(cmake --version | head -1 | awk '{print $3}')"
    version_ge "$cmake_version" 3.24 \
      || problems+=("CMake $cmake_version < 3.24 (hsbn's minimum; CUDA architecture 'native' needs it): pip install 'cmake>=3.24' and put it first on PATH")
  fi
  if ! command -v nvcc > /dev/null; then
    problems+=("nvcc not found (looked on PATH and in /usr/local/cuda/bin): install the CUDA toolkit, or pass --prebuilt")
  else
    log "nvcc: $(nvcc --version | tail -1)"
    probe="$(mktemp -d)"
    printf '__global__ void k(int* p) { *p = 1; }\nint main() { return 0; }\n' > "$probe/p.cu"
    if ! nvcc -c "$probe/p.cu" -o "$probe/p.o" > "$probe/log" 2>&1; then
      problems+=("nvcc rejects its host compiler ($(c++ --version 2>/dev/null | head -1)): $(tail -2 "$probe/log" | tr '\n' ' ') -- set CUDAHOSTCXX to a g++ that this nvcc supports")
    fi
    rm -rf "$probe"
  fi
fi
if [ ${#problems[@]} = 0 ]; then
  record prereqs passed
else
  for p in "${problems[@]}"; do log "prerequisite: $p"; done
  record prereqs failed "${#problems[@]} missing (the lines above say what to install or set)"
fi

# --- build -----------------------------------------------------------------------------------
HAVE_GPU=0
if nvidia-smi -L > /dev/null 2>&1 && [ -n "$(nvidia-smi -L 2>/dev/null)" ]; then HAVE_GPU=1; fi
ARCH="${HSBN_CUDA_ARCH:-}"
if [ -z "$ARCH" ]; then if [ "$HAVE_GPU" = 1 ]; then ARCH=native; else ARCH=90-real; fi; fi
if [ -n "$PREBUILT" ]; then
  BIN="$PREBUILT"
  {
    echo "prebuilt binaries from $PREBUILT:"
    cat "$PREBUILT/MANIFEST" 2>/dev/null || echo "(no MANIFEST)"
  } > "$BUILD_LOG"
  missing=""
  for f in bn_kernels_cpu_test bn_kernels_cuda_test bn_kernels_bench libhsbn_bn_bench.so; do
    [ -f "$BIN/$f" ] || missing="$missing $f"
  done
  if [ -n "$missing" ]; then record build failed "$PREBUILT lacks$missing"
  else record build passed "prebuilt: $(grep -m1 '^built' "$PREBUILT/MANIFEST" 2>/dev/null)"; fi
elif awk -F'\t' '$1 == "prereqs" && $2 != "passed" { f = 1 } END { exit !f }' "$RECORDS"; then
  record build not-run "the prerequisites above are missing"
else
  BIN="$BUILD/bin"
  log "configure (kernels only, CUDA architectures $ARCH)"
  # HSBN_CMAKE_ARGS is a list of CMake arguments: split on purpose.
  # shellcheck disable=SC2086
  if ! cmake -S . -B "$BUILD" -DHSBN_KERNELS_ONLY=ON -DHSBN_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="$ARCH" ${HSBN_CMAKE_ARGS:-} >> "$BUILD_LOG" 2>&1; then
    record build failed "configure (see build.log)"
  elif ! timeout 420 cmake --build "$BUILD" -j"$JOBS" --target bn_kernels_cuda_test \
      bn_kernels_cpu_test bn_kernels_bench hsbn_bn_bench >> "$BUILD_LOG" 2>&1; then
    record build failed "build (see build.log)"
  else
    grep "hsbn:" "$BUILD_LOG" | tee -a "$SUMMARY"
    mkdir -p "$BIN"
    ln -sf "$BUILD/tests/kernels/bn_kernels_cpu_test" "$BUILD/tests/kernels/bn_kernels_cuda_test" \
      "$BUILD/bench/kernels/bn_kernels_bench" "$BUILD/bench/kernels/libhsbn_bn_bench.so" "$BIN/"
    record build passed
  fi
fi
if ! awk -F'\t' '$1 == "build" && $2 == "passed" { f = 1 } END { exit !f }' "$RECORDS"; then
  skip_rest "the kernels were not built"
  finish
fi
KLIB="$BIN/libhsbn_bn_bench.so"
CUDA_TEST="$BIN/bn_kernels_cuda_test"

# --- gpu -------------------------------------------------------------------------------------
if [ "$HAVE_GPU" != 1 ]; then
  record gpu failed "no CUDA device: nvidia-smi lists no GPU (the build above is all this machine can check)"
  skip_rest "no GPU"
  finish
fi
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.free --format=csv,noheader \
  | tee -a "$SUMMARY"
NGPU="$(nvidia-smi -L | grep -c '^GPU')"
gpu_problems=()
driver_cuda="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)"
build_cuda="$(sed -n 's/^cuda_runtime \([0-9.]*\)$/\1/p' "$PREBUILT/MANIFEST" 2>/dev/null)"
[ -z "$build_cuda" ] && build_cuda="$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
log "driver supports CUDA ${driver_cuda:-?}; the kernels were built with CUDA ${build_cuda:-?}"
if [ -n "$driver_cuda" ] && [ -n "$build_cuda" ] && [ "${driver_cuda%%.*}" -lt "${build_cuda%%.*}" ]; then
  gpu_problems+=("the driver supports CUDA $driver_cuda, older than the CUDA $build_cuda runtime linked into the kernels: install a driver for CUDA ${build_cuda%%.*}, or build with a CUDA ${driver_cuda%%.*} nvcc first on PATH")
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  gpu_problems+=("PyTorch sees no CUDA device (a CPU-only torch, or its CUDA newer than the driver)")
fi
# The > 2^32-element fp16 case holds x, y, dy, dx and torch's copies: about 55 GB.
HUGE_ARGS=()
free_mib="$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 | tr -d ' ')"
HUGE_NOTE=""
if [ -n "$free_mib" ] && [ "$free_mib" -lt 57344 ]; then
  HUGE_ARGS=(--no-huge)
  HUGE_NOTE="NOTE: the > 2^32-element case left out: ${free_mib} MiB free on GPU 0, it needs about 56 GiB"
fi
if [ ${#gpu_problems[@]} = 0 ]; then
  record gpu passed "$NGPU GPU(s)"
else
  for p in "${gpu_problems[@]}"; do log "gpu: $p"; done
  record gpu failed "${gpu_problems[*]}"
fi

# --- kernel_tests ----------------------------------------------------------------------------
export HSBN_REQUIRE_GPU=1
section kernel_tests
cuda_out="$(mktemp)"
kt_fail=""
timeout 120 "$BIN/bn_kernels_cpu_test" >> "$TESTS_LOG" 2>&1 || kt_fail="CPU kernel tests failed; "
timeout 180 "$CUDA_TEST" > "$cuda_out" 2>&1 || kt_fail="${kt_fail}CUDA kernel tests failed; "
cat "$cuda_out" >> "$TESTS_LOG"
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$cuda_out" | tail -1)
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$cuda_out" | tail -1)
rm -f "$cuda_out"
[ "${skipped:-0}" = 0 ] || kt_fail="${kt_fail}${skipped} CUDA tests skipped; "
[ "${passed:-0}" -gt 0 ] || kt_fail="${kt_fail}no CUDA test passed; "
if [ -z "$kt_fail" ]; then record kernel_tests passed "${passed} CUDA tests"
else record kernel_tests failed "${kt_fail%; } (see tests.log)"; fi

# --- sanitizer -------------------------------------------------------------------------------
# memcheck and racecheck without the two largest shapes (minutes under the sanitizers).
SANITIZER_FILTER='--gtest_filter=-*64x64x3136*:*1x1x300007*'
if ! command -v compute-sanitizer > /dev/null; then
  record sanitizer not-run "compute-sanitizer not found (it comes with the CUDA toolkit)"
else
  section sanitizer
  san_fail=""
  san_out="$(mktemp)"
  for tool in memcheck racecheck; do
    echo "--- compute-sanitizer --tool $tool" >> "$san_out"
    timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 99 "$CUDA_TEST" \
      "$SANITIZER_FILTER" >> "$san_out" 2>&1
    rc=$?
    case "$rc" in
      0) ;;
      124) san_fail="$san_fail$tool timed out (150 s); " ;;
      *) san_fail="$san_fail$tool exit status $rc; " ;;
    esac
  done
  cat "$san_out" >> "$TESTS_LOG"
  # A sandbox that refuses the tool (gVisor: "Device not supported") is not a finding.
  refused=0
  grep -qiE "Device not supported|ERR_NVGPUCTRPERM|Unable to (attach|initialize)" "$san_out" \
    && refused=1
  rm -f "$san_out"
  if [ -z "$san_fail" ]; then record sanitizer passed
  elif [ "$refused" = 1 ]; then
    record sanitizer not-run "compute-sanitizer could not attach here (${san_fail%; }): see tests.log"
  else record sanitizer failed "${san_fail%; } (see tests.log)"; fi
fi

# --- bench -----------------------------------------------------------------------------------
section bench
if timeout 120 "$BIN/bn_kernels_bench" --device cuda --json "$BENCH_JSON" >> "$TESTS_LOG" 2>&1; then
  record bench passed
else record bench failed "bn_kernels_bench (see tests.log)"; fi

# --- torch_compare ---------------------------------------------------------------------------
section torch_compare
if timeout 240 "$PY" bench/kernels/torch_compare.py --lib "$KLIB" --json "$COMPARE_JSON" \
    "${HUGE_ARGS[@]}" >> "$TESTS_LOG" 2>&1; then
  record torch_compare passed "$HUGE_NOTE"
else record torch_compare failed "torch_compare.py (see tests.log)${HUGE_NOTE:+; $HUGE_NOTE}"; fi

# --- module ----------------------------------------------------------------------------------
section module
if PYTHONPATH="$REPO/client/python${PYTHONPATH:+:$PYTHONPATH}" timeout 180 "$PY" \
    bench/kernels/gpu_module_check.py --kernels-lib "$KLIB" --json "$MODULE_JSON" \
    >> "$TESTS_LOG" 2>&1; then
  record module passed
else record module failed "gpu_module_check.py (see tests.log)"; fi

# --- pytest_cuda and e2e: the wheel ----------------------------------------------------------
SITE="$BUILD/wheel-site"
mkdir -p "$BUILD"
if [ -z "$WHEEL" ]; then
  skip_rest "no wheel given (--wheel PATH or HSBN_WHEEL)"
  finish
elif [ ! -f "$WHEEL" ]; then
  skip_rest "$WHEEL does not exist"
  finish
fi
rm -rf "$SITE"
if ! { "$PY" -m pip install --no-deps --no-index --target "$SITE" "$WHEEL" \
       || "$PY" -m pip install --no-deps --no-index --break-system-packages --target "$SITE" \
         "$WHEEL"; } >> "$TESTS_LOG" 2>&1; then
  skip_rest "pip could not install $WHEEL (see tests.log)"
  finish
fi
# The repository's tests with the wheel's native parts, within $1 seconds; the rest of the
# arguments go to pytest. Sets pytest_line (pytest's summary, or why there is none); returns 0
# only when every test ran and passed (a skipped test is no pass).
pytest_line=""
run_pytest() {
  local limit="$1" pytest_out rc line
  shift
  pytest_out="$(mktemp)"
  (env -u HSBN_LIBRARY -u HSBN_AGGREGATOR PYTHONPATH="$SITE" timeout "$limit" "$PY" -m pytest \
    "$@" -q -rs -p no:cacheprovider) > "$pytest_out" 2>&1
  rc=$?
  cat "$pytest_out" >> "$TESTS_LOG"
  line="$(grep -E '^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|skipped|error)' "$pytest_out" | tail -1)"
  rm -f "$pytest_out"
  if [ "$rc" = 0 ] && [ -n "$line" ] && ! echo "$line" | grep -qE 'skipped|failed|error'; then
    pytest_line="$line"
    return 0
  fi
  pytest_line="status $rc: ${line:-no pytest summary} (a skipped test is no pass)"
  return 1
}

section pytest_cuda
# test_cuda.py runs only on a GPU.
if run_pytest 240 tests/python/test_cuda.py; then record pytest_cuda passed "$pytest_line"
else record pytest_cuda failed "$pytest_line"; fi

section compile_cuda
# The custom ops on CUDA tensors (issue #35; an opt-in, use_custom_ops(..., cuda=True), until
# this step has passed): torch.compile(fullgraph=True) of hsbn layers on the GPU, 0 graph
# breaks, compiled equal to eager, over 2 ranks of real aggregators.
if run_pytest 420 tests/python/test_compile.py -k cuda; then
  record compile_cuda passed "$pytest_line"
else record compile_cuda failed "$pytest_line"; fi

section e2e
(cd "$BUILD" && env -u HSBN_LIBRARY -u HSBN_AGGREGATOR PYTHONPATH="$SITE" timeout 300 "$PY" \
  "$REPO/bench/kernels/gpu_e2e_check.py" --devices "$NGPU" --require-kernels --json "$E2E_JSON") >> "$TESTS_LOG" 2>&1
rc=$?
line="$(grep '^end to end' "$TESTS_LOG" | tail -1)"
[ "$NGPU" -gt 1 ] || line="$line; NOTE: one GPU, so every local rank used it (the LOCAL_RANK to device mapping was not exercised)"
if [ "$rc" = 0 ]; then record e2e passed "$line"
else record e2e failed "status $rc: ${line:-no result line} (see tests.log)"; fi
finish

#!/usr/bin/env bash
# Builds hsbn with Debian's clang-14 under the sanitizers and runs the tests there:
#   asan    ASan+UBSan build in build-asan/, the whole ctest suite
#   tsan    TSan build in build-tsan/, the server, client and integration suites
#   python  the Python suite (tests/python) against build-asan's libhsbn.so and aggregator,
#           with the ASan runtime preloaded into python3
#   scripts/sanitize.sh [asan|tsan|python|all]     (default: asan)
#   HSBN_SANITIZE_JOBS=N    build jobs (default 2); HSBN_TEST_JOBS=N ctest jobs (default 2)
#
# Every sanitizer report of every process (tests, the aggregators and workers they start) is
# written to <build>/sanitizer-logs/; the run fails if any is there. Suppressions are only for
# code outside hsbn (Debian's uninstrumented gRPC, protobuf and Abseil) and live in
# tests/sanitize/*.supp, each with its reason. docs/results/RELIABILITY.md says what was found.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
what="${1:-asan}"
jobs="${HSBN_SANITIZE_JOBS:-2}"
supp="$PWD/tests/sanitize"

if ! command -v clang++-14 >/dev/null 2>&1 ||
   ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.asan-x86_64.so >/dev/null 2>&1; then
  echo "sanitize: clang++-14 or its sanitizer runtimes are missing: run scripts/setup.sh" >&2
  exit 2
fi
symbolizer=$(command -v llvm-symbolizer-14 || command -v llvm-symbolizer || true)

configure_and_build() {  # build-dir cache-file [targets...]
  local build=$1 cache=$2
  shift 2
  echo "sanitize: building $build/ ($(basename "$cache"))"
  cmake -S . -B "$build" -C "$cache" >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log"; return 1; }
  mv "$build.configure.log" "$build/configure.log"
  local target_args=()
  for t in "$@"; do target_args+=(--target "$t"); done
  if ! cmake --build "$build" -j "$jobs" "${target_args[@]}" >"$build/build.log" 2>&1; then
    grep -E "error" "$build/build.log" | head -20
    echo "sanitize: build failed; the full log is $build/build.log" >&2
    return 1
  fi
}

# Fails (printing them) if any process wrote a sanitizer report into $1.
check_logs() {
  local logs=$1 name=$2
  if compgen -G "$logs/*" >/dev/null; then
    echo "sanitize: $name: $(ls "$logs" | wc -l) sanitizer report(s) in $logs/:"
    for f in "$logs"/*; do echo "--- $f"; head -60 "$f"; done
    return 1
  fi
  echo "sanitize: $name: no sanitizer report"
}

# A test whose assertion is the aggregator's RSS after 128 MiB of results: under ASan, freed
# memory waits in the allocator's quarantine (256 MiB by default) so that a use after free is
# caught, and RSS says nothing about the aggregator. It runs in the normal build.
asan_skip='^Hardening\.AReaderThatDoesNotReadIsDroppedAtTheQueueCap$'

run_asan() {
  configure_and_build build-asan tests/sanitize/asan.cmake || return 1
  local logs="$PWD/build-asan/sanitizer-logs"
  rm -rf "$logs" && mkdir -p "$logs"
  echo "== ctest under ASan+UBSan"
  ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan:${ASAN_OPTIONS:-}" \
  LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan" \
  ASAN_SYMBOLIZER_PATH="$symbolizer" \
    ctest --test-dir build-asan --output-on-failure -j "${HSBN_TEST_JOBS:-2}" -E "$asan_skip"
  local status=$?
  check_logs "$logs" asan || status=1
  return $status
}

run_tsan() {
  local targets=(job_test client_result_test integration_test hsbn-aggregator hsbn-synthetic)
  configure_and_build build-tsan tests/sanitize/tsan.cmake "${targets[@]}" || return 1
  local logs="$PWD/build-tsan/sanitizer-logs"
  rm -rf "$logs" && mkdir -p "$logs"
  # The server, client and integration suites: every test of those executables.
  local suites=()
  for exe in build-tsan/tests/server/job_test build-tsan/tests/client/client_result_test \
             build-tsan/tests/integration/integration_test; do
    while read -r s; do suites+=("$s"); done < <("$exe" --gtest_list_tests | sed -n 's/^\([A-Za-z0-9_]*\)\.$/\1/p')
  done
  local regex
  regex="^($(IFS='|'; echo "${suites[*]}"))\\."
  echo "== ctest under TSan: $regex"
  TSAN_OPTIONS="suppressions=$supp/tsan.supp:log_path=$logs/tsan:second_deadlock_stack=1:${TSAN_OPTIONS:-}" \
  TSAN_SYMBOLIZER_PATH="$symbolizer" \
    ctest --test-dir build-tsan --output-on-failure -j "${HSBN_TEST_JOBS:-2}" -R "$regex"
  local status=$?
  check_logs "$logs" tsan || status=1
  return $status
}

run_python() {
  [ -x build-asan/client/libhsbn.so ] || [ -f build-asan/client/libhsbn.so ] ||
    configure_and_build build-asan tests/sanitize/asan.cmake || return 1
  local logs="$PWD/build-asan/sanitizer-logs-python"
  rm -rf "$logs" && mkdir -p "$logs"
  local runtime
  runtime=$(clang-14 -print-file-name=libclang_rt.asan-x86_64.so)
  # The aggregators the tests start inherit LD_PRELOAD: an ASan executable (which links its own
  # copy of the runtime) refuses a second one, so they are the normal build's; the ctest suite
  # checks them under ASan.
  local aggregator="${HSBN_AGGREGATOR:-$PWD/build/server/hsbn-aggregator}"
  [ -x "$aggregator" ] || { echo "sanitize: python: $aggregator is missing: run scripts/setup.sh" >&2; return 1; }
  echo "== pytest tests/python with $runtime preloaded (aggregator: $aggregator)"
  # CPython and PyTorch are not instrumented and keep memory until exit: no leak check here.
  PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}" \
  HSBN_LIBRARY="$PWD/build-asan/client/libhsbn.so" \
  HSBN_AGGREGATOR="$aggregator" \
  LD_PRELOAD="$runtime" \
  ASAN_OPTIONS="detect_leaks=0:log_path=$logs/asan:${ASAN_OPTIONS:-}" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan" \
  ASAN_SYMBOLIZER_PATH="$symbolizer" \
    /usr/bin/python3 -m pytest tests/python -q -p no:cacheprovider ${HSBN_PYTEST_ARGS:-}
  local status=$?
  check_logs "$logs" python || status=1
  return $status
}

status=0
case "$what" in
  asan) run_asan || status=1 ;;
  tsan) run_tsan || status=1 ;;
  python) run_python || status=1 ;;
  all) run_asan || status=1; run_tsan || status=1; run_python || status=1 ;;
  *) echo "usage: scripts/sanitize.sh [asan|tsan|python|all]" >&2; exit 2 ;;
esac
if [ "$status" -ne 0 ]; then
  echo "sanitize: FAILED ($what)"
  exit 1
fi
echo "sanitize: passed ($what)"

#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with Debian's clang-14 under ASan+UBSan into
# build-fuzz/ and runs each for SECONDS (default 30), one after another, starting from its seed
# corpus in tests/fuzz/corpus/<name>/ (copied: the tree is not changed). Prints executions per
# second and coverage per fuzzer; exits non-zero if any crashed, leaked, timed out or broke an
# invariant (the input that did it is saved in build-fuzz/artifacts/<name>/).
#
#   scripts/fuzz.sh [SECONDS]
#   HSBN_FUZZ_TARGETS="fuzz_job fuzz_env"   run only these
#   HSBN_FUZZ_JOBS=N                        build jobs (default 2)
#   HSBN_FUZZ_MERGE=1                       afterwards, merge what each run found into its seed
#                                           corpus in the tree (libFuzzer -merge=1: only inputs
#                                           that add coverage)
# Install what it needs with scripts/setup.sh (scripts/packages.txt: clang-14,
# libclang-rt-14-dev, llvm-14). docs/results/RELIABILITY.md has the numbers of the last long runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
seconds="${1:-30}"
build="build-fuzz"
read -r -a targets <<< "${HSBN_FUZZ_TARGETS:-fuzz_job fuzz_frames fuzz_client_results fuzz_env}"

if ! command -v clang++-14 >/dev/null 2>&1 ||
   ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "fuzz: clang++-14 or its libFuzzer runtime is missing: run scripts/setup.sh" >&2
  exit 2
fi

echo "fuzz: building ${targets[*]} into $build/"
cmake -S . -B "$build" -C tests/fuzz/fuzz.cmake >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
mv "$build.configure.log" "$build/configure.log"
if ! cmake --build "$build" -j "${HSBN_FUZZ_JOBS:-2}" --target "${targets[@]}" \
     >"$build/build.log" 2>&1; then
  grep -E "error" "$build/build.log" | head -20
  echo "fuzz: build failed; the full log is $build/build.log" >&2
  exit 1
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
symbolizer=$(command -v llvm-symbolizer-14 || command -v llvm-symbolizer || true)
[ -n "$symbolizer" ] && export ASAN_SYMBOLIZER_PATH="$symbolizer"

failed=()
summary=()
for t in "${targets[@]}"; do
  seeds="tests/fuzz/corpus/$t"
  work="$build/corpus/$t"
  artifacts="$build/artifacts/$t"
  mkdir -p "$work" "$artifacts"
  [ -d "$seeds" ] && cp -n "$seeds"/* "$work"/ 2>/dev/null
  log="$build/$t.log"
  echo "fuzz: $t for ${seconds}s (log: $log)"
  "$build/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" "$work" >"$log" 2>&1
  status=$?
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
  cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$done_line")
  ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$done_line")
  corp=$(sed -nE 's/.* corp: ([0-9]+)\/.*/\1/p' <<<"$done_line")
  execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+).*/\1/p' "$log")
  rate=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+).*/\1/p' "$log")
  line=$(printf '%-20s %8ss %12s execs %8s exec/s  cov %6s  ft %7s  corpus %6s' "$t" "$seconds" \
         "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}")
  if [ "$status" -ne 0 ] || [ -z "$done_line" ]; then
    failed+=("$t")
    line="$line  FAILED (status $status)"
    grep -E "INVARIANT VIOLATED|ERROR: |runtime error|SUMMARY" "$log" | head -5
    echo "fuzz: $t failed; input saved in $artifacts/, full log $log" >&2
  elif [ "${HSBN_FUZZ_MERGE:-0}" = 1 ]; then
    mkdir -p "$seeds"
    "$build/tests/fuzz/$t" -merge=1 "$seeds" "$work" >"$build/$t.merge.log" 2>&1
  fi
  summary+=("$line")
done

echo "== fuzz summary (cov: instrumented edges reached; ft: libFuzzer features)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: all passed"

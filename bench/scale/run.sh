#!/usr/bin/env bash
# Builds the scale benchmark and runs it: bench/scale/run.sh [--quick] [run.py flags...]
# e.g. bench/scale/run.sh --old-aggregator OLD_BUILD/server/hsbn-aggregator
# Build directory: $HSBN_BENCH_BUILD_DIR, default build-bench/ at the repository root. Results:
# BUILD/bench/scale/results.{json,md} (override with --json / --markdown).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${HSBN_BENCH_BUILD_DIR:-$root/build-bench}"
jobs="${HSBN_BENCH_JOBS:-2}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$jobs" --target bench_scale
exec python3 "$here/run.py" --build-dir "$build" \
  --json "$build/bench/scale/results.json" --markdown "$build/bench/scale/results.md" "$@"

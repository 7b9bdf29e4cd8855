#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU device check needs, into one folder to
# carry to the GPU machine, so that only the checks run there: the kernels' test and benchmark
# binaries (kernels-only build, self-contained: kernels/compat and tests/kernels/minitest instead
# of Abseil and GoogleTest, the static CUDA runtime) and the self-contained wheel (issue 16)
# from the main build. Checks that every binary needs only system libraries and holds code for
# the architectures asked for, and writes MANIFEST (commit, CUDA version, architectures, files).
#
#   bench/kernels/prepare_gpu_check.sh [DIR]    (default build-gpu-prebuilt; build*/ is ignored)
#
#   HSBN_CUDA_ARCH   CUDA architectures of the kernels-only binaries (default "90-real;90-virtual":
#                    the H200 of the device machines, PTX for newer GPUs)
#   HSBN_BUILD_DIR   the main build whose wheel is taken (default build: scripts/setup.sh)
#   HSBN_JOBS        parallel build jobs (default: number of cores)
#
# Then on the GPU machine, from the repository root (DIR carried along):
#   bench/kernels/run_gpu_checks.sh --prebuilt DIR --out OUTDIR     (the wheel: DIR/hsbn-*.whl)
set -euo pipefail
cd "$(dirname "$0")/../.." || exit 2
DIR="${1:-build-gpu-prebuilt}"
WORK="$DIR.work"
ARCH="${HSBN_CUDA_ARCH:-90-real;90-virtual}"
MAIN="${HSBN_BUILD_DIR:-build}"
JOBS="${HSBN_JOBS:-$(nproc)}"
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc > /dev/null || { echo "prepare: nvcc not found" >&2; exit 1; }

echo "prepare: kernels-only build for CUDA architectures $ARCH in $WORK"
mkdir -p "$WORK"
# HSBN_CMAKE_ARGS is a list of CMake arguments (e.g. compiler launchers): split on purpose.
# shellcheck disable=SC2086
cmake -S . -B "$WORK" -DHSBN_KERNELS_ONLY=ON -DHSBN_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_DISABLE_FIND_PACKAGE_absl=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON ${HSBN_CMAKE_ARGS:-} > "$WORK/prepare-configure.log" 2>&1 \
  || { cat "$WORK/prepare-configure.log"; exit 1; }
cmake --build "$WORK" -j "$JOBS" --target bn_kernels_cuda_test bn_kernels_cpu_test \
  bn_kernels_bench hsbn_bn_bench > "$WORK/prepare-build.log" 2>&1 \
  || { tail -40 "$WORK/prepare-build.log"; echo "prepare: build failed ($WORK/prepare-build.log)" >&2; exit 1; }

echo "prepare: the wheel from $MAIN"
[ -f "$MAIN/CMakeCache.txt" ] || { echo "prepare: no main build in $MAIN: run scripts/setup.sh" >&2; exit 1; }
grep -q '^HSBN_CUDA:STRING=OFF' "$MAIN/CMakeCache.txt" \
  && { echo "prepare: $MAIN was configured with HSBN_CUDA=OFF: its wheel has no CUDA kernels" >&2; exit 1; }
cmake --build "$MAIN" -j "$JOBS" --target hsbn_wheel > "$WORK/prepare-wheel.log" 2>&1 \
  || { tail -40 "$WORK/prepare-wheel.log"; exit 1; }
wheel="$(ls -t "$MAIN"/dist/hsbn-*.whl | head -1)"

rm -rf "$DIR"
mkdir -p "$DIR"
cp "$WORK/tests/kernels/bn_kernels_cpu_test" "$WORK/tests/kernels/bn_kernels_cuda_test" \
  "$WORK/bench/kernels/bn_kernels_bench" "$WORK/bench/kernels/libhsbn_bn_bench.so" "$wheel" "$DIR/"
strip --strip-debug "$DIR"/bn_kernels_* "$DIR/libhsbn_bn_bench.so"

# Only system libraries: glibc's, the GCC runtime's. Anything else would be missing there.
for f in "$DIR"/bn_kernels_* "$DIR/libhsbn_bn_bench.so"; do
  other="$(ldd "$f" | awk '{print $1}' | grep -vE '^(linux-vdso|/lib64/ld-linux|(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so)' || true)"
  [ -z "$other" ] || { echo "prepare: $f needs non-system libraries: $other" >&2; exit 1; }
done
# The wheel's libhsbn.so and the CUDA test hold device code (a .nv_fatbin section); cuobjdump,
# where installed, names its architectures.
unzip -o -q "$wheel" 'hsbn/_native/libhsbn.so' -d "$WORK/wheel" \
  || { echo "prepare: $wheel has no hsbn/_native/libhsbn.so" >&2; exit 1; }
device_code() {
  # (grep reads all of objdump's output: with -q, objdump's SIGPIPE would fail the pipeline)
  objdump -h "$1" | grep '\.nv_fatbin' > /dev/null \
    || { echo "prepare: $1 holds no CUDA code" >&2; exit 1; }
  if command -v cuobjdump > /dev/null; then
    cuobjdump --list-elf "$1" | sed -n 's/.*\.\(sm_[0-9a-z]*\)\..*/\1/p' | sort -u | tr '\n' ' '
  else
    echo "(cuobjdump not installed: architectures not listed)"
  fi
}
wheel_archs="$(device_code "$WORK/wheel/hsbn/_native/libhsbn.so")"
test_archs="$(device_code "$DIR/bn_kernels_cuda_test")"

{
  echo "built $(date -u +%FT%TZ) at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "cuda_runtime $(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
  echo "kernels-only architectures: $ARCH (SASS: $test_archs)"
  echo "wheel: $(basename "$wheel") (libhsbn.so SASS: $wheel_archs)"
  (cd "$DIR" && ls -l --time-style=+ | awk 'NR > 1 {print "file " $NF " " $5}')
} > "$DIR/MANIFEST"
cat "$DIR/MANIFEST"
total_kib="$(du -sk "$DIR" | awk '{print $1}')"
echo "prepare: $DIR holds ${total_kib} KiB"
[ "$total_kib" -lt 61440 ] || { echo "prepare: over 60 MiB, too large to carry" >&2; exit 1; }

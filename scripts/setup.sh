#!/usr/bin/env bash
# Installs the Debian packages hsbn needs (scripts/packages.txt) when any is missing, then
# configures and builds everything into build/. Safe to run again: it only does what is left.
#
#   scripts/setup.sh            install + build
#   HSBN_BUILD_DIR=dir          build somewhere else (default: build)
#   HSBN_JOBS=N                 parallel build jobs (default: number of cores)
#   HSBN_CMAKE_ARGS="..."       extra CMake arguments (e.g. -DHSBN_CUDA=OFF)
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
while read -r pkg; do
  pkg="${pkg%%#*}"; pkg="${pkg//[[:space:]]/}"
  [ -z "$pkg" ] && continue
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done < scripts/packages.txt

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${#missing[@]} missing Debian package(s): ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  # Another apt (unattended-upgrades on a fresh cloud machine) may hold the dpkg lock: wait for
  # it, up to 10 minutes, instead of failing at once.
  lock=(-o DPkg::Lock::Timeout=600)
  if command -v fuser >/dev/null && fuser /var/lib/dpkg/lock-frontend >/dev/null 2>&1; then
    echo "setup: another apt or dpkg is running; waiting for its lock (up to 10 minutes)"
  fi
  $SUDO apt-get "${lock[@]}" update -qq
  $SUDO apt-get "${lock[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# nvcc is optional; Debian machines with the CUDA toolkit often have it outside PATH.
cuda_args=()
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args+=("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")
fi

build="${HSBN_BUILD_DIR:-build}"
jobs="${HSBN_JOBS:-$(nproc)}"
echo "setup: configuring and building into $build/ with $jobs job(s)"
# shellcheck disable=SC2086
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${cuda_args[@]}" ${HSBN_CMAKE_ARGS:-} \
  >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
mv "$build.configure.log" "$build/configure.log"
set +o pipefail
cmake --build "$build" -j "$jobs" 2>&1 | tee "$build/build.log" \
  | { grep --line-buffered -E 'error|warning:|Linking [A-Z]+ (executable|shared|static)' || true; }
status=${PIPESTATUS[0]}  # cmake's; an up-to-date build prints nothing for grep to match
set -o pipefail
if [ "$status" -ne 0 ]; then
  echo "setup: build failed; the full log is $build/build.log" >&2
  exit 1
fi
echo "setup: done; binaries in $build/ (hsbn-aggregator: $build/server/hsbn-aggregator)"

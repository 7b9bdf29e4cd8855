#!/bin/sh
# Builds hsbn's wheel (libhsbn.so, hsbn-aggregator and the libraries they need, inside) from the
# CMake build and installs it into a Python environment. Writes nothing into the source tree.
#
#   client/python/install.sh [BUILD_DIR] [pip arguments...]
#
# BUILD_DIR (default: build, relative to the repository root) is configured if it is not yet,
# then the target hsbn_wheel is built into BUILD_DIR/dist/. PYTHON chooses the interpreter
# (default: python3). Debian's system Python refuses pip installs (PEP 668): use a venv
# made with the Python that has torch (Debian: /usr/bin/python3 -m venv --system-site-packages,
# which sees python3-torch).
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-build}
[ $# -gt 0 ] && shift
case $build in /*) ;; *) build="$repo/$build" ;; esac
python=${PYTHON:-python3}
[ -f "$build/CMakeCache.txt" ] || cmake -S "$repo" -B "$build" >/dev/null
cmake --build "$build" -j "${HSBN_JOBS:-2}" --target hsbn_wheel
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/client/python/pyproject.toml")
wheel=$(ls "$build/dist/hsbn-$version-py3-none-linux_"*.whl)
"$python" -m pip install "$@" "$wheel"

#!/bin/sh
# Installs the hsbn Python package with its native parts into a Python that has PyTorch.
#   client/python/install.sh [BUILD_DIR] [pip install options...]
# BUILD_DIR (default: build) is a CMake build of the hsbn_c and hsbn-aggregator targets. Set
# PYTHON to choose the interpreter (default: python3). Debian's system Python refuses pip
# installs (PEP 668): use a venv made with --system-site-packages to see Debian's torch, or pass
# --break-system-packages.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
[ $# -gt 0 ] && shift
python=${PYTHON:-python3}
for f in "$build/client/libhsbn.so" "$build/server/hsbn-aggregator"; do
  [ -f "$f" ] || { echo "install.sh: $f is missing; build it first:" >&2
                   echo "  cmake -S . -B $build && cmake --build $build -j2 --target hsbn_c hsbn-aggregator" >&2
                   exit 1; }
done
mkdir -p "$here/hsbn/_native"
cp "$build/client/libhsbn.so" "$build/server/hsbn-aggregator" "$here/hsbn/_native/"
# --no-build-isolation: build with the installed setuptools, so no network is needed.
"$python" -m pip install --no-build-isolation "$@" "$here"

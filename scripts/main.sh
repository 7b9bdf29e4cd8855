#!/usr/bin/env bash
# The main job: installs what is missing, builds, then compares BatchNorm synchronization
# scopes on Fashion-MNIST on this machine (examples/compare): local, node, group, auto, renorm,
# lagged and global hsbn BatchNorm across 4 simulated nodes x 2 workers behind a simulated 1 ms cross-node
# link, and a one-process reference, for a classification and a segmentation task. Writes
# results/compare/ (table, plot, JSON, CSV).
# Arguments go to the comparison (scripts/main.sh --help, which installs and builds nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"

for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
    echo "scripts/main.sh [FLAGS]: installs what is missing (scripts/setup.sh), builds, and runs"
    echo "examples/compare/hsbn_compare.py FLAGS on this machine."
    echo
    # The flags are the comparison's; printing them needs Debian's python3 with numpy and torch,
    # which the first run installs.
    if /usr/bin/python3 -c "import numpy, torch" >/dev/null 2>&1; then
      exec /usr/bin/python3 examples/compare/hsbn_compare.py --help
    fi
    echo "(Its flags are listed by examples/compare/hsbn_compare.py --help once python3-torch and"
    echo "python3-numpy are installed: scripts/setup.sh installs them. Topology: --nodes,"
    echo "--workers-per-node; batch: --batch; seeds: --seeds; tasks: --task; docs/results/COMPARISON.md.)"
    exit 0
  fi
done

scripts/setup.sh
build="${HSBN_BUILD_DIR:-build}"
export HSBN_LIBRARY="$PWD/$build/client/libhsbn.so"
export HSBN_AGGREGATOR="$PWD/$build/server/hsbn-aggregator"
# Debian's interpreter: it is the one with python3-torch.
exec /usr/bin/python3 examples/compare/hsbn_compare.py "$@"

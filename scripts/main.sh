#!/usr/bin/env bash
# The main job: installs what is missing, builds, then compares BatchNorm synchronization
# scopes on Fashion-MNIST on this machine (examples/compare): local, node, shadow and global
# hsbn BatchNorm across 2 simulated nodes x 4 workers, and a one-process reference, for a
# classification and a segmentation task. Writes results/compare/ (table, plot, JSON, CSV).
# Arguments go to the comparison (scripts/main.sh --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build="${HSBN_BUILD_DIR:-build}"
export PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"
export HSBN_LIBRARY="$PWD/$build/client/libhsbn.so"
export HSBN_AGGREGATOR="$PWD/$build/server/hsbn-aggregator"
# Debian's interpreter: it is the one with python3-torch.
exec /usr/bin/python3 examples/compare/hsbn_compare.py "$@"

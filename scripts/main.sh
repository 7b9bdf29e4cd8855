#!/usr/bin/env bash
# The main job: installs what is missing, builds, then runs the end-to-end synthetic check of
# the aggregation service on this machine (a root, 2 sidecars, 8 workers; node and global
# scope; every result verified). Arguments are passed to hsbn-synthetic (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build="${HSBN_BUILD_DIR:-build}"
exec "$build/examples/synthetic/hsbn-synthetic" "$@"

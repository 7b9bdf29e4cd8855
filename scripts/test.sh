#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the C++ suites under ctest, then the
# Python suite under pytest (Debian's /usr/bin/python3, which has PyTorch 1.13), then the same
# suite under PyTorch 2.x (scripts/torch2-root.sh: Debian 13's torch 2.6 in a kept debootstrap
# root), the fuzz smoke, and the containers leg.
#
#   scripts/test.sh              everything
#   HSBN_TEST_JOBS=N             ctest parallelism (default 2)
#   HSBN_PYTEST_ARGS="..."       extra pytest arguments (e.g. "-k global -x")
#   HSBN_TORCH2=0|1|auto         the torch 2.x leg. auto (default): run it where it can (root,
#                                debootstrap, a Debian mirror), else say why it is skipped;
#                                1: a skip is a failure; 0: not run
#   HSBN_CONTAINERS=0|1          0: skip the containers leg; 1: fail when it cannot run here
#                                (default: run it where a container runtime can run)
#   HSBN_FUZZ_SECONDS=N          seconds per fuzzer in the fuzz smoke (default 20; 0: skip it)
#   HSBN_SANITIZE=1              also run the whole ctest suite under ASan+UBSan (about 25 more
#                                minutes on 2 cores: scripts/sanitize.sh asan; off by default so
#                                CI stays near 25 minutes; docs/results/RELIABILITY.md)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
scripts/setup.sh || exit 1
build="${HSBN_BUILD_DIR:-build}"

echo "== ctest"
ctest --test-dir "$build" --output-on-failure -j "${HSBN_TEST_JOBS:-2}"
ctest_status=$?

pytest_status=0
suites=()
for d in tests/python tests/compare; do [ -d "$d" ] && suites+=("$d"); done
if [ ${#suites[@]} -gt 0 ]; then
  echo "== pytest"
  export PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"
  export HSBN_LIBRARY="$PWD/$build/client/libhsbn.so"
  export HSBN_AGGREGATOR="$PWD/$build/server/hsbn-aggregator"
  # shellcheck disable=SC2086
  /usr/bin/python3 -m pytest "${suites[@]}" -q -p no:cacheprovider ${HSBN_PYTEST_ARGS:-}
  pytest_status=$?
fi

# The Python suite again under torch 2.x and Python 3.13 (scripts/torch2-root.sh): Debian 13's
# python3-torch in a debootstrap root kept in /var/cache/hsbn/torch2-root ($HSBN_TORCH2_ROOT),
# with the wheel's native parts. The root is made once (about 2 GB; 3 minutes on a quiet machine
# with a quick mirror, 12 under load); a run then adds 30 s (a venv, the wheel) to the suite's own
# time: 10.5 minutes on 2 quiet cores (2026-12-04, inductor included), 20-30 on busy ones. Where
# it cannot run (not root, no debootstrap or unshare, no Debian mirror) it says why and is
# skipped; HSBN_TORCH2=0 skips it, HSBN_TORCH2=1 makes a skip a failure. A test that hangs fails
# by name after HSBN_TORCH2_TEST_TIMEOUT seconds (default 900).
torch2_status=0
torch2_note=""
if [ "${HSBN_TORCH2:-auto}" = 0 ]; then
  echo "test: torch 2.x leg NOT RUN (HSBN_TORCH2=0)"
  torch2_note=" (the torch 2.x leg was not run: HSBN_TORCH2=0)"
else
  echo "== pytest, torch 2.x"
  scripts/torch2-root.sh "$build"
  torch2_status=$?
  if [ "$torch2_status" -eq 77 ]; then
    echo "test: torch 2.x leg SKIPPED: it cannot run here (the line above says why)"
    torch2_note=" (the torch 2.x leg was skipped: see above)"
    torch2_status=0
    [ "${HSBN_TORCH2:-auto}" = 1 ] && torch2_status=1
  fi
fi

# Fuzzers and sanitizers (docs/results/RELIABILITY.md), where Debian's clang-14 is installed
# (scripts/packages.txt has it): each fuzzer for a short while, and with HSBN_SANITIZE=1 the
# whole ctest suite under ASan+UBSan. Each builds into a directory of its own (build-fuzz/,
# build-asan/).
reliability_status=0
if command -v clang++-14 >/dev/null 2>&1; then
  if [ "${HSBN_FUZZ_SECONDS:-20}" != 0 ]; then
    echo "== fuzz smoke"
    scripts/fuzz.sh "${HSBN_FUZZ_SECONDS:-20}" || reliability_status=1
  fi
  if [ "${HSBN_SANITIZE:-0}" != 0 ]; then
    echo "== ASan+UBSan"
    scripts/sanitize.sh asan || reliability_status=1
  fi
else
  echo "test: clang++-14 not found: fuzzers and sanitizers not run (scripts/setup.sh installs it)"
fi

# The sidecar pattern under a real container runtime (scripts/containers.sh; docs/DEPLOY.md,
# "Containers, run here"): images from docker/, pods of sidecars and trainers, the manifests
# played, faults. About 3-4 minutes with its base and images cached, 7-9 fresh. Where
# no container runtime can run (not root, podman not installable, containers do not start) it
# says why and is skipped; HSBN_CONTAINERS=0 skips it, HSBN_CONTAINERS=1 makes a skip a failure.
containers_status=0
containers_note=""
if [ "${HSBN_CONTAINERS:-auto}" = 0 ]; then
  echo "test: containers leg SKIPPED (HSBN_CONTAINERS=0)"
  containers_note=" (the containers leg was skipped: HSBN_CONTAINERS=0)"
else
  echo "== containers"
  scripts/containers.sh "$build"
  containers_status=$?
  if [ "$containers_status" -eq 77 ]; then
    echo "test: containers leg SKIPPED: no container runtime can run here (the line above says why)"
    containers_note=" (the containers leg was skipped: see above)"
    containers_status=0
    [ "${HSBN_CONTAINERS:-auto}" = 1 ] && containers_status=1
  fi
fi

if [ "$ctest_status" -ne 0 ] || [ "$pytest_status" -ne 0 ] || [ "$torch2_status" -ne 0 ] \
   || [ "$reliability_status" -ne 0 ] || [ "$containers_status" -ne 0 ]; then
  echo "test: FAILED (ctest status $ctest_status, pytest status $pytest_status," \
       "torch 2.x pytest status $torch2_status, fuzz/sanitizers status $reliability_status," \
       "containers status $containers_status)"
  exit 1
fi
echo "test: all passed$torch2_note$containers_note"

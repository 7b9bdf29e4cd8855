#!/usr/bin/env bash
# The main job's global vs reference check under CPU arithmetic settings that make PyTorch
# compute differently on this one machine, as another machine of the same kind can:
# ATEN_CPU_CAPABILITY=default|avx2|avx512 (torch's vector kernels) and DNNL_MAX_CPU_ISA=SSE41
# (oneDNN's convolutions). Each run must print PASS; the exit status is 1 if one does not.
#
#   examples/compare/isa_check.sh OUT [hsbn_compare.py arguments]
#
# Default arguments: --task seg --first-seed 1 --seeds 1 --modes node,global,reference (the
# cell that failed the earlier check on another machine). Writes OUT/<setting>/ (results.md,
# results.json, ...) and OUT/<setting>.log. Needs the build (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: examples/compare/isa_check.sh OUT [hsbn_compare.py arguments]}"
shift
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(--task seg --first-seed 1 --seeds 1 --modes "node,global,reference")
fi
build="${HSBN_BUILD_DIR:-build}"
export PYTHONPATH="$PWD/client/python${PYTHONPATH:+:$PYTHONPATH}"
export HSBN_LIBRARY="$PWD/$build/client/libhsbn.so"
export HSBN_AGGREGATOR="$PWD/$build/server/hsbn-aggregator"
export HSBN_LINKPROXY="$PWD/$build/tools/linkproxy/hsbn-linkproxy"
mkdir -p "$out"
status=0
for setting in ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 \
               ATEN_CPU_CAPABILITY=avx512 DNNL_MAX_CPU_ISA=SSE41; do
  name="${setting//=/-}"
  if env "$setting" /usr/bin/python3 examples/compare/hsbn_compare.py "${args[@]}" \
       --no-progress --out "$out/$name" >"$out/$name.log" 2>&1; then
    result=PASS
  else
    result="FAIL (exit status $?; $out/$name.log)"
    status=1
  fi
  echo "isa_check: $setting: $result"
done
exit "$status"

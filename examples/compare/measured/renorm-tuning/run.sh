#!/usr/bin/env bash
# The renorm tuning runs (docs/results/COMPARISON.md, "Renorm scope"): the sweep's default cell (4 nodes
# x 2 workers, batch 4, skew 0.8, 1 ms link) on seeds 10-12, never the reported seeds 0-4.
# node and global once (the baseline), then mode renorm once per setting. Writes one folder per
# run here; tabulate.py reads them. Usage: run.sh [NAME=OPTIONS ...] (default: every setting).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../../.." && pwd)"
export PYTHONPATH="$repo/client/python${PYTHONPATH:+:$PYTHONPATH}"
export HSBN_LIBRARY="${HSBN_LIBRARY:-$repo/build/client/libhsbn.so}"
export HSBN_AGGREGATOR="${HSBN_AGGREGATOR:-$repo/build/server/hsbn-aggregator}"

cell=(--sweep --sweep-batches 4 --sweep-skews 0.8 --sweep-seeds 3 --sweep-default-seeds 3
      --first-seed 10 --no-progress)
settings=("$@")
if [[ ${#settings[@]} -eq 0 ]]; then
  settings=(baseline
            "provisional=warmup=20,ramp=500,r_max=3,d_max=5"
            "w0-r0=warmup=0,ramp=0,r_max=3,d_max=5"
            "w5-r20=warmup=5,ramp=20,r_max=3,d_max=5"
            "w10-r50=warmup=10,ramp=50,r_max=3,d_max=5"
            "w5-r20-tight=warmup=5,ramp=20,r_max=1.5,d_max=1"
            "w5-r20-wide=warmup=5,ramp=20,r_max=10,d_max=20"
            "w5-r20-r1.25-d0.5=warmup=5,ramp=20,r_max=1.25,d_max=0.5"
            "w5-r20-r2-d2=warmup=5,ramp=20,r_max=2,d_max=2"
            "w0-r0-tight=warmup=0,ramp=0,r_max=1.5,d_max=1"
            "w5-r20-r1.1-d0.25=warmup=5,ramp=20,r_max=1.1,d_max=0.25"
            "no-correction=warmup=0,ramp=0,r_max=1,d_max=0")
fi
cd "$repo"
rel="${here#"$repo"/}"
for s in "${settings[@]}"; do
  name="${s%%=*}"
  out="$rel/$name"
  if [[ "$s" == baseline ]]; then
    modes=(--modes "node,global")
  else
    modes=(--modes renorm --renorm "${s#*=}")
  fi
  nice /usr/bin/python3 examples/compare/hsbn_compare.py "${cell[@]}" "${modes[@]}" \
    --out "$out"
  # The tuning keeps the numbers; the plots of a one-mode cell say nothing.
  rm -f "$out"/*.svg "$out"/*.png
done

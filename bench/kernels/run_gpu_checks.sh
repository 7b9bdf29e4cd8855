#!/usr/bin/env bash
# GPU checks of the BN kernels, run from the repository root on a machine with an NVIDIA GPU
# and nvcc: configure + build only the kernel targets, run the CUDA (and CPU) kernel tests, the
# kernel benchmark, and the PyTorch comparison when a CUDA PyTorch is installed. Results go to
# $OUT (default ./out). Budget: about 8 minutes.
set -uo pipefail
OUT="${OUT:-$PWD/out}"
BUILD="${BUILD:-build-gpu-checks}"
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
export PATH="/usr/local/cuda/bin:$PATH"

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
ARCH=()
if nvidia-smi > /dev/null 2>&1; then ARCH=(-DCMAKE_CUDA_ARCHITECTURES=native); fi

log "configure"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DHSBN_CUDA=ON "${ARCH[@]}" \
  > "$OUT/configure.txt" 2>&1 || { log "configure FAILED (see configure.txt)"; exit 1; }
log "build"
timeout 300 cmake --build "$BUILD" -j16 --target bn_kernels_cuda_test bn_kernels_cpu_test \
  bn_kernels_bench hsbn_bn_bench > "$OUT/build.txt" 2>&1 || { log "build FAILED (see build.txt)"; exit 1; }

status=0
log "CUDA tests"
timeout 120 "$BUILD/tests/kernels/bn_kernels_cuda_test" --gtest_output="json:$OUT/cuda_test.json" \
  > "$OUT/cuda_test.txt" 2>&1 || status=1
tail -3 "$OUT/cuda_test.txt" | tee -a "$OUT/summary.txt"
timeout 60 "$BUILD/tests/kernels/bn_kernels_cpu_test" > "$OUT/cpu_test.txt" 2>&1 || status=1
tail -1 "$OUT/cpu_test.txt" | tee -a "$OUT/summary.txt"

log "kernel benchmark"
timeout 120 "$BUILD/bench/kernels/bn_kernels_bench" --json "$OUT/bench.jsonl" \
  > "$OUT/bench.txt" 2>&1 || status=1
cat "$OUT/bench.txt"
PEAK=$(head -1 "$OUT/bench.txt" | sed -n 's/.*peak memory bandwidth: \([0-9]*\) GB\/s.*/\1/p')

if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "PyTorch comparison"
  timeout 180 python3 bench/kernels/torch_compare.py --lib "$BUILD/bench/kernels/libhsbn_bn_bench.so" \
    --peak-gbs "${PEAK:-0}" --json "$OUT/torch_compare.json" > "$OUT/torch_compare.txt" 2>&1 || status=1
  cat "$OUT/torch_compare.txt"
else
  log "no CUDA PyTorch: comparison skipped"
fi
log "done, status $status"
exit $status

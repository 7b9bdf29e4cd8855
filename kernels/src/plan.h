// plan.h — how the CUDA reductions split their work, derived from the shape alone.
//
// A reduction runs in two kernels: blocks write per-(split, channel) partial results into the
// workspace, then one thread per channel combines its `splits` partials in order in fp64. The
// split count depends only on (N, C, S, layout, dtype), never on the device or the alignment,
// so the workspace size can be queried without a GPU and the reduction order — hence the bits —
// is the same on every run and every device.
#ifndef HSBN_KERNELS_PLAN_H_
#define HSBN_KERNELS_PLAN_H_

#include <algorithm>
#include <cstdint>

#include "hsbn/bn_types.h"

namespace hsbn::kernels {

struct ReducePlan {
  int64_t splits = 1;      // partials per channel
  size_t acc_bytes = 4;    // sizeof the partials' accumulation type
  // Workspace layout: int64 counts[splits], then Acc a[splits * C], then Acc b[splits * C].
  size_t counts_offset() const { return 0; }
  size_t a_offset() const { return Align(static_cast<size_t>(splits) * 8); }
  size_t b_offset(int64_t c) const {
    return a_offset() + Align(static_cast<size_t>(splits * c) * acc_bytes);
  }
  size_t bytes(int64_t c) const {
    return b_offset(c) + Align(static_cast<size_t>(splits * c) * acc_bytes);
  }
  static size_t Align(size_t b) { return (b + 255) / 256 * 256; }
};

inline ReducePlan MakeReducePlan(const BnInput& in) {
  ReducePlan p;
  p.acc_bytes = in.dtype == DType::kF64 ? 8 : 4;
  const int64_t total = in.numel();
  const int64_t per_channel = in.n * in.s;
  if (total == 0 || in.c == 0) return p;
  // About 1024 blocks in all, each with at least 2048 and at most 65536 values.
  const int64_t per_block = std::clamp<int64_t>(total / 1024, 2048, 65536);
  if (in.layout == Layout::kNchw) {
    const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(1024, per_channel / 256));
    p.splits = std::clamp<int64_t>((per_channel + per_block - 1) / per_block, 1, cap);
  } else {
    // Each split is one row of blocks across the channels; the partials (8 bytes per channel
    // and split) stay small next to the input by keeping >= 64 rows per split.
    const int64_t channel_blocks = (in.c + 255) / 256;
    const int64_t want = (total + per_block - 1) / per_block / channel_blocks;
    const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(1024, per_channel / 64));
    p.splits = std::clamp<int64_t>(want, 1, cap);
  }
  return p;
}

}  // namespace hsbn::kernels

#endif  // HSBN_KERNELS_PLAN_H_

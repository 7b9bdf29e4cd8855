// plan.h — how the CUDA reductions split their work, derived from the shape alone.
//
// A reduction runs in two kernels: blocks write per-(split, channel) partial results into the
// workspace, then the partials of each channel are combined in fp64: by one thread in split
// order when there are at most kSerialMergeSplits of them, else by one block in a fixed tree
// (each thread folds splits t, t + 256, ... in order, then a shared-memory binary tree), so no
// thread merges more than splits / 256 + 8 partials. The split count depends only on
// (N, C, S, layout, dtype), never on the device, so the workspace size can be queried without a
// GPU. The reduction order also depends on whether the input pointers are 16-byte aligned (the
// stage-1 kernels load 16-byte vectors only from aligned inputs, which changes how values are
// grouped): the bits are the same on every run and device of an architecture for the same
// shape, dtype and alignment, and can differ in the last places between an aligned and an
// unaligned input. Input with one value per (sample, channel) (S = 1, BatchNorm1d on (N, C))
// is one row of C values per sample, the channels-last layout, and is reduced as such.
#ifndef HSBN_KERNELS_PLAN_H_
#define HSBN_KERNELS_PLAN_H_

#include <algorithm>
#include <cstdint>

#include "hsbn/bn_types.h"

namespace hsbn::kernels {

// Above this many splits a channel's partials are merged by a block in a tree.
constexpr int64_t kSerialMergeSplits = 16;

// The layout the reduction kernels read the input in: with S = 1, NCHW and channels-last are
// the same memory, and the channels-last kernel reads it with coalesced rows.
inline Layout ReduceLayout(const BnInput& in) {
  return in.s == 1 ? Layout::kChannelsLast : in.layout;
}

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
  if (ReduceLayout(in) == Layout::kNchw) {
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

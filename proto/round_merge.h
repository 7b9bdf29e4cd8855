// round_merge.h — the one reduction of a round: the members' contributions merged in member
// order. The aggregator's Job (gRPC rounds) and the shared-memory node path (shm_segment.h)
// both call it, so a result has the same bits whichever transport carried the round.
//
// Thread safety: a pure function.
#ifndef HSBN_ROUND_MERGE_H_
#define HSBN_ROUND_MERGE_H_

#include <cstdint>

#include "hsbn/moments.h"

namespace hsbn::wire {

// Reduces `n` contributions in index order 0, 1, ..., n-1 into `a` and `b` (`channels` doubles
// each; overwritten). `get(i, &ai, &bi)` returns member i's count and points ai/bi at its two
// arrays. Forward rounds merge (count, mean, m2) with Chan's formula; backward rounds sum.
// Returns the total count. REQUIRES: the counts' sum fits in int64 (callers check first).
template <typename Get>
int64_t ReduceInOrder(bool forward, int64_t channels, int n, Get get, double* a, double* b) {
  for (int64_t c = 0; c < channels; ++c) a[c] = b[c] = 0.0;
  int64_t count = 0;
  for (int i = 0; i < n; ++i) {
    const double* ai = nullptr;
    const double* bi = nullptr;
    const int64_t ci = get(i, &ai, &bi);
    if (forward) {
      count = MergeChannelMoments(count, a, b, ci, ai, bi, channels);
    } else {
      AddChannelSums(a, ai, channels);
      AddChannelSums(b, bi, channels);
      count += ci;
    }
  }
  return count;
}

}  // namespace hsbn::wire

#endif  // HSBN_ROUND_MERGE_H_

// round_merge.h — the one reduction of a round: the members' contributions merged in member
// order. The aggregator's Job (gRPC rounds) and the shared-memory node path (shm_segment.h)
// both call it, so a result has the same bits whichever transport carried the round.
//
// Thread safety: a pure function.
#ifndef HSBN_ROUND_MERGE_H_
#define HSBN_ROUND_MERGE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
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

// How many of the `n` doubles at `raw` are NaN or +-Inf (read with memcpy: `raw` may be
// unaligned). Branch-free with independent accumulators, so that the common case (none) costs a
// fraction of the merge.
inline int64_t CountNonFinite(const char* raw, int64_t n) {
  constexpr uint64_t kExp = 0x7ff0000000000000ull;
  uint64_t k[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    uint64_t w[4];
    std::memcpy(w, raw + i * 8, sizeof w);
    for (int j = 0; j < 4; ++j) k[j] += uint64_t((w[j] & kExp) == kExp);
  }
  for (; i < n; ++i) {
    uint64_t w;
    std::memcpy(&w, raw + i * 8, sizeof w);
    k[0] += uint64_t((w & kExp) == kExp);
  }
  return int64_t(k[0] + k[1] + k[2] + k[3]);
}

// The values check every contribution passes before it is merged, on either transport: the
// first value a member may not send, among `channels` a's then `channels` b's at `raw` (read
// with memcpy: `raw` may be unaligned). With `strict`, any NaN or Inf (the job's strict mode;
// otherwise they are data and propagate); in a forward round, a negative m2 (-Inf included),
// which is never a sum of squares. Returns false with `field` (e.g. "m2[3]") and `what` (why)
// set; true when every value may be merged.
inline bool CheckContributionValues(const char* raw, int64_t channels, bool forward, bool strict,
                                    std::string* field, std::string* what) {
  const char* name_a = forward ? "mean" : "sum_dy";
  const char* name_b = forward ? "m2" : "sum_dy_xmu";
  auto at = [&](int64_t i) {
    double v;
    std::memcpy(&v, raw + i * int64_t(sizeof(double)), sizeof(double));
    return v;
  };
  auto name = [&](int64_t i) {
    return absl::StrCat(i < channels ? name_a : name_b, "[", i < channels ? i : i - channels, "]");
  };
  for (int64_t i = 0; strict && i < 2 * channels; ++i) {
    const double v = at(i);
    if (std::isfinite(v)) continue;
    *field = name(i);
    *what = absl::StrCat("is ", v, "; the local batch has NaN or Inf values (check the input "
                                   "and the learning rate). This job is strict "
                                   "(HSBN_STRICT_FINITE)");
    return false;
  }
  for (int64_t i = channels; forward && i < 2 * channels; ++i) {
    const double v = at(i);
    if (!(v < 0)) continue;
    *field = name(i);
    *what = absl::StrCat("is ", v, "; a sum of squared deviations is never negative");
    return false;
  }
  return true;
}

}  // namespace hsbn::wire

#endif  // HSBN_ROUND_MERGE_H_

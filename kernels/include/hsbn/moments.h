// hsbn/moments.h — the merge arithmetic of BatchNorm statistics, in one place.
//
// Every piece of hsbn that combines statistics uses these functions: the CPU kernels, the CUDA
// kernels (they are __host__ __device__) and the aggregation server. Keeping one definition is
// what makes "the server's reduction" and "the kernel's reduction" the same numbers.
//
// A set of values is summarised by Moments{count, mean, m2}, where m2 = sum((x - mean)^2).
// Values are added one at a time with Welford's update and sets are combined with Chan's
// parallel formula. count == 0 is the identity of the merge, so an empty batch is a valid
// contribution. Combining in a fixed order gives bitwise-identical results on every run.
//
// Thread safety: pure functions on values; no shared state.
#ifndef HSBN_MOMENTS_H_
#define HSBN_MOMENTS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define HSBN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HSBN_HOST_DEVICE inline
#endif

namespace hsbn {

// Moments of one channel. Acc is the accumulation type (float or double).
template <typename Acc>
struct Moments {
  int64_t count;
  Acc mean;
  Acc m2;
};

template <typename Acc>
HSBN_HOST_DEVICE Moments<Acc> EmptyMoments() {
  return Moments<Acc>{0, Acc(0), Acc(0)};
}

// Welford's update: adds one value.
template <typename Acc>
HSBN_HOST_DEVICE void WelfordAdd(Moments<Acc>& m, Acc x) {
  m.count += 1;
  const Acc delta = x - m.mean;
  m.mean += delta / static_cast<Acc>(m.count);
  m.m2 += delta * (x - m.mean);
}

// Chan's parallel merge of two disjoint sets: returns the moments of their union.
// Either side may be empty.
template <typename Acc>
HSBN_HOST_DEVICE Moments<Acc> ChanMerge(const Moments<Acc>& a, const Moments<Acc>& b) {
  if (b.count == 0) return a;
  if (a.count == 0) return b;
  const int64_t n = a.count + b.count;
  const Acc b_share = static_cast<Acc>(b.count) / static_cast<Acc>(n);
  const Acc delta = b.mean - a.mean;
  Moments<Acc> r;
  r.count = n;
  r.mean = a.mean + delta * b_share;
  r.m2 = a.m2 + b.m2 + delta * delta * static_cast<Acc>(a.count) * b_share;
  return r;
}

// Merges the per-channel moments of set b into set a, in place, for `channels` channels that
// share one count per set (the count of a BatchNorm contribution is N * spatial, the same for
// every channel). Returns the merged count; the caller stores it.
HSBN_HOST_DEVICE int64_t MergeChannelMoments(int64_t count_a, double* mean_a, double* m2_a,
                                             int64_t count_b, const double* mean_b,
                                             const double* m2_b, int64_t channels) {
  if (count_b == 0) return count_a;
  if (count_a == 0) {
    for (int64_t c = 0; c < channels; ++c) {
      mean_a[c] = mean_b[c];
      m2_a[c] = m2_b[c];
    }
    return count_b;
  }
  for (int64_t c = 0; c < channels; ++c) {
    const Moments<double> r =
        ChanMerge(Moments<double>{count_a, mean_a[c], m2_a[c]},
                  Moments<double>{count_b, mean_b[c], m2_b[c]});
    mean_a[c] = r.mean;
    m2_a[c] = r.m2;
  }
  return count_a + count_b;
}

// Backward rounds reduce plain sums: a += b, element-wise.
HSBN_HOST_DEVICE void AddChannelSums(double* a, const double* b, int64_t channels) {
  for (int64_t c = 0; c < channels; ++c) a[c] += b[c];
}

// Variance used to normalize (biased, as torch.nn.BatchNorm in training) and the variance
// stored in running_var (unbiased). Both return 0 where they are undefined.
template <typename Acc>
HSBN_HOST_DEVICE Acc BiasedVariance(const Moments<Acc>& m) {
  return m.count > 0 ? m.m2 / static_cast<Acc>(m.count) : Acc(0);
}
template <typename Acc>
HSBN_HOST_DEVICE Acc UnbiasedVariance(const Moments<Acc>& m) {
  return m.count > 1 ? m.m2 / static_cast<Acc>(m.count - 1) : Acc(0);
}

}  // namespace hsbn

#endif  // HSBN_MOMENTS_H_

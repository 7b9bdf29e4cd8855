// CPU BatchNorm kernels. Reductions accumulate in fp64 over chunks that stay in L1 (two passes
// per chunk: sum, then squared deviations from the chunk mean), and chunks are combined with
// Chan's merge from hsbn/moments.h in a fixed order. Inner loops run over contiguous memory with
// several independent accumulators so the compiler can vectorize them without reassociating
// floating-point sums (the order is fixed by the code, so results are reproducible).
// Elementwise kernels compute in the same accumulation type as the CUDA kernels (fp32, or fp64
// for fp64 input) from the same per-channel coefficients (coeffs.h).
#include "cpu_kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "coeffs.h"
#include "convert.h"
#include "hsbn/moments.h"

namespace hsbn::kernels::cpu {
namespace {

// Element storage types on the CPU.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline double ToDouble(float v) { return v; }
inline double ToDouble(double v) { return v; }
inline double ToDouble(Half v) { return HalfBitsToFloat(v.bits); }
inline double ToDouble(BFloat16 v) { return Bf16BitsToFloat(v.bits); }

template <typename T>
inline typename AccOf<T>::type ToAcc(T v) {
  return static_cast<typename AccOf<T>::type>(ToDouble(v));
}

template <typename T>
inline T FromAcc(float v);
template <>
inline float FromAcc<float>(float v) { return v; }
template <>
inline Half FromAcc<Half>(float v) { return Half{FloatToHalfBits(v)}; }
template <>
inline BFloat16 FromAcc<BFloat16>(float v) { return BFloat16{FloatToBf16Bits(v)}; }

template <typename T, typename Acc>
inline T Store(Acc v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return FromAcc<T>(v);
  }
}

template <typename Fn>
void DispatchDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF16: fn(Half{}); break;
    case DType::kBF16: fn(BFloat16{}); break;
    case DType::kF32: fn(float{}); break;
    case DType::kF64: fn(double{}); break;
  }
}

constexpr int64_t kChunk = 2048;         // values per two-pass chunk (NCHW)
constexpr int64_t kChannelBlock = 256;   // channels per block (channels-last)
constexpr int64_t kBlockValues = 8192;   // values per two-pass row chunk (channels-last)
constexpr int kLanes = 8;                // independent accumulators

inline double Sum(const double* v, int64_t k) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += v[i + l];
  for (int l = 0; i < k; ++i, ++l) acc[l] += v[i];
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

inline double SumSquaredDeviation(const double* v, int64_t k, double mean) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double d = v[i + l] - mean;
      acc[l] += d * d;
    }
  for (int l = 0; i < k; ++i, ++l) {
    const double d = v[i] - mean;
    acc[l] += d * d;
  }
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

inline double SumProductDeviation(const double* dy, const double* x, int64_t k, double mean) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += dy[i + l] * (x[i + l] - mean);
  for (int l = 0; i < k; ++i, ++l) acc[l] += dy[i] * (x[i] - mean);
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

template <typename T>
inline void Widen(const T* p, int64_t k, double* out) {
  for (int64_t i = 0; i < k; ++i) out[i] = ToDouble(p[i]);
}

template <typename T>
void MomentsNchw(const BnInput& in, const T* x, double* mean, double* m2) {
  double buf[kChunk];
  for (int64_t c = 0; c < in.c; ++c) {
    Moments<double> acc = EmptyMoments<double>();
    for (int64_t n = 0; n < in.n; ++n) {
      const T* plane = x + (n * in.c + c) * in.s;
      for (int64_t s0 = 0; s0 < in.s; s0 += kChunk) {
        const int64_t k = std::min(kChunk, in.s - s0);
        Widen(plane + s0, k, buf);
        const double m = Sum(buf, k) / static_cast<double>(k);
        acc = ChanMerge(acc, Moments<double>{k, m, SumSquaredDeviation(buf, k, m)});
      }
    }
    mean[c] = acc.mean;
    m2[c] = acc.m2;
  }
}

template <typename T>
void MomentsChannelsLast(const BnInput& in, const T* x, double* mean, double* m2) {
  const int64_t rows = in.n * in.s;
  double sum[kChannelBlock], dev[kChannelBlock], cmean[kChannelBlock];
  for (int64_t c0 = 0; c0 < in.c; c0 += kChannelBlock) {
    const int64_t nc = std::min(kChannelBlock, in.c - c0);
    const int64_t chunk_rows = std::max<int64_t>(1, kBlockValues / nc);
    int64_t count = 0;
    for (int64_t j = 0; j < nc; ++j) mean[c0 + j] = m2[c0 + j] = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const int64_t k = std::min(chunk_rows, rows - r0);
      std::fill(sum, sum + nc, 0.0);
      std::fill(dev, dev + nc, 0.0);
      for (int64_t r = r0; r < r0 + k; ++r) {
        const T* row = x + r * in.c + c0;
        for (int64_t j = 0; j < nc; ++j) sum[j] += ToDouble(row[j]);
      }
      for (int64_t j = 0; j < nc; ++j) cmean[j] = sum[j] / static_cast<double>(k);
      for (int64_t r = r0; r < r0 + k; ++r) {
        const T* row = x + r * in.c + c0;
        for (int64_t j = 0; j < nc; ++j) {
          const double d = ToDouble(row[j]) - cmean[j];
          dev[j] += d * d;
        }
      }
      for (int64_t j = 0; j < nc; ++j) {
        const Moments<double> merged = ChanMerge(Moments<double>{count, mean[c0 + j], m2[c0 + j]},
                                                 Moments<double>{k, cmean[j], dev[j]});
        mean[c0 + j] = merged.mean;
        m2[c0 + j] = merged.m2;
      }
      count += k;
    }
  }
}

template <typename T>
void NormalizeTyped(const BnInput& in, const T* x, T* y, const BnStats& stats,
                    const BnAffine& affine, bool relu) {
  using Acc = typename AccOf<T>::type;
  auto apply = [relu](Acc v, const NormalizeCoeffs<Acc>& k) {
    Acc r = (v - k.mean) * k.alpha + k.beta;
    return relu ? (r > Acc(0) ? r : Acc(0)) : r;
  };
  if (in.layout == Layout::kNchw) {
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t c = 0; c < in.c; ++c) {
        const NormalizeCoeffs<Acc> k = MakeNormalizeCoeffs<Acc>(stats, affine, c);
        const int64_t base = (n * in.c + c) * in.s;
        for (int64_t s = 0; s < in.s; ++s) y[base + s] = Store<T>(apply(ToAcc(x[base + s]), k));
      }
    return;
  }
  NormalizeCoeffs<Acc> k[kChannelBlock];
  const int64_t rows = in.n * in.s;
  for (int64_t c0 = 0; c0 < in.c; c0 += kChannelBlock) {
    const int64_t nc = std::min(kChannelBlock, in.c - c0);
    for (int64_t j = 0; j < nc; ++j) k[j] = MakeNormalizeCoeffs<Acc>(stats, affine, c0 + j);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * in.c + c0;
      for (int64_t j = 0; j < nc; ++j) y[base + j] = Store<T>(apply(ToAcc(x[base + j]), k[j]));
    }
  }
}

template <typename T>
void BackwardReduceTyped(const BnInput& in, const T* dy, const T* x, const BnStats& stats,
                         double* sum_dy, double* sum_dy_xmu) {
  if (in.layout == Layout::kNchw) {
    double dbuf[kChunk], xbuf[kChunk];
    for (int64_t c = 0; c < in.c; ++c) {
      const double mean = LoadAsDouble(stats.mean, stats.dtype, c);
      double a = 0, b = 0;
      for (int64_t n = 0; n < in.n; ++n) {
        const int64_t base = (n * in.c + c) * in.s;
        for (int64_t s0 = 0; s0 < in.s; s0 += kChunk) {
          const int64_t k = std::min(kChunk, in.s - s0);
          Widen(dy + base + s0, k, dbuf);
          Widen(x + base + s0, k, xbuf);
          a += Sum(dbuf, k);
          b += SumProductDeviation(dbuf, xbuf, k, mean);
        }
      }
      sum_dy[c] = a;
      sum_dy_xmu[c] = b;
    }
    return;
  }
  double mean[kChannelBlock];
  const int64_t rows = in.n * in.s;
  for (int64_t c0 = 0; c0 < in.c; c0 += kChannelBlock) {
    const int64_t nc = std::min(kChannelBlock, in.c - c0);
    for (int64_t j = 0; j < nc; ++j) {
      mean[j] = LoadAsDouble(stats.mean, stats.dtype, c0 + j);
      sum_dy[c0 + j] = sum_dy_xmu[c0 + j] = 0;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * in.c + c0;
      double* a = sum_dy + c0;
      double* b = sum_dy_xmu + c0;
      for (int64_t j = 0; j < nc; ++j) {
        const double g = ToDouble(dy[base + j]);
        a[j] += g;
        b[j] += g * (ToDouble(x[base + j]) - mean[j]);
      }
    }
  }
}

template <typename T>
void BackwardElementwiseTyped(const BnInput& in, const T* dy, const T* x, const BnStats& stats,
                              const BnAffine& affine, const double* sum_dy,
                              const double* sum_dy_xmu, int64_t count, T* dx) {
  using Acc = typename AccOf<T>::type;
  auto apply = [](Acc g, Acc v, const BackwardCoeffs<Acc>& k) {
    return g * k.alpha + (v - k.mean) * k.gamma + k.beta;
  };
  if (in.layout == Layout::kNchw) {
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t c = 0; c < in.c; ++c) {
        const BackwardCoeffs<Acc> k =
            MakeBackwardCoeffs<Acc>(stats, affine, sum_dy, sum_dy_xmu, count, c);
        const int64_t base = (n * in.c + c) * in.s;
        for (int64_t s = 0; s < in.s; ++s)
          dx[base + s] = Store<T>(apply(ToAcc(dy[base + s]), ToAcc(x[base + s]), k));
      }
    return;
  }
  BackwardCoeffs<Acc> k[kChannelBlock];
  const int64_t rows = in.n * in.s;
  for (int64_t c0 = 0; c0 < in.c; c0 += kChannelBlock) {
    const int64_t nc = std::min(kChannelBlock, in.c - c0);
    for (int64_t j = 0; j < nc; ++j)
      k[j] = MakeBackwardCoeffs<Acc>(stats, affine, sum_dy, sum_dy_xmu, count, c0 + j);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * in.c + c0;
      for (int64_t j = 0; j < nc; ++j)
        dx[base + j] = Store<T>(apply(ToAcc(dy[base + j]), ToAcc(x[base + j]), k[j]));
    }
  }
}

}  // namespace

void LocalMoments(const BnInput& in, const void* x, double* mean, double* m2) {
  if (in.count() == 0) {
    std::fill(mean, mean + in.c, 0.0);
    std::fill(m2, m2 + in.c, 0.0);
    return;
  }
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (in.layout == Layout::kNchw) {
      MomentsNchw(in, static_cast<const T*>(x), mean, m2);
    } else {
      MomentsChannelsLast(in, static_cast<const T*>(x), mean, m2);
    }
  });
}

void Normalize(const BnInput& in, const void* x, void* y, const BnStats& stats,
               const BnAffine& affine, bool relu) {
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    NormalizeTyped(in, static_cast<const T*>(x), static_cast<T*>(y), stats, affine, relu);
  });
}

void BackwardReduce(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                    double* sum_dy, double* sum_dy_xmu, void* grad_weight, void* grad_bias,
                    DType grad_dtype) {
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    BackwardReduceTyped(in, static_cast<const T*>(dy), static_cast<const T*>(x), stats, sum_dy,
                        sum_dy_xmu);
  });
  for (int64_t c = 0; c < in.c; ++c) {
    if (grad_weight)
      StoreFromDouble(grad_weight, grad_dtype, c, sum_dy_xmu[c] * ChannelInvstd(stats, c));
    if (grad_bias) StoreFromDouble(grad_bias, grad_dtype, c, sum_dy[c]);
  }
}

void BackwardElementwise(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                         const BnAffine& affine, const double* sum_dy, const double* sum_dy_xmu,
                         int64_t count, void* dx) {
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    BackwardElementwiseTyped(in, static_cast<const T*>(dy), static_cast<const T*>(x), stats,
                             affine, sum_dy, sum_dy_xmu, count, static_cast<T*>(dx));
  });
}

void UpdateRunningStats(int64_t channels, int64_t count, const double* mean, const double* m2,
                        void* running_mean, void* running_var, DType running_dtype,
                        double factor) {
  for (int64_t c = 0; c < channels; ++c) {
    const double unbiased = UnbiasedVariance(Moments<double>{count, mean[c], m2[c]});
    const double rm = LoadAsDouble(running_mean, running_dtype, c);
    const double rv = LoadAsDouble(running_var, running_dtype, c);
    StoreFromDouble(running_mean, running_dtype, c, (1.0 - factor) * rm + factor * mean[c]);
    StoreFromDouble(running_var, running_dtype, c, (1.0 - factor) * rv + factor * unbiased);
  }
}

}  // namespace hsbn::kernels::cpu

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

#include "coeffs.h"
#include "convert.h"
#include "convert_cpu.h"
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
static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2, "arrays of them are uint16_t arrays");

inline const uint16_t* Bits(const Half* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const uint16_t* Bits(const BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* Bits(Half* p) { return reinterpret_cast<uint16_t*>(p); }
inline uint16_t* Bits(BFloat16* p) { return reinterpret_cast<uint16_t*>(p); }

// The elementwise kernels read their elements as V = AccOf<T> (float for fp16 / bf16 / fp32,
// double for fp64; the conversion is exact), a block at a time: Load returns the values
// themselves when T is already V, else converts the block into a stack buffer with the block
// conversions of convert_cpu.h (baseline or AVX2 + F16C build, chosen at run time; same bits).
// They compute a block into OutBuf (the output itself when T is V) and Flush converts it back
// (round to nearest even). The arithmetic is the same code, in the same order, for every dtype.
inline const float* Load(const float* p, int64_t, float*) { return p; }
inline const double* Load(const double* p, int64_t, double*) { return p; }
inline const float* Load(const Half* p, int64_t k, float* buf) {
  Converters().half_to_float(Bits(p), k, buf);
  return buf;
}
inline const float* Load(const BFloat16* p, int64_t k, float* buf) {
  Converters().bf16_to_float(Bits(p), k, buf);
  return buf;
}

inline float* OutBuf(float* p, float*) { return p; }
inline double* OutBuf(double* p, double*) { return p; }
inline float* OutBuf(Half*, float* buf) { return buf; }
inline float* OutBuf(BFloat16*, float* buf) { return buf; }

inline void Flush(const float*, int64_t, float*) {}
inline void Flush(const double*, int64_t, double*) {}
inline void Flush(const float* buf, int64_t k, Half* p) {
  Converters().float_to_half(buf, k, Bits(p));
}
inline void Flush(const float* buf, int64_t k, BFloat16* p) {
  Converters().float_to_bf16(buf, k, Bits(p));
}

// The reductions read fp32, fp64 and bf16 in place (bf16 -> fp32 is a shift, fused into the
// loop) and fp16 through a converted block (ReadBlock); Val reads element i as V.
inline float Val(const float* p, int64_t i) { return p[i]; }
inline double Val(const double* p, int64_t i) { return p[i]; }
inline float Val(const BFloat16* p, int64_t i) { return Bf16BitsToFloatFast(p[i].bits); }

template <typename T>
struct ReadOf {
  using type = T;
};
template <>
struct ReadOf<Half> {
  using type = float;
};
template <typename T>
inline const T* ReadBlock(const T* p, int64_t, typename AccOf<T>::type*) {
  return p;
}
inline const float* ReadBlock(const Half* p, int64_t k, float* buf) { return Load(p, k, buf); }

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
constexpr int64_t kElemBlock = 1024;     // values per block of the elementwise kernels (NCHW)
constexpr int kLanes = 8;                // independent accumulators

// The reductions accumulate values read as float or double (Val) in fp64; float -> double is
// exact, so this gives the same sums as widening to a double buffer first.
template <typename V>
inline double Sum(const V* v, int64_t k) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += static_cast<double>(Val(v, i + l));
  for (int l = 0; i < k; ++i, ++l) acc[l] += static_cast<double>(Val(v, i));
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

template <typename V>
inline double SumSquaredDeviation(const V* v, int64_t k, double mean) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double d = static_cast<double>(Val(v, i + l)) - mean;
      acc[l] += d * d;
    }
  for (int l = 0; i < k; ++i, ++l) {
    const double d = static_cast<double>(Val(v, i)) - mean;
    acc[l] += d * d;
  }
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

template <typename V>
inline double SumProductDeviation(const V* dy, const V* x, int64_t k, double mean) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l)
      acc[l] += static_cast<double>(Val(dy, i + l)) * (static_cast<double>(Val(x, i + l)) - mean);
  for (int l = 0; i < k; ++i, ++l)
    acc[l] += static_cast<double>(Val(dy, i)) * (static_cast<double>(Val(x, i)) - mean);
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

template <typename T>
void MomentsNchw(const BnInput& in, const T* x, double* mean, double* m2) {
  using R = typename ReadOf<T>::type;
  typename AccOf<T>::type buf[kChunk];
  for (int64_t c = 0; c < in.c; ++c) {
    Moments<double> acc = EmptyMoments<double>();
    for (int64_t n = 0; n < in.n; ++n) {
      const T* plane = x + (n * in.c + c) * in.s;
      for (int64_t s0 = 0; s0 < in.s; s0 += kChunk) {
        const int64_t k = std::min(kChunk, in.s - s0);
        const R* v = ReadBlock(plane + s0, k, buf);
        const double m = Sum(v, k) / static_cast<double>(k);
        acc = ChanMerge(acc, Moments<double>{k, m, SumSquaredDeviation(v, k, m)});
      }
    }
    mean[c] = acc.mean;
    m2[c] = acc.m2;
  }
}

template <typename T>
void MomentsChannelsLast(const BnInput& in, const T* x, double* mean, double* m2) {
  using R = typename ReadOf<T>::type;
  const int64_t rows = in.n * in.s;
  double sum[kChannelBlock], dev[kChannelBlock], cmean[kChannelBlock];
  typename AccOf<T>::type buf[kChannelBlock];
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
        const R* row = ReadBlock(x + r * in.c + c0, nc, buf);
        for (int64_t j = 0; j < nc; ++j) sum[j] += static_cast<double>(Val(row, j));
      }
      for (int64_t j = 0; j < nc; ++j) cmean[j] = sum[j] / static_cast<double>(k);
      for (int64_t r = r0; r < r0 + k; ++r) {
        const R* row = ReadBlock(x + r * in.c + c0, nc, buf);
        for (int64_t j = 0; j < nc; ++j) {
          const double d = static_cast<double>(Val(row, j)) - cmean[j];
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

template <typename Acc>
inline Acc NormalizeValue(Acc v, const NormalizeCoeffs<Acc>& k, bool relu) {
  const Acc r = (v - k.mean) * k.alpha + k.beta;
  return relu ? (r > Acc(0) ? r : Acc(0)) : r;
}

template <typename T>
void NormalizeTyped(const BnInput& in, const T* x, T* y, const BnStats& stats,
                    const BnAffine& affine, bool relu) {
  using Acc = typename AccOf<T>::type;
  Acc xbuf[kElemBlock], ybuf[kElemBlock];
  if (in.layout == Layout::kNchw) {
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t c = 0; c < in.c; ++c) {
        const NormalizeCoeffs<Acc> k = MakeNormalizeCoeffs<Acc>(stats, affine, c);
        const int64_t base = (n * in.c + c) * in.s;
        for (int64_t s0 = 0; s0 < in.s; s0 += kElemBlock) {
          const int64_t len = std::min(kElemBlock, in.s - s0);
          const Acc* xv = Load(x + base + s0, len, xbuf);
          Acc* yv = OutBuf(y + base + s0, ybuf);
          for (int64_t s = 0; s < len; ++s) yv[s] = NormalizeValue(xv[s], k, relu);
          Flush(yv, len, y + base + s0);
        }
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
      const Acc* xv = Load(x + base, nc, xbuf);
      Acc* yv = OutBuf(y + base, ybuf);
      for (int64_t j = 0; j < nc; ++j) yv[j] = NormalizeValue(xv[j], k[j], relu);
      Flush(yv, nc, y + base);
    }
  }
}

template <typename T>
void BackwardReduceTyped(const BnInput& in, const T* dy, const T* x, const BnStats& stats,
                         double* sum_dy, double* sum_dy_xmu) {
  using V = typename AccOf<T>::type;
  using R = typename ReadOf<T>::type;
  if (in.layout == Layout::kNchw) {
    V dbuf[kChunk], xbuf[kChunk];
    for (int64_t c = 0; c < in.c; ++c) {
      const double mean = LoadAsDouble(stats.mean, stats.dtype, c);
      double a = 0, b = 0;
      for (int64_t n = 0; n < in.n; ++n) {
        const int64_t base = (n * in.c + c) * in.s;
        for (int64_t s0 = 0; s0 < in.s; s0 += kChunk) {
          const int64_t k = std::min(kChunk, in.s - s0);
          const R* g = ReadBlock(dy + base + s0, k, dbuf);
          const R* v = ReadBlock(x + base + s0, k, xbuf);
          a += Sum(g, k);
          b += SumProductDeviation(g, v, k, mean);
        }
      }
      sum_dy[c] = a;
      sum_dy_xmu[c] = b;
    }
    return;
  }
  double mean[kChannelBlock];
  V dbuf[kChannelBlock], xbuf[kChannelBlock];
  const int64_t rows = in.n * in.s;
  for (int64_t c0 = 0; c0 < in.c; c0 += kChannelBlock) {
    const int64_t nc = std::min(kChannelBlock, in.c - c0);
    for (int64_t j = 0; j < nc; ++j) {
      mean[j] = LoadAsDouble(stats.mean, stats.dtype, c0 + j);
      sum_dy[c0 + j] = sum_dy_xmu[c0 + j] = 0;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * in.c + c0;
      const R* gv = ReadBlock(dy + base, nc, dbuf);
      const R* xv = ReadBlock(x + base, nc, xbuf);
      double* a = sum_dy + c0;
      double* b = sum_dy_xmu + c0;
      for (int64_t j = 0; j < nc; ++j) {
        const double g = static_cast<double>(Val(gv, j));
        a[j] += g;
        b[j] += g * (static_cast<double>(Val(xv, j)) - mean[j]);
      }
    }
  }
}

template <typename Acc>
inline Acc BackwardValue(Acc g, Acc v, const BackwardCoeffs<Acc>& k) {
  return g * k.alpha + (v - k.mean) * k.gamma + k.beta;
}

template <typename T>
void BackwardElementwiseTyped(const BnInput& in, const T* dy, const T* x, const BnStats& stats,
                              const BnAffine& affine, const double* sum_dy,
                              const double* sum_dy_xmu, int64_t count, T* dx) {
  using Acc = typename AccOf<T>::type;
  Acc gbuf[kElemBlock], xbuf[kElemBlock], obuf[kElemBlock];
  if (in.layout == Layout::kNchw) {
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t c = 0; c < in.c; ++c) {
        const BackwardCoeffs<Acc> k =
            MakeBackwardCoeffs<Acc>(stats, affine, sum_dy, sum_dy_xmu, count, c);
        const int64_t base = (n * in.c + c) * in.s;
        for (int64_t s0 = 0; s0 < in.s; s0 += kElemBlock) {
          const int64_t len = std::min(kElemBlock, in.s - s0);
          const Acc* gv = Load(dy + base + s0, len, gbuf);
          const Acc* xv = Load(x + base + s0, len, xbuf);
          Acc* ov = OutBuf(dx + base + s0, obuf);
          for (int64_t s = 0; s < len; ++s) ov[s] = BackwardValue(gv[s], xv[s], k);
          Flush(ov, len, dx + base + s0);
        }
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
      const Acc* gv = Load(dy + base, nc, gbuf);
      const Acc* xv = Load(x + base, nc, xbuf);
      Acc* ov = OutBuf(dx + base, obuf);
      for (int64_t j = 0; j < nc; ++j) ov[j] = BackwardValue(gv[j], xv[j], k[j]);
      Flush(ov, nc, dx + base);
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

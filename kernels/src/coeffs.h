// coeffs.h — per-channel coefficients of the elementwise kernels, computed in fp64 from the
// statistics and parameters in whatever dtype the caller holds them, then rounded once to the
// kernel's accumulation type. The CPU and CUDA kernels call the same functions, so both
// devices start the elementwise arithmetic from identical coefficients.
#ifndef HSBN_KERNELS_COEFFS_H_
#define HSBN_KERNELS_COEFFS_H_

#include <cmath>
#include <cstdint>

#include "convert.h"
#include "hsbn/bn_types.h"
#include "hsbn/moments.h"

namespace hsbn::kernels {

HSBN_HOST_DEVICE double ChannelInvstd(const BnStats& s, int64_t c) {
  const double v = LoadAsDouble(s.second, s.dtype, c);
  switch (s.kind) {
    case StatsKind::kInvstd: return v;
    case StatsKind::kVar: return 1.0 / sqrt(v + s.eps);
    default: {
      const double var = s.count > 0 ? v / static_cast<double>(s.count) : 0.0;
      return 1.0 / sqrt(var + s.eps);
    }
  }
}

// y = (x - mean) * alpha + beta
template <typename Acc>
struct NormalizeCoeffs {
  Acc mean, alpha, beta;
};

template <typename Acc>
HSBN_HOST_DEVICE NormalizeCoeffs<Acc> MakeNormalizeCoeffs(const BnStats& s, const BnAffine& a,
                                                          int64_t c) {
  const double w = a.weight ? LoadAsDouble(a.weight, a.dtype, c) : 1.0;
  const double b = a.bias ? LoadAsDouble(a.bias, a.dtype, c) : 0.0;
  return {static_cast<Acc>(LoadAsDouble(s.mean, s.dtype, c)),
          static_cast<Acc>(ChannelInvstd(s, c) * w), static_cast<Acc>(b)};
}

// dx = dy * alpha + (x - mean) * gamma + beta, which is
// (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count) * invstd * weight.
template <typename Acc>
struct BackwardCoeffs {
  Acc mean, alpha, gamma, beta;
};

template <typename Acc>
HSBN_HOST_DEVICE BackwardCoeffs<Acc> MakeBackwardCoeffs(const BnStats& s, const BnAffine& a,
                                                        const double* sum_dy,
                                                        const double* sum_dy_xmu, int64_t count,
                                                        int64_t c) {
  const double w = a.weight ? LoadAsDouble(a.weight, a.dtype, c) : 1.0;
  const double invstd = ChannelInvstd(s, c);
  const double alpha = invstd * w;
  const double inv_count = count > 0 ? 1.0 / static_cast<double>(count) : 0.0;
  const double mean_dy = sum_dy[c] * inv_count;
  const double mean_dy_xmu = sum_dy_xmu[c] * inv_count;
  return {static_cast<Acc>(LoadAsDouble(s.mean, s.dtype, c)), static_cast<Acc>(alpha),
          static_cast<Acc>(-alpha * invstd * invstd * mean_dy_xmu),
          static_cast<Acc>(-alpha * mean_dy)};
}

// The accumulation type of the elementwise kernels for an element dtype: fp32 for fp16, bf16
// and fp32 input, fp64 for fp64 input.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

}  // namespace hsbn::kernels

#endif  // HSBN_KERNELS_COEFFS_H_

// hsbn/bn_types.h — the value types that describe a BatchNorm kernel call: device, element
// dtype, memory layout, the (N, C, S) input, the statistics and the affine parameters.
// Plain structs with no dependencies, shared by the C++ API (hsbn/bn_kernels.h) and the CUDA
// sources, which do not see absl.
#ifndef HSBN_BN_TYPES_H_
#define HSBN_BN_TYPES_H_

#include <cstddef>
#include <cstdint>

namespace hsbn::kernels {

enum class Device { kCpu = 0, kCuda = 1 };
enum class DType { kF16 = 0, kBF16 = 1, kF32 = 2, kF64 = 3 };
// kNchw: (N, C, S) contiguous. kChannelsLast: (N, S, C) contiguous (NHWC / NDHWC).
enum class Layout { kNchw = 0, kChannelsLast = 1 };

inline size_t DTypeSize(DType dtype) {
  return dtype == DType::kF64 ? 8 : dtype == DType::kF32 ? 4 : 2;
}

struct BnInput {
  Device device = Device::kCpu;
  DType dtype = DType::kF32;
  Layout layout = Layout::kNchw;
  int64_t n = 0;  // batch
  int64_t c = 0;  // channels
  int64_t s = 1;  // product of spatial sizes (1 for BatchNorm1d on (N, C))
  int64_t numel() const { return n * c * s; }
  int64_t count() const { return n * s; }  // values per channel
};

// How the per-channel statistics used to normalize are given. `second` holds, per kind:
//   kInvstd: 1 / sqrt(var + eps)           (eps unused)
//   kVar:    the biased variance           (invstd = 1 / sqrt(var + eps))
//   kM2:     sum((x - mean)^2) over `count` values (var = m2 / count, invstd as for kVar)
// `mean` and `second` are C values of `dtype` (kF32 or kF64) on the input's device.
enum class StatsKind { kInvstd = 0, kVar = 1, kM2 = 2 };
struct BnStats {
  const void* mean = nullptr;
  const void* second = nullptr;
  DType dtype = DType::kF64;
  StatsKind kind = StatsKind::kInvstd;
  double eps = 1e-5;
  int64_t count = 0;  // only for kM2
};

// Affine parameters (C values of `dtype` on the input's device); a null weight means 1, a null
// bias means 0. Gradient outputs use the same dtype.
struct BnAffine {
  const void* weight = nullptr;
  const void* bias = nullptr;
  DType dtype = DType::kF32;
};

}  // namespace hsbn::kernels

#endif  // HSBN_BN_TYPES_H_

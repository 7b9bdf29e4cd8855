// common.cuh — device-side helpers shared by the CUDA BN kernels: element types per dtype,
// 16-byte vector access, and dispatch from the run-time dtype to a template.
#ifndef HSBN_KERNELS_CUDA_COMMON_CUH_
#define HSBN_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "coeffs.h"
#include "hsbn/bn_types.h"

namespace hsbn::kernels::cuda {

constexpr int kThreads = 256;
constexpr int kVecBytes = 16;

__device__ __forceinline__ float ToAcc(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToAcc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToAcc(float v) { return v; }
__device__ __forceinline__ double ToAcc(double v) { return v; }

template <typename T>
__device__ __forceinline__ T FromAcc(typename AccOf<T>::type v);
template <>
__device__ __forceinline__ __half FromAcc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromAcc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ float FromAcc<float>(float v) { return v; }
template <>
__device__ __forceinline__ double FromAcc<double>(double v) { return v; }

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> LoadVec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <typename T, int V>
__device__ __forceinline__ void StoreVec(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

template <typename T>
constexpr int VecWidth() {
  return kVecBytes / static_cast<int>(sizeof(T));
}

inline bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0;
}

template <typename Fn>
void DispatchDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF16: fn(__half{}); break;
    case DType::kBF16: fn(__nv_bfloat16{}); break;
    case DType::kF32: fn(float{}); break;
    case DType::kF64: fn(double{}); break;
  }
}

// Blocks for a grid-stride elementwise launch: enough to fill the device several times over.
int MaxResidentBlocks();

inline const char* LastLaunchError() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace hsbn::kernels::cuda

#endif  // HSBN_KERNELS_CUDA_COMMON_CUH_

// cuda_kernels.h — the CUDA implementations behind hsbn/bn_kernels.h, declared without CUDA
// types so that plain C++ can call them. Arguments are validated by the caller
// (bn_kernels.cc). Each returns nullptr on success or a static message naming the CUDA error.
#ifndef HSBN_KERNELS_CUDA_KERNELS_H_
#define HSBN_KERNELS_CUDA_KERNELS_H_

#include <cstdint>

#include "hsbn/bn_types.h"

namespace hsbn::kernels::cuda {

bool DeviceAvailable();

const char* LocalMoments(const BnInput& in, const void* x, double* mean, double* m2,
                         void* workspace, void* stream);
const char* Normalize(const BnInput& in, const void* x, void* y, const BnStats& stats,
                      const BnAffine& affine, bool relu, void* stream);
const char* BackwardReduce(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                           double* sum_dy, double* sum_dy_xmu, void* grad_weight,
                           void* grad_bias, DType grad_dtype, void* workspace, void* stream);
const char* BackwardElementwise(const BnInput& in, const void* dy, const void* x,
                                const BnStats& stats, const BnAffine& affine,
                                const double* sum_dy, const double* sum_dy_xmu, int64_t count,
                                void* dx, void* stream);
const char* UpdateRunningStats(int64_t channels, int64_t count, const double* mean,
                               const double* m2, void* running_mean, void* running_var,
                               DType running_dtype, double factor, void* stream);

}  // namespace hsbn::kernels::cuda

#endif  // HSBN_KERNELS_CUDA_KERNELS_H_

// cpu_kernels.h — the CPU implementations behind hsbn/bn_kernels.h. Arguments are validated by
// the caller (bn_kernels.cc); these functions only compute.
#ifndef HSBN_KERNELS_CPU_KERNELS_H_
#define HSBN_KERNELS_CPU_KERNELS_H_

#include <cstdint>

#include "hsbn/bn_types.h"

namespace hsbn::kernels::cpu {

void LocalMoments(const BnInput& in, const void* x, double* mean, double* m2);
void Normalize(const BnInput& in, const void* x, void* y, const BnStats& stats,
               const BnAffine& affine, bool relu);
void BackwardReduce(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                    double* sum_dy, double* sum_dy_xmu, void* grad_weight, void* grad_bias,
                    DType grad_dtype);
void BackwardElementwise(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                         const BnAffine& affine, const double* sum_dy, const double* sum_dy_xmu,
                         int64_t count, void* dx);
void UpdateRunningStats(int64_t channels, int64_t count, const double* mean, const double* m2,
                        void* running_mean, void* running_var, DType running_dtype,
                        double factor);

}  // namespace hsbn::kernels::cpu

#endif  // HSBN_KERNELS_CPU_KERNELS_H_

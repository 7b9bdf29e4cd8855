// cuda_kernels.h — the CUDA implementations behind hsbn/bn_kernels.h, declared without CUDA
// types so that plain C++ can call them. Arguments are validated by the caller
// (bn_kernels.cc). Each returns nullptr on success or a static message naming the CUDA error.
#ifndef HSBN_KERNELS_CUDA_KERNELS_H_
#define HSBN_KERNELS_CUDA_KERNELS_H_

#include <cstdint>

#include "hsbn/bn_types.h"

namespace hsbn::kernels::cuda {

bool DeviceAvailable();

// Makes the device that holds `ptr` this thread's current one for the scope's lifetime, then
// restores the previous one. libhsbn links its own CUDA runtime, whose current device is not
// the caller's (PyTorch's) current device: every entry point runs on the device of the memory
// it is given. A host pointer changes nothing. error() is nullptr or the CUDA error.
class DeviceScope {
 public:
  explicit DeviceScope(const void* ptr);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  const char* error() const { return error_; }

 private:
  int previous_ = -1;
  const char* error_ = nullptr;
};

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

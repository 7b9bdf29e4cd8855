// The C ABI (hsbn/bn_kernels_c.h): converts plain arguments to the C++ API's types and its
// absl::Status to an int code plus a per-thread message.
#include "hsbn/bn_kernels_c.h"

#include <string>

#include "hsbn/bn_kernels.h"

namespace {

using hsbn::kernels::BnAffine;
using hsbn::kernels::BnInput;
using hsbn::kernels::BnStats;
using hsbn::kernels::Device;
using hsbn::kernels::DType;
using hsbn::kernels::Layout;
using hsbn::kernels::StatsKind;

thread_local std::string last_error;

int Report(const absl::Status& s) {
  if (s.ok()) {
    last_error.clear();
    return 0;
  }
  last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

BnInput Input(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s) {
  BnInput in;
  in.device = static_cast<Device>(device);
  in.dtype = static_cast<DType>(dtype);
  in.layout = static_cast<Layout>(layout);
  in.n = n;
  in.c = c;
  in.s = s;
  return in;
}

BnStats Stats(const void* mean, const void* second, int dtype, int kind, double eps,
              int64_t count) {
  BnStats st;
  st.mean = mean;
  st.second = second;
  st.dtype = static_cast<DType>(dtype);
  st.kind = static_cast<StatsKind>(kind);
  st.eps = eps;
  st.count = count;
  return st;
}

}  // namespace

extern "C" {

const char* hsbn_bn_last_error(void) { return last_error.c_str(); }

int hsbn_bn_abi_version(void) { return HSBN_BN_ABI_VERSION; }

int hsbn_bn_cuda_available(void) { return hsbn::kernels::CudaAvailable() ? 1 : 0; }

int hsbn_bn_workspace_size(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                           size_t* bytes) {
  if (bytes == nullptr) return Report(absl::InvalidArgumentError("bytes is null"));
  if (n < 0 || c < 0 || s < 0 || dtype < 0 || dtype > 3 || layout < 0 || layout > 1 ||
      device < 0 || device > 1)
    return Report(absl::InvalidArgumentError("invalid device, dtype, layout or negative shape"));
  *bytes = hsbn::kernels::WorkspaceBytes(Input(device, dtype, layout, n, c, s));
  return Report(absl::OkStatus());
}

int hsbn_bn_moments(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                    const void* x, int64_t* count, double* mean, double* m2, void* workspace,
                    size_t workspace_bytes, void* stream) {
  return Report(hsbn::kernels::LocalMoments(Input(device, dtype, layout, n, c, s), x, count, mean,
                                            m2, workspace, workspace_bytes, stream));
}

int hsbn_bn_normalize(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                      const void* x, void* y, const void* mean, const void* stats_second,
                      int stats_dtype, int stats_kind, double eps, int64_t stats_count,
                      const void* weight, const void* bias, int param_dtype, int relu,
                      void* stream) {
  BnAffine affine;
  affine.weight = weight;
  affine.bias = bias;
  affine.dtype = static_cast<DType>(param_dtype);
  return Report(hsbn::kernels::Normalize(
      Input(device, dtype, layout, n, c, s), x, y,
      Stats(mean, stats_second, stats_dtype, stats_kind, eps, stats_count), affine, relu != 0,
      stream));
}

int hsbn_bn_backward_reduce(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                            const void* dy, const void* x, const void* mean,
                            const void* stats_second, int stats_dtype, int stats_kind,
                            double eps, int64_t stats_count, double* sum_dy, double* sum_dy_xmu,
                            void* grad_weight, void* grad_bias, int grad_dtype, void* workspace,
                            size_t workspace_bytes, void* stream) {
  return Report(hsbn::kernels::BackwardReduce(
      Input(device, dtype, layout, n, c, s), dy, x,
      Stats(mean, stats_second, stats_dtype, stats_kind, eps, stats_count), sum_dy, sum_dy_xmu,
      grad_weight, grad_bias, static_cast<DType>(grad_dtype), workspace, workspace_bytes,
      stream));
}

int hsbn_bn_backward_elemt(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                           const void* dy, const void* x, const void* mean,
                           const void* stats_second, int stats_dtype, int stats_kind, double eps,
                           int64_t stats_count, const void* weight, int param_dtype,
                           const double* sum_dy, const double* sum_dy_xmu, int64_t count,
                           void* dx, void* stream) {
  BnAffine affine;
  affine.weight = weight;
  affine.dtype = static_cast<DType>(param_dtype);
  return Report(hsbn::kernels::BackwardElementwise(
      Input(device, dtype, layout, n, c, s), dy, x,
      Stats(mean, stats_second, stats_dtype, stats_kind, eps, stats_count), affine, sum_dy,
      sum_dy_xmu, count, dx, stream));
}

int hsbn_bn_running_stats_update(int device, int64_t c, int64_t count, const double* mean,
                                 const double* m2, void* running_mean, void* running_var,
                                 int running_dtype, double momentum, int cumulative,
                                 int64_t num_batches_tracked, void* stream) {
  return Report(hsbn::kernels::UpdateRunningStats(
      static_cast<Device>(device), c, count, mean, m2, running_mean, running_var,
      static_cast<DType>(running_dtype), momentum, cumulative != 0, num_batches_tracked, stream));
}

}  // extern "C"

// Argument validation and device dispatch for hsbn/bn_kernels.h. Everything a caller can get
// wrong is checked here, once, before any kernel runs; the CPU and CUDA implementations assume
// valid arguments.
#include "hsbn/bn_kernels.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cpu_kernels.h"
#include "plan.h"
#if HSBN_HAVE_CUDA
#include "cuda_kernels.h"
#endif

namespace hsbn::kernels {
namespace {

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
  }
  return "invalid";
}

bool ValidDType(DType d) { return static_cast<unsigned>(d) <= static_cast<unsigned>(DType::kF64); }

absl::Status CheckDevice(Device device) {
  if (device == Device::kCpu) return absl::OkStatus();
  if (device != Device::kCuda)
    return absl::InvalidArgumentError(
        absl::StrCat("device ", static_cast<int>(device), " is neither CPU (0) nor CUDA (1)"));
#if HSBN_HAVE_CUDA
  if (!cuda::DeviceAvailable())
    return absl::FailedPreconditionError(
        "CUDA device requested but no CUDA device is visible (check CUDA_VISIBLE_DEVICES and "
        "the driver)");
  return absl::OkStatus();
#else
  return absl::UnimplementedError(
      "CUDA device requested but hsbn was built without CUDA (configure with nvcc on PATH, "
      "or -DHSBN_CUDA=ON)");
#endif
}

absl::Status CheckInput(const BnInput& in) {
  if (absl::Status s = CheckDevice(in.device); !s.ok()) return s;
  if (!ValidDType(in.dtype))
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", static_cast<int>(in.dtype), " is not f16 (0), bf16 (1), f32 (2) or f64 (3)"));
  if (in.layout != Layout::kNchw && in.layout != Layout::kChannelsLast)
    return absl::InvalidArgumentError(
        absl::StrCat("layout ", static_cast<int>(in.layout),
                     " is neither NCHW-contiguous (0) nor channels-last (1)"));
  if (in.n < 0 || in.c < 0 || in.s < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("shape (N=", in.n, ", C=", in.c, ", S=", in.s, ") has a negative size"));
  constexpr int64_t kMax = int64_t{1} << 48;
  if ((in.n > 0 && in.c > kMax / in.n) || (in.n * in.c > 0 && in.s > kMax / (in.n * in.c)))
    return absl::InvalidArgumentError(
        absl::StrCat("shape (N=", in.n, ", C=", in.c, ", S=", in.s, ") has more than 2^48 elements"));
  if (in.device == Device::kCuda && in.count() >= (int64_t{1} << 32))
    return absl::InvalidArgumentError(
        absl::StrCat("N*S = ", in.count(), " values per channel; the CUDA kernels support < 2^32"));
  return absl::OkStatus();
}

absl::Status CheckArray(const void* p, bool needed, const char* name) {
  if (needed && p == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  return absl::OkStatus();
}

absl::Status CheckStats(const BnInput& in, const BnStats& s) {
  if (s.dtype != DType::kF32 && s.dtype != DType::kF64)
    return absl::InvalidArgumentError(
        absl::StrCat("statistics dtype ", DTypeName(s.dtype), " must be f32 or f64"));
  if (s.kind != StatsKind::kInvstd && s.kind != StatsKind::kVar && s.kind != StatsKind::kM2)
    return absl::InvalidArgumentError(
        absl::StrCat("statistics kind ", static_cast<int>(s.kind),
                     " is not invstd (0), var (1) or m2 (2)"));
  if (!(s.eps >= 0) || !std::isfinite(s.eps))
    return absl::InvalidArgumentError(absl::StrCat("eps = ", s.eps, " must be finite and >= 0"));
  if (s.kind == StatsKind::kM2 && s.count < 0)
    return absl::InvalidArgumentError(absl::StrCat("statistics count = ", s.count, " is negative"));
  const bool any = in.c > 0;
  if (absl::Status st = CheckArray(s.mean, any, "mean"); !st.ok()) return st;
  return CheckArray(s.second, any, s.kind == StatsKind::kInvstd ? "invstd" : s.kind == StatsKind::kVar ? "var" : "m2");
}

absl::Status CheckAffine(const BnAffine& a) {
  if ((a.weight || a.bias) && !ValidDType(a.dtype))
    return absl::InvalidArgumentError(
        absl::StrCat("affine dtype ", static_cast<int>(a.dtype), " is not a valid dtype"));
  return absl::OkStatus();
}

absl::Status CheckWorkspace(const BnInput& in, const void* ws, size_t bytes) {
  const size_t need = WorkspaceBytes(in);
  if (bytes < need)
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace of ", bytes, " bytes is too small: this input needs ", need,
        " (ask hsbn_bn_workspace_size / WorkspaceBytes)"));
  if (need > 0 && ws == nullptr) return absl::InvalidArgumentError("workspace is null");
  return absl::OkStatus();
}

#if HSBN_HAVE_CUDA
absl::Status CudaResult(const char* error) {
  if (error == nullptr) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA error: ", error));
}
#endif

#define HSBN_RETURN_IF_ERROR(expr)          \
  do {                                      \
    if (absl::Status _s = (expr); !_s.ok()) \
      return _s;                            \
  } while (0)

}  // namespace

size_t WorkspaceBytes(const BnInput& in) {
  if (in.device != Device::kCuda || in.numel() <= 0) return 0;
  return MakeReducePlan(in).bytes(in.c);
}

bool CudaAvailable() {
#if HSBN_HAVE_CUDA
  return cuda::DeviceAvailable();
#else
  return false;
#endif
}

absl::Status LocalMoments(const BnInput& in, const void* x, int64_t* count, double* mean,
                          double* m2, void* workspace, size_t workspace_bytes, void* stream) {
  HSBN_RETURN_IF_ERROR(CheckInput(in));
  HSBN_RETURN_IF_ERROR(CheckArray(x, in.numel() > 0, "x"));
  HSBN_RETURN_IF_ERROR(CheckArray(count, true, "count"));
  HSBN_RETURN_IF_ERROR(CheckArray(mean, in.c > 0, "mean"));
  HSBN_RETURN_IF_ERROR(CheckArray(m2, in.c > 0, "m2"));
  HSBN_RETURN_IF_ERROR(CheckWorkspace(in, workspace, workspace_bytes));
  *count = in.count();
  if (in.c == 0) return absl::OkStatus();
  if (in.device == Device::kCpu) {
    cpu::LocalMoments(in, x, mean, m2);
    return absl::OkStatus();
  }
#if HSBN_HAVE_CUDA
  const cuda::DeviceScope on(mean);
  if (on.error() != nullptr) return CudaResult(on.error());
  return CudaResult(cuda::LocalMoments(in, x, mean, m2, workspace, stream));
#else
  return absl::InternalError("unreachable: CUDA not built");
#endif
}

absl::Status Normalize(const BnInput& in, const void* x, void* y, const BnStats& stats,
                       const BnAffine& affine, bool relu, void* stream) {
  HSBN_RETURN_IF_ERROR(CheckInput(in));
  HSBN_RETURN_IF_ERROR(CheckArray(x, in.numel() > 0, "x"));
  HSBN_RETURN_IF_ERROR(CheckArray(y, in.numel() > 0, "y"));
  HSBN_RETURN_IF_ERROR(CheckStats(in, stats));
  HSBN_RETURN_IF_ERROR(CheckAffine(affine));
  if (in.numel() == 0) return absl::OkStatus();
  if (in.device == Device::kCpu) {
    cpu::Normalize(in, x, y, stats, affine, relu);
    return absl::OkStatus();
  }
#if HSBN_HAVE_CUDA
  const cuda::DeviceScope on(y);
  if (on.error() != nullptr) return CudaResult(on.error());
  return CudaResult(cuda::Normalize(in, x, y, stats, affine, relu, stream));
#else
  return absl::InternalError("unreachable: CUDA not built");
#endif
}

absl::Status BackwardReduce(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                            double* sum_dy, double* sum_dy_xmu, void* grad_weight,
                            void* grad_bias, DType grad_dtype, void* workspace,
                            size_t workspace_bytes, void* stream) {
  HSBN_RETURN_IF_ERROR(CheckInput(in));
  HSBN_RETURN_IF_ERROR(CheckArray(dy, in.numel() > 0, "dy"));
  HSBN_RETURN_IF_ERROR(CheckArray(x, in.numel() > 0, "x"));
  HSBN_RETURN_IF_ERROR(CheckStats(in, stats));
  HSBN_RETURN_IF_ERROR(CheckArray(sum_dy, in.c > 0, "sum_dy"));
  HSBN_RETURN_IF_ERROR(CheckArray(sum_dy_xmu, in.c > 0, "sum_dy_xmu"));
  if ((grad_weight || grad_bias) && !ValidDType(grad_dtype))
    return absl::InvalidArgumentError(
        absl::StrCat("gradient dtype ", static_cast<int>(grad_dtype), " is not a valid dtype"));
  HSBN_RETURN_IF_ERROR(CheckWorkspace(in, workspace, workspace_bytes));
  if (in.c == 0) return absl::OkStatus();
  if (in.device == Device::kCpu) {
    cpu::BackwardReduce(in, dy, x, stats, sum_dy, sum_dy_xmu, grad_weight, grad_bias, grad_dtype);
    return absl::OkStatus();
  }
#if HSBN_HAVE_CUDA
  const cuda::DeviceScope on(sum_dy);
  if (on.error() != nullptr) return CudaResult(on.error());
  return CudaResult(cuda::BackwardReduce(in, dy, x, stats, sum_dy, sum_dy_xmu, grad_weight,
                                         grad_bias, grad_dtype, workspace, stream));
#else
  return absl::InternalError("unreachable: CUDA not built");
#endif
}

absl::Status BackwardElementwise(const BnInput& in, const void* dy, const void* x,
                                 const BnStats& stats, const BnAffine& affine,
                                 const double* sum_dy, const double* sum_dy_xmu, int64_t count,
                                 void* dx, void* stream) {
  HSBN_RETURN_IF_ERROR(CheckInput(in));
  HSBN_RETURN_IF_ERROR(CheckArray(dy, in.numel() > 0, "dy"));
  HSBN_RETURN_IF_ERROR(CheckArray(x, in.numel() > 0, "x"));
  HSBN_RETURN_IF_ERROR(CheckArray(dx, in.numel() > 0, "dx"));
  HSBN_RETURN_IF_ERROR(CheckStats(in, stats));
  HSBN_RETURN_IF_ERROR(CheckAffine(affine));
  HSBN_RETURN_IF_ERROR(CheckArray(sum_dy, in.c > 0, "sum_dy"));
  HSBN_RETURN_IF_ERROR(CheckArray(sum_dy_xmu, in.c > 0, "sum_dy_xmu"));
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("count = ", count, " is negative"));
  if (in.numel() == 0) return absl::OkStatus();
  if (in.device == Device::kCpu) {
    cpu::BackwardElementwise(in, dy, x, stats, affine, sum_dy, sum_dy_xmu, count, dx);
    return absl::OkStatus();
  }
#if HSBN_HAVE_CUDA
  const cuda::DeviceScope on(dx);
  if (on.error() != nullptr) return CudaResult(on.error());
  return CudaResult(cuda::BackwardElementwise(in, dy, x, stats, affine, sum_dy, sum_dy_xmu, count,
                                              dx, stream));
#else
  return absl::InternalError("unreachable: CUDA not built");
#endif
}

absl::Status UpdateRunningStats(Device device, int64_t channels, int64_t count, const double* mean,
                                const double* m2, void* running_mean, void* running_var,
                                DType running_dtype, double momentum, bool cumulative,
                                int64_t num_batches_tracked, void* stream) {
  HSBN_RETURN_IF_ERROR(CheckDevice(device));
  if (channels < 0)
    return absl::InvalidArgumentError(absl::StrCat("channels = ", channels, " is negative"));
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("count = ", count, " is negative"));
  if (count == 1)
    return absl::InvalidArgumentError(
        "count = 1: expected more than 1 value per channel when training (the unbiased "
        "variance is undefined)");
  if (!ValidDType(running_dtype))
    return absl::InvalidArgumentError(absl::StrCat(
        "running statistics dtype ", static_cast<int>(running_dtype), " is not a valid dtype"));
  double factor = momentum;
  if (cumulative) {
    if (num_batches_tracked < 1)
      return absl::InvalidArgumentError(absl::StrCat(
          "num_batches_tracked = ", num_batches_tracked,
          " with momentum=None: pass the count after this batch's increment (>= 1)"));
    factor = 1.0 / static_cast<double>(num_batches_tracked);
  } else if (!(momentum >= 0.0 && momentum <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("momentum = ", momentum, " is not in [0, 1]"));
  }
  const bool any = channels > 0;
  HSBN_RETURN_IF_ERROR(CheckArray(mean, any, "mean"));
  HSBN_RETURN_IF_ERROR(CheckArray(m2, any, "m2"));
  HSBN_RETURN_IF_ERROR(CheckArray(running_mean, any, "running_mean"));
  HSBN_RETURN_IF_ERROR(CheckArray(running_var, any, "running_var"));
  if (count == 0 || channels == 0) return absl::OkStatus();
  if (device == Device::kCpu) {
    cpu::UpdateRunningStats(channels, count, mean, m2, running_mean, running_var, running_dtype,
                            factor);
    return absl::OkStatus();
  }
#if HSBN_HAVE_CUDA
  const cuda::DeviceScope on(running_mean);
  if (on.error() != nullptr) return CudaResult(on.error());
  return CudaResult(cuda::UpdateRunningStats(channels, count, mean, m2, running_mean, running_var,
                                             running_dtype, factor, stream));
#else
  return absl::InternalError("unreachable: CUDA not built");
#endif
}

}  // namespace hsbn::kernels

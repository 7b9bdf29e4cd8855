// hsbn/bn_kernels.h — the BatchNorm step as kernels: local moments, normalize, backward reduce,
// backward elementwise and the running-statistics update, on the CPU and on CUDA GPUs.
//
// Every function takes the input's description (`BnInput`: device, dtype, layout and the
// (N, C, S) shape, S being the product of the spatial sizes) and raw pointers. The same API
// runs on both devices: on the CPU it is the reference the tests use and the path for CPU
// trainers; on CUDA it is stream-ordered — work is enqueued on `stream` (a cudaStream_t, null for
// the legacy default stream), nothing synchronizes the host and nothing allocates. Reductions
// use a caller-provided workspace of WorkspaceBytes() bytes on the input's device.
//
// Determinism: reductions combine per-thread Welford / partial sums in an order fixed by the
// shape alone (Chan's merge from hsbn/moments.h, fp64 for the final combine, no atomics), so the
// same input gives the same bits on every run. The CPU and the GPU agree to rounding, not bits.
//
// Pointers: arrays of an element dtype (x, y, dy, dx) hold N*C*S elements in `layout`; statistics
// and parameter arrays hold C elements. With Device::kCuda every array pointer is device memory
// of one device, on which the work runs whatever device is current, except `count` outputs and
// scalar arguments, which are host values (count = N*S is known on the host, so returning it
// costs no synchronisation). With Device::kCpu every pointer is host memory.
//
// Thread safety: functions are reentrant; concurrent calls must not share output or workspace
// memory.
#ifndef HSBN_BN_KERNELS_H_
#define HSBN_BN_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "hsbn/bn_types.h"

namespace hsbn::kernels {

// Bytes of workspace LocalMoments and BackwardReduce need for this input (may be 0). Depends
// only on the shape, never on the device present.
size_t WorkspaceBytes(const BnInput& in);

// True when the library was built with CUDA and a CUDA device is visible.
bool CudaAvailable();

// Per channel count (= N*S, host), mean[C] and m2[C] (fp64, input's device) of x.
absl::Status LocalMoments(const BnInput& in, const void* x, int64_t* count, double* mean,
                          double* m2, void* workspace, size_t workspace_bytes, void* stream);

// y = (x - mean) * invstd * weight + bias, in x's dtype, optionally followed by ReLU.
// y may equal x (in place); it must not otherwise overlap it.
absl::Status Normalize(const BnInput& in, const void* x, void* y, const BnStats& stats,
                       const BnAffine& affine, bool relu, void* stream);

// Per channel sum_dy = sum(dy) and sum_dy_xmu = sum(dy * (x - mean)) (fp64 [C], input's device).
// If grad_weight / grad_bias are non-null they receive sum_dy_xmu * invstd and sum_dy in
// affine.dtype (affine.weight / bias are not read).
absl::Status BackwardReduce(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                            double* sum_dy, double* sum_dy_xmu, void* grad_weight,
                            void* grad_bias, DType grad_dtype, void* workspace,
                            size_t workspace_bytes, void* stream);

// dx = (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count) * invstd * weight,
// the input gradient of training-mode BatchNorm, where sum_dy / sum_dy_xmu (fp64 [C], input's
// device) are reduced over all `count` values that were normalized together (all workers).
// dx may equal dy (in place).
absl::Status BackwardElementwise(const BnInput& in, const void* dy, const void* x,
                                 const BnStats& stats, const BnAffine& affine,
                                 const double* sum_dy, const double* sum_dy_xmu, int64_t count,
                                 void* dx, void* stream);

// running = (1 - f) * running + f * batch, with batch variance m2 / (count - 1) (unbiased), as
// torch.nn.BatchNorm* does; f = momentum, or 1 / num_batches_tracked when `cumulative`
// (momentum=None; num_batches_tracked is the value after this batch's increment).
// mean / m2 are fp64 [C]; running_mean / running_var are [C] of running_dtype; all on `device`.
// count == 0 leaves the running statistics unchanged; count == 1 is INVALID_ARGUMENT (torch
// raises "Expected more than 1 value per channel when training").
absl::Status UpdateRunningStats(Device device, int64_t channels, int64_t count, const double* mean,
                                const double* m2, void* running_mean, void* running_var,
                                DType running_dtype, double momentum, bool cumulative,
                                int64_t num_batches_tracked, void* stream);

}  // namespace hsbn::kernels

#endif  // HSBN_BN_KERNELS_H_

/* hsbn/bn_kernels_c.h — C ABI of the hsbn BatchNorm kernels (part of libhsbn_kernels).
 *
 * Plain functions over raw pointers, for ctypes and other foreign-function callers; the C++
 * API is hsbn/bn_kernels.h and these functions forward to it. Every function returns 0 on
 * success or a nonzero code (the gRPC / absl status numbers: 3 invalid argument, 9 failed
 * precondition, 12 unimplemented, 13 internal); hsbn_bn_last_error() then says what went wrong
 * (per thread, valid until the next hsbn_bn_ call on that thread).
 *
 * An input is described by (device, dtype, layout, n, c, s): N*C*S elements, S the product of
 * the spatial sizes (1 for BatchNorm1d on (N, C)); layout NCHW means (N, C, S) contiguous,
 * CHANNELS_LAST means (N, S, C) contiguous.
 *
 * Where pointers live: with device HSBN_BN_CUDA every array argument is device memory of one
 * CUDA device — inputs, outputs, statistics, parameters and the workspace — and the work runs on
 * that device whatever device is current (the library's CUDA runtime is its own), enqueued on
 * `stream` (a cudaStream_t of that device, NULL for the legacy default stream) without host
 * synchronization or allocation. The `count` output of hsbn_bn_moments and all scalar arguments
 * are host values. With device HSBN_BN_CPU every pointer is host memory and `stream` is ignored.
 * Statistics arrays (mean, m2, var, invstd, sum_dy, sum_dy_xmu) hold C values; fp64 unless a
 * dtype argument says otherwise.
 *
 * Results are deterministic: the same input gives the same bits on every run.
 * Thread safety: reentrant; concurrent calls must not share outputs or workspace.
 */
#ifndef HSBN_BN_KERNELS_C_H_
#define HSBN_BN_KERNELS_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HSBN_BN_ABI_VERSION 1

typedef enum hsbn_bn_device { HSBN_BN_CPU = 0, HSBN_BN_CUDA = 1 } hsbn_bn_device;
typedef enum hsbn_bn_dtype {
  HSBN_BN_F16 = 0,
  HSBN_BN_BF16 = 1,
  HSBN_BN_F32 = 2,
  HSBN_BN_F64 = 3
} hsbn_bn_dtype;
typedef enum hsbn_bn_layout { HSBN_BN_NCHW = 0, HSBN_BN_CHANNELS_LAST = 1 } hsbn_bn_layout;
/* What the `stats_second` array of a normalization holds (see hsbn_bn_normalize). */
typedef enum hsbn_bn_stats_kind {
  HSBN_BN_INVSTD = 0, /* 1 / sqrt(var + eps) */
  HSBN_BN_VAR = 1,    /* biased variance; invstd = 1 / sqrt(var + eps) */
  HSBN_BN_M2 = 2      /* sum of squared deviations over stats_count values; var = m2 / count */
} hsbn_bn_stats_kind;

/* Message of the last failed hsbn_bn_ call on this thread ("" if none); never NULL. */
const char* hsbn_bn_last_error(void);
/* HSBN_BN_ABI_VERSION of the loaded library. */
int hsbn_bn_abi_version(void);
/* 1 if the library was built with CUDA and a CUDA device is visible, else 0. */
int hsbn_bn_cuda_available(void);

/* Bytes of workspace hsbn_bn_moments and hsbn_bn_backward_reduce need for this input (0 on the
 * CPU). Depends only on the arguments; needs no GPU. */
int hsbn_bn_workspace_size(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                           size_t* bytes);

/* Local statistics of x: *count = N*S (host), mean[C] and m2[C] = sum((x - mean)^2), fp64, on
 * the input's device. An empty batch gives count 0, mean 0, m2 0. */
int hsbn_bn_moments(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                    const void* x, int64_t* count, double* mean, double* m2, void* workspace,
                    size_t workspace_bytes, void* stream);

/* y = (x - mean) * invstd * weight + bias in x's dtype, then max(y, 0) if relu != 0.
 * mean[C] and stats_second[C] have stats_dtype (F32 or F64); stats_kind says whether the
 * second array is invstd, var (with eps) or m2 (with eps and stats_count). weight and bias are
 * [C] of param_dtype or NULL (1 and 0). All arrays on the input's device; y may equal x. */
int hsbn_bn_normalize(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                      const void* x, void* y, const void* mean, const void* stats_second,
                      int stats_dtype, int stats_kind, double eps, int64_t stats_count,
                      const void* weight, const void* bias, int param_dtype, int relu,
                      void* stream);

/* sum_dy[C] = sum(dy), sum_dy_xmu[C] = sum(dy * (x - mean)) (fp64, input's device). If
 * grad_weight / grad_bias are non-NULL they receive sum_dy_xmu * invstd and sum_dy as
 * grad_dtype [C]. The statistics are given as for hsbn_bn_normalize. */
int hsbn_bn_backward_reduce(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                            const void* dy, const void* x, const void* mean,
                            const void* stats_second, int stats_dtype, int stats_kind,
                            double eps, int64_t stats_count, double* sum_dy, double* sum_dy_xmu,
                            void* grad_weight, void* grad_bias, int grad_dtype, void* workspace,
                            size_t workspace_bytes, void* stream);

/* dx = (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count) * invstd * weight, with
 * sum_dy / sum_dy_xmu (fp64 [C], input's device) reduced over all `count` values normalized
 * together (host scalar). weight is [C] of param_dtype or NULL. dx may equal dy. */
int hsbn_bn_backward_elemt(int device, int dtype, int layout, int64_t n, int64_t c, int64_t s,
                           const void* dy, const void* x, const void* mean,
                           const void* stats_second, int stats_dtype, int stats_kind, double eps,
                           int64_t stats_count, const void* weight, int param_dtype,
                           const double* sum_dy, const double* sum_dy_xmu, int64_t count,
                           void* dx, void* stream);

/* running = (1 - f) * running + f * batch for running_mean and running_var ([C] of
 * running_dtype, on `device`), with batch mean[C] and unbiased variance m2[C] / (count - 1)
 * (fp64, on `device`). f = momentum, or 1 / num_batches_tracked when cumulative != 0
 * (torch's momentum=None; pass num_batches_tracked after incrementing it). count == 0 changes
 * nothing; count == 1 is an error, as in torch. */
int hsbn_bn_running_stats_update(int device, int64_t c, int64_t count, const double* mean,
                                 const double* m2, void* running_mean, void* running_var,
                                 int running_dtype, double momentum, int cumulative,
                                 int64_t num_batches_tracked, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HSBN_BN_KERNELS_C_H_ */

// Per-channel reductions on the GPU: local moments (count, mean, m2) and the backward sums
// (sum_dy, sum_dy_xmu), for NCHW-contiguous and channels-last input.
//
// Two kernels per reduction, no atomics, an order fixed by the shape (plan.h):
//  1. Blocks stream the input with 16-byte loads (kUnroll loads in flight per thread). Each
//     thread folds groups of up to kUnroll * V values into its state — for moments, a group's
//     own two-pass (count, mean, m2) merged by Chan's formula, the batched form of Welford's
//     update that needs one division per group rather than per value. Threads then combine in a
//     fixed binary tree in shared memory and the block writes one partial per channel.
//  2. One thread per channel combines the `splits` partials in fp64, in split order.
// Moments accumulate values minus a per-channel pivot (the channel's first value), so fp32
// accumulation keeps its digits when |mean| >> std; the pivot is added back in fp64.
#include <cstdint>

#include "common.cuh"
#include "cuda_kernels.h"
#include "fast_divmod.h"
#include "hsbn/moments.h"
#include "plan.h"

namespace hsbn::kernels::cuda {
namespace {

constexpr int kUnroll = 4;

// Combines the state (n, a, b) of one channel with (n2, a2, b2); the caller adds the counts.
template <bool kBackward, typename Acc>
__device__ __forceinline__ void Combine(int64_t n, Acc& a, Acc& b, int64_t n2, Acc a2, Acc b2) {
  if constexpr (kBackward) {
    a += a2;
    b += b2;
  } else {
    const Moments<Acc> r = ChanMerge(Moments<Acc>{n, a, b}, Moments<Acc>{n2, a2, b2});
    a = r.mean;
    b = r.m2;
  }
}

// Folds k loaded items (rows of W values per channel... ) of one channel into (n, a, b).
// xs[u] / gs[u] for u < k hold the values (already pivot-shifted for moments, already
// centred by the mean for backward).
template <bool kBackward, typename Acc, int K>
__device__ __forceinline__ void FoldGroup(int64_t n, Acc& a, Acc& b, const Acc (&xs)[K],
                                          const Acc (&gs)[K], int k) {
  if constexpr (kBackward) {
    Acc sa = 0, sb = 0;
#pragma unroll
    for (int u = 0; u < K; ++u)
      if (u < k) {
        sa += gs[u];
        sb += gs[u] * xs[u];
      }
    a += sa;
    b += sb;
  } else {
    Acc sum = 0;
#pragma unroll
    for (int u = 0; u < K; ++u)
      if (u < k) sum += xs[u];
    const Acc gmean = sum / static_cast<Acc>(k);
    Acc gm2 = 0;
#pragma unroll
    for (int u = 0; u < K; ++u)
      if (u < k) {
        const Acc d = xs[u] - gmean;
        gm2 += d * d;
      }
    Combine<false>(n, a, b, int64_t{k}, gmean, gm2);
  }
}

// Combines the W-channel states of a block's threads, arranged as rows x cols (thread t is
// column t % cols, row t / cols), down the rows in a fixed binary tree. Row 0 gets the result.
template <bool kBackward, typename Acc, int W>
__device__ void BlockReduceRows(int64_t& n, Acc (&a)[W], Acc (&b)[W], int cols) {
  __shared__ int64_t sn[kThreads];
  __shared__ Acc sa[W][kThreads];
  __shared__ Acc sb[W][kThreads];
  const int t = threadIdx.x;
  const int rows = kThreads / cols;
  const int row = t / cols;
  __syncthreads();  // the previous use of the shared arrays is over
  sn[t] = n;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    sa[w][t] = a[w];
    sb[w][t] = b[w];
  }
  __syncthreads();
  for (int half = rows / 2; half > 0; half /= 2) {
    if (row < half) {
      const int o = t + half * cols;
#pragma unroll
      for (int w = 0; w < W; ++w) Combine<kBackward>(sn[t], sa[w][t], sb[w][t], sn[o], sa[w][o], sb[w][o]);
      sn[t] += sn[o];
    }
    __syncthreads();
  }
  n = sn[t];
#pragma unroll
  for (int w = 0; w < W; ++w) {
    a[w] = sa[w][t];
    b[w] = sb[w][t];
  }
}

// NCHW: block (split j, channel c). The channel's N*S values are `items` vectors of V values
// (V divides S), item v at plane v / (S/V); items are dealt to the splits' threads round robin.
template <typename T, int V, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    ReduceNchwKernel(const T* __restrict__ x, const T* __restrict__ dy, BnStats stats, int64_t C,
                     int64_t S, uint32_t items, FastDivmod items_per_plane, int64_t splits,
                     int64_t* __restrict__ counts, typename AccOf<T>::type* __restrict__ pa,
                     typename AccOf<T>::type* __restrict__ pb) {
  using Acc = typename AccOf<T>::type;
  const int64_t j = blockIdx.x;
  const uint64_t stride = static_cast<uint64_t>(splits) * kThreads;
  for (int64_t c = blockIdx.y; c < C; c += gridDim.y) {
    const Acc center = kBackward ? static_cast<Acc>(LoadAsDouble(stats.mean, stats.dtype, c))
                                 : ToAcc(x[c * S]);
    int64_t n = 0;
    Acc a[1] = {0}, b[1] = {0};
    for (uint64_t v0 = j * kThreads + threadIdx.x; v0 < items; v0 += stride * kUnroll) {
      Vec<T, V> xv[kUnroll], gv[kUnroll];
      int k = 0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t v = v0 + u * stride;
        if (v < items) {
          uint32_t plane, pos;
          items_per_plane.DivMod(static_cast<uint32_t>(v), &plane, &pos);
          const int64_t off = (plane * C + c) * S + static_cast<int64_t>(pos) * V;
          xv[u] = LoadVec<T, V>(x + off);
          if constexpr (kBackward) gv[u] = LoadVec<T, V>(dy + off);
          ++k;
        }
      }
      Acc xs[kUnroll * V], gs[kUnroll * V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          xs[u * V + e] = u < k ? ToAcc(xv[u].v[e]) - center : Acc(0);
          if constexpr (kBackward) gs[u * V + e] = u < k ? ToAcc(gv[u].v[e]) : Acc(0);
        }
      FoldGroup<kBackward>(n, a[0], b[0], xs, gs, k * V);
      n += k * V;
    }
    BlockReduceRows<kBackward, Acc, 1>(n, a, b, 1);
    if (threadIdx.x == 0) {
      pa[j * C + c] = a[0];
      pb[j * C + c] = b[0];
      if (c == 0) counts[j] = n;
    }
  }
}

// Channels-last: rows of C values. Thread column g owns channels [g*V, g*V + V); block
// (column block, split j) walks rows j*rows_per_block + row, stepping splits * rows_per_block.
template <typename T, int V, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    ReduceChannelsLastKernel(const T* __restrict__ x, const T* __restrict__ dy, BnStats stats,
                             int64_t C, int64_t rows, int cols, int64_t splits,
                             int64_t* __restrict__ counts,
                             typename AccOf<T>::type* __restrict__ pa,
                             typename AccOf<T>::type* __restrict__ pb) {
  using Acc = typename AccOf<T>::type;
  const int col = threadIdx.x % cols;
  const int row = threadIdx.x / cols;
  const int rows_per_block = kThreads / cols;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * cols + col;
  const bool active = g < C / V;
  const int64_t c0 = g * V;
  const int64_t j = blockIdx.y;
  const int64_t stride = splits * rows_per_block;

  Acc center[V];
  int64_t n = 0;
  Acc a[V], b[V];
#pragma unroll
  for (int w = 0; w < V; ++w) {
    a[w] = b[w] = 0;
    center[w] = 0;
    if (active)
      center[w] = kBackward ? static_cast<Acc>(LoadAsDouble(stats.mean, stats.dtype, c0 + w))
                            : ToAcc(x[c0 + w]);
  }
  if (active) {
    for (int64_t r0 = j * rows_per_block + row; r0 < rows; r0 += stride * kUnroll) {
      Vec<T, V> xv[kUnroll], gv[kUnroll];
      int k = 0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = r0 + u * stride;
        if (r < rows) {
          xv[u] = LoadVec<T, V>(x + r * C + c0);
          if constexpr (kBackward) gv[u] = LoadVec<T, V>(dy + r * C + c0);
          ++k;
        }
      }
#pragma unroll
      for (int w = 0; w < V; ++w) {
        Acc xs[kUnroll], gs[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          xs[u] = u < k ? ToAcc(xv[u].v[w]) - center[w] : Acc(0);
          gs[u] = (kBackward && u < k) ? ToAcc(gv[u].v[w]) : Acc(0);
        }
        FoldGroup<kBackward>(n, a[w], b[w], xs, gs, k);
      }
      n += k;
    }
  }
  BlockReduceRows<kBackward, Acc, V>(n, a, b, cols);
  if (row == 0 && active) {
#pragma unroll
    for (int w = 0; w < V; ++w) {
      pa[j * C + c0 + w] = a[w];
      pb[j * C + c0 + w] = b[w];
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) counts[j] = n;
}

// The backward blocks centre x by the mean rounded to their accumulator's type (m_acc), so
// they sum dy * (x - m_acc); sum_dy_xmu is that plus (m_acc - mean) * sum_dy, added in fp64.
// Without it a mean far from zero (|mean| >> std) biases sum_dy_xmu by ulp(mean) * sum_dy.
template <typename T>
__device__ __forceinline__ double CenterCorrection(const BnStats& stats, int64_t c, double sum_dy) {
  using Acc = typename AccOf<T>::type;
  const double mean = LoadAsDouble(stats.mean, stats.dtype, c);
  return (static_cast<double>(static_cast<Acc>(mean)) - mean) * sum_dy;
}

// One thread per channel: combines the splits' partials in order, in fp64.
template <typename T, bool kBackward>
__global__ void FinalizeKernel(const T* __restrict__ x, Layout layout, int64_t C, int64_t S,
                               int64_t splits, const int64_t* __restrict__ counts,
                               const typename AccOf<T>::type* __restrict__ pa,
                               const typename AccOf<T>::type* __restrict__ pb, double* out_a,
                               double* out_b, BnStats stats, void* grad_weight, void* grad_bias,
                               DType grad_dtype) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  if constexpr (kBackward) {
    double a = 0, b = 0;
    for (int64_t j = 0; j < splits; ++j) {
      a += static_cast<double>(pa[j * C + c]);
      b += static_cast<double>(pb[j * C + c]);
    }
    b += CenterCorrection<T>(stats, c, a);
    out_a[c] = a;
    out_b[c] = b;
    if (grad_weight) StoreFromDouble(grad_weight, grad_dtype, c, b * ChannelInvstd(stats, c));
    if (grad_bias) StoreFromDouble(grad_bias, grad_dtype, c, a);
  } else {
    Moments<double> m = EmptyMoments<double>();
    for (int64_t j = 0; j < splits; ++j)
      m = ChanMerge(m, Moments<double>{counts[j], static_cast<double>(pa[j * C + c]),
                                       static_cast<double>(pb[j * C + c])});
    const double pivot = static_cast<double>(ToAcc(x[layout == Layout::kNchw ? c * S : c]));
    out_a[c] = m.count > 0 ? pivot + m.mean : 0.0;
    out_b[c] = m.m2;
  }
}

// One block per channel: the same combine as FinalizeKernel, bounded for many splits. Thread t
// folds splits t, t + kThreads, ... in order, then the block combines the threads in a fixed
// binary tree (BlockReduceRows), so the order, hence the result, depends on the shape only.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    FinalizeTreeKernel(const T* __restrict__ x, Layout layout, int64_t C, int64_t S,
                       int64_t splits, const int64_t* __restrict__ counts,
                       const typename AccOf<T>::type* __restrict__ pa,
                       const typename AccOf<T>::type* __restrict__ pb, double* out_a,
                       double* out_b, BnStats stats, void* grad_weight, void* grad_bias,
                       DType grad_dtype) {
  const int64_t c = blockIdx.x;
  int64_t n = 0;
  double a[1] = {0}, b[1] = {0};
  for (int64_t j = threadIdx.x; j < splits; j += kThreads) {
    const int64_t nj = kBackward ? 0 : counts[j];
    Combine<kBackward, double>(n, a[0], b[0], nj, static_cast<double>(pa[j * C + c]),
                               static_cast<double>(pb[j * C + c]));
    n += nj;
  }
  BlockReduceRows<kBackward, double, 1>(n, a, b, 1);
  if (threadIdx.x != 0) return;
  if constexpr (kBackward) {
    b[0] += CenterCorrection<T>(stats, c, a[0]);
    out_a[c] = a[0];
    out_b[c] = b[0];
    if (grad_weight) StoreFromDouble(grad_weight, grad_dtype, c, b[0] * ChannelInvstd(stats, c));
    if (grad_bias) StoreFromDouble(grad_bias, grad_dtype, c, a[0]);
  } else {
    const double pivot = static_cast<double>(ToAcc(x[layout == Layout::kNchw ? c * S : c]));
    out_a[c] = n > 0 ? pivot + a[0] : 0.0;
    out_b[c] = b[0];
  }
}

int Pow2AtLeast(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

template <typename T, bool kBackward>
const char* LaunchReduce(const BnInput& in, const T* x, const T* dy, const BnStats& stats,
                         double* out_a, double* out_b, void* grad_weight, void* grad_bias,
                         DType grad_dtype, void* workspace, cudaStream_t stream) {
  using Acc = typename AccOf<T>::type;
  constexpr int kV = VecWidth<T>();
  const ReducePlan plan = MakeReducePlan(in);
  char* ws = static_cast<char*>(workspace);
  int64_t* counts = reinterpret_cast<int64_t*>(ws + plan.counts_offset());
  Acc* pa = reinterpret_cast<Acc*>(ws + plan.a_offset());
  Acc* pb = reinterpret_cast<Acc*>(ws + plan.b_offset(in.c));
  const bool aligned = Aligned(x) && (!kBackward || Aligned(dy));
  const Layout layout = ReduceLayout(in);

  if (layout == Layout::kNchw) {
    const bool vec = aligned && in.s % kV == 0;
    const int64_t v = vec ? kV : 1;
    const uint32_t items = static_cast<uint32_t>(in.n * in.s / v);
    const FastDivmod per_plane(static_cast<uint32_t>(in.s / v));
    const dim3 grid(static_cast<unsigned>(plan.splits),
                    static_cast<unsigned>(in.c < 65535 ? in.c : 65535));
    if (vec) {
      ReduceNchwKernel<T, kV, kBackward><<<grid, kThreads, 0, stream>>>(
          x, dy, stats, in.c, in.s, items, per_plane, plan.splits, counts, pa, pb);
    } else {
      ReduceNchwKernel<T, 1, kBackward><<<grid, kThreads, 0, stream>>>(
          x, dy, stats, in.c, in.s, items, per_plane, plan.splits, counts, pa, pb);
    }
  } else {
    const bool vec = aligned && in.c % kV == 0;
    const int64_t groups = vec ? in.c / kV : in.c;
    const int cols = Pow2AtLeast(groups < 32 ? groups : 32);
    const dim3 grid(static_cast<unsigned>((groups + cols - 1) / cols),
                    static_cast<unsigned>(plan.splits));
    if (vec) {
      ReduceChannelsLastKernel<T, kV, kBackward><<<grid, kThreads, 0, stream>>>(
          x, dy, stats, in.c, in.count(), cols, plan.splits, counts, pa, pb);
    } else {
      ReduceChannelsLastKernel<T, 1, kBackward><<<grid, kThreads, 0, stream>>>(
          x, dy, stats, in.c, in.count(), cols, plan.splits, counts, pa, pb);
    }
  }
  if (const char* e = LastLaunchError()) return e;
  if (plan.splits > kSerialMergeSplits) {
    FinalizeTreeKernel<T, kBackward><<<static_cast<unsigned>(in.c), kThreads, 0, stream>>>(
        x, layout, in.c, in.s, plan.splits, counts, pa, pb, out_a, out_b, stats, grad_weight,
        grad_bias, grad_dtype);
  } else {
    const unsigned blocks = static_cast<unsigned>((in.c + kThreads - 1) / kThreads);
    FinalizeKernel<T, kBackward><<<blocks, kThreads, 0, stream>>>(
        x, layout, in.c, in.s, plan.splits, counts, pa, pb, out_a, out_b, stats, grad_weight,
        grad_bias, grad_dtype);
  }
  return LastLaunchError();
}

const char* ZeroOutputs(int64_t c, double* a, double* b, void* grad_weight, void* grad_bias,
                        DType grad_dtype, cudaStream_t stream) {
  cudaMemsetAsync(a, 0, c * sizeof(double), stream);
  cudaMemsetAsync(b, 0, c * sizeof(double), stream);
  if (grad_weight) cudaMemsetAsync(grad_weight, 0, c * DTypeSize(grad_dtype), stream);
  if (grad_bias) cudaMemsetAsync(grad_bias, 0, c * DTypeSize(grad_dtype), stream);
  return LastLaunchError();
}

}  // namespace

const char* LocalMoments(const BnInput& in, const void* x, double* mean, double* m2,
                         void* workspace, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (in.count() == 0) return ZeroOutputs(in.c, mean, m2, nullptr, nullptr, DType::kF64, s);
  const char* error = nullptr;
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    error = LaunchReduce<T, false>(in, static_cast<const T*>(x), nullptr, BnStats{}, mean, m2,
                                   nullptr, nullptr, DType::kF64, workspace, s);
  });
  return error;
}

const char* BackwardReduce(const BnInput& in, const void* dy, const void* x, const BnStats& stats,
                           double* sum_dy, double* sum_dy_xmu, void* grad_weight,
                           void* grad_bias, DType grad_dtype, void* workspace, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (in.count() == 0)
    return ZeroOutputs(in.c, sum_dy, sum_dy_xmu, grad_weight, grad_bias, grad_dtype, s);
  const char* error = nullptr;
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    error = LaunchReduce<T, true>(in, static_cast<const T*>(x), static_cast<const T*>(dy), stats,
                                  sum_dy, sum_dy_xmu, grad_weight, grad_bias, grad_dtype,
                                  workspace, s);
  });
  return error;
}

}  // namespace hsbn::kernels::cuda

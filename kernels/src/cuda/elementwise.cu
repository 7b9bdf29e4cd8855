// Elementwise BN kernels on the GPU: normalize (optionally fused with ReLU) and the input
// gradient. Each block first computes the per-channel coefficients of the channels it touches
// into shared memory (in fp64, rounded once, coeffs.h), then streams its elements with 16-byte
// loads, kUnroll in flight per thread. Output may alias input: every element is read and written
// by the same thread, read first.
//
// NCHW: block b owns the contiguous elements [b*chunk, (b+1)*chunk), whose planes (n, c) form a
//       contiguous range; the coefficient table is indexed by plane.
// Channels-last: thread column g owns channels [g*V, g*V + V) and walks rows; the table holds
//       the block's channels.
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "cuda_kernels.h"
#include "fast_divmod.h"

namespace hsbn::kernels::cuda {
namespace {

constexpr int kUnroll = 4;

template <typename T>
struct NormalizeOp {
  using Acc = typename AccOf<T>::type;
  using Coeffs = NormalizeCoeffs<Acc>;
  static constexpr bool kHasDy = false;
  BnStats stats;
  BnAffine affine;
  bool relu;
  __device__ Coeffs Make(int64_t c) const { return MakeNormalizeCoeffs<Acc>(stats, affine, c); }
  __device__ __forceinline__ Acc Apply(const Coeffs& k, Acc x, Acc) const {
    const Acc r = (x - k.mean) * k.alpha + k.beta;
    return relu ? (r > Acc(0) ? r : Acc(0)) : r;
  }
};

template <typename T>
struct BackwardOp {
  using Acc = typename AccOf<T>::type;
  using Coeffs = BackwardCoeffs<Acc>;
  static constexpr bool kHasDy = true;
  BnStats stats;
  BnAffine affine;
  const double* sum_dy;
  const double* sum_dy_xmu;
  int64_t count;
  __device__ Coeffs Make(int64_t c) const {
    return MakeBackwardCoeffs<Acc>(stats, affine, sum_dy, sum_dy_xmu, count, c);
  }
  __device__ __forceinline__ Acc Apply(const Coeffs& k, Acc x, Acc g) const {
    return g * k.alpha + (x - k.mean) * k.gamma + k.beta;
  }
};

// Plane index and position of element i (i < 2^32 uses the fast dividers).
struct PlaneIndex {
  FastDivmod by_s, by_c;
  bool small;
  int64_t S, C;
  __device__ __forceinline__ void Locate(int64_t i, int64_t* plane, int64_t* pos) const {
    if (small) {
      uint32_t q, r;
      by_s.DivMod(static_cast<uint32_t>(i), &q, &r);
      *plane = q;
      *pos = r;
    } else {
      *plane = i / S;
      *pos = i - *plane * S;
    }
  }
  __device__ __forceinline__ int64_t Channel(int64_t plane) const {
    if (small) {
      uint32_t q, r;
      by_c.DivMod(static_cast<uint32_t>(plane), &q, &r);
      return r;
    }
    return plane % C;
  }
};

template <typename T, int V, typename Op>
__global__ void __launch_bounds__(kThreads)
    ElementwiseNchwKernel(const T* x, const T* dy, T* out, Op op, PlaneIndex index,
                          int64_t numel, int64_t chunk) {
  using Acc = typename Op::Acc;
  using Coeffs = typename Op::Coeffs;
  // The table is Coeffs: the dynamic shared memory must start aligned for them.
  static_assert(alignof(Coeffs) <= 16, "the shared table's alignment");
  extern __shared__ __align__(16) unsigned char smem[];
  Coeffs* table = reinterpret_cast<Coeffs*>(smem);
  const int64_t begin = blockIdx.x * chunk;
  const int64_t end = begin + chunk < numel ? begin + chunk : numel;
  int64_t first_plane, last_plane, pos;
  index.Locate(begin, &first_plane, &pos);
  index.Locate(end - 1, &last_plane, &pos);
  for (int64_t p = first_plane + threadIdx.x; p <= last_plane; p += kThreads)
    table[p - first_plane] = op.Make(index.Channel(p));
  __syncthreads();

  const int64_t step = static_cast<int64_t>(kThreads) * V;
  for (int64_t i0 = begin + threadIdx.x * V; i0 < end; i0 += step * kUnroll) {
    Vec<T, V> xv[kUnroll], gv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * step;
      if (i < end) {
        xv[u] = LoadVec<T, V>(x + i);
        if constexpr (Op::kHasDy) gv[u] = LoadVec<T, V>(dy + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * step;
      if (i < end) {
        int64_t plane, s;
        index.Locate(i, &plane, &s);
        int64_t slot = plane - first_plane;
        Vec<T, V> yv;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if (s == index.S) {  // crossed into the next plane inside this vector
            s = 0;
            ++slot;
          }
          const Acc g = Op::kHasDy ? ToAcc(gv[u].v[e]) : Acc(0);
          yv.v[e] = FromAcc<T>(op.Apply(table[slot], ToAcc(xv[u].v[e]), g));
          ++s;
        }
        StoreVec<T, V>(out + i, yv);
      }
    }
  }
}

template <typename T, int V, typename Op>
__global__ void __launch_bounds__(kThreads)
    ElementwiseChannelsLastKernel(const T* x, const T* dy, T* out, Op op, int64_t C,
                                  int64_t rows, int cols) {
  using Acc = typename Op::Acc;
  using Coeffs = typename Op::Coeffs;
  // The table is Coeffs: the dynamic shared memory must start aligned for them.
  static_assert(alignof(Coeffs) <= 16, "the shared table's alignment");
  extern __shared__ __align__(16) unsigned char smem[];
  Coeffs* table = reinterpret_cast<Coeffs*>(smem);
  const int64_t block_c0 = static_cast<int64_t>(blockIdx.x) * cols * V;
  for (int t = threadIdx.x; t < cols * V; t += kThreads)
    if (block_c0 + t < C) table[t] = op.Make(block_c0 + t);
  __syncthreads();

  const int col = threadIdx.x % cols;
  const int row = threadIdx.x / cols;
  const int64_t rows_per_block = kThreads / cols;
  const int64_t c0 = block_c0 + static_cast<int64_t>(col) * V;
  if (c0 >= C) return;
  Coeffs k[V];
#pragma unroll
  for (int w = 0; w < V; ++w) k[w] = table[col * V + w];
  const int64_t stride = gridDim.y * rows_per_block;
  for (int64_t r0 = blockIdx.y * rows_per_block + row; r0 < rows; r0 += stride * kUnroll) {
    Vec<T, V> xv[kUnroll], gv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t r = r0 + u * stride;
      if (r < rows) {
        xv[u] = LoadVec<T, V>(x + r * C + c0);
        if constexpr (Op::kHasDy) gv[u] = LoadVec<T, V>(dy + r * C + c0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t r = r0 + u * stride;
      if (r < rows) {
        Vec<T, V> yv;
#pragma unroll
        for (int w = 0; w < V; ++w) {
          const Acc g = Op::kHasDy ? ToAcc(gv[u].v[w]) : Acc(0);
          yv.v[w] = FromAcc<T>(op.Apply(k[w], ToAcc(xv[u].v[w]), g));
        }
        StoreVec<T, V>(out + r * C + c0, yv);
      }
    }
  }
}

template <typename T, typename Op>
const char* LaunchElementwise(const BnInput& in, const T* x, const T* dy, T* out, const Op& op,
                              cudaStream_t stream) {
  using Coeffs = typename Op::Coeffs;
  constexpr int kV = VecWidth<T>();
  const bool aligned = Aligned(x) && Aligned(out) && (!Op::kHasDy || Aligned(dy));
  const int64_t target_blocks = MaxResidentBlocks();
  // With S == 1 both layouts are the same (N, C) matrix; the column kernel suits it.
  if (in.layout == Layout::kNchw && in.s > 1) {
    const int64_t numel = in.numel();
    const bool vec = aligned && numel % kV == 0;
    const int64_t v = vec ? kV : 1;
    const int64_t unit = kThreads * v;
    int64_t chunk = (numel + target_blocks - 1) / target_blocks;
    chunk = std::max<int64_t>(unit, (chunk + unit - 1) / unit * unit);
    // Keep the block's coefficient table within 48 KiB.
    const int64_t max_planes = (48 * 1024) / static_cast<int64_t>(sizeof(Coeffs));
    while (chunk > unit && chunk / in.s + 2 > max_planes) chunk -= unit;
    const int64_t planes = std::min<int64_t>(chunk / in.s + 2, in.n * in.c);
    const size_t smem = static_cast<size_t>(planes) * sizeof(Coeffs);
    PlaneIndex index;
    index.small = numel < (int64_t{1} << 32);
    index.S = in.s;
    index.C = in.c;
    if (index.small) {
      index.by_s = FastDivmod(static_cast<uint32_t>(in.s));
      index.by_c = FastDivmod(static_cast<uint32_t>(in.c));
    }
    const unsigned blocks = static_cast<unsigned>((numel + chunk - 1) / chunk);
    if (vec) {
      ElementwiseNchwKernel<T, kV, Op><<<blocks, kThreads, smem, stream>>>(x, dy, out, op, index,
                                                                           numel, chunk);
    } else {
      ElementwiseNchwKernel<T, 1, Op><<<blocks, kThreads, smem, stream>>>(x, dy, out, op, index,
                                                                          numel, chunk);
    }
    return LastLaunchError();
  }
  const int64_t rows = in.count();
  const bool vec = aligned && in.c % kV == 0;
  const int64_t v = vec ? kV : 1;
  const int64_t groups = in.c / v;
  int cols = 1;
  while (cols < groups && cols < 32) cols *= 2;
  const int64_t rows_per_block = kThreads / cols;
  const int64_t grid_x = (groups + cols - 1) / cols;
  // Enough row blocks to fill the device, but at least 4 rows per thread where there are rows.
  int64_t grid_y = std::max<int64_t>(1, target_blocks / grid_x);
  grid_y = std::min<int64_t>(grid_y, std::max<int64_t>(1, rows / (rows_per_block * 4)));
  grid_y = std::min<int64_t>(grid_y, 65535);
  const size_t smem = static_cast<size_t>(cols * v) * sizeof(Coeffs);
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  if (vec) {
    ElementwiseChannelsLastKernel<T, kV, Op><<<grid, kThreads, smem, stream>>>(
        x, dy, out, op, in.c, rows, cols);
  } else {
    ElementwiseChannelsLastKernel<T, 1, Op><<<grid, kThreads, smem, stream>>>(
        x, dy, out, op, in.c, rows, cols);
  }
  return LastLaunchError();
}

}  // namespace

const char* Normalize(const BnInput& in, const void* x, void* y, const BnStats& stats,
                      const BnAffine& affine, bool relu, void* stream) {
  const char* error = nullptr;
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    const NormalizeOp<T> op{stats, affine, relu};
    error = LaunchElementwise<T>(in, static_cast<const T*>(x), nullptr, static_cast<T*>(y), op,
                                 static_cast<cudaStream_t>(stream));
  });
  return error;
}

const char* BackwardElementwise(const BnInput& in, const void* dy, const void* x,
                                const BnStats& stats, const BnAffine& affine,
                                const double* sum_dy, const double* sum_dy_xmu, int64_t count,
                                void* dx, void* stream) {
  const char* error = nullptr;
  DispatchDType(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    const BackwardOp<T> op{stats, affine, sum_dy, sum_dy_xmu, count};
    error = LaunchElementwise<T>(in, static_cast<const T*>(x), static_cast<const T*>(dy),
                                 static_cast<T*>(dx), op, static_cast<cudaStream_t>(stream));
  });
  return error;
}

}  // namespace hsbn::kernels::cuda

// The CUDA BN kernels against the CPU kernels (which the CPU tests hold to a long-double
// reference), and run-to-run bit reproducibility. Skipped, with the reason, without a GPU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/bn_kernels.h"
#include "hsbn/bn_kernels_c.h"
#include "test_util.h"

namespace hsbn::kernels {
namespace {

using testing::Buffer;
using testing::Describe;
using testing::Epsilon;
using testing::SubnormalSpacing;
using testing::MakeInput;
using testing::RandomInput;

std::string NoGpuReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
  return n == 0 ? "no CUDA device is visible" : "";
}

// HSBN_REQUIRE_GPU=1 (the GPU device check) turns the skip into a failure.
bool GpuRequired() {
  const char* e = std::getenv("HSBN_REQUIRE_GPU");
  return e != nullptr && std::strcmp(e, "1") == 0;
}

#define SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                  \
    if (!CudaAvailable()) {                                                             \
      ASSERT_FALSE(GpuRequired()) << "HSBN_REQUIRE_GPU=1 but " << NoGpuReason();        \
      GTEST_SKIP() << NoGpuReason();                                                    \
    }                                                                                   \
  } while (0)

// Device memory holding `bytes` bytes, starting `offset` bytes into the allocation (to test
// unaligned inputs).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes, size_t offset = 0) : offset_(offset) {
    EXPECT_EQ(cudaMalloc(&base_, bytes + offset + 16), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return static_cast<char*>(base_) + offset_; }
  template <typename T>
  T* as() const { return static_cast<T*>(get()); }
  void Upload(const void* src, size_t bytes) {
    ASSERT_EQ(cudaMemcpy(get(), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Download(void* dst, size_t bytes) const {
    ASSERT_EQ(cudaMemcpy(dst, get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* base_ = nullptr;
  size_t offset_;
};

template <typename T>
std::vector<T> Download(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  b.Download(v.data(), n * sizeof(T));
  return v;
}

struct Case {
  DType dtype;
  Layout layout;
  int64_t n, c, s;
  double mean_scale;
  size_t misalign;  // bytes added to the data pointers (one element: no vector loads)
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (Layout layout : {Layout::kNchw, Layout::kChannelsLast})
    for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32, DType::kF64}) {
      const size_t one = DTypeSize(dtype);
      cases.push_back({dtype, layout, 8, 32, 32 * 32, 1.0, 0});        // vector path
      cases.push_back({dtype, layout, 8, 32, 32 * 32, 1.0, one});      // unaligned
      cases.push_back({dtype, layout, 4, 24, 7 * 7, 2.0, 0});          // S = 49
      cases.push_back({dtype, layout, 3, 5, 3 * 5 * 7, 1.0, 0});       // 3d
      cases.push_back({dtype, layout, 1, 1, 300007, 0.5, 0});          // C = 1, N = 1, prime S
      cases.push_back({dtype, layout, 2, 4096, 9, 1.0, 0});            // C = 4096
      cases.push_back({dtype, layout, 700, 48, 1, 1.0, 0});            // BatchNorm1d
      cases.push_back({dtype, layout, 0, 16, 64, 1.0, 0});             // empty batch
      cases.push_back({dtype, layout, 64, 64, 56 * 56, 1.0, 0});       // 12.8 M values
      cases.push_back({dtype, layout, 4, 2, 65536, 1.0, 0});           // 128 splits: tree merge
    }
  for (Layout layout : {Layout::kNchw, Layout::kChannelsLast}) {
    cases.push_back({DType::kF32, layout, 8, 8, 4099, 1e4, 0});        // mean 1e4 x std
    cases.push_back({DType::kF16, layout, 8, 8, 4099, 1e4, 0});
  }
  return cases;
}

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& p = info.param;
  static const char* names[] = {"f16", "bf16", "f32", "f64"};
  return std::string(names[static_cast<int>(p.dtype)]) +
         (p.layout == Layout::kNchw ? "_nchw_" : "_cl_") + std::to_string(p.n) + "x" +
         std::to_string(p.c) + "x" + std::to_string(p.s) + (p.misalign ? "_unaligned" : "") +
         (p.mean_scale > 100 ? "_bigmean" : "") + "_" + std::to_string(info.index);
}

class CudaKernelsTest : public ::testing::TestWithParam<Case> {};

// Moments, normalize, backward reduce and backward elementwise on the GPU against the CPU, and
// every reduction twice with identical bits.
TEST_P(CudaKernelsTest, MatchesCpuAndIsBitwiseReproducible) {
  SKIP_WITHOUT_GPU();
  const Case& p = GetParam();
  BnInput host = MakeInput(Device::kCpu, p.dtype, p.layout, p.n, p.c, p.s);
  BnInput dev = host;
  dev.device = Device::kCuda;
  const Buffer x = RandomInput(host, p.mean_scale, 1.0, 17);
  const Buffer dy = RandomInput(host, 0.0, 1.0, 18);
  const size_t bytes = static_cast<size_t>(host.numel()) * DTypeSize(p.dtype);
  const int64_t C = p.c;
  DeviceBuffer dx_in(bytes, p.misalign), ddy(bytes, p.misalign), dout(bytes, p.misalign);
  if (bytes) {
    dx_in.Upload(x.data(), bytes);
    ddy.Upload(dy.data(), bytes);
  }
  const size_t ws_bytes = WorkspaceBytes(dev);
  DeviceBuffer ws(ws_bytes);
  DeviceBuffer dmean(C * 8), dm2(C * 8), dmean2(C * 8), dm22(C * 8);

  // Moments.
  std::vector<double> mean(C), m2(C);
  int64_t count = -1, dcount = -1;
  ASSERT_TRUE(LocalMoments(host, x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  absl::Status st = LocalMoments(dev, dx_in.get(), &dcount, dmean.as<double>(), dm2.as<double>(),
                                 ws.get(), ws_bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  st = LocalMoments(dev, dx_in.get(), &dcount, dmean2.as<double>(), dm22.as<double>(), ws.get(),
                    ws_bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dcount, count);
  const std::vector<double> gmean = Download<double>(dmean, C), gm2 = Download<double>(dm2, C);
  EXPECT_EQ(gmean, Download<double>(dmean2, C)) << "moments differ between runs";
  EXPECT_EQ(gm2, Download<double>(dm22, C)) << "moments differ between runs";
  const double acc_eps = p.dtype == DType::kF64 ? 1e-13 : 2e-6;
  for (int64_t c = 0; c < C; ++c) {
    const double sd = count > 0 ? std::sqrt(m2[c] / count) : 0.0;
    ASSERT_NEAR(gmean[c], mean[c], acc_eps * (sd + 1e-3 * std::fabs(mean[c])) * 4)
        << Describe(host) << " mean, channel " << c;
    ASSERT_NEAR(gm2[c], m2[c], acc_eps * 16 * m2[c] + 1e-30) << Describe(host) << " m2, channel " << c;
  }
  if (host.numel() == 0) return;

  // Normalize with the CPU's statistics (both devices see the same inputs).
  std::vector<float> weight(C), bias(C);
  for (int64_t c = 0; c < C; ++c) {
    weight[c] = 0.5f + 0.125f * (c % 7);
    bias[c] = 0.25f * (c % 5) - 0.5f;
  }
  DeviceBuffer dw(C * 4), db(C * 4);
  dw.Upload(weight.data(), C * 4);
  db.Upload(bias.data(), C * 4);
  dmean.Upload(mean.data(), C * 8);
  dm2.Upload(m2.data(), C * 8);
  const double eps = 1e-5;
  const BnStats hstats{mean.data(), m2.data(), DType::kF64, StatsKind::kM2, eps, count};
  const BnStats dstats{dmean.get(), dm2.get(), DType::kF64, StatsKind::kM2, eps, count};
  const BnAffine haff{weight.data(), bias.data(), DType::kF32};
  const BnAffine daff{dw.get(), db.get(), DType::kF32};
  Buffer y(host), gy(host);
  ASSERT_TRUE(Normalize(host, x.data(), y.data(), hstats, haff, true, nullptr).ok());
  st = Normalize(dev, dx_in.get(), dout.get(), dstats, daff, true, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  dout.Download(gy.data(), bytes);
  const double u = p.dtype == DType::kF64 ? Epsilon(DType::kF64) : Epsilon(DType::kF32);
  for (int64_t n = 0; n < p.n; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t s = 0; s < p.s; ++s) {
        const double invstd = 1.0 / std::sqrt(m2[c] / count + eps);
        const double terms = (std::fabs(x.Get(n, c, s)) + std::fabs(mean[c])) * invstd * weight[c] + 1;
        ASSERT_NEAR(gy.Get(n, c, s), y.Get(n, c, s),
                    2 * Epsilon(p.dtype) * std::fabs(y.Get(n, c, s)) + 8 * u * terms +
                        SubnormalSpacing(p.dtype))
            << Describe(host) << " normalize at n=" << n << " c=" << c << " s=" << s;
      }

  // Backward reduce (twice: identical bits) and backward elementwise.
  std::vector<double> sum_dy(C), sum_dy_xmu(C);
  std::vector<float> gw(C), gb(C);
  ASSERT_TRUE(BackwardReduce(host, dy.data(), x.data(), hstats, sum_dy.data(), sum_dy_xmu.data(),
                             gw.data(), gb.data(), DType::kF32, nullptr, 0, nullptr).ok());
  DeviceBuffer dsd(C * 8), dsx(C * 8), dsd2(C * 8), dsx2(C * 8), dgw(C * 4), dgb(C * 4);
  st = BackwardReduce(dev, ddy.get(), dx_in.get(), dstats, dsd.as<double>(), dsx.as<double>(),
                      dgw.get(), dgb.get(), DType::kF32, ws.get(), ws_bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  st = BackwardReduce(dev, ddy.get(), dx_in.get(), dstats, dsd2.as<double>(), dsx2.as<double>(),
                      nullptr, nullptr, DType::kF32, ws.get(), ws_bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<double> gsd = Download<double>(dsd, C), gsx = Download<double>(dsx, C);
  EXPECT_EQ(gsd, Download<double>(dsd2, C)) << "sum_dy differs between runs";
  EXPECT_EQ(gsx, Download<double>(dsx2, C)) << "sum_dy_xmu differs between runs";
  const std::vector<float> ggw = Download<float>(dgw, C), ggb = Download<float>(dgb, C);
  for (int64_t c = 0; c < C; ++c) {
    double mag = 0;  // sum |dy| * (1 + |x - mean|): the size of the summed terms
    for (int64_t n = 0; n < p.n; ++n)
      for (int64_t s = 0; s < p.s; ++s)
        mag += std::fabs(dy.Get(n, c, s)) * (1 + std::fabs(x.Get(n, c, s) - mean[c]));
    const double tol = (p.dtype == DType::kF64 ? 1e-14 : 1e-6) * mag;
    ASSERT_NEAR(gsd[c], sum_dy[c], tol) << Describe(host) << " sum_dy, channel " << c;
    ASSERT_NEAR(gsx[c], sum_dy_xmu[c], tol) << Describe(host) << " sum_dy_xmu, channel " << c;
    ASSERT_NEAR(ggb[c], gb[c], tol + 1e-6 * std::fabs(gb[c]));
    ASSERT_NEAR(ggw[c], gw[c], tol / std::sqrt(m2[c] / count + eps) + 1e-6 * std::fabs(gw[c]));
  }
  // The elementwise pass takes the CPU's sums so that only its own arithmetic is compared.
  dsd.Upload(sum_dy.data(), C * 8);
  dsx.Upload(sum_dy_xmu.data(), C * 8);
  Buffer dx(host), gdx(host);
  ASSERT_TRUE(BackwardElementwise(host, dy.data(), x.data(), hstats, haff, sum_dy.data(),
                                  sum_dy_xmu.data(), count, dx.data(), nullptr).ok());
  st = BackwardElementwise(dev, ddy.get(), dx_in.get(), dstats, daff, dsd.as<double>(),
                           dsx.as<double>(), count, dout.get(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  dout.Download(gdx.data(), bytes);
  for (int64_t n = 0; n < p.n; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t s = 0; s < p.s; ++s) {
        const double invstd = 1.0 / std::sqrt(m2[c] / count + eps);
        const double terms = (std::fabs(dy.Get(n, c, s)) + std::fabs(sum_dy[c]) / count +
                              (std::fabs(x.Get(n, c, s)) + std::fabs(mean[c])) * invstd * invstd *
                                  std::fabs(sum_dy_xmu[c]) / count) *
                             invstd * weight[c];
        ASSERT_NEAR(gdx.Get(n, c, s), dx.Get(n, c, s),
                    2 * Epsilon(p.dtype) * std::fabs(dx.Get(n, c, s)) + 8 * u * terms +
                        SubnormalSpacing(p.dtype))
            << Describe(host) << " dx at n=" << n << " c=" << c << " s=" << s;
      }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaKernelsTest, ::testing::ValuesIn(Cases()), Name);

TEST(CudaKernels, RunningStatsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t C = 5, count = 37;
  std::vector<double> mean = {1, 2, 3, -4, 5}, m2 = {36, 72, 1, 0, 9};
  std::vector<float> rm(C, 0.25f), rv(C, 2.0f);
  DeviceBuffer dmean(C * 8), dm2(C * 8), drm(C * 4), drv(C * 4);
  dmean.Upload(mean.data(), C * 8);
  dm2.Upload(m2.data(), C * 8);
  drm.Upload(rm.data(), C * 4);
  drv.Upload(rv.data(), C * 4);
  ASSERT_EQ(0, hsbn_bn_running_stats_update(HSBN_BN_CUDA, C, count, dmean.as<double>(),
                                            dm2.as<double>(), drm.get(), drv.get(), HSBN_BN_F32,
                                            0.0, 1, 3, nullptr))
      << hsbn_bn_last_error();
  ASSERT_EQ(0, hsbn_bn_running_stats_update(HSBN_BN_CPU, C, count, mean.data(), m2.data(),
                                            rm.data(), rv.data(), HSBN_BN_F32, 0.0, 1, 3, nullptr));
  // Within 1 ulp of float: the GPU may contract (1 - f) * r + f * v into an FMA in double.
  const std::vector<float> grm = Download<float>(drm, C), grv = Download<float>(drv, C);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_LE(std::fabs(grm[c] - rm[c]), std::fabs(std::nextafter(rm[c], 2 * rm[c] + 1) - rm[c]))
        << "running_mean c=" << c << ": " << grm[c] << " vs " << rm[c];
    EXPECT_LE(std::fabs(grv[c] - rv[c]), std::fabs(std::nextafter(rv[c], 2 * rv[c] + 1) - rv[c]))
        << "running_var c=" << c << ": " << grv[c] << " vs " << rv[c];
  }
}

// libhsbn's CUDA runtime has a current device of its own: an entry point runs on the device
// that holds its memory, and leaves the current device as it found it. With one GPU the memory's
// device is the current one (all this machine can check); with several it is the last GPU.
TEST(CudaKernels, RunsOnTheDeviceOfItsMemoryWhateverDeviceIsCurrent) {
  SKIP_WITHOUT_GPU();
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  const int data_device = devices - 1;
  const int64_t N = 8, C = 3, S = 50;
  const BnInput host = MakeInput(Device::kCpu, DType::kF32, Layout::kNchw, N, C, S);
  const BnInput gpu = MakeInput(Device::kCuda, DType::kF32, Layout::kNchw, N, C, S);
  const Buffer x = RandomInput(host, 1.0, 2.0, 41);
  ASSERT_EQ(cudaSetDevice(data_device), cudaSuccess);
  DeviceBuffer dx(host.numel() * 4), dmean(C * 8), dm2(C * 8), ws(WorkspaceBytes(gpu));
  dx.Upload(x.data(), host.numel() * 4);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  int64_t count = 0;
  ASSERT_EQ(0, hsbn_bn_moments(HSBN_BN_CUDA, HSBN_BN_F32, HSBN_BN_NCHW, N, C, S, dx.get(), &count,
                               dmean.as<double>(), dm2.as<double>(), ws.get(),
                               WorkspaceBytes(gpu), nullptr))
      << hsbn_bn_last_error();
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0);
  ASSERT_EQ(cudaSetDevice(data_device), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<double> mean(C), m2(C);
  ASSERT_TRUE(LocalMoments(host, x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  const std::vector<double> gm = Download<double>(dmean, C), gv = Download<double>(dm2, C);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_NEAR(gm[c], mean[c], 1e-6 * (std::fabs(mean[c]) + 1)) << "c=" << c;
    EXPECT_NEAR(gv[c], m2[c], 1e-5 * m2[c]) << "c=" << c;
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// (N, C, 1) is the same memory in both layouts, and both are reduced by the channels-last
// kernels: the same bits, and the same bits as the CPU's within rounding.
TEST(CudaKernels, SpatialSizeOneReducesIdenticallyInEitherLayout) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 4096, C = 64;
  const BnInput nchw = MakeInput(Device::kCuda, DType::kF32, Layout::kNchw, N, C, 1);
  BnInput cl = nchw;
  cl.layout = Layout::kChannelsLast;
  const Buffer x = RandomInput(MakeInput(Device::kCpu, DType::kF32, Layout::kNchw, N, C, 1), 5.0,
                               2.0, 31);
  const Buffer dy = RandomInput(MakeInput(Device::kCpu, DType::kF32, Layout::kNchw, N, C, 1), 0.0,
                                1.0, 32);
  DeviceBuffer dx(N * C * 4), ddy(N * C * 4), ws(WorkspaceBytes(nchw));
  dx.Upload(x.data(), N * C * 4);
  ddy.Upload(dy.data(), N * C * 4);
  ASSERT_EQ(WorkspaceBytes(nchw), WorkspaceBytes(cl));
  DeviceBuffer m_a(C * 8), v_a(C * 8), m_b(C * 8), v_b(C * 8), s_a(C * 8), t_a(C * 8),
      s_b(C * 8), t_b(C * 8);
  int64_t count = 0;
  ASSERT_TRUE(LocalMoments(nchw, dx.get(), &count, m_a.as<double>(), v_a.as<double>(), ws.get(),
                           WorkspaceBytes(nchw), nullptr).ok());
  ASSERT_TRUE(LocalMoments(cl, dx.get(), &count, m_b.as<double>(), v_b.as<double>(), ws.get(),
                           WorkspaceBytes(cl), nullptr).ok());
  const BnStats stats{m_a.get(), v_a.get(), DType::kF64, StatsKind::kM2, 1e-5, count};
  ASSERT_TRUE(BackwardReduce(nchw, ddy.get(), dx.get(), stats, s_a.as<double>(), t_a.as<double>(),
                             nullptr, nullptr, DType::kF32, ws.get(), WorkspaceBytes(nchw),
                             nullptr).ok());
  ASSERT_TRUE(BackwardReduce(cl, ddy.get(), dx.get(), stats, s_b.as<double>(), t_b.as<double>(),
                             nullptr, nullptr, DType::kF32, ws.get(), WorkspaceBytes(cl),
                             nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(Download<double>(m_a, C), Download<double>(m_b, C));
  EXPECT_EQ(Download<double>(v_a, C), Download<double>(v_b, C));
  EXPECT_EQ(Download<double>(s_a, C), Download<double>(s_b, C));
  EXPECT_EQ(Download<double>(t_a, C), Download<double>(t_b, C));
  std::vector<double> mean(C), m2(C);
  const BnInput host = MakeInput(Device::kCpu, DType::kF32, Layout::kNchw, N, C, 1);
  ASSERT_TRUE(LocalMoments(host, x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  const std::vector<double> gm = Download<double>(m_a, C), gv = Download<double>(v_a, C);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_NEAR(gm[c], mean[c], 1e-6 * (std::fabs(mean[c]) + 1)) << "c=" << c;
    EXPECT_NEAR(gv[c], m2[c], 1e-5 * m2[c]) << "c=" << c;
  }
}

TEST(CudaKernels, InPlaceNormalizeThroughTheCAbiOnAStream) {
  SKIP_WITHOUT_GPU();
  const BnInput host = MakeInput(Device::kCpu, DType::kBF16, Layout::kNchw, 4, 16, 1000);
  const Buffer x = RandomInput(host, 3.0, 2.0, 5);
  const size_t bytes = host.numel() * 2;
  DeviceBuffer dx(bytes), dmean(16 * 4), dvar(16 * 4);
  dx.Upload(x.data(), bytes);
  std::vector<float> mean(16, 3.0f), var(16, 4.0f);
  dmean.Upload(mean.data(), 64);
  dvar.Upload(var.data(), 64);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(0, hsbn_bn_normalize(HSBN_BN_CUDA, HSBN_BN_BF16, HSBN_BN_NCHW, 4, 16, 1000, dx.get(),
                                 dx.get(), dmean.get(), dvar.get(), HSBN_BN_F32, HSBN_BN_VAR, 0.0,
                                 0, nullptr, nullptr, HSBN_BN_F32, 0, stream))
      << hsbn_bn_last_error();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  Buffer y(host), want(host);
  dx.Download(y.data(), bytes);
  const BnStats st{mean.data(), var.data(), DType::kF32, StatsKind::kVar, 0.0, 0};
  ASSERT_TRUE(Normalize(host, x.data(), want.data(), st, BnAffine{}, false, nullptr).ok());
  for (int64_t n = 0; n < 4; ++n)
    for (int64_t c = 0; c < 16; ++c)
      for (int64_t s = 0; s < 1000; ++s)
        ASSERT_NEAR(y.Get(n, c, s), want.Get(n, c, s), 1e-2 * (std::fabs(want.Get(n, c, s)) + 1e-2));
}

}  // namespace
}  // namespace hsbn::kernels

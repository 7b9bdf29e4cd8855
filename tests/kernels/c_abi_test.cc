// The C ABI (hsbn/bn_kernels_c.h) on the CPU: same results as the C++ API, error codes and
// messages for bad arguments.
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
using testing::MakeInput;
using testing::RandomInput;

TEST(CAbi, FullStepOnCpuMatchesTheCppApi) {
  const BnInput in = MakeInput(Device::kCpu, DType::kF32, Layout::kChannelsLast, 4, 6, 25);
  const Buffer x = RandomInput(in, 2.0, 1.5, 1), dy = RandomInput(in, 0.0, 1.0, 2);
  const int64_t C = in.c;
  size_t ws = 99;
  ASSERT_EQ(0, hsbn_bn_workspace_size(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_CHANNELS_LAST, 4, C, 25, &ws));
  EXPECT_EQ(ws, 0u);

  std::vector<double> mean(C), m2(C), mean_cpp(C), m2_cpp(C);
  int64_t count = 0, count_cpp = 0;
  ASSERT_EQ(0, hsbn_bn_moments(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_CHANNELS_LAST, 4, C, 25,
                               x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr))
      << hsbn_bn_last_error();
  ASSERT_TRUE(LocalMoments(in, x.data(), &count_cpp, mean_cpp.data(), m2_cpp.data(), nullptr, 0,
                           nullptr).ok());
  EXPECT_EQ(count, 100);
  EXPECT_EQ(0, std::memcmp(mean.data(), mean_cpp.data(), C * 8));
  EXPECT_EQ(0, std::memcmp(m2.data(), m2_cpp.data(), C * 8));

  std::vector<float> w(C, 2.0f), b(C, 1.0f), gw(C), gb(C);
  Buffer y(in), y_cpp(in), dx(in);
  ASSERT_EQ(0, hsbn_bn_normalize(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_CHANNELS_LAST, 4, C, 25,
                                 x.data(), y.data(), mean.data(), m2.data(), HSBN_BN_F64,
                                 HSBN_BN_M2, 1e-5, count, w.data(), b.data(), HSBN_BN_F32, 0,
                                 nullptr))
      << hsbn_bn_last_error();
  const BnStats stats{mean.data(), m2.data(), DType::kF64, StatsKind::kM2, 1e-5, count};
  ASSERT_TRUE(Normalize(in, x.data(), y_cpp.data(), stats,
                        BnAffine{w.data(), b.data(), DType::kF32}, false, nullptr).ok());
  EXPECT_EQ(0, std::memcmp(y.data(), y_cpp.data(), in.numel() * 4));
  // Normalized values have mean `bias` and variance weight^2 (biased, up to eps).
  double s = 0, ss = 0;
  for (int64_t n = 0; n < 4; ++n)
    for (int64_t p = 0; p < 25; ++p) {
      s += y.Get(n, 0, p);
      ss += (y.Get(n, 0, p) - 1.0) * (y.Get(n, 0, p) - 1.0);
    }
  EXPECT_NEAR(s / 100, 1.0, 1e-5);
  EXPECT_NEAR(ss / 100, 4.0, 1e-3);

  std::vector<double> sum_dy(C), sum_dy_xmu(C);
  ASSERT_EQ(0, hsbn_bn_backward_reduce(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_CHANNELS_LAST, 4, C, 25,
                                       dy.data(), x.data(), mean.data(), m2.data(), HSBN_BN_F64,
                                       HSBN_BN_M2, 1e-5, count, sum_dy.data(), sum_dy_xmu.data(),
                                       gw.data(), gb.data(), HSBN_BN_F32, nullptr, 0, nullptr))
      << hsbn_bn_last_error();
  for (int64_t c = 0; c < C; ++c) {
    const double invstd = 1.0 / std::sqrt(m2[c] / count + 1e-5);
    EXPECT_FLOAT_EQ(gw[c], static_cast<float>(sum_dy_xmu[c] * invstd));
    EXPECT_FLOAT_EQ(gb[c], static_cast<float>(sum_dy[c]));
  }
  ASSERT_EQ(0, hsbn_bn_backward_elemt(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_CHANNELS_LAST, 4, C, 25,
                                      dy.data(), x.data(), mean.data(), m2.data(), HSBN_BN_F64,
                                      HSBN_BN_M2, 1e-5, count, w.data(), HSBN_BN_F32,
                                      sum_dy.data(), sum_dy_xmu.data(), count, dx.data(),
                                      nullptr))
      << hsbn_bn_last_error();
  // The input gradient of BatchNorm is orthogonal to constants and to x - mean, per channel.
  for (int64_t c = 0; c < C; ++c) {
    double a = 0, bsum = 0, mag = 0;
    for (int64_t n = 0; n < 4; ++n)
      for (int64_t p = 0; p < 25; ++p) {
        a += dx.Get(n, c, p);
        bsum += dx.Get(n, c, p) * (x.Get(n, c, p) - mean[c]);
        mag += std::fabs(dx.Get(n, c, p)) * (1 + std::fabs(x.Get(n, c, p) - mean[c]));
      }
    EXPECT_NEAR(a, 0.0, 1e-5 * mag);
    EXPECT_NEAR(bsum, 0.0, 1e-5 * mag);
  }

  std::vector<float> rm(C, 0.0f), rv(C, 1.0f);
  ASSERT_EQ(0, hsbn_bn_running_stats_update(HSBN_BN_CPU, C, count, mean.data(), m2.data(),
                                            rm.data(), rv.data(), HSBN_BN_F32, 0.1, 0, 0,
                                            nullptr));
  EXPECT_FLOAT_EQ(rm[2], static_cast<float>(0.1 * mean[2]));
  EXPECT_FLOAT_EQ(rv[2], static_cast<float>(0.9 + 0.1 * m2[2] / (count - 1)));
  EXPECT_STREQ(hsbn_bn_last_error(), "");
}

TEST(CAbi, BadArgumentsReturnInvalidArgumentWithAMessage) {
  std::vector<double> mean(3), m2(3);
  std::vector<float> x(3 * 4);
  int64_t count;
  EXPECT_EQ(3, hsbn_bn_moments(HSBN_BN_CPU, 9, HSBN_BN_NCHW, 1, 3, 4, x.data(), &count,
                               mean.data(), m2.data(), nullptr, 0, nullptr));
  EXPECT_NE(std::string(hsbn_bn_last_error()).find("dtype 9"), std::string::npos)
      << hsbn_bn_last_error();
  EXPECT_EQ(3, hsbn_bn_moments(HSBN_BN_CPU, HSBN_BN_F32, 5, 1, 3, 4, x.data(), &count,
                               mean.data(), m2.data(), nullptr, 0, nullptr));
  EXPECT_NE(std::string(hsbn_bn_last_error()).find("layout"), std::string::npos);
  EXPECT_EQ(3, hsbn_bn_moments(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_NCHW, -1, 3, 4, x.data(),
                               &count, mean.data(), m2.data(), nullptr, 0, nullptr));
  EXPECT_EQ(3, hsbn_bn_moments(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_NCHW, 1, 3, 4, nullptr, &count,
                               mean.data(), m2.data(), nullptr, 0, nullptr));
  EXPECT_NE(std::string(hsbn_bn_last_error()).find("x is null"), std::string::npos);
  EXPECT_EQ(3, hsbn_bn_normalize(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_NCHW, 1, 3, 4, x.data(),
                                 x.data(), mean.data(), m2.data(), HSBN_BN_F16, HSBN_BN_VAR,
                                 1e-5, 0, nullptr, nullptr, HSBN_BN_F32, 0, nullptr));
  EXPECT_NE(std::string(hsbn_bn_last_error()).find("f32 or f64"), std::string::npos);
  EXPECT_EQ(3, hsbn_bn_normalize(HSBN_BN_CPU, HSBN_BN_F32, HSBN_BN_NCHW, 1, 3, 4, x.data(),
                                 x.data(), mean.data(), m2.data(), HSBN_BN_F64, HSBN_BN_VAR,
                                 -1.0, 0, nullptr, nullptr, HSBN_BN_F32, 0, nullptr));
  EXPECT_EQ(3, hsbn_bn_running_stats_update(HSBN_BN_CPU, 3, 10, mean.data(), m2.data(),
                                            mean.data(), m2.data(), HSBN_BN_F64, 1.5, 0, 0,
                                            nullptr));
  EXPECT_NE(std::string(hsbn_bn_last_error()).find("momentum"), std::string::npos);
  EXPECT_EQ(3, hsbn_bn_running_stats_update(HSBN_BN_CPU, 3, 10, mean.data(), m2.data(),
                                            mean.data(), m2.data(), HSBN_BN_F64, 0.1, 1, 0,
                                            nullptr));
}

TEST(CAbi, CudaWorkspaceIsKnownWithoutAGpuAndCudaCallsFailCleanlyWithoutOne) {
  size_t bytes = 0;
  ASSERT_EQ(0, hsbn_bn_workspace_size(HSBN_BN_CUDA, HSBN_BN_F16, HSBN_BN_NCHW, 8, 256, 128 * 128,
                                      &bytes));
  EXPECT_GT(bytes, 256u * 16);  // per-split partials for every channel
  EXPECT_EQ(0, hsbn_bn_workspace_size(HSBN_BN_CUDA, HSBN_BN_F16, HSBN_BN_NCHW, 0, 256, 49, &bytes));
  EXPECT_EQ(bytes, 0u);
  if (hsbn_bn_cuda_available()) GTEST_SKIP() << "a CUDA device is present; covered by the CUDA tests";
  std::vector<double> mean(3), m2(3);
  int64_t count;
  const int rc = hsbn_bn_moments(HSBN_BN_CUDA, HSBN_BN_F32, HSBN_BN_NCHW, 1, 3, 4, mean.data(),
                                 &count, mean.data(), m2.data(), nullptr, 0, nullptr);
  EXPECT_TRUE(rc == 9 || rc == 12) << rc;
  EXPECT_NE(std::string(hsbn_bn_last_error()).find("CUDA"), std::string::npos);
}

TEST(CAbi, AbiVersion) { EXPECT_EQ(hsbn_bn_abi_version(), HSBN_BN_ABI_VERSION); }

}  // namespace
}  // namespace hsbn::kernels

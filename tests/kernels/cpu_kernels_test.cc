// The CPU BN kernels against a long-double reference computed on the values exactly as stored.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/bn_kernels.h"
#include "test_util.h"

namespace hsbn::kernels {
namespace {

using testing::Buffer;
using testing::Describe;
using testing::Epsilon;
using testing::MakeInput;
using testing::RandomInput;
using testing::ReferenceMoments;

struct MomentsCase {
  DType dtype;
  Layout layout;
  int64_t n, c, s;
  double mean_scale, std;
};

class CpuMomentsTest : public ::testing::TestWithParam<MomentsCase> {};

TEST_P(CpuMomentsTest, MatchesLongDoubleReference) {
  const MomentsCase& p = GetParam();
  const BnInput in = MakeInput(Device::kCpu, p.dtype, p.layout, p.n, p.c, p.s);
  const Buffer x = RandomInput(in, p.mean_scale, p.std, 1234);
  std::vector<double> mean(in.c, -1), m2(in.c, -1);
  int64_t count = -1;
  ASSERT_TRUE(LocalMoments(in, x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  EXPECT_EQ(count, in.n * in.s);
  const testing::RefMoments ref = ReferenceMoments(x);
  for (int64_t c = 0; c < in.c; ++c) {
    const double scale = std::fabs(static_cast<double>(ref.mean[c])) + p.std;
    EXPECT_NEAR(mean[c], static_cast<double>(ref.mean[c]), 1e-13 * scale)
        << Describe(in) << " channel " << c;
    // m2 is a sum of squares: relative accuracy, plus the rounding of mean^2-sized terms.
    EXPECT_NEAR(m2[c], static_cast<double>(ref.m2[c]),
                1e-11 * static_cast<double>(ref.m2[c]) + 1e-15 * scale * p.std * count)
        << Describe(in) << " channel " << c;
  }
}

std::vector<MomentsCase> MomentsCases() {
  std::vector<MomentsCase> cases;
  for (Layout layout : {Layout::kNchw, Layout::kChannelsLast}) {
    for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32, DType::kF64}) {
      cases.push_back({dtype, layout, 4, 3, 1000, 0.5, 2.0});  // 2d-like
      cases.push_back({dtype, layout, 3, 5, 3 * 5 * 7, 1.0, 1.0});  // 3d: D*H*W = 105
      cases.push_back({dtype, layout, 1, 7, 13 * 11, -3.0, 0.25});  // N = 1
      cases.push_back({dtype, layout, 1000, 6, 1, 2.0, 1.0});  // BatchNorm1d on (N, C)
      cases.push_back({dtype, layout, 2, 1, 100003, 0.0, 1.0});  // C = 1, prime S
      cases.push_back({dtype, layout, 2, 4096, 3, 1.0, 1.0});  // C = 4096
      cases.push_back({dtype, layout, 0, 5, 9, 1.0, 1.0});  // empty batch
      cases.push_back({dtype, layout, 4, 3, 0, 1.0, 1.0});  // empty spatial
    }
    // Mean 1e4 x std: naive E[x^2] - E[x]^2 would lose every digit.
    cases.push_back({DType::kF32, layout, 8, 4, 2053, 1e4, 1.0});
    cases.push_back({DType::kF16, layout, 8, 4, 2053, 1e4, 1.0});
    cases.push_back({DType::kF64, layout, 8, 4, 2053, 1e8, 1e-4});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuMomentsTest, ::testing::ValuesIn(MomentsCases()));

TEST(CpuMoments, EmptyBatchIsTheMergeIdentity) {
  const BnInput in = MakeInput(Device::kCpu, DType::kF32, Layout::kNchw, 0, 3, 16);
  std::vector<double> mean(3, 7), m2(3, 7);
  int64_t count = -1;
  ASSERT_TRUE(LocalMoments(in, nullptr, &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  EXPECT_EQ(count, 0);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(mean[c], 0.0);
    EXPECT_EQ(m2[c], 0.0);
  }
}

TEST(CpuMoments, LayoutsAgree) {
  const BnInput a = MakeInput(Device::kCpu, DType::kF32, Layout::kNchw, 5, 300, 77);
  BnInput b = a;
  b.layout = Layout::kChannelsLast;
  const Buffer xa = RandomInput(a, 3.0, 1.0, 99);
  Buffer xb(b);
  for (int64_t n = 0; n < a.n; ++n)
    for (int64_t c = 0; c < a.c; ++c)
      for (int64_t s = 0; s < a.s; ++s) xb.Set(n, c, s, xa.Get(n, c, s));
  std::vector<double> ma(a.c), va(a.c), mb(a.c), vb(a.c);
  int64_t count;
  ASSERT_TRUE(LocalMoments(a, xa.data(), &count, ma.data(), va.data(), nullptr, 0, nullptr).ok());
  ASSERT_TRUE(LocalMoments(b, xb.data(), &count, mb.data(), vb.data(), nullptr, 0, nullptr).ok());
  for (int64_t c = 0; c < a.c; ++c) {
    EXPECT_NEAR(ma[c], mb[c], 1e-13 * std::fabs(ma[c]));
    EXPECT_NEAR(va[c], vb[c], 1e-12 * va[c]);
  }
}

TEST(CpuMoments, RepeatedRunsGiveIdenticalBits) {
  const BnInput in = MakeInput(Device::kCpu, DType::kBF16, Layout::kChannelsLast, 3, 65, 301);
  const Buffer x = RandomInput(in, 1.0, 1.0, 5);
  std::vector<double> m1(in.c), v1(in.c), m2(in.c), v2(in.c);
  int64_t count;
  ASSERT_TRUE(LocalMoments(in, x.data(), &count, m1.data(), v1.data(), nullptr, 0, nullptr).ok());
  ASSERT_TRUE(LocalMoments(in, x.data(), &count, m2.data(), v2.data(), nullptr, 0, nullptr).ok());
  EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), in.c * sizeof(double)));
  EXPECT_EQ(0, std::memcmp(v1.data(), v2.data(), in.c * sizeof(double)));
}

// ---- normalize -------------------------------------------------------------------------------

struct NormalizeCase {
  DType dtype;
  Layout layout;
  int64_t n, c, s;
  bool affine, relu;
  StatsKind kind;
};

class CpuNormalizeTest : public ::testing::TestWithParam<NormalizeCase> {};

TEST_P(CpuNormalizeTest, MatchesLongDoubleReference) {
  const NormalizeCase& p = GetParam();
  const BnInput in = MakeInput(Device::kCpu, p.dtype, p.layout, p.n, p.c, p.s);
  const Buffer x = RandomInput(in, 10.0, 3.0, 21);
  std::vector<double> mean(in.c), m2(in.c);
  int64_t count;
  ASSERT_TRUE(LocalMoments(in, x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  const double eps = 1e-5;
  std::vector<double> second(in.c);
  for (int64_t c = 0; c < in.c; ++c) {
    const double var = m2[c] / count;
    second[c] = p.kind == StatsKind::kInvstd ? 1.0 / std::sqrt(var + eps)
                : p.kind == StatsKind::kVar  ? var
                                             : m2[c];
  }
  std::vector<float> weight(in.c), bias(in.c);
  for (int64_t c = 0; c < in.c; ++c) {
    weight[c] = 0.5f + 0.25f * (c % 5);
    bias[c] = -1.0f + 0.5f * (c % 3);
  }
  BnStats stats{mean.data(), second.data(), DType::kF64, p.kind, eps, count};
  BnAffine affine;
  if (p.affine) affine = BnAffine{weight.data(), bias.data(), DType::kF32};
  Buffer y(in);
  ASSERT_TRUE(Normalize(in, x.data(), y.data(), stats, affine, p.relu, nullptr).ok());
  const double tol = 4 * Epsilon(in.dtype == DType::kF64 ? DType::kF64 : DType::kF32);
  for (int64_t n = 0; n < in.n; ++n)
    for (int64_t c = 0; c < in.c; ++c)
      for (int64_t s = 0; s < in.s; ++s) {
        const long double invstd = 1.0L / std::sqrt(static_cast<long double>(m2[c]) / count + eps);
        const long double w = p.affine ? weight[c] : 1.0L, b = p.affine ? bias[c] : 0.0L;
        long double ref = (x.Get(n, c, s) - static_cast<long double>(mean[c])) * invstd * w + b;
        if (p.relu && ref < 0) ref = 0;
        const double got = y.Get(n, c, s);
        // Output rounding (half an ulp of the dtype) plus the fp32/fp64 arithmetic on terms as
        // large as x * invstd * w.
        const double terms = std::fabs(x.Get(n, c, s) * static_cast<double>(invstd * w)) +
                             std::fabs(mean[c] * static_cast<double>(invstd * w)) + std::fabs(b);
        ASSERT_NEAR(got, static_cast<double>(ref),
                    Epsilon(in.dtype) * std::fabs(static_cast<double>(ref)) + tol * terms)
            << Describe(in) << " at n=" << n << " c=" << c << " s=" << s;
        if (p.relu) {
          ASSERT_GE(got, 0.0);
        }
      }
}

std::vector<NormalizeCase> NormalizeCases() {
  std::vector<NormalizeCase> cases;
  for (Layout layout : {Layout::kNchw, Layout::kChannelsLast})
    for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32, DType::kF64}) {
      cases.push_back({dtype, layout, 3, 5, 37, true, false, StatsKind::kInvstd});
      cases.push_back({dtype, layout, 2, 300, 9, false, false, StatsKind::kVar});
      cases.push_back({dtype, layout, 4, 3, 1, true, true, StatsKind::kM2});
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuNormalizeTest, ::testing::ValuesIn(NormalizeCases()));

TEST(CpuNormalize, InPlaceEqualsOutOfPlace) {
  const BnInput in = MakeInput(Device::kCpu, DType::kF16, Layout::kChannelsLast, 2, 7, 33);
  Buffer x = RandomInput(in, 1.0, 1.0, 3);
  std::vector<double> mean(in.c, 0.5), var(in.c, 2.0);
  BnStats stats{mean.data(), var.data(), DType::kF64, StatsKind::kVar, 1e-5, 0};
  Buffer y(in);
  ASSERT_TRUE(Normalize(in, x.data(), y.data(), stats, BnAffine{}, true, nullptr).ok());
  ASSERT_TRUE(Normalize(in, x.data(), x.data(), stats, BnAffine{}, true, nullptr).ok());
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), in.numel() * 2));
}

// ---- backward against finite differences, fp64 ---------------------------------------------

// Training-mode BatchNorm forward, in long double, of the values x (logical order), and the
// loss sum(g * y).
long double ReferenceLoss(const BnInput& in, const std::vector<long double>& x,
                          const std::vector<long double>& w, const std::vector<long double>& b,
                          const std::vector<long double>& g, long double eps) {
  long double loss = 0;
  const long double count = static_cast<long double>(in.count());
  for (int64_t c = 0; c < in.c; ++c) {
    long double sum = 0, m2 = 0;
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t s = 0; s < in.s; ++s) sum += x[(n * in.c + c) * in.s + s];
    const long double mean = sum / count;
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t s = 0; s < in.s; ++s) {
        const long double d = x[(n * in.c + c) * in.s + s] - mean;
        m2 += d * d;
      }
    const long double invstd = 1.0L / std::sqrt(m2 / count + eps);
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t s = 0; s < in.s; ++s) {
        const int64_t i = (n * in.c + c) * in.s + s;
        loss += g[i] * ((x[i] - mean) * invstd * w[c] + b[c]);
      }
  }
  return loss;
}

class CpuBackwardTest : public ::testing::TestWithParam<Layout> {};

TEST_P(CpuBackwardTest, MatchesFiniteDifferencesOfTheReference) {
  const BnInput in = MakeInput(Device::kCpu, DType::kF64, GetParam(), 2, 3, 5);
  const double eps = 1e-3;
  Buffer x = RandomInput(in, 1.0, 1.0, 77);
  Buffer g = RandomInput(in, 0.0, 1.0, 78);
  std::vector<double> weight = {0.7, -1.3, 2.0}, bias = {0.1, 0.2, -0.3};
  std::vector<long double> xl(in.numel()), gl(in.numel()), wl(weight.begin(), weight.end()),
      bl(bias.begin(), bias.end());
  for (int64_t n = 0; n < in.n; ++n)
    for (int64_t c = 0; c < in.c; ++c)
      for (int64_t s = 0; s < in.s; ++s) {
        xl[(n * in.c + c) * in.s + s] = x.Get(n, c, s);
        gl[(n * in.c + c) * in.s + s] = g.Get(n, c, s);
      }

  // The kernels: moments, backward reduce, backward elementwise.
  std::vector<double> mean(in.c), m2(in.c), sum_dy(in.c), sum_dy_xmu(in.c), gw(in.c), gb(in.c);
  int64_t count;
  ASSERT_TRUE(LocalMoments(in, x.data(), &count, mean.data(), m2.data(), nullptr, 0, nullptr).ok());
  const BnStats stats{mean.data(), m2.data(), DType::kF64, StatsKind::kM2, eps, count};
  const BnAffine affine{weight.data(), bias.data(), DType::kF64};
  ASSERT_TRUE(BackwardReduce(in, g.data(), x.data(), stats, sum_dy.data(), sum_dy_xmu.data(),
                             gw.data(), gb.data(), DType::kF64, nullptr, 0, nullptr)
                  .ok());
  Buffer dx(in);
  ASSERT_TRUE(BackwardElementwise(in, g.data(), x.data(), stats, affine, sum_dy.data(),
                                  sum_dy_xmu.data(), count, dx.data(), nullptr)
                  .ok());

  const long double h = 1e-5L;
  for (int64_t n = 0; n < in.n; ++n)
    for (int64_t c = 0; c < in.c; ++c)
      for (int64_t s = 0; s < in.s; ++s) {
        const int64_t i = (n * in.c + c) * in.s + s;
        std::vector<long double> xp = xl, xm = xl;
        xp[i] += h;
        xm[i] -= h;
        const long double fd = (ReferenceLoss(in, xp, wl, bl, gl, eps) -
                                ReferenceLoss(in, xm, wl, bl, gl, eps)) / (2 * h);
        EXPECT_NEAR(dx.Get(n, c, s), static_cast<double>(fd), 1e-8 * (1 + std::fabs((double)fd)))
            << "dx at n=" << n << " c=" << c << " s=" << s;
      }
  for (int64_t c = 0; c < in.c; ++c) {
    std::vector<long double> wp = wl, wm = wl, bp = bl, bm = bl;
    wp[c] += h;
    wm[c] -= h;
    bp[c] += h;
    bm[c] -= h;
    const long double fdw = (ReferenceLoss(in, xl, wp, bl, gl, eps) -
                             ReferenceLoss(in, xl, wm, bl, gl, eps)) / (2 * h);
    const long double fdb = (ReferenceLoss(in, xl, wl, bp, gl, eps) -
                             ReferenceLoss(in, xl, wl, bm, gl, eps)) / (2 * h);
    EXPECT_NEAR(gw[c], static_cast<double>(fdw), 1e-8 * (1 + std::fabs((double)fdw))) << c;
    EXPECT_NEAR(gb[c], static_cast<double>(fdb), 1e-8 * (1 + std::fabs((double)fdb))) << c;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CpuBackwardTest,
                         ::testing::Values(Layout::kNchw, Layout::kChannelsLast));

TEST(CpuBackward, ReduceMatchesLongDoubleSumsForLowPrecisionInput) {
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (Layout layout : {Layout::kNchw, Layout::kChannelsLast}) {
      const BnInput in = MakeInput(Device::kCpu, dtype, layout, 3, 257, 29);
      const Buffer x = RandomInput(in, 4.0, 1.0, 8), dy = RandomInput(in, 0.0, 1.0, 9);
      std::vector<float> mean(in.c), invstd(in.c, 1.0f);
      for (int64_t c = 0; c < in.c; ++c) mean[c] = 4.0f * (1 + c % 3);
      const BnStats stats{mean.data(), invstd.data(), DType::kF32, StatsKind::kInvstd, 0, 0};
      std::vector<double> sum_dy(in.c), sum_dy_xmu(in.c);
      std::vector<float> gb(in.c);
      ASSERT_TRUE(BackwardReduce(in, dy.data(), x.data(), stats, sum_dy.data(),
                                 sum_dy_xmu.data(), nullptr, gb.data(), DType::kF32, nullptr, 0,
                                 nullptr)
                      .ok());
      for (int64_t c = 0; c < in.c; ++c) {
        long double a = 0, b = 0, mag = 0;
        for (int64_t n = 0; n < in.n; ++n)
          for (int64_t s = 0; s < in.s; ++s) {
            a += dy.Get(n, c, s);
            b += static_cast<long double>(dy.Get(n, c, s)) * (x.Get(n, c, s) - mean[c]);
            mag += std::fabs(dy.Get(n, c, s)) * (1 + std::fabs(x.Get(n, c, s)));
          }
        ASSERT_NEAR(sum_dy[c], static_cast<double>(a), 1e-13 * static_cast<double>(mag));
        ASSERT_NEAR(sum_dy_xmu[c], static_cast<double>(b), 1e-13 * static_cast<double>(mag));
        ASSERT_EQ(gb[c], static_cast<float>(sum_dy[c]));
      }
    }
  }
}

// ---- running statistics --------------------------------------------------------------------

TEST(CpuRunningStats, MomentumAndCumulativeAverageAsTorch) {
  const std::vector<double> mean = {1.0, -2.0}, m2 = {9.0, 18.0};  // count 10: unbiased 1, 2
  std::vector<float> rm = {0.5f, 0.5f}, rv = {1.0f, 1.0f};
  ASSERT_TRUE(UpdateRunningStats(Device::kCpu, 2, 10, mean.data(), m2.data(), rm.data(),
                                 rv.data(), DType::kF32, 0.1, false, 0, nullptr)
                  .ok());
  EXPECT_FLOAT_EQ(rm[0], 0.9f * 0.5f + 0.1f * 1.0f);
  EXPECT_FLOAT_EQ(rm[1], 0.9f * 0.5f + 0.1f * -2.0f);
  EXPECT_FLOAT_EQ(rv[0], 0.9f * 1.0f + 0.1f * 1.0f);
  EXPECT_FLOAT_EQ(rv[1], 0.9f * 1.0f + 0.1f * 2.0f);

  // momentum=None, 4th batch: factor 1/4.
  std::vector<double> rm64 = {2.0, 2.0}, rv64 = {4.0, 4.0};
  ASSERT_TRUE(UpdateRunningStats(Device::kCpu, 2, 10, mean.data(), m2.data(), rm64.data(),
                                 rv64.data(), DType::kF64, 0.1, true, 4, nullptr)
                  .ok());
  EXPECT_DOUBLE_EQ(rm64[0], 0.75 * 2.0 + 0.25 * 1.0);
  EXPECT_DOUBLE_EQ(rv64[1], 0.75 * 4.0 + 0.25 * 2.0);

  // An empty batch leaves them alone; a single value per channel is an error, as in torch.
  ASSERT_TRUE(UpdateRunningStats(Device::kCpu, 2, 0, mean.data(), m2.data(), rm64.data(),
                                 rv64.data(), DType::kF64, 0.1, false, 0, nullptr)
                  .ok());
  EXPECT_DOUBLE_EQ(rm64[0], 1.75);
  const absl::Status one = UpdateRunningStats(Device::kCpu, 2, 1, mean.data(), m2.data(),
                                              rm64.data(), rv64.data(), DType::kF64, 0.1, false,
                                              0, nullptr);
  EXPECT_EQ(one.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_DOUBLE_EQ(rm64[0], 1.75);
}

}  // namespace
}  // namespace hsbn::kernels

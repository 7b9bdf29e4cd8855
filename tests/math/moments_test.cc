// The merge arithmetic (hsbn/moments.h) against a long-double two-pass reference.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/moments.h"

namespace hsbn {
namespace {

struct Ref {
  int64_t count;
  long double mean, m2;
};

Ref TwoPass(const std::vector<double>& v) {
  Ref r{int64_t(v.size()), 0, 0};
  if (v.empty()) return r;
  long double sum = 0;
  for (double x : v) sum += x;
  r.mean = sum / v.size();
  for (double x : v) r.m2 += (x - r.mean) * (x - r.mean);
  return r;
}

Moments<double> Welford(const std::vector<double>& v) {
  Moments<double> m = EmptyMoments<double>();
  for (double x : v) WelfordAdd(m, x);
  return m;
}

// Splits v into parts of the given sizes, reduces each with Welford and merges them in order.
Moments<double> SplitMerge(const std::vector<double>& v, const std::vector<size_t>& sizes) {
  Moments<double> acc = EmptyMoments<double>();
  size_t at = 0;
  for (size_t n : sizes) {
    std::vector<double> part(v.begin() + at, v.begin() + at + n);
    acc = ChanMerge(acc, Welford(part));
    at += n;
  }
  return acc;
}

void ExpectClose(const Moments<double>& got, const Ref& want, double rel) {
  EXPECT_EQ(got.count, want.count);
  const double mean_scale = std::max(std::fabs(double(want.mean)), 1e-300);
  EXPECT_LE(std::fabs(got.mean - double(want.mean)) / mean_scale, rel)
      << "mean " << got.mean << " want " << double(want.mean);
  const double m2_scale = std::max(double(want.m2), 1e-300);
  EXPECT_LE(std::fabs(got.m2 - double(want.m2)) / m2_scale, rel)
      << "m2 " << got.m2 << " want " << double(want.m2);
}

TEST(Moments, EmptyIsTheIdentityOfTheMerge) {
  const Moments<double> a{5, 1.5, 2.25};
  const Moments<double> e = EmptyMoments<double>();
  const Moments<double> l = ChanMerge(e, a), r = ChanMerge(a, e);
  EXPECT_EQ(l.count, 5);
  EXPECT_EQ(l.mean, 1.5);
  EXPECT_EQ(l.m2, 2.25);
  EXPECT_EQ(r.count, 5);
  EXPECT_EQ(r.mean, 1.5);
  EXPECT_EQ(r.m2, 2.25);
  const Moments<double> ee = ChanMerge(e, e);
  EXPECT_EQ(ee.count, 0);
  EXPECT_EQ(ee.mean, 0.0);
  EXPECT_EQ(ee.m2, 0.0);
}

TEST(Moments, SingleElement) {
  const Moments<double> m = Welford({42.5});
  EXPECT_EQ(m.count, 1);
  EXPECT_EQ(m.mean, 42.5);
  EXPECT_EQ(m.m2, 0.0);
  EXPECT_EQ(BiasedVariance(m), 0.0);
  EXPECT_EQ(UnbiasedVariance(m), 0.0);
}

TEST(Moments, TwoElementsExactly) {
  const Moments<double> m = ChanMerge(Welford({1.0}), Welford({3.0}));
  EXPECT_EQ(m.count, 2);
  EXPECT_EQ(m.mean, 2.0);
  EXPECT_EQ(m.m2, 2.0);
  EXPECT_EQ(BiasedVariance(m), 1.0);
  EXPECT_EQ(UnbiasedVariance(m), 2.0);
}

TEST(Moments, LargeMeanToStdRatioDoesNotCancel) {
  // mean / std = 1e6: E[x^2] - E[x]^2 in double would lose every digit of the variance.
  std::mt19937_64 rng(7);
  std::normal_distribution<double> d(1e6, 1.0);
  std::vector<double> v(100000);
  for (double& x : v) x = d(rng);
  const Ref want = TwoPass(v);
  ExpectClose(Welford(v), want, 1e-9);
  ExpectClose(SplitMerge(v, {1, 99, 50000, 49900}), want, 1e-9);
  // The naive formula is far off: proof that the test data is adversarial.
  double ds = 0, ds2 = 0;
  for (double x : v) {
    ds += x;
    ds2 += x * x;
  }
  const double naive_m2 = ds2 - ds * ds / double(v.size());
  EXPECT_GT(std::fabs(naive_m2 - double(want.m2)) / double(want.m2), 1e-3);
}

TEST(Moments, VeryUnevenCountsMerge) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> d(-3.0, 2.0);
  std::vector<double> v(1000001);
  for (double& x : v) x = d(rng);
  const Ref want = TwoPass(v);
  ExpectClose(SplitMerge(v, {1, 1000000}), want, 1e-10);
  ExpectClose(SplitMerge(v, {1000000, 1}), want, 1e-10);
  ExpectClose(SplitMerge(v, {0, 3, 0, 999998, 0}), want, 1e-10);
}

TEST(Moments, ChannelMergeMatchesPerChannelReferenceForC1AndC4096) {
  for (int64_t channels : {int64_t(1), int64_t(4096)}) {
    std::mt19937_64 rng(channels);
    const std::vector<int64_t> counts = {0, 1, 7, 1000, 0, 3};
    std::vector<std::vector<double>> parts;  // [worker][i * channels + c]
    for (int64_t n : counts) {
      std::vector<double> p(size_t(n * channels));
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < channels; ++c) {
          std::normal_distribution<double> d(1e4 * double(c % 5 + 1), 1.0 + double(c % 3));
          p[size_t(i * channels + c)] = d(rng);
        }
      }
      parts.push_back(std::move(p));
    }
    int64_t count = 0;
    std::vector<double> mean(channels, 0.0), m2(channels, 0.0);
    for (size_t w = 0; w < parts.size(); ++w) {
      std::vector<double> wm(channels), wm2(channels);
      for (int64_t c = 0; c < channels; ++c) {
        Moments<double> m = EmptyMoments<double>();
        for (int64_t i = 0; i < counts[w]; ++i) WelfordAdd(m, parts[w][size_t(i * channels + c)]);
        wm[c] = m.mean;
        wm2[c] = m.m2;
      }
      count = MergeChannelMoments(count, mean.data(), m2.data(), counts[w], wm.data(),
                                  wm2.data(), channels);
    }
    EXPECT_EQ(count, 1011);
    for (int64_t c = 0; c < channels; ++c) {
      std::vector<double> all;
      for (size_t w = 0; w < parts.size(); ++w) {
        for (int64_t i = 0; i < counts[w]; ++i) all.push_back(parts[w][size_t(i * channels + c)]);
      }
      const Ref want = TwoPass(all);
      ASSERT_NEAR(mean[c], double(want.mean), 1e-12 * std::fabs(double(want.mean)))
          << "C=" << channels << " c=" << c;
      ASSERT_NEAR(m2[c], double(want.m2), 1e-10 * double(want.m2)) << "C=" << channels << " c=" << c;
    }
  }
}

TEST(Moments, MergeOrderIsFixedSoResultsAreBitwiseReproducible) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> d(5.0, 3.0);
  std::vector<Moments<double>> parts;
  for (int w = 0; w < 8; ++w) {
    std::vector<double> v(17 + w);
    for (double& x : v) x = d(rng);
    parts.push_back(Welford(v));
  }
  auto reduce = [&] {
    Moments<double> acc = EmptyMoments<double>();
    for (const auto& p : parts) acc = ChanMerge(acc, p);
    return acc;
  };
  const Moments<double> a = reduce(), b = reduce();
  EXPECT_EQ(0, std::memcmp(&a.mean, &b.mean, sizeof(double)));
  EXPECT_EQ(0, std::memcmp(&a.m2, &b.m2, sizeof(double)));
}

TEST(Moments, SumsAddElementwise) {
  double a[3] = {1.0, -2.0, 0.5};
  const double b[3] = {0.25, 2.0, -0.5};
  AddChannelSums(a, b, 3);
  EXPECT_EQ(a[0], 1.25);
  EXPECT_EQ(a[1], 0.0);
  EXPECT_EQ(a[2], 0.0);
}

}  // namespace
}  // namespace hsbn

// fp16 / bf16 conversions and the fast divider used by the kernels' index arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "convert.h"
#include "fast_divmod.h"
#include "gtest/gtest.h"

namespace hsbn::kernels {
namespace {

bool IsNanHalf(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

TEST(HalfConversion, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfBitsToFloat(static_cast<uint16_t>(h));
    if (IsNanHalf(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(IsNanHalf(FloatToHalfBits(f))) << h;
    } else {
      EXPECT_EQ(FloatToHalfBits(f), h) << "half bits " << h << " -> " << f;
    }
  }
}

TEST(HalfConversion, KnownValues) {
  EXPECT_EQ(HalfBitsToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfBitsToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0xc000), -2.0f);
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even
  EXPECT_EQ(FloatToHalfBits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(FloatToHalfBits(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);                         // rounds to inf
  EXPECT_EQ(FloatToHalfBits(-1e9f), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);            // tie -> even (zero)
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1023.5f, -24)), 0x0400);         // up to min normal
}

// Nearest-even rounding of random floats, checked against the sorted list of all halves.
TEST(HalfConversion, RoundsToNearestEven) {
  std::vector<double> halves;  // non-negative finite halves, ascending (bits are monotone)
  for (uint32_t h = 0; h < 0x7c00; ++h) halves.push_back(HalfBitsToFloat(static_cast<uint16_t>(h)));
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> exponent(-27.0, 16.0);
  for (int i = 0; i < 200000; ++i) {
    const float f = static_cast<float>(std::exp2(exponent(rng)) * (1.0 + 1e-3 * (i % 7)));
    const uint16_t got = FloatToHalfBits(f);
    const auto it = std::lower_bound(halves.begin(), halves.end(), static_cast<double>(f));
    uint32_t want;
    if (it == halves.end()) {
      want = f >= 65520.0f ? 0x7c00 : 0x7bff;
    } else {
      const uint32_t hi = static_cast<uint32_t>(it - halves.begin());
      if (*it == f || hi == 0) {
        want = hi;
      } else {
        const double dl = f - halves[hi - 1], dh = *it - f;
        want = dl < dh ? hi - 1 : dh < dl ? hi : ((hi - 1) % 2 == 0 ? hi - 1 : hi);
      }
    }
    ASSERT_EQ(got, want) << "float " << f;
  }
}

TEST(Bf16Conversion, EveryBf16RoundTripsAndRoundsToNearestEven) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = Bf16BitsToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16BitsToFloat(FloatToBf16Bits(f))));
    } else {
      EXPECT_EQ(FloatToBf16Bits(f), b);
    }
  }
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);       // tie -> even
  EXPECT_EQ(FloatToBf16Bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);   // tie -> even (up)
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(1.0f, -9)), 0x3f80);
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(1.5f, -8)), 0x3f81);
}

TEST(FastDivmod, MatchesIntegerDivision) {
  std::mt19937 rng(11);
  std::vector<uint32_t> divisors = {1, 2, 3, 5, 7, 49, 64, 641, 4096, 16384, 65535, 1u << 31,
                                    (1u << 31) - 1, (1u << 31) + 1, 0xffffffffu};
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + rng() % 100000);
  for (int i = 0; i < 50; ++i) divisors.push_back(1 + rng());
  for (uint32_t d : divisors) {
    const FastDivmod f(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d, 0xffffffffu, 0xfffffffeu,
                                0x80000000u};
    for (int i = 0; i < 2000; ++i) ns.push_back(rng());
    for (uint32_t n : ns) {
      uint32_t q, r;
      f.DivMod(n, &q, &r);
      ASSERT_EQ(q, n / d) << n << " / " << d;
      ASSERT_EQ(r, n % d) << n << " % " << d;
    }
  }
}

}  // namespace
}  // namespace hsbn::kernels

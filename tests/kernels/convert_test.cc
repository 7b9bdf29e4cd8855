// fp16 / bf16 conversions and the fast divider used by the kernels' index arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "convert.h"
#include "convert_cpu.h"
#include "fast_divmod.h"
#include "gtest/gtest.h"

#if defined(__SSE2__) || defined(__x86_64__)
#include <xmmintrin.h>
#define HSBN_TEST_MXCSR 1
#endif

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

// The CPU kernels' branchless / block conversions (convert_cpu.h) against the scalar ones of
// convert.h, bit for bit, for every converter set this CPU runs (baseline, and AVX2 + F16C).
std::vector<const BlockConverters*> ConverterSets() {
  std::vector<const BlockConverters*> sets = {&BaselineConverters()};
  if (Avx2Converters()) sets.push_back(Avx2Converters());
  return sets;
}

uint32_t Bits(float f) { return AsBits(f); }

// Every fp16 and every bf16 bit pattern, converted as one block starting at an odd offset (so
// the vector loops run unaligned and the scalar tails run too), and one at a time.
void CheckEvery16BitPattern(const BlockConverters& cv) {
  std::vector<uint16_t> in(65536 + 1);
  for (uint32_t h = 0; h < 65536; ++h) in[h + 1] = static_cast<uint16_t>(h);
  std::vector<float> half(65536 + 1), bf(65536 + 1);
  cv.half_to_float(in.data() + 1, 65536, half.data() + 1);
  cv.bf16_to_float(in.data() + 1, 65536, bf.data() + 1);
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    ASSERT_EQ(Bits(half[h + 1]), Bits(HalfBitsToFloat(b))) << cv.name << " half " << h;
    ASSERT_EQ(Bits(HalfBitsToFloatFast(b)), Bits(HalfBitsToFloat(b))) << "half " << h;
    ASSERT_EQ(Bits(bf[h + 1]), Bits(Bf16BitsToFloat(b))) << cv.name << " bf16 " << h;
    ASSERT_EQ(Bits(Bf16BitsToFloatFast(b)), Bits(Bf16BitsToFloat(b))) << "bf16 " << h;
  }
  // And back: every half / bf16 value as a float (NaNs with every payload included).
  std::vector<uint16_t> half_back(65536 + 1), bf_back(65536 + 1);
  cv.float_to_half(half.data() + 1, 65536, half_back.data() + 1);
  cv.float_to_bf16(bf.data() + 1, 65536, bf_back.data() + 1);
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(half_back[h + 1], FloatToHalfBits(half[h + 1])) << cv.name << " half " << h;
    ASSERT_EQ(bf_back[h + 1], FloatToBf16Bits(bf[h + 1])) << cv.name << " bf16 " << h;
  }
}

// fp32 -> fp16 / bf16 over a set of fp32 bit patterns: a block conversion at an odd offset and
// the inline function, both against convert.h.
void CheckFloatPatterns(const BlockConverters& cv, const std::vector<uint32_t>& patterns) {
  std::vector<float> in(patterns.size() + 1);
  for (size_t i = 0; i < patterns.size(); ++i) in[i + 1] = AsFloat(patterns[i]);
  std::vector<uint16_t> half(in.size()), bf(in.size());
  const int64_t n = static_cast<int64_t>(patterns.size());
  cv.float_to_half(in.data() + 1, n, half.data() + 1);
  cv.float_to_bf16(in.data() + 1, n, bf.data() + 1);
  for (size_t i = 0; i < patterns.size(); ++i) {
    const float f = in[i + 1];
    ASSERT_EQ(half[i + 1], FloatToHalfBits(f)) << cv.name << " float bits " << patterns[i];
    ASSERT_EQ(FloatToHalfBitsFast(f), FloatToHalfBits(f)) << "float bits " << patterns[i];
    ASSERT_EQ(bf[i + 1], FloatToBf16Bits(f)) << cv.name << " float bits " << patterns[i];
    ASSERT_EQ(FloatToBf16BitsFast(f), FloatToBf16Bits(f)) << "float bits " << patterns[i];
  }
}

// Every fp32 exponent and fp16-representable mantissa prefix with the dropped bits at and
// around the rounding tie (for both fp16's 13 dropped bits and bf16's 16), plus a stride
// through all 2^32 patterns. HSBN_EXHAUSTIVE_CONVERT=1 checks all 2^32 instead (minutes).
void CheckFloatSweep(const BlockConverters& cv) {
  std::vector<uint32_t> patterns;
  auto flush = [&] {
    CheckFloatPatterns(cv, patterns);
    patterns.clear();
  };
  if (const char* e = std::getenv("HSBN_EXHAUSTIVE_CONVERT"); e && *e == '1') {
    for (uint64_t base = 0; base < (1ull << 32); base += 1u << 20) {
      for (uint32_t i = 0; i < (1u << 20); ++i) patterns.push_back(static_cast<uint32_t>(base + i));
      flush();
      if (::testing::Test::HasFatalFailure()) return;
    }
    return;
  }
  for (uint32_t prefix = 0; prefix < (1u << 19); ++prefix) {
    for (uint32_t low : {0x0u, 0x1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu})
      patterns.push_back((prefix << 13) | low);
  }
  flush();
  if (::testing::Test::HasFatalFailure()) return;
  for (uint32_t prefix = 0; prefix < (1u << 16); ++prefix) {
    for (uint32_t low : {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      patterns.push_back((prefix << 16) | low);
  }
  flush();
  if (::testing::Test::HasFatalFailure()) return;
  for (uint64_t u = 0; u < (1ull << 32); u += 4093) patterns.push_back(static_cast<uint32_t>(u));
  flush();
}

TEST(CpuConversion, EveryHalfAndBf16PatternMatchesScalar) {
  for (const BlockConverters* cv : ConverterSets()) {
    SCOPED_TRACE(cv->name);
    CheckEvery16BitPattern(*cv);
  }
}

TEST(CpuConversion, FloatToHalfAndBf16MatchScalar) {
  for (const BlockConverters* cv : ConverterSets()) {
    SCOPED_TRACE(cv->name);
    CheckFloatSweep(*cv);
  }
}

TEST(CpuConversion, KnownValuesAndTies) {
  for (const BlockConverters* cv : ConverterSets()) {
    SCOPED_TRACE(cv->name);
    const std::vector<float> in = {
        1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11), 65519.0f, 65520.0f,
        -1e9f, std::ldexp(1.0f, -25), std::ldexp(1.5f, -25), std::ldexp(1023.5f, -24),
        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN(),
        AsFloat(0x7f800001u), AsFloat(0xffbfffffu), -0.0f, std::ldexp(1.0f, -149)};
    const std::vector<uint16_t> want = {0x3c00, 0x3c02, 0x7bff, 0x7c00, 0xfc00, 0x0000, 0x0001,
                                        0x0400, 0x7c00, 0xfe00, 0x7e00, 0xfe00, 0x8000, 0x0000};
    std::vector<uint16_t> got(in.size());
    cv->float_to_half(in.data(), static_cast<int64_t>(in.size()), got.data());
    for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(got[i], want[i]) << i;
  }
}

#if HSBN_TEST_MXCSR
// Trainers may run with flush-to-zero / denormals-are-zero (torch.set_flush_denormal(True)).
// The scalar conversions use only normal fp32 arithmetic, so the block versions must still
// match them under FTZ + DAZ.
TEST(CpuConversion, MatchesScalarUnderFlushToZero) {
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // FTZ | DAZ
  for (const BlockConverters* cv : ConverterSets()) {
    SCOPED_TRACE(cv->name);
    CheckEvery16BitPattern(*cv);
    std::vector<uint32_t> patterns;
    // fp32 denormals, then the range whose fp16 result is subnormal
    for (uint32_t u = 0; u < 0x00800000u; u += 61) patterns.push_back(u);
    for (uint32_t u = 0x33000000u; u < 0x38800000u; u += 61) patterns.push_back(u);
    for (size_t i = 0, n = patterns.size(); i < n; ++i)
      patterns.push_back(patterns[i] | 0x80000000u);
    CheckFloatPatterns(*cv, patterns);
  }
  _mm_setcsr(saved);
}
#endif

TEST(CpuConversion, ReportsTheVersionInUse) {
  std::printf("fp16/bf16 block conversions in use: %s\n", Converters().name);
  EXPECT_TRUE(&Converters() == &BaselineConverters() || &Converters() == Avx2Converters());
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

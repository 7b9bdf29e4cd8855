// round_merge.h's checks, which both transports run on every contribution: counting NaN and
// Inf (every bit pattern, every position against the 4-wide unrolling, unaligned input), and
// the first value a member may not send.
#include "round_merge.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsbn::wire {
namespace {

TEST(RoundMerge, CountNonFiniteFindsEveryNaNAndInfAtEveryPosition) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  uint64_t payload_nan_bits = 0x7ff0000000000001ull;  // a signalling NaN with a payload
  double snan;
  std::memcpy(&snan, &payload_nan_bits, sizeof snan);
  const double specials[] = {nan, -nan, inf, -inf, snan};
  const double finite[] = {0.0, -0.0, 1.0, -1e308, std::numeric_limits<double>::max(),
                           std::numeric_limits<double>::denorm_min(), 5e-324};
  for (int n = 0; n <= 11; ++n) {
    for (int at = 0; at < n; ++at) {
      for (double s : specials) {
        std::vector<double> v(size_t(n), 0.5);
        v[size_t(at)] = s;
        // Unaligned: the values one byte into a buffer.
        std::vector<char> raw(size_t(n) * 8 + 1);
        std::memcpy(raw.data() + 1, v.data(), size_t(n) * 8);
        EXPECT_EQ(CountNonFinite(raw.data() + 1, n), 1) << "n=" << n << " at=" << at;
      }
    }
    std::vector<double> all(size_t(n), inf);
    EXPECT_EQ(CountNonFinite(reinterpret_cast<const char*>(all.data()), n), n);
  }
  std::vector<double> fin(std::begin(finite), std::end(finite));
  EXPECT_EQ(CountNonFinite(reinterpret_cast<const char*>(fin.data()), int64_t(fin.size())), 0);
}

TEST(RoundMerge, CheckContributionValuesNamesTheFirstBadValue) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::string field, what;
  // Forward, not strict: NaN is data, a negative m2 is not.
  std::vector<double> v = {1.0, nan, 2.0, 3.0};  // mean[0..1], m2[0..1]
  EXPECT_TRUE(CheckContributionValues(reinterpret_cast<const char*>(v.data()), 2, true, false,
                                      &field, &what));
  v[3] = -1.0;
  EXPECT_FALSE(CheckContributionValues(reinterpret_cast<const char*>(v.data()), 2, true, false,
                                       &field, &what));
  EXPECT_EQ(field, "m2[1]");
  EXPECT_NE(what.find("never negative"), std::string::npos) << what;
  // Strict: the NaN comes first, whatever follows.
  EXPECT_FALSE(CheckContributionValues(reinterpret_cast<const char*>(v.data()), 2, true, true,
                                       &field, &what));
  EXPECT_EQ(field, "mean[1]");
  EXPECT_NE(what.find("HSBN_STRICT_FINITE"), std::string::npos) << what;
  // Backward: negative sums are fine; strict names the backward fields.
  std::vector<double> g = {-1.0, -2.0, -3.0, -std::numeric_limits<double>::infinity()};
  EXPECT_TRUE(CheckContributionValues(reinterpret_cast<const char*>(g.data()), 2, false, false,
                                      &field, &what));
  EXPECT_FALSE(CheckContributionValues(reinterpret_cast<const char*>(g.data()), 2, false, true,
                                       &field, &what));
  EXPECT_EQ(field, "sum_dy_xmu[1]");
}

}  // namespace
}  // namespace hsbn::wire

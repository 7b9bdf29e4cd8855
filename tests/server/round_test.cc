// The round core (round.h): its checks, which both transports run on every contribution: counting NaN and
// Inf (every bit pattern, every position against the 4-wide unrolling, unaligned input), and
// the first value a member may not send.
#include "round.h"

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "wire.h"

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

// The scan before the checks' per-value loops: for every special value at every position (against
// the 4-wide unrolling, unaligned), each mode finds exactly what the per-value test finds, and
// CheckContributionValues still names that value.
TEST(RoundMerge, AnyNonFiniteAndAnyNegativeAgreeWithThePerValueTestAtEveryPosition) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const double values[] = {nan, -nan, inf, -inf, -1.0, -5e-324, -0.0, 0.0, 2.0,
                           std::numeric_limits<double>::max()};
  for (int n = 1; n <= 11; ++n) {
    for (int at = 0; at < n; ++at) {
      for (double x : values) {
        std::vector<double> v(size_t(n), 0.5);
        v[size_t(at)] = x;
        std::vector<char> raw(size_t(n) * 8 + 3);
        std::memcpy(raw.data() + 3, v.data(), size_t(n) * 8);
        const char* p = raw.data() + 3;
        const bool nonfinite = !std::isfinite(x), negative = x < 0;
        EXPECT_EQ(AnyNonFinite(p, n), nonfinite) << n << " " << at << " " << x;
        EXPECT_EQ(AnyNegative(p, n), negative) << n << " " << at << " " << x;
        if (n % 2 == 0) {
          // n / 2 channels: a forward round's m2 half is checked for negatives, the strict
          // mode for NaN and Inf anywhere.
          const int64_t c = n / 2;
          std::string field, what;
          const bool bad_m2 = at >= c && negative;
          EXPECT_EQ(CheckContributionValues(p, c, true, false, &field, &what), !bad_m2);
          if (bad_m2) {
            EXPECT_EQ(field, absl::StrCat("m2[", at - c, "]"));
          }
          EXPECT_EQ(CheckContributionValues(p, c, false, true, &field, &what), !nonfinite);
          if (nonfinite) {
            EXPECT_EQ(field, at < c ? absl::StrCat("sum_dy[", at, "]")
                                    : absl::StrCat("sum_dy_xmu[", at - c, "]"));
          }
        }
      }
    }
  }
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

TEST(RoundCore, MembersAreNamedAsEveryMessageNamesThem) {
  MemberNames ranks;
  ranks.node_rank = 1;
  ranks.local_world_size = 4;
  EXPECT_EQ(ranks(2), "rank 6 (node 1, local rank 2)");
  EXPECT_EQ(ranks.Rank(2), 6);
  MemberNames nodes;
  nodes.nodes = true;
  nodes.local_world_size = 4;
  EXPECT_EQ(nodes(2), "node 2 (ranks 8-11)");
  EXPECT_EQ(nodes.Rank(2), -1);
}

std::string Who() { return "rank 1 (node 0, local rank 1)"; }
std::string Round() { return "op 3, seq 7, forward"; }

TEST(RoundCore, CheckFieldsRefusesEachFieldNamingIt) {
  RoundRules rules;
  rules.max_channels = 64;
  ContributionView c;
  c.scope = v1::SCOPE_NODE;
  c.channels = 8;
  c.count = 5;
  EXPECT_TRUE(CheckFields(c, rules, Who, Round).ok());
  auto refused = [&](ContributionView bad, const RoundRules& r) {
    absl::Status s = CheckFields(bad, r, Who, Round);
    return std::make_pair(s.code(), std::string(s.message()));
  };
  ContributionView bad = c;
  bad.scope = 9;
  auto [code, text] = refused(bad, rules);
  EXPECT_EQ(code, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(text, "rank 1 (node 0, local rank 1) sent an invalid contribution to round op 3, "
                  "seq 7, forward: field 'scope' is 9; expected node, global, shadow, group, "
                  "renorm or lagged");
  bad.scope = v1::SCOPE_GROUP;  // the segment carries no group rounds
  RoundRules segment = rules;
  segment.group_allowed = false;
  segment.transport_cap = 16;
  EXPECT_NE(refused(bad, segment).second.find("expected node, global, shadow, renorm or lagged"),
            std::string::npos);
  bad.scope = v1::SCOPE_RENORM;  // a forward scope only
  RoundRules backward = rules;
  backward.forward = false;
  EXPECT_NE(refused(bad, backward).second.find("backward round is node scope"),
            std::string::npos);
  EXPECT_EQ(refused(bad, rules).first, absl::StatusCode::kOk);
  bad = c;
  bad.channels = 0;
  EXPECT_NE(refused(bad, rules).second.find("field 'channels' is 0"), std::string::npos);
  bad.channels = 65;  // over --max-channels
  EXPECT_EQ(refused(bad, rules).first, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused(bad, rules).second.find("--max-channels=64"), std::string::npos);
  bad.channels = 17;  // within the limit, over the segment's cap
  segment.max_channels = 16;
  EXPECT_EQ(refused(bad, segment).first, absl::StatusCode::kResourceExhausted);
  segment.max_channels = 64;
  EXPECT_EQ(refused(bad, segment).first, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused(bad, segment).second.find("the node's segment carries 1 to 16"),
            std::string::npos);
  bad = c;
  bad.count = -1;
  EXPECT_NE(refused(bad, rules).second.find("field 'count' is -1; counts are >= 0"),
            std::string::npos);
}

TEST(RoundCore, NamesAreBuiltOnlyForAnError) {
  int built = 0;
  auto who = [&] { ++built; return Who(); };
  auto round = [&] { ++built; return Round(); };
  RoundRules rules;
  rules.max_channels = 8;
  std::vector<double> v = {1.0, 2.0};
  ContributionView c{v1::SCOPE_GLOBAL, 1, 3, reinterpret_cast<const char*>(v.data())};
  EXPECT_TRUE(CheckFields(c, rules, who, round).ok());
  EXPECT_TRUE(CheckSameRound(c, 1, v1::SCOPE_GLOBAL, who, who, round).ok());
  EXPECT_TRUE(CheckValues(c, rules, who, round).ok());
  EXPECT_EQ(built, 0);
  absl::Status s = CheckSameRound(c, 2, v1::SCOPE_GLOBAL, who, [] { return std::string("rank 0"); },
                                  round);
  EXPECT_EQ(s.message(), "rank 1 (node 0, local rank 1) sent an invalid contribution to round op "
                         "3, seq 7, forward: field 'channels' is 1 but rank 0 sent 2; every "
                         "worker must run the same model");
  s = CheckSameRound(c, 1, v1::SCOPE_NODE, who, [] { return std::string("rank 0"); }, round);
  EXPECT_NE(s.message().find("field 'scope' is global but rank 0 sent node"), std::string::npos);
}

TEST(RoundCore, ReduceRoundRefusesCountsThatOverflowAndNonFiniteMergesWhenStrict) {
  const double big = std::numeric_limits<double>::max();
  std::vector<int64_t> counts = {std::numeric_limits<int64_t>::max(), 1};
  std::vector<std::vector<double>> a = {{1.0}, {2.0}}, b = {{0.0}, {0.0}};
  double ra, rb;
  int64_t total = -1;
  ReduceFault fault;
  auto get = [&](int i, const double** ai, const double** bi) {
    *ai = a[size_t(i)].data();
    *bi = b[size_t(i)].data();
    return counts[size_t(i)];
  };
  auto count_of = [&](int i) { return counts[size_t(i)]; };
  auto name = [](int i) { return absl::StrCat("rank ", i); };
  auto ref = [] { return RoundRef{"op 1, seq 0, forward", "job"}; };
  absl::Status s = ReduceRound(true, 1, 2, count_of, get, name, false, ref, &ra, &rb, &total,
                               &fault);
  EXPECT_EQ(fault, ReduceFault::kCountOverflow);
  EXPECT_NE(s.message().find("overflow int64 when summed (rank 0 count=9223372036854775807, "
                             "rank 1 count=1)"),
            std::string::npos)
      << s;
  // Backward sums of finite values that overflow: data unless strict.
  counts = {1, 1};
  a = {{big}, {big}};
  s = ReduceRound(false, 1, 2, count_of, get, name, false, ref, &ra, &rb, &total, &fault);
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(total, 2);
  EXPECT_TRUE(std::isinf(ra));
  s = ReduceRound(false, 1, 2, count_of, get, name, true, ref, &ra, &rb, &total, &fault);
  EXPECT_EQ(fault, ReduceFault::kMergedNonFinite);
  EXPECT_NE(s.message().find("round op 1, seq 0, forward of job 'job': the merged statistics "
                             "overflow"),
            std::string::npos);
}

TEST(RoundCore, DeadlineTextsAndTheForwardedRoundsBackstop) {
  const RoundRef ref{"op 1, seq 2, backward", "j"};
  absl::Status s = TimedOut(ref, std::chrono::milliseconds(500), {"rank 1 (node 0, local rank 1)"});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("round op 1, seq 2, backward of job 'j' timed out after 500 ms "
                             "waiting for rank 1 (node 0, local rank 1). Those processes"),
            std::string::npos);
  s = RootSilent(ref, std::chrono::milliseconds(700));
  EXPECT_NE(s.message().find("the root aggregator did not answer within 700 ms"),
            std::string::npos);
  s = MemberGone(ref, "node 1 (ranks 2-3)", Gone::kLeft);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("cannot complete: node 1 (ranks 2-3) left the job; the job cannot "
                             "make progress"),
            std::string::npos);
  // The backstop: the round timeout plus a tenth of it, at least a second.
  EXPECT_EQ(ForwardedBackstop(std::chrono::milliseconds(30000)).count(), 33000);
  EXPECT_EQ(ForwardedBackstop(std::chrono::milliseconds(500)).count(), 1500);
}

}  // namespace
}  // namespace hsbn::wire

// The scope table is the wire's whole enum but for UNSPECIFIED and the reserved auto (5):
// a scope added to the .proto and not to wire::kScopes fails here, not as "unknown-scope" in
// a user's error message or an "unknown" metrics label.
TEST(ScopeTable, NamesEveryWireScopeOnceAndParsesItsOwnNames) {
  const auto* e = hsbn::v1::Scope_descriptor();
  std::vector<std::string> named;
  for (int i = 0; i < e->value_count(); ++i) {
    const auto scope = hsbn::v1::Scope(e->value(i)->number());
    if (scope == hsbn::v1::SCOPE_UNSPECIFIED) {
      EXPECT_STREQ(hsbn::wire::ScopeName(scope), "unknown-scope");
      continue;
    }
    const std::string name = hsbn::wire::ScopeName(scope);
    EXPECT_NE(name, "unknown-scope") << e->value(i)->name();
    EXPECT_EQ(hsbn::wire::ParseScope(name), scope) << name;
    named.push_back(name);
  }
  EXPECT_EQ(named, (std::vector<std::string>{"node", "global", "shadow", "group", "renorm",
                                             "lagged"}));
  size_t on_wire = 0;
  for (const hsbn::wire::ScopeEntry& e : hsbn::wire::kScopes) {
    on_wire += e.scope != hsbn::v1::SCOPE_UNSPECIFIED;
  }
  EXPECT_EQ(on_wire, named.size());  // every other row (auto) never goes on the wire
  EXPECT_STREQ(hsbn::wire::ScopeName(hsbn::v1::Scope(5), "unknown"), "unknown");
  EXPECT_EQ(hsbn::wire::ParseScope("auto"), hsbn::v1::SCOPE_UNSPECIFIED);
  EXPECT_EQ(hsbn::wire::ParseScope("Global"), hsbn::v1::SCOPE_UNSPECIFIED);
}

// Protocol semantics of one job at one aggregator (server/job.h), without sockets.
#include "job.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/moments.h"
#include "wire.h"

namespace hsbn::server {
namespace {

using std::chrono::milliseconds;

// Test sessions: small numbers; S(0) is "no session".
SessionId S(uint64_t n) { return SessionId{0, n}; }

class RecordingSink : public ResultSink {
 public:
  void Send(v1::Result r) override { results.push_back(std::move(r)); }
  std::vector<v1::Result> results;
};

struct Fixture {
  explicit Fixture(int lws, int nodes = 1, int node = 0, bool parent = false,
                   v1::MemberKind kind = v1::MEMBER_KIND_WORKER, JobLimits limits = {},
                   bool strict = false, int group_nodes = 0, int member_nodes = 0,
                   int group = -1) {
    layout.member_kind = kind;
    layout.member_nodes = member_nodes;
    layout.group = group;
    layout.strict_finite = strict;
    layout.group_nodes = group_nodes;
    layout.local_world_size = lws;
    layout.num_nodes = nodes;
    layout.world_size = lws * nodes;
    layout.node_rank = kind == v1::MEMBER_KIND_WORKER ? node : -1;
    limits.has_parent = parent;
    job = std::make_unique<Job>("job", layout, limits);
    for (int i = 0; i < layout.expected_members(); ++i) {
      sinks.push_back(std::make_shared<RecordingSink>());
      Actions a;
      EXPECT_TRUE(job->AddMember(i, S(100 + i), S(0), Clock::now(), &a).ok());
      EXPECT_TRUE(job->Attach(i, S(100 + i), sinks.back(), Clock::now()).ok());
    }
  }
  // Contributes and delivers the results to the recording sinks, like the service does.
  Actions Send(int member, const v1::Contribution& c, Clock::time_point now = Clock::now()) {
    Actions a;
    job->Contribute(member, S(100 + member), c, now, &a);
    Deliver(a);
    return a;
  }
  void Deliver(const Actions& a) {
    for (const auto& d : a.deliveries) {
      for (const auto& [session, sink] : d.to) {
        v1::Result r = *d.result;
        r.set_session(session.Bytes());
        sink->Send(r);
      }
    }
  }
  JobLayout layout;
  std::unique_ptr<Job> job;
  std::vector<std::shared_ptr<RecordingSink>> sinks;
};

v1::Contribution Fwd(uint32_t op, uint64_t seq, int64_t count, std::vector<double> mean,
                     std::vector<double> m2, v1::Scope scope = v1::SCOPE_NODE) {
  v1::Contribution c;
  c.set_op(op);
  c.set_seq(seq);
  c.set_phase(v1::PHASE_FORWARD);
  c.set_scope(scope);
  c.set_channels(uint32_t(mean.size()));
  c.set_count(count);
  wire::PackPayload(mean.data(), m2.data(), int64_t(mean.size()), c.mutable_data());
  return c;
}

std::vector<double> A(const v1::Result& r) {
  std::vector<double> a(r.channels()), b(r.channels());
  wire::UnpackPayload(r.data(), r.channels(), a.data(), b.data());
  return a;
}
std::vector<double> B(const v1::Result& r) {
  std::vector<double> a(r.channels()), b(r.channels());
  wire::UnpackPayload(r.data(), r.channels(), a.data(), b.data());
  return b;
}

TEST(Job, NodeRoundMergesInMemberOrderAndAnswersEveryMemberTheSameBits) {
  Fixture f(3);
  // Worker data: {1,2}, {}, {4,5,6}: mean 3.6, m2 = sum (x-3.6)^2 = 17.2
  f.Send(2, Fwd(0, 0, 3, {5.0}, {2.0}));
  f.Send(0, Fwd(0, 0, 2, {1.5}, {0.5}));
  EXPECT_TRUE(f.sinks[0]->results.empty());
  f.Send(1, Fwd(0, 0, 0, {0.0}, {0.0}));  // an empty batch still takes part
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    EXPECT_EQ(s->results[0].code(), 0);
    EXPECT_EQ(s->results[0].count(), 5);
    EXPECT_NEAR(A(s->results[0])[0], 3.6, 1e-15);
    EXPECT_NEAR(B(s->results[0])[0], 17.2, 1e-13);
    EXPECT_EQ(s->results[0].data(), f.sinks[0]->results[0].data());
    EXPECT_EQ(s->results[0].scope(), v1::SCOPE_NODE);
  }
}

TEST(Job, BackwardRoundsSum) {
  Fixture f(2);
  v1::Contribution c = Fwd(4, 9, 3, {1.0, 2.0}, {-3.0, 0.5});
  c.set_phase(v1::PHASE_BACKWARD);  // negative sums are fine in backward
  f.Send(0, c);
  c = Fwd(4, 9, 1, {0.25, -2.0}, {1.0, 0.5});
  c.set_phase(v1::PHASE_BACKWARD);
  f.Send(1, c);
  ASSERT_EQ(f.sinks[1]->results.size(), 1u);
  const auto& r = f.sinks[1]->results[0];
  EXPECT_EQ(r.count(), 4);
  EXPECT_EQ(A(r), (std::vector<double>{1.25, 0.0}));
  EXPECT_EQ(B(r), (std::vector<double>{-2.0, 1.0}));
}

TEST(Job, RoundsAreMatchedByKeyNotByArrivalOrder) {
  Fixture f(2);
  f.Send(0, Fwd(1, 0, 1, {1.0}, {0.0}));
  f.Send(1, Fwd(2, 0, 1, {10.0}, {0.0}));
  f.Send(1, Fwd(1, 0, 1, {3.0}, {0.0}));
  f.Send(0, Fwd(2, 0, 1, {20.0}, {0.0}));
  ASSERT_EQ(f.sinks[0]->results.size(), 2u);
  EXPECT_EQ(f.sinks[0]->results[0].op(), 1u);
  EXPECT_EQ(A(f.sinks[0]->results[0])[0], 2.0);
  EXPECT_EQ(f.sinks[0]->results[1].op(), 2u);
  EXPECT_EQ(A(f.sinks[0]->results[1])[0], 15.0);
}

TEST(Job, IdenticalRepeatIsIgnoredAndRepeatAfterCompletionGetsTheResultAgain) {
  Fixture f(2);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}));
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}));  // retransmission
  EXPECT_TRUE(f.sinks[0]->results.empty());
  f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}));  // after completion: same answer again
  ASSERT_EQ(f.sinks[0]->results.size(), 2u);
  EXPECT_EQ(f.sinks[0]->results[1].data(), f.sinks[0]->results[0].data());
}

TEST(Job, ReusedRoundKeyWithNewDataIsRefusedNotAnsweredWithTheOldResult) {
  Fixture f(2);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}));
  f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  f.Send(0, Fwd(0, 0, 1, {7.0}, {0.0}));  // same key, new data: a reused key
  ASSERT_EQ(f.sinks[0]->results.size(), 2u);
  EXPECT_EQ(f.sinks[0]->results[1].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(f.sinks[0]->results[1].message().find("must not be reused"), std::string::npos)
      << f.sinks[0]->results[1].message();
  EXPECT_NE(f.sinks[0]->results[1].message().find("rank 0"), std::string::npos);
  f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}));  // a true retransmission still gets the result
  ASSERT_EQ(f.sinks[1]->results.size(), 2u);
  EXPECT_EQ(f.sinks[1]->results[1].code(), 0);
  EXPECT_EQ(A(f.sinks[1]->results[1])[0], 2.0);
}

struct BadCase {
  const char* name;
  v1::Contribution contribution;
  int code;
  const char* field;
};

TEST(Job, BadContributionsFailTheRoundForEveryMemberNamingRankAndField) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<BadCase> cases = {
      {"-inf m2", Fwd(0, 0, 2, {0, 0, 0, 0}, {1, -inf, 1, 1}), 3, "m2[1]"},
      {"negative count", Fwd(0, 0, -1, {0, 0, 0, 0}, {1, 1, 1, 1}), 3, "'count'"},
      {"negative m2", Fwd(0, 0, 2, {0, 0, 0, 0}, {1, -1, 1, 1}), 3, "m2[1]"},
      {"channel mismatch", Fwd(0, 0, 2, {0, 0, 0}, {1, 1, 1}), 3, "'channels'"},
      {"scope mismatch", Fwd(0, 0, 2, {0, 0, 0, 0}, {1, 1, 1, 1}, v1::SCOPE_SHADOW), 3,
       "'scope'"},
      {"conflicting duplicate", Fwd(0, 0, 2, {9, 0, 0, 0}, {1, 1, 1, 1}), 3, "duplicate"},
  };
  for (const BadCase& bc : cases) {
    SCOPED_TRACE(bc.name);
    Fixture f(3, 2, 1);  // node 1 of 2: ranks 3, 4, 5
    const bool duplicate = std::string(bc.name) == "conflicting duplicate";
    f.Send(0, Fwd(0, 0, 2, {0, 0, 0, 0}, {1, 1, 1, 1}));
    if (duplicate) {
      f.Send(1, Fwd(0, 0, 2, {0, 0, 0, 0}, {1, 1, 1, 1}));
      f.Send(1, bc.contribution);
    } else {
      f.Send(1, bc.contribution);
    }
    ASSERT_EQ(f.sinks[0]->results.size(), 1u);
    ASSERT_EQ(f.sinks[1]->results.size(), 1u);
    const v1::Result& r = f.sinks[0]->results[0];
    EXPECT_EQ(r.code(), bc.code);
    EXPECT_NE(r.message().find("rank 4"), std::string::npos) << r.message();
    EXPECT_NE(r.message().find(bc.field), std::string::npos) << r.message();
    EXPECT_EQ(f.sinks[1]->results[0].code(), bc.code);
    // A late contribution to the failed round gets the same error.
    f.Send(2, Fwd(0, 0, 2, {0, 0, 0, 0}, {1, 1, 1, 1}));
    ASSERT_EQ(f.sinks[2]->results.size(), 1u);
    EXPECT_EQ(f.sinks[2]->results[0].code(), bc.code);
    EXPECT_EQ(f.sinks[2]->results[0].message(), r.message());
    // The job's next round works.
    for (int m = 0; m < 3; ++m) f.Send(m, Fwd(0, 1, 1, {double(m)}, {0.0}));
    EXPECT_EQ(f.sinks[0]->results.back().code(), 0);
    EXPECT_EQ(A(f.sinks[0]->results.back())[0], 1.0);
  }
}

TEST(Job, TooManyChannelsIsResourceExhausted) {
  JobLimits limits;
  limits.max_channels = 4;
  Fixture f(2, 1, 0, false, v1::MEMBER_KIND_WORKER, limits);
  f.Send(1, Fwd(0, 0, 1, {0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}));
  ASSERT_EQ(f.sinks[1]->results.size(), 1u);
  EXPECT_EQ(f.sinks[1]->results[0].code(), int(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(f.sinks[1]->results[0].message().find("rank 1"), std::string::npos);
  EXPECT_NE(f.sinks[1]->results[0].message().find("--max-channels=4"), std::string::npos);
}

TEST(Job, TooManyOpenRoundsIsResourceExhausted) {
  JobLimits limits;
  limits.max_open_rounds = 2;
  Fixture f(2, 1, 0, false, v1::MEMBER_KIND_WORKER, limits);
  f.Send(0, Fwd(0, 0, 1, {0}, {0}));
  f.Send(0, Fwd(1, 0, 1, {0}, {0}));
  f.Send(0, Fwd(2, 0, 1, {0}, {0}));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].op(), 2u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kResourceExhausted));
  f.Send(1, Fwd(0, 0, 1, {2}, {0}));  // the open ones still complete
  EXPECT_EQ(f.sinks[1]->results.back().code(), 0);
}

TEST(Job, DeadlineFailsTheRoundNamingTheMissingRanks) {
  JobLimits limits;
  limits.round_timeout = milliseconds(1000);
  Fixture f(4, 2, 1, false, v1::MEMBER_KIND_WORKER, limits);
  const auto t0 = Clock::now();
  f.Send(0, Fwd(3, 7, 1, {0}, {0}), t0);
  f.Send(2, Fwd(3, 7, 1, {0}, {0}), t0);
  Actions early;
  f.job->Expire(t0 + milliseconds(999), &early);
  EXPECT_TRUE(early.deliveries.empty());
  Actions late;
  f.job->Expire(t0 + milliseconds(1000), &late);
  f.Deliver(late);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  const auto& r = f.sinks[0]->results[0];
  EXPECT_EQ(r.code(), int(absl::StatusCode::kDeadlineExceeded));
  EXPECT_NE(r.message().find("rank 5"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("rank 7"), std::string::npos) << r.message();
  EXPECT_EQ(r.message().find("rank 4 "), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("op 3, seq 7, forward"), std::string::npos) << r.message();
  // The straggler's contribution, late, gets the same error.
  f.Send(1, Fwd(3, 7, 1, {0}, {0}));
  EXPECT_EQ(f.sinks[1]->results.back().code(), int(absl::StatusCode::kDeadlineExceeded));
}

TEST(Job, MemberWhoseStreamBreaksFailsItsOpenRoundsAtOnce) {
  Fixture f(3);
  f.Send(0, Fwd(0, 0, 1, {0}, {0}));
  f.Send(2, Fwd(1, 0, 1, {0}, {0}));
  f.Send(1, Fwd(1, 0, 1, {0}, {0}));  // rank 1 contributed to op 1, not to op 0
  Actions a;
  f.job->MemberGone(2, S(102), /*left=*/false, Clock::now(), &a);
  f.Deliver(a);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].op(), 0u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kUnavailable));
  EXPECT_NE(f.sinks[0]->results[0].message().find("rank 2"), std::string::npos);
  EXPECT_TRUE(f.sinks[1]->results.empty());  // op 1 can still complete without rank 2? no:
  // op 1 has rank 2's contribution already; it waits for rank 0.
  f.Send(0, Fwd(1, 0, 1, {0}, {0}));
  EXPECT_EQ(f.sinks[1]->results.back().code(), 0);
  // A new round cannot complete without rank 2: it fails at once.
  f.Send(1, Fwd(5, 0, 1, {0}, {0}));
  EXPECT_EQ(f.sinks[1]->results.back().code(), int(absl::StatusCode::kUnavailable));
  EXPECT_NE(f.sinks[1]->results.back().message().find("rank 2"), std::string::npos);
  // After it rejoins, rounds work again.
  Actions j;
  ASSERT_TRUE(f.job->AddMember(2, S(202), S(102), Clock::now(), &j).ok());
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(f.job->Attach(2, S(202), sink, Clock::now()).ok());
  Actions c;
  for (int m = 0; m < 3; ++m) {
    Actions x;
    f.job->Contribute(m, S(m == 2 ? 202 : 100 + m), Fwd(6, 0, 1, {double(m)}, {0}), Clock::now(),
                      &x);
    f.Deliver(x);
  }
  EXPECT_EQ(f.sinks[0]->results.back().code(), 0);
}

// A stopping aggregator fails every open round with one status, and every later contribution
// gets it too: no round opens again in the process, so no rank can wait in one (issue 26).
TEST(Job, AfterFailAllEveryContributionGetsTheSameStatusAndNoRoundOpens) {
  Fixture f(2);
  f.Send(0, Fwd(0, 0, 1, {0}, {0}));
  const absl::Status closing = absl::UnavailableError("sidecar s is shutting down (SIGTERM)");
  Actions a;
  f.job->FailAll(closing, &a);
  f.Deliver(a);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kUnavailable));
  EXPECT_EQ(f.sinks[0]->results[0].message(), closing.message());
  // Rank 1 was between rounds: its next contribution, to a new round, is answered at once.
  Actions b = f.Send(1, Fwd(1, 0, 1, {0}, {0}));
  ASSERT_EQ(f.sinks[1]->results.size(), 1u);
  EXPECT_EQ(f.sinks[1]->results[0].op(), 1u);
  EXPECT_EQ(f.sinks[1]->results[0].code(), int(absl::StatusCode::kUnavailable));
  EXPECT_EQ(f.sinks[1]->results[0].message(), closing.message());
  EXPECT_TRUE(b.forwards.empty());
  v1::JobStatus status;
  f.job->FillStatus(&status);
  EXPECT_EQ(status.open_rounds(), 0);
}

TEST(Job, SecondLiveSessionForTheSameRankIsRefused) {
  Fixture f(2);
  Actions a;
  absl::Status s = f.job->AddMember(1, S(555), S(0), Clock::now(), &a);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("rank 1"), std::string::npos);
  EXPECT_TRUE(f.job->AddMember(1, S(556), S(101), Clock::now(), &a).ok());  // a reconnect names its old session
  // The replaced session can no longer contribute; nothing is touched.
  Actions c;
  EXPECT_FALSE(f.job->Contribute(1, S(101), Fwd(0, 0, 1, {1.0}, {0.0}), Clock::now(), &c));
  EXPECT_TRUE(c.deliveries.empty());
  v1::JobStatus status;
  f.job->FillStatus(&status);
  EXPECT_EQ(status.open_rounds(), 0);
}

TEST(Job, GlobalScopeIsForwardedAndAnsweredWithTheParentsResult) {
  Fixture f(2, 2, 0, /*parent=*/true);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GLOBAL));
  Actions a = f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].count, 2);
  EXPECT_TRUE(f.sinks[0]->results.empty());  // waits for the root
  v1::Result root;
  root.set_op(0);
  root.set_phase(v1::PHASE_FORWARD);
  root.set_channels(1);
  root.set_count(4);
  root.set_scope(v1::SCOPE_GLOBAL);
  std::vector<double> m = {5.0}, m2 = {20.0};
  wire::PackPayload(m.data(), m2.data(), 1, root.mutable_data());
  Actions b;
  f.job->ParentResult(root, &b);
  f.Deliver(b);
  ASSERT_EQ(f.sinks[1]->results.size(), 1u);
  EXPECT_EQ(f.sinks[1]->results[0].count(), 4);
  EXPECT_EQ(A(f.sinks[1]->results[0])[0], 5.0);
  EXPECT_EQ(f.sinks[1]->results[0].scope(), v1::SCOPE_GLOBAL);
}

TEST(Job, ParentResultIsRelayedWithTheRoundsOwnScopeWhateverTheRootSays) {
  // Found by tests/fuzz/fuzz_job: a root that answers with a scope outside the protocol's,
  // and (later) one that marks its answer late, which a forwarded round's answer never is.
  Fixture f(1, 2, 0, /*parent=*/true);
  Actions a = f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(a.forwards.size(), 1u);
  v1::Result root;
  root.set_phase(v1::PHASE_FORWARD);
  root.set_channels(1);
  root.set_count(2);
  root.set_scope(v1::Scope(-7));
  root.set_late(true);
  *root.mutable_data() = *a.forwards[0].data;
  Actions b;
  f.job->ParentResult(root, &b);
  f.Deliver(b);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), 0);
  EXPECT_EQ(f.sinks[0]->results[0].scope(), v1::SCOPE_GLOBAL);
  EXPECT_EQ(f.sinks[0]->results[0].count(), 2);
  EXPECT_FALSE(f.sinks[0]->results[0].late());
}

TEST(Job, LosingTheParentFailsForwardedRoundsAtOnce) {
  Fixture f(1, 2, 0, /*parent=*/true);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GLOBAL));
  Actions a;
  f.job->ParentLost(absl::UnavailableError("root gone"), &a);
  f.Deliver(a);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kUnavailable));
}

TEST(Job, MultiNodeGlobalScopeWithoutParentIsAFailedPrecondition) {
  Fixture f(1, 2, 0, /*parent=*/false);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(f.sinks[0]->results[0].message().find("--upstream"), std::string::npos);
}

TEST(Job, SingleNodeGlobalScopeIsAnsweredLocally) {
  Fixture f(2, 1, 0, /*parent=*/false);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GLOBAL));
  f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].scope(), v1::SCOPE_GLOBAL);
  EXPECT_EQ(A(f.sinks[0]->results[0])[0], 2.0);
}

TEST(Job, ShadowAnswersWithNodeStatisticsAtOnceAndForwardsThePartial) {
  Fixture f(2, 2, 1, /*parent=*/true);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_SHADOW));
  Actions a = f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}, v1::SCOPE_SHADOW));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].scope(), v1::SCOPE_NODE);
  EXPECT_EQ(A(f.sinks[0]->results[0])[0], 2.0);
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_SHADOW);
}

TEST(Job, RootRecordsHowFarEachNodeIsFromGlobalInShadowRounds) {
  Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  // node 0: mean 0, var 1 (count 10); node 1: mean 2, var 1 (count 10)
  // global: mean 1, var = 1 + 1 = 2
  root.Send(0, Fwd(0, 0, 10, {0.0}, {10.0}, v1::SCOPE_SHADOW));
  root.Send(1, Fwd(0, 0, 10, {2.0}, {10.0}, v1::SCOPE_SHADOW));
  EXPECT_TRUE(root.sinks[0]->results.empty());  // nodes do not wait for shadow rounds
  v1::JobStatus status;
  root.job->FillStatus(&status);
  ASSERT_EQ(status.divergence_size(), 2);
  for (const auto& d : status.divergence()) {
    EXPECT_EQ(d.rounds(), 1);
    EXPECT_NEAR(d.mean_shift_avg(), 1.0 / std::sqrt(2.0 + 1e-5), 1e-12);
    EXPECT_NEAR(d.var_ratio_avg(), (1.0 + 1e-5) / (2.0 + 1e-5), 1e-12);
  }
}

// --- renorm scope --------------------------------------------------------------------------------

// The late global results a sink received (Result.late), in order.
std::vector<v1::Result> Late(const RecordingSink& s) {
  std::vector<v1::Result> out;
  for (const auto& r : s.results) {
    if (r.late()) out.push_back(r);
  }
  return out;
}

TEST(Job, RenormAnswersNodeAtOnceThenRelaysTheRootsGlobalResultToEveryWorker) {
  Fixture f(2, 2, 1, /*parent=*/true);
  f.Send(0, Fwd(3, 7, 1, {1.0}, {0.0}, v1::SCOPE_RENORM));
  Actions a = f.Send(1, Fwd(3, 7, 1, {3.0}, {0.0}, v1::SCOPE_RENORM));
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    EXPECT_FALSE(s->results[0].late());
    EXPECT_EQ(s->results[0].scope(), v1::SCOPE_NODE);
    EXPECT_EQ(A(s->results[0])[0], 2.0);
  }
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_RENORM);
  EXPECT_EQ(a.forwards[0].count, 2);

  // The root's answer: the job's statistics (node 0 had mean 5, m2 4 over 2 values).
  v1::Result global;
  global.set_op(3);
  global.set_seq(7);
  global.set_phase(v1::PHASE_FORWARD);
  global.set_scope(v1::SCOPE_RENORM);
  global.set_channels(1);
  global.set_count(4);
  std::vector<double> gm{3.5}, gm2{13.0};
  wire::PackPayload(gm.data(), gm2.data(), 1, global.mutable_data());
  Actions b;
  f.job->ParentResult(global, &b);
  f.Deliver(b);
  for (auto& s : f.sinks) {
    std::vector<v1::Result> late = Late(*s);
    ASSERT_EQ(late.size(), 1u);
    EXPECT_EQ(late[0].code(), 0);
    EXPECT_EQ(late[0].scope(), v1::SCOPE_GLOBAL);
    EXPECT_EQ(late[0].op(), 3u);
    EXPECT_EQ(late[0].seq(), 7u);
    EXPECT_EQ(late[0].count(), 4);
    EXPECT_EQ(A(late[0])[0], 3.5);
    EXPECT_EQ(B(late[0])[0], 13.0);
  }
  // A repeat of the root's answer is not relayed again.
  Actions c;
  f.job->ParentResult(global, &c);
  EXPECT_TRUE(c.deliveries.empty());
}

TEST(Job, RenormRoundTheRootFailedReachesEveryWorkerAsALateError) {
  Fixture f(2, 2, 0, /*parent=*/true);
  f.Send(0, Fwd(1, 0, 1, {1.0}, {0.0}, v1::SCOPE_RENORM));
  f.Send(1, Fwd(1, 0, 1, {3.0}, {0.0}, v1::SCOPE_RENORM));
  Actions a;
  f.job->ParentResult(wire::ErrorResult(1, 0, v1::PHASE_FORWARD,
                                        absl::DeadlineExceededError("node 1 (ranks 2-3) is late")),
                      &a);
  f.Deliver(a);
  for (auto& s : f.sinks) {
    std::vector<v1::Result> late = Late(*s);
    ASSERT_EQ(late.size(), 1u);
    EXPECT_EQ(late[0].code(), int(absl::StatusCode::kDeadlineExceeded));
    EXPECT_NE(late[0].message().find("node 1 (ranks 2-3)"), std::string::npos);
  }
}

TEST(Job, RenormLateResultsFailWhenTheParentIsLostOrSilent) {
  Fixture f(1, 2, 0, /*parent=*/true);
  f.Send(0, Fwd(1, 0, 1, {1.0}, {0.0}, v1::SCOPE_RENORM));
  f.Send(0, Fwd(1, 1, 1, {1.0}, {0.0}, v1::SCOPE_RENORM));
  Actions lost;
  f.job->ParentLost(absl::UnavailableError("the root went away"), &lost);
  f.Deliver(lost);
  std::vector<v1::Result> late = Late(*f.sinks[0]);
  ASSERT_EQ(late.size(), 2u);
  for (const auto& r : late) EXPECT_EQ(r.code(), int(absl::StatusCode::kUnavailable));

  // A root that never answers: past the backstop, the wait ends naming the round.
  f.Send(0, Fwd(1, 2, 1, {1.0}, {0.0}, v1::SCOPE_RENORM));
  Actions early;
  f.job->Expire(Clock::now(), &early);
  EXPECT_TRUE(early.deliveries.empty());
  Actions expired;
  f.job->Expire(Clock::now() + std::chrono::hours(1), &expired);
  f.Deliver(expired);
  late = Late(*f.sinks[0]);
  ASSERT_EQ(late.size(), 3u);
  EXPECT_EQ(late[2].seq(), 2u);
  EXPECT_EQ(late[2].code(), int(absl::StatusCode::kDeadlineExceeded));
  EXPECT_NE(late[2].message().find("root aggregator did not answer"), std::string::npos);
}

TEST(Job, RenormInAOneNodeJobIsANodeRoundWithNoLateResult) {
  // The node's statistics are the job's: clients keep the node answer as the global ones.
  Fixture f(2, 1, 0, /*parent=*/false);
  f.Send(0, Fwd(2, 0, 1, {1.0}, {0.0}, v1::SCOPE_RENORM));
  Actions a = f.Send(1, Fwd(2, 0, 1, {3.0}, {0.0}, v1::SCOPE_RENORM));
  EXPECT_TRUE(a.forwards.empty());
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    EXPECT_FALSE(s->results[0].late());
    EXPECT_EQ(s->results[0].scope(), v1::SCOPE_NODE);
    EXPECT_EQ(A(s->results[0])[0], 2.0);
  }
}

TEST(Job, RenormIsAForwardScopeOnly) {
  Fixture f(2, 2, 0, /*parent=*/true);
  v1::Contribution c = Fwd(1, 0, 1, {1.0}, {0.0}, v1::SCOPE_RENORM);
  c.set_phase(v1::PHASE_BACKWARD);
  f.Send(0, c);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(f.sinks[0]->results[0].message().find("backward round is node scope"),
            std::string::npos);
}

TEST(Job, RootAnswersRenormRoundsLikeGlobalAndRecordsTheirDivergence) {
  Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  root.Send(0, Fwd(0, 0, 10, {0.0}, {10.0}, v1::SCOPE_RENORM));
  root.Send(1, Fwd(0, 0, 10, {2.0}, {10.0}, v1::SCOPE_RENORM));
  for (auto& s : root.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    EXPECT_EQ(s->results[0].count(), 20);
    EXPECT_EQ(A(s->results[0])[0], 1.0);
    EXPECT_EQ(B(s->results[0])[0], 40.0);
  }
  v1::JobStatus status;
  root.job->FillStatus(&status);
  EXPECT_EQ(status.divergence_size(), 2);
}

// --- group scope ---------------------------------------------------------------------------------

Fixture GroupRoot(int nodes, int k) {
  return Fixture(1, nodes, 0, false, v1::MEMBER_KIND_AGGREGATOR, {}, false, k);
}

TEST(Job, RootCompletesEachGroupAsSoonAsItsNodesContributedAndAnswersOnlyThem) {
  Fixture root = GroupRoot(4, 2);  // groups {0, 1} and {2, 3}
  root.Send(3, Fwd(0, 0, 2, {10.0}, {1.0}, v1::SCOPE_GROUP));
  root.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP));
  EXPECT_TRUE(root.sinks[0]->results.empty());
  root.Send(1, Fwd(0, 0, 3, {5.0}, {2.0}, v1::SCOPE_GROUP));
  // Group 0 is done (node 1 was its last), group 1 still waits for node 2.
  ASSERT_EQ(root.sinks[0]->results.size(), 1u);
  ASSERT_EQ(root.sinks[1]->results.size(), 1u);
  EXPECT_TRUE(root.sinks[2]->results.empty());
  EXPECT_TRUE(root.sinks[3]->results.empty());
  const v1::Result& g0 = root.sinks[0]->results[0];
  EXPECT_EQ(g0.code(), 0);
  EXPECT_EQ(g0.count(), 4);
  EXPECT_EQ(g0.scope(), v1::SCOPE_GROUP);
  // {1} and three values of mean 5, m2 2: mean 4, m2 = 2 + 1*3*16/4 = 14
  EXPECT_NEAR(A(g0)[0], 4.0, 1e-15);
  EXPECT_NEAR(B(g0)[0], 14.0, 1e-13);
  EXPECT_EQ(g0.data(), root.sinks[1]->results[0].data());
  root.Send(2, Fwd(0, 0, 2, {20.0}, {1.0}, v1::SCOPE_GROUP));
  ASSERT_EQ(root.sinks[2]->results.size(), 1u);
  ASSERT_EQ(root.sinks[3]->results.size(), 1u);
  EXPECT_EQ(root.sinks[0]->results.size(), 1u);  // group 0 got nothing more
  EXPECT_EQ(root.sinks[2]->results[0].count(), 4);
  EXPECT_NEAR(A(root.sinks[2]->results[0])[0], 15.0, 1e-15);
  EXPECT_EQ(root.sinks[2]->results[0].data(), root.sinks[3]->results[0].data());
  // A group round is merged in node order, like any other: the same bits whatever the arrival.
  Fixture again = GroupRoot(4, 2);
  again.Send(1, Fwd(0, 0, 3, {5.0}, {2.0}, v1::SCOPE_GROUP));
  again.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP));
  ASSERT_EQ(again.sinks[0]->results.size(), 1u);
  EXPECT_EQ(again.sinks[0]->results[0].data(), g0.data());
}

TEST(Job, GroupOfAllNodesEqualsGlobalAndTheRootNamesTheGroupWhenItTimesOut) {
  Fixture root = GroupRoot(2, 2);
  root.Send(0, Fwd(0, 0, 10, {0.0}, {10.0}, v1::SCOPE_GROUP));
  root.Send(1, Fwd(0, 0, 10, {2.0}, {10.0}, v1::SCOPE_GROUP));
  root.Send(0, Fwd(0, 1, 10, {0.0}, {10.0}, v1::SCOPE_GLOBAL));
  root.Send(1, Fwd(0, 1, 10, {2.0}, {10.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(root.sinks[0]->results.size(), 2u);
  EXPECT_EQ(root.sinks[0]->results[0].data(), root.sinks[0]->results[1].data());
  Fixture four = GroupRoot(4, 2);
  const auto t0 = Clock::now();
  four.Send(2, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP), t0);
  Actions a;
  four.job->Expire(t0 + std::chrono::hours(1), &a);
  four.Deliver(a);
  ASSERT_EQ(four.sinks[2]->results.size(), 1u);
  const std::string& msg = four.sinks[2]->results[0].message();
  EXPECT_EQ(four.sinks[2]->results[0].code(), int(absl::StatusCode::kDeadlineExceeded));
  EXPECT_NE(msg.find("group 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("node 3"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("node 0"), std::string::npos) << msg;  // not a member of that round
}

TEST(Job, GroupAndGlobalUnderOneRoundKeyAreAScopeMismatch) {
  Fixture root = GroupRoot(4, 2);
  root.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GLOBAL));
  root.Send(1, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP));
  ASSERT_EQ(root.sinks[0]->results.size(), 1u);
  ASSERT_EQ(root.sinks[1]->results.size(), 1u);
  EXPECT_EQ(root.sinks[1]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(root.sinks[1]->results[0].message().find("'scope' is group"), std::string::npos)
      << root.sinks[1]->results[0].message();
  EXPECT_EQ(root.sinks[0]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
}

TEST(Job, GroupScopeWithoutAGroupSizeIsRefusedNamingTheSetting) {
  Fixture f(2, 2, 0, /*parent=*/true);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(f.sinks[0]->results[0].message().find("HSBN_GROUP_NODES"), std::string::npos);
}

TEST(Job, SidecarForwardsGroupRoundsAndAnswersGroupsOfOneNodeItself) {
  Fixture f(2, 4, 1, /*parent=*/true, v1::MEMBER_KIND_WORKER, {}, false, /*group_nodes=*/2);
  f.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP));
  Actions a = f.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}, v1::SCOPE_GROUP));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_GROUP);
  EXPECT_TRUE(f.sinks[0]->results.empty());  // waits for the root's group result
  v1::Result root;
  root.set_phase(v1::PHASE_FORWARD);
  root.set_channels(1);
  root.set_count(4);
  *root.mutable_data() = *a.forwards[0].data;
  Actions b;
  f.job->ParentResult(root, &b);
  f.Deliver(b);
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].scope(), v1::SCOPE_GROUP);
  Fixture one(2, 4, 1, /*parent=*/true, v1::MEMBER_KIND_WORKER, {}, false, /*group_nodes=*/1);
  one.Send(0, Fwd(0, 0, 1, {1.0}, {0.0}, v1::SCOPE_GROUP));
  Actions c = one.Send(1, Fwd(0, 0, 1, {3.0}, {0.0}, v1::SCOPE_GROUP));
  EXPECT_TRUE(c.forwards.empty());
  ASSERT_EQ(one.sinks[0]->results.size(), 1u);
  EXPECT_EQ(A(one.sinks[0]->results[0])[0], 2.0);
  EXPECT_EQ(one.sinks[0]->results[0].scope(), v1::SCOPE_GROUP);
}

TEST(Job, GroupSizeMustDivideTheNodesAndMatchTheJob) {
  absl::Status s = wire::CheckGroupNodes(3, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("HSBN_GROUP_NODES=3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("4 nodes"), std::string::npos) << s.message();
  EXPECT_TRUE(wire::CheckGroupNodes(2, 4).ok());
  EXPECT_TRUE(wire::CheckGroupNodes(0, 3).ok());
  EXPECT_FALSE(wire::CheckGroupNodes(-1, 4).ok());
  EXPECT_EQ(wire::CheckWorkerLayout(0, 8, 0, 2, 0, 0, 3).code(),
            absl::StatusCode::kInvalidArgument);
  Fixture f(2, 4, 0, true, v1::MEMBER_KIND_WORKER, {}, false, 2);
  JobLayout other = f.layout;
  other.group_nodes = 4;
  s = f.job->CheckLayout(other, "rank 1");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("group_nodes=4"), std::string::npos) << s.message();
}

// --- auto scope ----------------------------------------------------------------------------------

v1::Contribution Decide(uint32_t op, uint64_t seq, int64_t count, std::vector<double> mean,
                        std::vector<double> m2, double max_shift = 0.05, double max_log = 0.05) {
  v1::Contribution c = Fwd(op, seq, count, std::move(mean), std::move(m2), v1::SCOPE_GLOBAL);
  c.mutable_decide()->set_max_mean_shift(max_shift);
  c.mutable_decide()->set_max_log_var_ratio(max_log);
  c.mutable_decide()->set_warmup_rounds(2);
  return c;
}

TEST(Job, RootDecidesAutoScopePerOpFromItsShadowRecordAndTellsEveryNode) {
  Fixture root(1, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  // op 1: the nodes agree (node == global); op 2: node means 0 and 2 (mean shift 0.707).
  for (uint64_t seq = 0; seq < 2; ++seq) {
    root.Send(0, Fwd(1, seq, 10, {1.0}, {10.0}, v1::SCOPE_SHADOW));
    root.Send(1, Fwd(1, seq, 10, {1.0}, {10.0}, v1::SCOPE_SHADOW));
    root.Send(0, Fwd(2, seq, 10, {0.0}, {10.0}, v1::SCOPE_SHADOW));
    root.Send(1, Fwd(2, seq, 10, {2.0}, {10.0}, v1::SCOPE_SHADOW));
  }
  for (uint32_t op : {1u, 2u}) {
    root.Send(0, Decide(op, 2, 10, {1.0}, {10.0}));
    root.Send(1, Decide(op, 2, 10, {1.0}, {10.0}));
  }
  for (auto& sink : root.sinks) {
    ASSERT_EQ(sink->results.size(), 2u);
    const v1::Result& same = sink->results[0];
    const v1::Result& apart = sink->results[1];
    ASSERT_TRUE(same.has_decision());
    EXPECT_EQ(same.decision().scope(), v1::SCOPE_NODE);
    EXPECT_EQ(same.decision().rounds(), 2);
    EXPECT_NEAR(same.decision().mean_shift(), 0.0, 1e-15);
    EXPECT_EQ(apart.decision().scope(), v1::SCOPE_GLOBAL);
    EXPECT_NEAR(apart.decision().mean_shift(), 1.0 / std::sqrt(2.0 + 1e-5), 1e-12);
    EXPECT_EQ(apart.decision().SerializeAsString(),
              root.sinks[0]->results[1].decision().SerializeAsString());
  }
  // Thresholds are the request's: with a looser one, op 2's next window keeps node scope.
  for (uint64_t seq = 3; seq < 5; ++seq) {
    root.Send(0, Fwd(2, seq, 10, {0.0}, {10.0}, v1::SCOPE_SHADOW));
    root.Send(1, Fwd(2, seq, 10, {2.0}, {10.0}, v1::SCOPE_SHADOW));
  }
  root.Send(0, Decide(2, 5, 10, {1.0}, {10.0}, /*max_shift=*/1.0, /*max_log=*/1.0));
  root.Send(1, Decide(2, 5, 10, {1.0}, {10.0}, 1.0, 1.0));
  ASSERT_EQ(root.sinks[0]->results.size(), 3u);
  EXPECT_EQ(root.sinks[0]->results[2].decision().scope(), v1::SCOPE_NODE);
  EXPECT_EQ(root.sinks[0]->results[2].decision().rounds(), 2);  // this window only
}

TEST(Job, WithGroupsAutoScopeComparesGroupsWithGlobal) {
  Fixture root = GroupRoot(4, 2);
  // Nodes 0 and 1 are far apart but their group is the global average; so is group 1's.
  const double means[4] = {0.0, 2.0, 0.0, 2.0};
  for (int n = 0; n < 4; ++n) root.Send(n, Fwd(7, 0, 10, {means[n]}, {10.0}, v1::SCOPE_SHADOW));
  v1::JobStatus status;
  root.job->FillStatus(&status);
  EXPECT_EQ(status.group_nodes(), 2);
  ASSERT_EQ(status.group_divergence_size(), 2);
  EXPECT_NEAR(status.group_divergence(0).mean_shift_avg(), 0.0, 1e-15);
  ASSERT_EQ(status.divergence_size(), 4);
  EXPECT_GT(status.divergence(0).mean_shift_avg(), 0.5);
  for (int n = 0; n < 4; ++n) root.Send(n, Decide(7, 1, 10, {1.0}, {10.0}));
  ASSERT_EQ(root.sinks[3]->results.size(), 1u);
  EXPECT_EQ(root.sinks[3]->results[0].decision().scope(), v1::SCOPE_GROUP);
}

TEST(Job, AutoDecisionWithoutARecordIsGlobalAndDifferentRequestsAreRefused) {
  Fixture root(1, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  root.Send(0, Decide(3, 0, 10, {1.0}, {10.0}));
  root.Send(1, Decide(3, 0, 10, {1.0}, {10.0}));
  ASSERT_EQ(root.sinks[0]->results.size(), 1u);
  EXPECT_EQ(root.sinks[0]->results[0].decision().scope(), v1::SCOPE_GLOBAL);
  EXPECT_EQ(root.sinks[0]->results[0].decision().rounds(), 0);
  root.Send(0, Decide(3, 1, 10, {1.0}, {10.0}, 0.05));
  root.Send(1, Decide(3, 1, 10, {1.0}, {10.0}, 0.5));
  ASSERT_EQ(root.sinks[1]->results.size(), 2u);
  EXPECT_EQ(root.sinks[1]->results[1].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(root.sinks[1]->results[1].message().find("max_mean_shift=0.5"), std::string::npos)
      << root.sinks[1]->results[1].message();
  v1::Contribution bad = Decide(3, 2, 10, {1.0}, {10.0}, std::nan(""));
  root.Send(0, bad);
  EXPECT_EQ(root.sinks[0]->results.back().code(), int(absl::StatusCode::kInvalidArgument));
  // A single-node job decides at its sidecar: node and global are the same there.
  Fixture one(2, 1, 0, false);
  one.Send(0, Decide(3, 0, 1, {1.0}, {0.0}));
  one.Send(1, Decide(3, 0, 1, {1.0}, {0.0}));
  ASSERT_EQ(one.sinks[1]->results.size(), 1u);
  EXPECT_EQ(one.sinks[1]->results[0].decision().scope(), v1::SCOPE_NODE);
}

TEST(Job, ChildAbortFailsTheRoundForTheOtherNodesAtOnce) {
  Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  root.Send(0, Fwd(0, 0, 10, {0.0}, {10.0}, v1::SCOPE_GLOBAL));
  v1::Abort abort;
  abort.set_op(0);
  abort.set_phase(v1::PHASE_FORWARD);
  abort.set_code(int(absl::StatusCode::kDeadlineExceeded));
  abort.set_message("rank 5 missing");
  Actions a;
  root.job->ChildAbort(1, abort, &a);
  root.Deliver(a);
  ASSERT_EQ(root.sinks[0]->results.size(), 1u);
  EXPECT_EQ(root.sinks[0]->results[0].code(), int(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(root.sinks[0]->results[0].message(), "rank 5 missing");
}

TEST(Job, SidecarTellsItsParentWhenAWorkerCrashesAndWhenEveryWorkerIsBack) {
  Fixture f(2, 2, 1, /*parent=*/true);  // node 1 of 2: ranks 2 and 3
  Actions a;
  f.job->MemberGone(1, S(101), /*left=*/false, Clock::now(), &a);
  ASSERT_EQ(a.node_states.size(), 1u);
  EXPECT_FALSE(a.node_states[0].healthy);
  EXPECT_NE(a.node_states[0].message.find("rank 3"), std::string::npos) << a.node_states[0].message;
  std::string why;  // said again to a root the sidecar joins anew
  EXPECT_TRUE(f.job->NodeDown(&why));
  EXPECT_EQ(why, a.node_states[0].message);
  Actions b;  // a second crash: the parent already knows the node is down
  f.job->MemberGone(0, S(100), /*left=*/false, Clock::now(), &b);
  EXPECT_TRUE(b.node_states.empty());
  Actions c;  // one of the two is back: still down
  ASSERT_TRUE(f.job->AddMember(0, S(200), S(100), Clock::now(), &c).ok());
  EXPECT_TRUE(c.node_states.empty());
  Actions d;  // both back
  ASSERT_TRUE(f.job->AddMember(1, S(201), S(101), Clock::now(), &d).ok());
  ASSERT_EQ(d.node_states.size(), 1u);
  EXPECT_TRUE(d.node_states[0].healthy);
  EXPECT_FALSE(f.job->NodeDown(&why));
  // A worker that leaves when it is done is not a crash: nothing goes to the parent.
  Actions e;
  f.job->MemberGone(0, S(200), /*left=*/true, Clock::now(), &e);
  EXPECT_TRUE(e.node_states.empty());
  // Without a parent (single-node jobs, or no --upstream) there is nobody to tell.
  Fixture alone(2, 2, 1, /*parent=*/false);
  Actions g;
  alone.job->MemberGone(1, S(101), /*left=*/false, Clock::now(), &g);
  EXPECT_TRUE(g.node_states.empty());
}

TEST(Job, RootFailsRoundsWaitingForANodeThatIsDownAtOnceUntilItIsBack) {
  Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);  // nodes 0 and 1, 2 ranks each
  root.Send(0, Fwd(0, 0, 10, {0.0}, {10.0}, v1::SCOPE_GLOBAL));  // waits for node 1
  root.Send(1, Fwd(1, 0, 10, {0.0}, {10.0}, v1::SCOPE_GLOBAL));  // node 1 sent op 1 already
  v1::NodeState down;
  down.set_healthy(false);
  down.set_message("rank 3 (node 1, local rank 1) disconnected");
  Actions a;
  root.job->ChildState(1, down, &a);
  root.Deliver(a);
  ASSERT_EQ(root.sinks[0]->results.size(), 1u);  // op 0 failed at once; op 1 still open
  const v1::Result& r = root.sinks[0]->results[0];
  EXPECT_EQ(r.op(), 0u);
  EXPECT_EQ(r.code(), int(absl::StatusCode::kUnavailable));
  EXPECT_NE(r.message().find("node 1"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("rank 3 (node 1, local rank 1) disconnected"), std::string::npos);
  EXPECT_TRUE(root.sinks[1]->results.empty());
  // op 1 has node 1's partial: node 0 can still complete it.
  root.Send(0, Fwd(1, 0, 10, {2.0}, {10.0}, v1::SCOPE_GLOBAL));
  EXPECT_EQ(root.sinks[0]->results.back().code(), 0);
  EXPECT_EQ(root.sinks[0]->results.back().count(), 20);
  // A new round cannot complete while node 1 is down.
  root.Send(0, Fwd(2, 0, 10, {0.0}, {10.0}, v1::SCOPE_GLOBAL));
  EXPECT_EQ(root.sinks[0]->results.back().op(), 2u);
  EXPECT_EQ(root.sinks[0]->results.back().code(), int(absl::StatusCode::kUnavailable));
  EXPECT_NE(root.sinks[0]->results.back().message().find("rank 3"), std::string::npos);
  // Back: rounds complete again.
  v1::NodeState up;
  up.set_healthy(true);
  Actions b;
  root.job->ChildState(1, up, &b);
  root.Send(0, Fwd(3, 0, 10, {0.0}, {10.0}, v1::SCOPE_GLOBAL));
  root.Send(1, Fwd(3, 0, 10, {2.0}, {10.0}, v1::SCOPE_GLOBAL));
  EXPECT_EQ(root.sinks[0]->results.back().op(), 3u);
  EXPECT_EQ(root.sinks[0]->results.back().code(), 0);
  EXPECT_EQ(root.sinks[1]->results.back().code(), 0);
}

TEST(Job, LayoutMismatchNamesTheField) {
  Fixture f(2, 2, 0);
  JobLayout other = f.layout;
  other.world_size = 8;
  other.local_world_size = 4;
  absl::Status s = f.job->CheckLayout(other, "rank 3");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank 3"), std::string::npos);
  EXPECT_NE(s.message().find("world_size=8"), std::string::npos);
}


// NaN and Inf are data: they propagate to every member by IEEE arithmetic, identically, so that
// mixed-precision loss scaling sees an overflow on every rank (as with torch's SyncBatchNorm).
TEST(Job, NonFiniteValuesPropagateIdenticallyToEveryMemberAndAreCounted) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  Fixture f(3);
  Actions a0 = f.Send(0, Fwd(0, 0, 2, {1.0, nan, 3.0}, {1, 1, 1}));
  EXPECT_EQ(a0.nonfinite[0], 1);
  f.Send(1, Fwd(0, 0, 2, {1.0, 2.0, 3.0}, {1, 1, inf}));
  f.Send(2, Fwd(0, 0, 2, {1.0, 2.0, 3.0}, {1, 1, 1}));
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    EXPECT_EQ(s->results[0].code(), 0) << s->results[0].message();
    EXPECT_EQ(s->results[0].data(), f.sinks[0]->results[0].data());  // bitwise the same
  }
  const v1::Result& r = f.sinks[0]->results[0];
  EXPECT_EQ(A(r)[0], 1.0);
  EXPECT_TRUE(std::isnan(A(r)[1]));
  EXPECT_EQ(A(r)[2], 3.0);
  EXPECT_EQ(B(r)[0], 3.0);
  EXPECT_TRUE(std::isinf(B(r)[2]));
  // Backward: an overflowing gradient sum reaches every member.
  v1::Contribution c = Fwd(0, 0, 2, {inf, 1.0, 2.0}, {0, 0, 0});
  c.set_phase(v1::PHASE_BACKWARD);
  Actions a1 = f.Send(0, c);
  EXPECT_EQ(a1.nonfinite[1], 1);
  c = Fwd(0, 0, 2, {1.0, 1.0, 2.0}, {0, 0, 0});
  c.set_phase(v1::PHASE_BACKWARD);
  f.Send(1, c);
  f.Send(2, c);
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 2u);
    EXPECT_EQ(s->results[1].code(), 0);
    EXPECT_TRUE(std::isinf(A(s->results[1])[0]));
    EXPECT_EQ(A(s->results[1])[1], 3.0);
  }
}

TEST(Job, StrictJobRejectsNonFiniteValuesNamingRankAndField) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Fixture f(3, 2, 1, false, v1::MEMBER_KIND_WORKER, {}, /*strict=*/true);
  f.Send(0, Fwd(0, 0, 2, {0, 0, 0, 0}, {1, 1, 1, 1}));
  f.Send(1, Fwd(0, 0, 2, {0.0, 0.0, 0.0, nan}, {1, 1, 1, 1}));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  const v1::Result& r = f.sinks[0]->results[0];
  EXPECT_EQ(r.code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message().find("rank 4"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("mean[3]"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("HSBN_STRICT_FINITE"), std::string::npos) << r.message();
}

TEST(Job, MergeThatOverflowsIsDataUnlessStrict) {
  // Finite inputs whose merge overflows: Inf for everyone, or a named failure when strict.
  for (bool strict : {false, true}) {
    SCOPED_TRACE(strict);
    Fixture f(2, 1, 0, false, v1::MEMBER_KIND_WORKER, {}, strict);
    f.Send(0, Fwd(0, 0, 1, {1e308}, {0}));
    f.Send(1, Fwd(0, 0, 1, {-1e308}, {0}));
    ASSERT_EQ(f.sinks[0]->results.size(), 1u);
    const v1::Result& r = f.sinks[1]->results[0];
    if (strict) {
      EXPECT_EQ(r.code(), int(absl::StatusCode::kInvalidArgument));
      EXPECT_NE(r.message().find("overflow"), std::string::npos) << r.message();
    } else {
      EXPECT_EQ(r.code(), 0);
      EXPECT_FALSE(std::isfinite(B(r)[0]));
    }
  }
}

TEST(Job, CountsWhoseSumOverflowsInt64FailNamingTheRoundAndTheMembers) {
  Fixture f(2, 2, 1);  // ranks 2, 3
  const int64_t big = std::numeric_limits<int64_t>::max();
  f.Send(0, Fwd(5, 7, big, {1.0}, {0}));
  f.Send(1, Fwd(5, 7, 2, {1.0}, {0}));
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    const v1::Result& r = s->results[0];
    EXPECT_EQ(r.code(), int(absl::StatusCode::kInvalidArgument));
    EXPECT_NE(r.message().find("op 5, seq 7"), std::string::npos) << r.message();
    EXPECT_NE(r.message().find("rank 2"), std::string::npos) << r.message();
    EXPECT_NE(r.message().find("rank 3"), std::string::npos) << r.message();
    EXPECT_NE(r.message().find(std::to_string(big)), std::string::npos) << r.message();
  }
  // Backward sums are counted the same way.
  v1::Contribution c = Fwd(5, 8, big, {1.0}, {0});
  c.set_phase(v1::PHASE_BACKWARD);
  f.Send(0, c);
  c.set_count(1);
  f.Send(1, c);
  EXPECT_EQ(f.sinks[0]->results.back().code(), int(absl::StatusCode::kInvalidArgument));
}

TEST(Job, LayerNamesAreBoundedChargedAndReleasedAndTheFirstNameStays) {
  auto budget = std::make_shared<MemoryBudget>(64 << 10);  // a quarter: 16 KiB of names
  JobLimits limits;
  limits.budget = budget;
  {
    Fixture f(1, 2, 0, /*parent=*/true, v1::MEMBER_KIND_WORKER, limits);
    v1::LayerNames names;
    auto add = [&](uint32_t op, const std::string& name) {
      v1::LayerName* n = names.add_layers();
      n->set_op(op);
      n->set_name(name);
    };
    add(1, "net:bn1");
    add(1, "a second name");                   // the first stays
    add(2, std::string("bad\x01"));           // not printable: dropped
    add(3, std::string(Job::kMaxNameBytes + 1, 'x'));  // too long: dropped
    add(4, "");                                // empty: dropped
    for (uint32_t op = 10; op < 10 + 200; ++op) add(op, std::string(200, 'n'));  // 52 KiB
    Actions a;
    f.job->NameLayers(names, &a);
    ASSERT_FALSE(a.names.empty());
    EXPECT_EQ(a.names[0].op(), 1u);
    EXPECT_EQ(a.names[0].name(), "net:bn1");
    for (const v1::LayerName& n : a.names) EXPECT_NE(n.op(), 2u) << "a bad name went up";
    // The budget stopped the flood within its quarter.
    EXPECT_LT(a.names.size(), 100u);
    EXPECT_GT(budget->used(), 0);
    EXPECT_LE(budget->used(), 16 << 10);
  }
  EXPECT_EQ(budget->used(), 0);  // released with the job
}

TEST(Job, LaggedTripsCountOncePerOpAndSeqRefuseBadFieldsAndStayBounded) {
  auto budget = std::make_shared<MemoryBudget>(64 << 10);
  JobLimits limits;
  limits.budget = budget;
  {
    Fixture f(1, 2, 0, /*parent=*/true, v1::MEMBER_KIND_WORKER, limits);
    auto trip = [](uint32_t op, uint64_t seq, double drift, int64_t calls) {
      v1::LaggedTrip t;
      t.set_op(op);
      t.set_seq(seq);
      t.set_drift(drift);
      t.set_exact_calls(calls);
      return t;
    };
    Actions a;
    v1::LayerNames names;
    v1::LayerName* n = names.add_layers();
    n->set_op(7);
    n->set_name("net:bn1");
    f.job->NameLayers(names, &a);
    // Both ranks report the trip of call seq 4: one trip; a later one counts again; an older
    // or repeated seq does not.
    EXPECT_TRUE(f.job->RecordTrip(trip(7, 4, 2.5, 30)).ok());
    EXPECT_TRUE(f.job->RecordTrip(trip(7, 4, 2.5, 30)).ok());
    EXPECT_TRUE(f.job->RecordTrip(trip(7, 40, INFINITY, 8)).ok());
    EXPECT_TRUE(f.job->RecordTrip(trip(7, 39, 1.0, 8)).ok());
    for (double bad : {-1.0, double(NAN)}) {
      absl::Status s = f.job->RecordTrip(trip(8, 5, bad, 8));
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(s.message().find("drift"), std::string::npos) << s;
    }
    for (int64_t bad : {int64_t{0}, int64_t{-3}, (int64_t{1} << 30) + 1}) {
      absl::Status s = f.job->RecordTrip(trip(8, 5, 1.0, bad));
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(s.message().find("exact_calls"), std::string::npos) << s;
    }
    v1::JobStatus st;
    f.job->FillStatus(&st);
    ASSERT_EQ(st.lagged_trips_size(), 1);
    const v1::LaggedTripStatus& t = st.lagged_trips(0);
    EXPECT_EQ(t.op(), 7u);
    EXPECT_EQ(t.layer(), "net:bn1");
    EXPECT_EQ(t.trips(), 2);
    EXPECT_EQ(t.last_seq(), 40u);
    EXPECT_TRUE(std::isinf(t.last_drift()));
    EXPECT_EQ(t.exact_calls(), 8);
    // A flood of ops: bounded by kMaxNames and by the budget's quarter, refused past them.
    int refused = 0;
    for (uint32_t op = 100; op < 100 + 2 * Job::kMaxNames; ++op) {
      refused += f.job->RecordTrip(trip(op, 1, 1.0, 8)).code() ==
                 absl::StatusCode::kResourceExhausted;
    }
    EXPECT_GE(refused, int(Job::kMaxNames));
    EXPECT_LE(budget->used(), 16 << 10);
  }
  EXPECT_EQ(budget->used(), 0);  // released with the job
}

TEST(Job, MemoryBudgetRefusesTheOffenderAndReturnsToZeroWhenTheJobEnds) {
  auto budget = std::make_shared<MemoryBudget>(64 << 10);
  JobLimits limits;
  limits.budget = budget;
  {
    Fixture f(2, 1, 0, false, v1::MEMBER_KIND_WORKER, limits);
    f.Send(0, Fwd(0, 0, 1, std::vector<double>(16, 1.0), std::vector<double>(16, 0.0)));
    EXPECT_GT(budget->used(), 0);
    f.Send(1, Fwd(0, 0, 1, std::vector<double>(16, 1.0), std::vector<double>(16, 0.0)));
    ASSERT_EQ(f.sinks[0]->results.size(), 1u);
    EXPECT_EQ(f.sinks[0]->results[0].code(), 0);
    // 4096 channels * 16 bytes = 64 KiB: more than the budget holds.
    Actions a = f.Send(0, Fwd(1, 0, 1, std::vector<double>(4096, 1.0),
                              std::vector<double>(4096, 0.0)));
    ASSERT_EQ(f.sinks[0]->results.size(), 2u);
    EXPECT_EQ(f.sinks[0]->results[1].code(), int(absl::StatusCode::kResourceExhausted));
    EXPECT_NE(f.sinks[0]->results[1].message().find("--memory-budget-bytes"), std::string::npos);
    ASSERT_EQ(a.refused.size(), 1u);
    EXPECT_STREQ(a.refused[0], "memory_budget");
    EXPECT_EQ(budget->used(), f.job->held_bytes());
  }
  EXPECT_EQ(budget->used(), 0);
}

// A job that sends shadow rounds for ever more layers cannot grow the root's records without
// bound: each record is charged, within a quarter of the budget; unrecorded layers decide global.
TEST(Job, ShadowRecordsAreChargedAndBoundedByAQuarterOfTheBudget) {
  auto budget = std::make_shared<MemoryBudget>(64 << 10);
  JobLimits limits;
  limits.budget = budget;
  limits.finished_rounds_kept = 0;
  {
    Fixture root(1, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR, limits);
    for (uint32_t op = 0; op < 1000; ++op) {
      root.Send(0, Fwd(op, 0, 10, {1.0}, {10.0}, v1::SCOPE_SHADOW));
      root.Send(1, Fwd(op, 0, 10, {3.0}, {10.0}, v1::SCOPE_SHADOW));
    }
    EXPECT_LE(budget->used(), budget->limit() / 4);
    EXPECT_EQ(budget->used(), root.job->held_bytes());
    v1::JobStatus status;
    root.job->FillStatus(&status);
    EXPECT_GT(status.divergence_size(), 0);
    EXPECT_LT(status.divergence_size(), 2000);  // 4000 records would not fit in 16 KiB
    // The last op has no record: its decision is global, with zero rounds behind it.
    root.Send(0, Decide(999, 1, 10, {1.0}, {10.0}, 100.0, 100.0));
    root.Send(1, Decide(999, 1, 10, {1.0}, {10.0}, 100.0, 100.0));
    ASSERT_FALSE(root.sinks[0]->results.empty());
    EXPECT_EQ(root.sinks[0]->results.back().decision().scope(), v1::SCOPE_GLOBAL);
    EXPECT_EQ(root.sinks[0]->results.back().decision().rounds(), 0);
    // The first op was recorded: its decision frees its window's records.
    const int64_t before = budget->used();
    root.Send(0, Decide(0, 1, 10, {1.0}, {10.0}, 100.0, 100.0));
    root.Send(1, Decide(0, 1, 10, {1.0}, {10.0}, 100.0, 100.0));
    EXPECT_EQ(root.sinks[0]->results.back().decision().scope(), v1::SCOPE_NODE);
    EXPECT_EQ(root.sinks[0]->results.back().decision().rounds(), 1);
    EXPECT_LT(budget->used(), before);
  }
  EXPECT_EQ(budget->used(), 0);
}

// Kept results are charged like round data, and refused like it: a job whose finished rounds
// would fill the budget keeps their outcome only, so they cannot crowd out other jobs' rounds.
TEST(Job, KeptResultsThatTheBudgetCannotHoldAreDroppedNotForced) {
  auto budget = std::make_shared<MemoryBudget>(16 << 10);  // kept results: 8 KiB at most
  JobLimits limits;
  limits.budget = budget;
  Fixture f(1, 1, 0, false, v1::MEMBER_KIND_WORKER, limits);
  const std::vector<double> a(256, 1.0), b(256, 0.0);  // 4 KiB per result
  for (uint64_t seq = 0; seq < 4; ++seq) f.Send(0, Fwd(0, seq, 1, a, b));
  for (const auto& r : f.sinks[0]->results) EXPECT_EQ(r.code(), 0) << r.message();
  EXPECT_LE(budget->used(), budget->limit());
  // The oldest result was kept, a later one was not: a retransmission of it says why.
  f.Send(0, Fwd(0, 3, 1, a, b));
  EXPECT_EQ(f.sinks[0]->results.back().code(), int(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(f.sinks[0]->results.back().message().find("not kept"), std::string::npos);
  f.Send(0, Fwd(0, 0, 1, a, b));
  EXPECT_EQ(f.sinks[0]->results.back().code(), 0);
  EXPECT_EQ(f.sinks[0]->results.back().data(), f.sinks[0]->results[0].data());
}

TEST(Job, DroppableWhenNoMemberAttachedForTheAttachTimeout) {
  JobLayout layout;
  layout.local_world_size = 2;
  layout.num_nodes = 1;
  layout.world_size = 2;
  layout.node_rank = 0;
  Job job("job", layout, JobLimits{});
  const Clock::time_point t0 = Clock::now();
  Actions a;
  ASSERT_TRUE(job.AddMember(0, S(1), S(0), t0, &a).ok());
  EXPECT_FALSE(job.Droppable(t0 + std::chrono::seconds(59), std::chrono::seconds(60)));
  EXPECT_TRUE(job.Droppable(t0 + std::chrono::seconds(61), std::chrono::seconds(60)));
  // Once a member is attached, the job lives however long it runs.
  ASSERT_TRUE(job.Attach(0, S(1), std::make_shared<RecordingSink>(), t0).ok());
  EXPECT_FALSE(job.Droppable(t0 + std::chrono::hours(5), std::chrono::seconds(60)));
  job.MemberGone(0, S(1), /*left=*/false, t0, &a);
  EXPECT_TRUE(job.Droppable(t0, std::chrono::seconds(60)));  // every member gone
}


// A group aggregator (docs/PROTOCOL.md, "Group tier"): group 1 of a job of 4 nodes in groups of
// 2; its members are nodes 2 and 3.
TEST(GroupTier, GroupAggregatorCompletesGroupRoundsAndForwardsOneMergedPartialOfWiderOnes) {
  Fixture f(1, 4, 0, /*parent=*/true, v1::MEMBER_KIND_AGGREGATOR, {}, false, /*group_nodes=*/2,
            /*member_nodes=*/1, /*group=*/1);
  ASSERT_EQ(f.layout.expected_members(), 2);
  EXPECT_EQ(f.job->MemberName(0), "node 2 (ranks 2-2)");
  // A group round completes here: both nodes answered, nothing goes up.
  Actions a = f.Send(0, Fwd(1, 0, 2, {1.0}, {2.0}, v1::SCOPE_GROUP));
  a = f.Send(1, Fwd(1, 0, 2, {3.0}, {2.0}, v1::SCOPE_GROUP));
  EXPECT_TRUE(a.forwards.empty());
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 1u);
    EXPECT_EQ(s->results[0].scope(), v1::SCOPE_GROUP);
    EXPECT_EQ(s->results[0].count(), 4);
    EXPECT_EQ(A(s->results[0])[0], 2.0);
    EXPECT_EQ(B(s->results[0])[0], 8.0);  // 2 + 2 + (3 - 1)^2 * 2 * 2 / 4
  }
  // A global round: one merged partial goes up, and the nodes wait for the root's answer.
  f.Send(0, Fwd(1, 1, 2, {1.0}, {2.0}, v1::SCOPE_GLOBAL));
  a = f.Send(1, Fwd(1, 1, 2, {3.0}, {2.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].count, 4);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_GLOBAL);
  EXPECT_EQ(f.sinks[0]->results.size(), 1u);
  v1::Result root;
  root.set_op(1);
  root.set_seq(1);
  root.set_phase(v1::PHASE_FORWARD);
  root.set_channels(1);
  root.set_count(8);
  std::vector<double> gm = {5.0}, gm2 = {40.0};
  wire::PackPayload(gm.data(), gm2.data(), 1, root.mutable_data());
  Actions up;
  f.job->ParentResult(root, &up);
  f.Deliver(up);
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 2u);
    EXPECT_EQ(s->results[1].count(), 8);
    EXPECT_EQ(s->results[1].scope(), v1::SCOPE_GLOBAL);
  }
  // A shadow round: the sidecars answered their workers already; the merged partial goes up
  // and the root's global statistics come back for the per-node record, delivered to nobody.
  f.Send(0, Fwd(2, 0, 2, {1.0}, {2.0}, v1::SCOPE_SHADOW));
  a = f.Send(1, Fwd(2, 0, 2, {3.0}, {2.0}, v1::SCOPE_SHADOW));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_TRUE(a.deliveries.empty());
  root.set_op(2);
  root.set_seq(0);
  Actions back;
  f.job->ParentResult(root, &back);
  EXPECT_TRUE(back.deliveries.empty());
  v1::JobStatus st;
  f.job->FillStatus(&st);
  EXPECT_EQ(st.group(), 1);
  ASSERT_EQ(st.divergence_size(), 2);
  EXPECT_EQ(st.divergence(0).node(), 2);
  EXPECT_EQ(st.divergence(1).node(), 3);
  // Node 2 at mean 1 against the job's 5, variance 5: shift 4 / sqrt(5 + 1e-5).
  EXPECT_NEAR(st.divergence(0).mean_shift_avg(), 4.0 / std::sqrt(5.0 + 1e-5), 1e-12);
  ASSERT_EQ(st.group_divergence_size(), 1);
  EXPECT_EQ(st.group_divergence(0).node(), 1);
  EXPECT_NEAR(st.group_divergence(0).mean_shift_avg(), 3.0 / std::sqrt(5.0 + 1e-5), 1e-12);
  // A node that goes down takes the group down at the root; back when it is back.
  v1::NodeState down;
  down.set_healthy(false);
  down.set_message("rank 2 disconnected");
  Actions d;
  f.job->ChildState(0, down, &d);
  ASSERT_EQ(d.node_states.size(), 1u);
  EXPECT_FALSE(d.node_states[0].healthy);
  EXPECT_NE(d.node_states[0].message.find("node 2"), std::string::npos);
  v1::NodeState healthy;
  healthy.set_healthy(true);
  Actions h;
  f.job->ChildState(0, healthy, &h);
  ASSERT_EQ(h.node_states.size(), 1u);
  EXPECT_TRUE(h.node_states[0].healthy);
}

TEST(GroupTier, RootAboveGroupAggregatorsRefusesGroupRoundsAndRecordsShadowPerGroup) {
  Fixture f(1, 4, 0, /*parent=*/false, v1::MEMBER_KIND_AGGREGATOR, {}, false, /*group_nodes=*/2,
            /*member_nodes=*/2);
  ASSERT_EQ(f.layout.expected_members(), 2);
  EXPECT_EQ(f.job->MemberName(1), "group 1 (nodes 2-3)");
  f.Send(0, Fwd(1, 0, 4, {2.0}, {8.0}, v1::SCOPE_GROUP));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_EQ(f.sinks[0]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(f.sinks[0]->results[0].message().find("group aggregators reduce"), std::string::npos);
  // Shadow: every group aggregator gets the global statistics back.
  f.Send(0, Fwd(2, 0, 4, {2.0}, {8.0}, v1::SCOPE_SHADOW));
  f.Send(1, Fwd(2, 0, 4, {8.0}, {8.0}, v1::SCOPE_SHADOW));
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), size_t(&s == &f.sinks[0] ? 2 : 1));
    EXPECT_EQ(s->results.back().count(), 8);
    EXPECT_EQ(A(s->results.back())[0], 5.0);
  }
  v1::JobStatus st;
  f.job->FillStatus(&st);
  EXPECT_EQ(st.member_nodes(), 2);
  EXPECT_EQ(st.divergence_size(), 0);
  ASSERT_EQ(st.group_divergence_size(), 2);
  EXPECT_EQ(st.group_divergence(1).node(), 1);
}

// --- lagged scope --------------------------------------------------------------------------------

v1::Contribution Bwd(uint32_t op, uint64_t seq, int64_t count, std::vector<double> sum_dy,
                     std::vector<double> sum_dy_xmu, v1::Scope scope = v1::SCOPE_LAGGED) {
  v1::Contribution c = Fwd(op, seq, count, std::move(sum_dy), std::move(sum_dy_xmu), scope);
  c.set_phase(v1::PHASE_BACKWARD);
  return c;
}

v1::Result ParentAnswer(uint32_t op, uint64_t seq, v1::Phase phase, int64_t count,
                        std::vector<double> a, std::vector<double> b) {
  v1::Result r;
  r.set_op(op);
  r.set_seq(seq);
  r.set_phase(phase);
  r.set_scope(v1::SCOPE_LAGGED);
  r.set_channels(uint32_t(a.size()));
  r.set_count(count);
  wire::PackPayload(a.data(), b.data(), int64_t(a.size()), r.mutable_data());
  return r;
}

TEST(Lagged, SidecarAnswersBothPhasesWithTheNodeAtOnceAndRelaysTheRootsResultsLate) {
  Fixture f(2, 2, 1, /*parent=*/true);
  f.Send(0, Fwd(3, 7, 1, {1.0}, {0.0}, v1::SCOPE_LAGGED));
  Actions a = f.Send(1, Fwd(3, 7, 1, {3.0}, {0.0}, v1::SCOPE_LAGGED));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_LAGGED);
  EXPECT_EQ(a.forwards[0].key.phase, v1::PHASE_FORWARD);
  // Backward sums around the node's mean 2: the node's sums at once, and up they go.
  f.Send(0, Bwd(3, 7, 1, {0.5}, {-0.5}));
  a = f.Send(1, Bwd(3, 7, 1, {1.5}, {1.5}));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_LAGGED);
  EXPECT_EQ(a.forwards[0].key.phase, v1::PHASE_BACKWARD);
  EXPECT_EQ(a.forwards[0].count, 2);
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 2u);
    EXPECT_FALSE(s->results[0].late());
    EXPECT_EQ(s->results[0].scope(), v1::SCOPE_NODE);
    EXPECT_EQ(A(s->results[0])[0], 2.0);
    EXPECT_FALSE(s->results[1].late());
    EXPECT_EQ(s->results[1].scope(), v1::SCOPE_NODE);
    EXPECT_EQ(s->results[1].phase(), v1::PHASE_BACKWARD);
    EXPECT_EQ(s->results[1].count(), 2);
    EXPECT_EQ(A(s->results[1])[0], 2.0);
    EXPECT_EQ(B(s->results[1])[0], 1.0);
  }
  // The root's answers to both phases reach every worker as late results of their phase.
  Actions up;
  f.job->ParentResult(ParentAnswer(3, 7, v1::PHASE_FORWARD, 4, {3.5}, {13.0}), &up);
  f.job->ParentResult(ParentAnswer(3, 7, v1::PHASE_BACKWARD, 4, {5.0}, {-2.25}), &up);
  f.Deliver(up);
  for (auto& s : f.sinks) {
    std::vector<v1::Result> late = Late(*s);
    ASSERT_EQ(late.size(), 2u);
    EXPECT_EQ(late[0].phase(), v1::PHASE_FORWARD);
    EXPECT_EQ(late[0].scope(), v1::SCOPE_GLOBAL);
    EXPECT_EQ(A(late[0])[0], 3.5);
    EXPECT_EQ(late[1].phase(), v1::PHASE_BACKWARD);
    EXPECT_EQ(late[1].scope(), v1::SCOPE_GLOBAL);
    EXPECT_EQ(late[1].code(), 0);
    EXPECT_EQ(late[1].count(), 4);
    EXPECT_EQ(A(late[1])[0], 5.0);
    EXPECT_EQ(B(late[1])[0], -2.25);
  }
  // A repeat, and a result for a round this sidecar never forwarded (a future one), reach
  // nobody; the second is logged.
  Actions again;
  f.job->ParentResult(ParentAnswer(3, 7, v1::PHASE_BACKWARD, 4, {5.0}, {-2.25}), &again);
  f.job->ParentResult(ParentAnswer(3, 99, v1::PHASE_BACKWARD, 4, {5.0}, {-2.25}), &again);
  EXPECT_TRUE(again.deliveries.empty());
  ASSERT_EQ(again.round_failures.size(), 1u);
  EXPECT_NE(again.round_failures[0].find("seq 99"), std::string::npos);
  EXPECT_NE(again.round_failures[0].find("did not forward"), std::string::npos);
}

// Node 0: x = {0, 2} (mean 1), dy = {1, 1}; node 1: x = {2, 4} (mean 3), dy = {2, -1}. The
// job: mean 2, sum dy = 3, sum dy (x - 2) = (-2 + 0) + (0 - 2) = -4.
constexpr double kJobSumDyXmu = -4.0;

TEST(Lagged, RootRecentresEachNodesBackwardSumsOnTheJobsMeanAndWaitsForNoOne) {
  Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  // Node 0 runs ahead: its backward partial (around its own mean 1) arrives before node 1's
  // forward.
  root.Send(0, Fwd(5, 0, 2, {1.0}, {2.0}, v1::SCOPE_LAGGED));
  root.Send(0, Bwd(5, 0, 2, {2.0}, {0.0}));
  EXPECT_TRUE(root.sinks[0]->results.empty());
  root.Send(1, Fwd(5, 0, 2, {3.0}, {2.0}, v1::SCOPE_LAGGED));
  root.Send(1, Bwd(5, 0, 2, {1.0}, {-3.0}));  // around node 1's mean 3
  for (auto& s : root.sinks) {
    ASSERT_EQ(s->results.size(), 2u);
    EXPECT_EQ(s->results[0].count(), 4);
    EXPECT_EQ(A(s->results[0])[0], 2.0);
    EXPECT_EQ(B(s->results[0])[0], 8.0);
    const v1::Result& back = s->results[1];
    EXPECT_EQ(back.phase(), v1::PHASE_BACKWARD);
    EXPECT_EQ(back.code(), 0);
    EXPECT_EQ(back.count(), 4);
    EXPECT_EQ(A(back)[0], 3.0);
    EXPECT_EQ(B(back)[0], kJobSumDyXmu);  // around the job's mean 2
    EXPECT_EQ(back.data(), root.sinks[0]->results[1].data());
  }
  // A global backward round of contributions taken around the job's mean gives the same sums.
  root.Send(0, Fwd(6, 0, 2, {1.0}, {2.0}, v1::SCOPE_GLOBAL));
  root.Send(1, Fwd(6, 0, 2, {3.0}, {2.0}, v1::SCOPE_GLOBAL));
  root.Send(0, Bwd(6, 0, 2, {2.0}, {-2.0}, v1::SCOPE_GLOBAL));
  root.Send(1, Bwd(6, 0, 2, {1.0}, {-2.0}, v1::SCOPE_GLOBAL));
  ASSERT_EQ(root.sinks[0]->results.size(), 4u);
  EXPECT_EQ(root.sinks[0]->results[3].data(), root.sinks[0]->results[1].data());
}

TEST(Lagged, AGroupAggregatorRecentresOnItsGroupsMeanAndSendsItsForwardUpFirst) {
  Fixture f(1, 4, 0, /*parent=*/true, v1::MEMBER_KIND_AGGREGATOR, {}, false, /*group_nodes=*/2,
            /*member_nodes=*/1, /*group=*/1);
  Actions a = f.Send(0, Fwd(5, 0, 2, {1.0}, {2.0}, v1::SCOPE_LAGGED));
  a = f.Send(0, Bwd(5, 0, 2, {2.0}, {0.0}));
  EXPECT_TRUE(a.forwards.empty());
  a = f.Send(1, Fwd(5, 0, 2, {3.0}, {2.0}, v1::SCOPE_LAGGED));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].key.phase, v1::PHASE_FORWARD);
  a = f.Send(1, Bwd(5, 0, 2, {1.0}, {-3.0}));
  ASSERT_EQ(a.forwards.size(), 1u);
  EXPECT_EQ(a.forwards[0].key.phase, v1::PHASE_BACKWARD);
  EXPECT_EQ(a.forwards[0].scope, v1::SCOPE_LAGGED);
  EXPECT_EQ(a.forwards[0].count, 4);
  std::vector<double> dy(1), dyxmu(1);
  wire::UnpackPayload(*a.forwards[0].data, 1, dy.data(), dyxmu.data());
  EXPECT_EQ(dy[0], 3.0);
  EXPECT_EQ(dyxmu[0], kJobSumDyXmu);  // around the group's mean 2: what the root re-centres
  // The nodes wait for the root's answers, which go down as they come.
  EXPECT_TRUE(f.sinks[0]->results.empty());
  Actions down;
  f.job->ParentResult(ParentAnswer(5, 0, v1::PHASE_BACKWARD, 8, {3.0}, {-1.0}), &down);
  f.Deliver(down);
  ASSERT_EQ(f.sinks[1]->results.size(), 1u);
  EXPECT_EQ(f.sinks[1]->results[0].phase(), v1::PHASE_BACKWARD);
  EXPECT_EQ(f.sinks[1]->results[0].scope(), v1::SCOPE_LAGGED);
  EXPECT_EQ(B(f.sinks[1]->results[0])[0], -1.0);
}

TEST(Lagged, ABackwardWithoutItsForwardOrWithAnotherCountIsRefusedToItsSenderOnly) {
  Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR);
  // No forward from node 1 under (op 5, seq 0): refused to node 1 alone.
  root.Send(0, Fwd(5, 0, 2, {1.0}, {2.0}, v1::SCOPE_LAGGED));
  root.Send(1, Bwd(5, 0, 2, {1.0}, {-3.0}));
  EXPECT_TRUE(root.sinks[0]->results.empty());
  ASSERT_EQ(root.sinks[1]->results.size(), 1u);
  EXPECT_EQ(root.sinks[1]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(root.sinks[1]->results[0].message().find("sent no lagged forward contribution to "
                                                     "op 5, seq 0"),
            std::string::npos)
      << root.sinks[1]->results[0].message();
  // Another count than its forward's: refused to node 0 alone.
  root.Send(0, Bwd(5, 0, 3, {2.0}, {0.0}));
  ASSERT_EQ(root.sinks[0]->results.size(), 1u);
  EXPECT_EQ(root.sinks[0]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(root.sinks[0]->results[0].message().find("field 'count' is 3 but its lagged forward "
                                                     "contribution"),
            std::string::npos)
      << root.sinks[0]->results[0].message();
  EXPECT_EQ(root.sinks[1]->results.size(), 1u);
  // The round itself goes on: done right, both phases complete.
  root.Send(1, Fwd(5, 0, 2, {3.0}, {2.0}, v1::SCOPE_LAGGED));
  root.Send(0, Bwd(5, 0, 2, {2.0}, {0.0}));
  root.Send(1, Bwd(5, 0, 2, {1.0}, {-3.0}));
  for (auto& s : root.sinks) {
    ASSERT_FALSE(s->results.empty());
    EXPECT_EQ(s->results.back().code(), 0);
    EXPECT_EQ(s->results.back().phase(), v1::PHASE_BACKWARD);
    EXPECT_EQ(B(s->results.back())[0], kJobSumDyXmu);
  }
  // A backward whose forward round failed gets the forward's error.
  root.Send(0, Fwd(5, 1, 2, {1.0}, {2.0}, v1::SCOPE_LAGGED));
  root.Send(1, Fwd(5, 1, 2, {1.0, 2.0}, {2.0, 2.0}, v1::SCOPE_LAGGED));  // other channels
  root.Send(0, Bwd(5, 1, 2, {2.0}, {0.0}));
  const v1::Result& failed = root.sinks[0]->results.back();
  EXPECT_EQ(failed.code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(failed.phase(), v1::PHASE_BACKWARD);
  EXPECT_NE(failed.message().find("its forward round failed"), std::string::npos)
      << failed.message();
}

TEST(Lagged, ASidecarChecksEachRanksBackwardAgainstItsForward) {
  Fixture f(2, 2, 0, /*parent=*/true);
  v1::Contribution lone = Bwd(4, 0, 1, {1.0}, {0.0});
  f.Send(1, lone);
  ASSERT_EQ(f.sinks[1]->results.size(), 1u);
  EXPECT_EQ(f.sinks[1]->results[0].code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(f.sinks[1]->results[0].message().find("rank 1"), std::string::npos);
  EXPECT_TRUE(f.sinks[0]->results.empty());
  // Rank 0 forwarded (its round still open), then sends another count.
  f.Send(0, Fwd(4, 0, 3, {1.0}, {0.0}, v1::SCOPE_LAGGED));
  f.Send(0, Bwd(4, 0, 2, {1.0}, {0.0}));
  ASSERT_EQ(f.sinks[0]->results.size(), 1u);
  EXPECT_NE(f.sinks[0]->results[0].message().find("field 'count' is 2"), std::string::npos)
      << f.sinks[0]->results[0].message();
}

TEST(Lagged, TheForwardRecordsAreBoundedAndAForgottenForwardIsNamed) {
  JobLimits limits;
  limits.max_open_rounds = 2;
  Fixture f(1, 2, 0, /*parent=*/true, v1::MEMBER_KIND_WORKER, limits);
  for (uint64_t seq = 0; seq < 5; ++seq) f.Send(0, Fwd(1, seq, 1, {1.0}, {0.0}, v1::SCOPE_LAGGED));
  // Only the two newest forwards are remembered.
  f.Send(0, Bwd(1, 0, 1, {1.0}, {0.0}));
  const v1::Result& forgotten = f.sinks[0]->results.back();
  EXPECT_EQ(forgotten.code(), int(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(forgotten.message().find("--max-open-rounds"), std::string::npos)
      << forgotten.message();
  f.Send(0, Bwd(1, 4, 1, {1.0}, {0.0}));
  EXPECT_EQ(f.sinks[0]->results.back().code(), 0);
  EXPECT_EQ(f.sinks[0]->results.back().phase(), v1::PHASE_BACKWARD);
}

TEST(Lagged, AForwardRecordTheBudgetCannotHoldFailsItsBackwardNamingTheFlag) {
  // 64 channels: a root's record holds 3 x 512 bytes, more than a quarter of the budget.
  auto budget = std::make_shared<MemoryBudget>(4096);
  {
    JobLimits limits;
    limits.budget = budget;
    Fixture root(2, 2, 0, false, v1::MEMBER_KIND_AGGREGATOR, limits);
    const std::vector<double> v(64, 1.0);
    root.Send(0, Fwd(5, 0, 2, v, v, v1::SCOPE_LAGGED));
    root.Send(1, Fwd(5, 0, 2, v, v, v1::SCOPE_LAGGED));
    ASSERT_EQ(root.sinks[0]->results.size(), 1u);
    EXPECT_EQ(root.sinks[0]->results[0].code(), 0);
    root.Send(0, Bwd(5, 0, 2, v, v));
    ASSERT_EQ(root.sinks[0]->results.size(), 2u);
    const v1::Result& refused = root.sinks[0]->results[1];
    EXPECT_EQ(refused.code(), int(absl::StatusCode::kResourceExhausted));
    EXPECT_NE(refused.message().find("--memory-budget-bytes"), std::string::npos)
        << refused.message();
    EXPECT_LE(budget->used(), budget->limit());
  }
  EXPECT_EQ(budget->used(), 0);  // everything the job held goes back with it
}

TEST(Lagged, OneNodeJobAnswersBothPhasesWithTheNodeAndSendsNoLateResult) {
  Fixture f(2, 1, 0, /*parent=*/false);
  f.Send(0, Fwd(2, 0, 1, {1.0}, {0.0}, v1::SCOPE_LAGGED));
  Actions a = f.Send(1, Fwd(2, 0, 1, {3.0}, {0.0}, v1::SCOPE_LAGGED));
  f.Send(0, Bwd(2, 0, 1, {1.0}, {-1.0}));
  Actions b = f.Send(1, Bwd(2, 0, 1, {1.0}, {1.0}));
  EXPECT_TRUE(a.forwards.empty());
  EXPECT_TRUE(b.forwards.empty());
  for (auto& s : f.sinks) {
    ASSERT_EQ(s->results.size(), 2u);
    EXPECT_EQ(s->results[1].scope(), v1::SCOPE_NODE);
    EXPECT_EQ(A(s->results[1])[0], 2.0);
    EXPECT_EQ(B(s->results[1])[0], 0.0);
    EXPECT_TRUE(Late(*s).empty());
  }
}

}  // namespace
}  // namespace hsbn::server

// Group and auto scope through the C++ client with real aggregators (a root and a sidecar per
// node; each rank on its own thread, since rounds block).
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "local_cluster.h"
#include "test_cluster.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;

using testing::ConnectJob;

using testing::OnEveryRank;

TEST(Scopes, GroupRoundsReduceEachGroupOfNodesAndTheGroupSizeMustDivideTheNodes) {
  auto c = testing::StartCluster(4, 1);
  ASSERT_TRUE(c);
  ClientOptions bad = testing::RankOptions(*c, 0, "groups-bad");
  bad.group_nodes = 3;
  auto refused = Client::Connect(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("HSBN_GROUP_NODES=3"), std::string::npos);
  EXPECT_NE(refused.status().message().find("4 nodes"), std::string::npos);

  auto clients = ConnectJob(*c, "groups", 2);
  for (auto& cl : clients) ASSERT_TRUE(cl);
  // Rank r holds one value, r: groups {0, 1} and {2, 3} have means 0.5 and 2.5.
  std::vector<double> mean(4), m2(4);
  std::vector<int64_t> count(4);
  OnEveryRank(4, [&](int r) {
    double a = r, b = 0;
    absl::Status s = clients[r]->Forward(1, 0, Scope::kGroup, 1, 1, &a, &b, &count[r], &mean[r],
                                         &m2[r]);
    EXPECT_TRUE(s.ok()) << s;
  });
  EXPECT_EQ(count, (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(mean, (std::vector<double>{0.5, 0.5, 2.5, 2.5}));
  EXPECT_EQ(m2, (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
  EXPECT_EQ(clients[0]->Stats().of(Scope::kGroup, Phase::kForward).completed, 1);
}

TEST(Scopes, GroupRoundsOverNodesOfSeveralWorkersMergeEachGroupsWorkersForwardAndBackward) {
  auto c = testing::StartCluster(4, 2);
  ASSERT_TRUE(c);
  auto clients = ConnectJob(*c, "groups-4x2", 2);
  for (auto& cl : clients) ASSERT_TRUE(cl);
  // Rank r holds one value, r: groups are ranks 0-3 (mean 1.5) and 4-7 (mean 5.5), m2 5 each.
  std::vector<double> mean(8), m2(8), sum(8), sum_xmu(8);
  OnEveryRank(8, [&](int r) {
    double a = r, b = 0, x = 1.0, y = r;
    int64_t n = 0;
    absl::Status s = clients[r]->Forward(2, 0, Scope::kGroup, 1, 1, &a, &b, &n, &mean[r], &m2[r]);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(n, 4);
    s = clients[r]->Backward(2, 0, Scope::kGroup, 1, 1, &x, &y, &n, &sum[r], &sum_xmu[r]);
    EXPECT_TRUE(s.ok()) << s;
  });
  for (int r = 0; r < 8; ++r) {
    const int first = r < 4 ? 0 : 4;
    EXPECT_EQ(mean[r], r < 4 ? 1.5 : 5.5) << r;
    EXPECT_EQ(m2[r], 5.0) << r;
    EXPECT_EQ(sum[r], 4.0) << r;
    EXPECT_EQ(sum_xmu[r], r < 4 ? 6.0 : 22.0) << r;
    EXPECT_EQ(std::memcmp(&mean[r], &mean[first], sizeof(double)), 0);
  }
}

TEST(Scopes, AutoScopeDecidesPerOpAtTheRootAndEveryRankGetsTheSameDecision) {
  auto c = testing::StartCluster(2, 1);
  ASSERT_TRUE(c);
  AutoPolicy policy;
  policy.warmup_rounds = 3;
  auto clients = ConnectJob(*c, "auto", 0, policy);
  for (auto& cl : clients) ASSERT_TRUE(cl);
  // op 1: node r's data is {10r - 1, 10r + 1} (nodes far apart); op 2: {-1, 1} everywhere.
  OnEveryRank(2, [&](int r) {
    Client& cl = *clients[r];
    for (uint64_t seq = 0; seq < 6; ++seq) {
      for (uint32_t op : {1u, 2u}) {
        double a = op == 1 ? 10.0 * r : 0.0, b = 2.0, x = 0, y = 0;
        int64_t n = 0;
        absl::Status s = cl.Forward(op, seq, Scope::kAuto, 1, 2, &a, &b, &n, &a, &b);
        ASSERT_TRUE(s.ok()) << s;
        s = cl.Backward(op, seq, Scope::kAuto, 1, 2, &x, &y, &n, &x, &y);
        ASSERT_TRUE(s.ok()) << s;
      }
    }
  });
  for (int r = 0; r < 2; ++r) {
    const AutoDecision far = clients[r]->AutoDecisionOf(1), near = clients[r]->AutoDecisionOf(2);
    ASSERT_TRUE(far.decided && near.decided);
    EXPECT_EQ(far.scope, Scope::kGlobal);
    EXPECT_EQ(near.scope, Scope::kNode);
    EXPECT_EQ(far.decided_at, 3);
    EXPECT_EQ(far.rounds, 3);
    EXPECT_EQ(far.mean_shift, clients[0]->AutoDecisionOf(1).mean_shift);
    EXPECT_GT(far.mean_shift, 0.9);
    EXPECT_EQ(near.mean_shift, 0.0);
    const ClientStats s = clients[r]->Stats();
    // Per op: 3 shadow forwards (node backwards), the decision round (global both ways), then
    // 2 steps in the decided scope.
    EXPECT_EQ(s.of(Scope::kShadow, Phase::kForward).completed, 6);
    EXPECT_EQ(s.of(Scope::kGlobal, Phase::kForward).completed, 2 + 2);
    EXPECT_EQ(s.of(Scope::kGlobal, Phase::kBackward).completed, 2 + 2);
    EXPECT_EQ(s.of(Scope::kNode, Phase::kForward).completed, 2);
    EXPECT_EQ(s.of(Scope::kNode, Phase::kBackward).completed, 6 + 2);
  }
}

TEST(Scopes, AutoScopeRechecksBySamplingAndDecidesAgainWhenTheDataChanges) {
  auto c = testing::StartCluster(2, 1);
  ASSERT_TRUE(c);
  AutoPolicy policy;
  policy.warmup_rounds = 2;
  policy.recheck_every = 2;
  auto clients = ConnectJob(*c, "auto-recheck", 0, policy);
  for (auto& cl : clients) ASSERT_TRUE(cl);
  // seq 0-1: warm-up (nodes agree) -> seq 2 decides node; samples at seq 4 and 6 (nodes now
  // far apart) -> seq 8 decides global.
  std::vector<std::vector<Scope>> decided(2);
  OnEveryRank(2, [&](int r) {
    for (uint64_t seq = 0; seq < 10; ++seq) {
      double a = seq >= 3 ? 10.0 * r : 0.0, b = 2.0;
      int64_t n = 0;
      absl::Status s = clients[r]->Forward(9, seq, Scope::kAuto, 1, 2, &a, &b, &n, &a, &b);
      ASSERT_TRUE(s.ok()) << s;
      decided[r].push_back(clients[r]->AutoDecisionOf(9).scope);
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(decided[r][2], Scope::kNode);
    EXPECT_EQ(decided[r][7], Scope::kNode);
    EXPECT_EQ(decided[r][8], Scope::kGlobal);
    const AutoDecision d = clients[r]->AutoDecisionOf(9);
    EXPECT_EQ(d.decided_at, 8);
    EXPECT_EQ(d.rounds, 2);  // the two samples
    const ClientStats s = clients[r]->Stats();
    EXPECT_EQ(s.of(Scope::kShadow, Phase::kForward).completed, 4);  // seq 0, 1, 4, 6
    EXPECT_EQ(s.of(Scope::kGlobal, Phase::kForward).completed, 3);  // seq 2, 8, 9
    EXPECT_EQ(s.of(Scope::kNode, Phase::kForward).completed, 3);    // seq 3, 5, 7
  }
}

TEST(Scopes, AutoScopeRefusesToRunAheadOfItsDecisionAndRestoresSavedDecisions) {
  auto c = testing::StartCluster(1, 2);
  ASSERT_TRUE(c);
  AutoPolicy policy;
  policy.warmup_rounds = 1;
  auto clients = ConnectJob(*c, "auto-ahead", 0, policy);
  for (auto& cl : clients) ASSERT_TRUE(cl);
  double a = 1, b = 0;
  // Rank 0 starts the decision round (seq 1) and, without waiting for it, seq 2.
  auto decision = clients[0]->Start(Phase::kForward, 5, 1, Scope::kAuto, 1, 1, &a, &b);
  ASSERT_TRUE(decision.ok()) << decision.status();
  auto ahead = clients[0]->Start(Phase::kForward, 5, 2, Scope::kAuto, 1, 1, &a, &b);
  ASSERT_FALSE(ahead.ok());
  EXPECT_EQ(ahead.status().code(), absl::StatusCode::kFailedPrecondition);
  int64_t n = 0;
  ASSERT_TRUE(clients[1]->Forward(5, 1, Scope::kAuto, 1, 1, &a, &b, &n, &a, &b).ok());
  ASSERT_TRUE(clients[0]->Wait(**decision, &n, &a, &b).ok());
  // One node: node and global are the same, and the sidecar decides node.
  EXPECT_EQ(clients[0]->AutoDecisionOf(5).scope, Scope::kNode);
  // A restored decision applies to every round of the op, with no warm-up.
  for (auto& cl : clients) ASSERT_TRUE(cl->SetAutoDecision(6, Scope::kGlobal).ok());
  OnEveryRank(2, [&](int r) {
    double x = r, y = 0;
    int64_t m = 0;
    ASSERT_TRUE(clients[r]->Forward(6, 0, Scope::kAuto, 1, 1, &x, &y, &m, &x, &y).ok());
  });
  EXPECT_EQ(clients[0]->Stats().of(Scope::kGlobal, Phase::kForward).completed, 2);
  EXPECT_EQ(clients[0]->SetAutoDecision(7, Scope::kGroup).code(),
            absl::StatusCode::kFailedPrecondition);  // no groups in this job
  AutoPolicy bad;
  bad.warmup_rounds = 0;
  EXPECT_EQ(clients[0]->SetAutoPolicy(8, bad).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsbn

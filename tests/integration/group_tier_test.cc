// The group tier with real aggregator processes: a root, one group aggregator (--role=group) per
// K consecutive nodes and a sidecar per node (LocalCluster's group_tier). Every scope through the
// tier equals BatchNorm over the concatenated batch, the same bits on every rank and run; group
// rounds never reach the root; the failure semantics per level; the refusals at Join. Run on
// both node transports (the "grpc:" copy of this binary's tests).
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/status.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "local_cluster.h"
#include "test_cluster.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;

std::unique_ptr<LocalCluster> StartTier(int nodes, int per_node, int group_nodes,
                                        std::vector<std::string> flags = {}) {
  cluster::ClusterOptions opts;
  opts.nodes = nodes;
  opts.workers_per_node = per_node;
  opts.group_tier = true;
  opts.group_nodes = group_nodes;
  opts.extra_flags = std::move(flags);
  auto c = LocalCluster::Start(opts);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

using testing::ConnectJob;

using testing::OnEveryRank;

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Rank r's data: kValues values per channel, drawn from a distribution that differs by node.
constexpr int kChannels = 3;
constexpr int kValues = 5;
std::vector<double> RankData(int rank, int node) {
  std::mt19937_64 gen(1000 + rank);
  std::normal_distribution<double> d(1.5 * node, 1.0 + 0.25 * node);
  std::vector<double> x(kChannels * kValues);
  for (double& v : x) v = d(gen);
  return x;
}

// Per channel: (count, mean, m2) of `x` (kValues values per channel).
void Moments(const std::vector<double>& x, double* mean, double* m2) {
  for (int c = 0; c < kChannels; ++c) {
    double s = 0;
    for (int i = 0; i < kValues; ++i) s += x[c * kValues + i];
    mean[c] = s / kValues;
    double q = 0;
    for (int i = 0; i < kValues; ++i) q += (x[c * kValues + i] - mean[c]) * (x[c * kValues + i] - mean[c]);
    m2[c] = q;
  }
}

// The reference: two-pass moments over the concatenated data of ranks [lo, hi).
void Reference(const LocalCluster& c, int lo, int hi, double* mean, double* m2) {
  for (int ch = 0; ch < kChannels; ++ch) {
    double s = 0;
    int n = 0;
    for (int r = lo; r < hi; ++r) {
      const auto x = RankData(r, r / c.workers_per_node());
      for (int i = 0; i < kValues; ++i, ++n) s += x[ch * kValues + i];
    }
    mean[ch] = s / n;
    double q = 0;
    for (int r = lo; r < hi; ++r) {
      const auto x = RankData(r, r / c.workers_per_node());
      for (int i = 0; i < kValues; ++i) q += (x[ch * kValues + i] - mean[ch]) * (x[ch * kValues + i] - mean[ch]);
    }
    m2[ch] = q;
  }
}

struct Out {
  int64_t count = 0;
  double mean[kChannels] = {}, m2[kChannels] = {};
};

// One forward round of `scope` on every rank; the answers by rank.
std::vector<Out> Round(LocalCluster& c, std::vector<std::unique_ptr<Client>>& job, uint32_t op,
                       uint64_t seq, Scope scope) {
  std::vector<Out> out(job.size());
  OnEveryRank(int(job.size()), [&](int r) {
    double mean[kChannels], m2[kChannels];
    Moments(RankData(r, r / c.workers_per_node()), mean, m2);
    absl::Status s = job[r]->Forward(op, seq, scope, kChannels, kValues, mean, m2, &out[r].count,
                                     out[r].mean, out[r].m2);
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
  });
  return out;
}

int64_t RootRoundsCompleted(LocalCluster& c, const std::string& job) {
  StatusQuery q;
  q.address = c.root_address();
  q.job_id = job;
  auto st = QueryStatus(q);
  EXPECT_TRUE(st.ok()) << st.status();
  if (!st.ok() || st->jobs_size() != 1) return -1;
  return st->jobs(0).rounds_completed();
}

TEST(GroupTier, EveryScopeEqualsBatchNormOverTheConcatenatedBatchAndGroupRoundsStayInTheTier) {
  auto c = StartTier(4, 2, 2);
  ASSERT_TRUE(c);
  ASSERT_EQ(c->groups(), 2);
  for (const char* name : {"tier-a", "tier-b"}) {  // two runs: the same bits
    auto job = ConnectJob(*c, name, 2);
    for (auto& cl : job) ASSERT_TRUE(cl);
    const std::vector<Out> group = Round(*c, job, 1, 0, Scope::kGroup);
    const std::vector<Out> global = Round(*c, job, 1, 1, Scope::kGlobal);
    const std::vector<Out> renorm = Round(*c, job, 2, 0, Scope::kRenorm);
    for (int r = 0; r < c->world_size(); ++r) {
      const int g = r / 4;  // 2 nodes x 2 ranks per group
      double mean[kChannels], m2[kChannels];
      Reference(*c, 4 * g, 4 * g + 4, mean, m2);
      EXPECT_EQ(group[r].count, 4 * kValues);
      for (int ch = 0; ch < kChannels; ++ch) {
        EXPECT_NEAR(group[r].mean[ch], mean[ch], 1e-12) << r;
        EXPECT_NEAR(group[r].m2[ch], m2[ch], 1e-10 * m2[ch]) << r;
        EXPECT_TRUE(SameBits(group[r].mean[ch], group[4 * g].mean[ch]));
        EXPECT_TRUE(SameBits(group[r].m2[ch], group[4 * g].m2[ch]));
      }
      Reference(*c, 0, 8, mean, m2);
      EXPECT_EQ(global[r].count, 8 * kValues);
      for (int ch = 0; ch < kChannels; ++ch) {
        EXPECT_NEAR(global[r].mean[ch], mean[ch], 1e-12) << r;
        EXPECT_NEAR(global[r].m2[ch], m2[ch], 1e-10 * m2[ch]) << r;
        EXPECT_TRUE(SameBits(global[r].mean[ch], global[0].mean[ch]));
        EXPECT_TRUE(SameBits(global[r].m2[ch], global[0].m2[ch]));
      }
      // Renorm: the node's statistics at once, the job's afterwards, the global round's bits
      // (the same data under another op).
      EXPECT_EQ(renorm[r].count, 2 * kValues);
      int64_t n = 0;
      double gm[kChannels], gm2[kChannels];
      absl::Status s = job[r]->GlobalStats(2, 0, kChannels, &n, gm, gm2);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(n, 8 * kValues);
      for (int ch = 0; ch < kChannels; ++ch) {
        EXPECT_TRUE(SameBits(gm[ch], global[0].mean[ch])) << r;
        EXPECT_TRUE(SameBits(gm2[ch], global[0].m2[ch])) << r;
      }
    }
    // Backward through the tier: the group's and the job's sums.
    std::vector<double> sums(job.size()), xmus(job.size());
    OnEveryRank(c->world_size(), [&](int r) {
      double a = 1.0, b = r;
      int64_t n = 0;
      ASSERT_TRUE(job[r]->Backward(1, 0, Scope::kGroup, 1, 1, &a, &b, &n, &sums[r], &xmus[r]).ok());
      EXPECT_EQ(n, 4);
      EXPECT_EQ(sums[r], 4.0);
      EXPECT_EQ(xmus[r], r < 4 ? 6.0 : 22.0);
      ASSERT_TRUE(job[r]->Backward(1, 1, Scope::kGlobal, 1, 1, &a, &b, &n, &sums[r], &xmus[r]).ok());
      EXPECT_EQ(sums[r], 8.0);
      EXPECT_EQ(xmus[r], 28.0);
    });
    // The root completed the global rounds (forward and backward) and renorm's, never a group's.
    EXPECT_EQ(RootRoundsCompleted(*c, name), 3);
  }
}

TEST(GroupTier, ShadowIsRecordedPerGroupAtTheRootAndPerNodeAtTheGroupAggregatorsAndAutoDecides) {
  auto c = StartTier(4, 1, 2);
  ASSERT_TRUE(c);
  AutoPolicy policy;
  policy.warmup_rounds = 3;
  auto job = ConnectJob(*c, "tier-auto", 2, policy);
  for (auto& cl : job) ASSERT_TRUE(cl);
  // op 1: groups far apart (node n holds {10*(n/2) - 1, 10*(n/2) + 1}); op 2: {-1, 1} everywhere.
  OnEveryRank(4, [&](int r) {
    for (uint64_t seq = 0; seq < 5; ++seq) {
      for (uint32_t op : {1u, 2u}) {
        double a = op == 1 ? 10.0 * (r / 2) : 0.0, b = 2.0, x = 0, y = 0;
        int64_t n = 0;
        absl::Status s = job[r]->Forward(op, seq, Scope::kAuto, 1, 2, &a, &b, &n, &a, &b);
        ASSERT_TRUE(s.ok()) << s;
        s = job[r]->Backward(op, seq, Scope::kAuto, 1, 2, &x, &y, &n, &x, &y);
        ASSERT_TRUE(s.ok()) << s;
      }
    }
  });
  for (int r = 0; r < 4; ++r) {
    const AutoDecision far = job[r]->AutoDecisionOf(1), near = job[r]->AutoDecisionOf(2);
    ASSERT_TRUE(far.decided && near.decided) << r;
    EXPECT_EQ(far.scope, Scope::kGlobal) << r;
    EXPECT_EQ(near.scope, Scope::kGroup) << r;
    EXPECT_EQ(far.rounds, 3) << r;
  }
  // The root: one record per group, none per node. Each group aggregator: its nodes.
  StatusQuery q;
  q.job_id = "tier-auto";
  q.address = c->root_address();
  auto root = QueryStatus(q);
  ASSERT_TRUE(root.ok()) << root.status();
  ASSERT_EQ(root->jobs_size(), 1);
  EXPECT_EQ(root->role(), "root");
  EXPECT_EQ(root->jobs(0).member_nodes(), 2);
  EXPECT_EQ(root->jobs(0).divergence_size(), 0);
  int far_groups = 0;
  for (const auto& d : root->jobs(0).group_divergence()) {
    EXPECT_EQ(d.rounds(), 3) << d.ShortDebugString();
    if (d.op() == 1) {
      ++far_groups;
      EXPECT_NEAR(d.mean_shift_avg(), 5.0 / std::sqrt(26.0 + 1e-5), 1e-9);
    }
  }
  EXPECT_EQ(far_groups, 2);
  for (int g = 0; g < 2; ++g) {
    q.address = c->group_address(g);
    auto st = QueryStatus(q);
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_EQ(st->jobs_size(), 1);
    EXPECT_EQ(st->role(), "group");
    EXPECT_EQ(st->jobs(0).group(), g);
    std::vector<int> nodes;
    for (const auto& d : st->jobs(0).divergence()) {
      if (d.op() == 1) nodes.push_back(d.node());
      EXPECT_EQ(d.rounds(), 3);
    }
    EXPECT_EQ(nodes, (std::vector<int>{2 * g, 2 * g + 1}));
  }
  // Status from a rank shows the tree: its sidecar, the group aggregator, the root.
  auto tree = job[3]->Status(/*include_upstream=*/true);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(tree->role(), "node");
  EXPECT_EQ(tree->upstream().role(), "group");
  EXPECT_EQ(tree->upstream().jobs(0).group(), 1);
  EXPECT_EQ(tree->upstream().upstream().role(), "root");
}

TEST(GroupTier, ADeadRootFailsGlobalRoundsAndLeavesNodeAndGroupRoundsWorking) {
  auto c = StartTier(4, 1, 2);
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "tier-root-dies", 2, {}, std::chrono::milliseconds(60000));
  for (auto& cl : job) ASSERT_TRUE(cl);
  Round(*c, job, 1, 0, Scope::kGlobal);  // every level joined
  c->root()->Signal(SIGKILL);
  c->root()->Wait(std::chrono::seconds(10));
  OnEveryRank(4, [&](int r) {
    double a[kChannels] = {1, 2, 3}, b[kChannels] = {0, 0, 0}, m[kChannels], q[kChannels];
    int64_t n = 0;
    absl::Status s = job[r]->Forward(1, 1, Scope::kGlobal, kChannels, 1, a, b, &n, m, q);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("root"), std::string::npos) << s;
    for (uint64_t seq = 0; seq < 3; ++seq) {
      s = job[r]->Forward(2, seq, Scope::kGroup, kChannels, 1, a, b, &n, m, q);
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(n, 2);
      s = job[r]->Forward(3, seq, Scope::kNode, kChannels, 1, a, b, &n, m, q);
      EXPECT_TRUE(s.ok()) << s;
    }
  });
}

TEST(GroupTier, ADeadGroupAggregatorFailsItsNodesRoundsAtOnceNamingItAndARestartedOneServesAgain) {
  auto c = StartTier(4, 1, 2);
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "tier-group-dies", 2, {}, std::chrono::milliseconds(60000));
  for (auto& cl : job) ASSERT_TRUE(cl);
  Round(*c, job, 1, 0, Scope::kGlobal);
  c->group(0)->Signal(SIGKILL);
  c->group(0)->Wait(std::chrono::seconds(10));
  // Nodes 0 and 1 lost their group aggregator: their group and global rounds fail with
  // UNAVAILABLE naming it (not at the 60 s deadline). Group 1's group rounds go on; its global
  // round fails too, since group 0 is gone from the root.
  OnEveryRank(4, [&](int r) {
    double a[kChannels] = {1, 2, 3}, b[kChannels] = {0, 0, 0}, m[kChannels], q[kChannels];
    int64_t n = 0;
    absl::Status s = job[r]->Forward(2, 0, Scope::kGroup, kChannels, 1, a, b, &n, m, q);
    if (r < 2) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_NE(s.message().find("group aggregator"), std::string::npos) << s;
    } else {
      EXPECT_TRUE(s.ok()) << s;
    }
    s = job[r]->Forward(1, 1, Scope::kGlobal, kChannels, 1, a, b, &n, m, q);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    s = job[r]->Forward(3, 0, Scope::kNode, kChannels, 1, a, b, &n, m, q);
    EXPECT_TRUE(s.ok()) << s;
  });
  ASSERT_TRUE(c->RestartGroup(0).ok());
  // The sidecars join the restarted group aggregator, and it joins the root, on a later round:
  // the first ones after the restart may still fail (a sidecar whose connect attempt failed
  // while the group aggregator was down retries after 2 s).
  for (Scope scope : {Scope::kGroup, Scope::kGlobal}) {
    const uint32_t op = scope == Scope::kGroup ? 2 : 1;
    bool done = false;
    for (uint64_t seq = 10; seq < 110 && !done; ++seq) {
      std::vector<absl::Status> status(4);
      std::vector<Out> out(4);
      OnEveryRank(4, [&](int r) {
        double mean[kChannels], m2[kChannels];
        Moments(RankData(r, r), mean, m2);
        status[r] = job[r]->Forward(op, seq, scope, kChannels, kValues, mean, m2, &out[r].count,
                                    out[r].mean, out[r].m2);
      });
      done = true;
      for (int r = 0; r < 4; ++r) {
        if (!status[r].ok()) {
          EXPECT_EQ(status[r].code(), absl::StatusCode::kUnavailable) << status[r];
          done = false;
        } else {
          EXPECT_EQ(out[r].count, (scope == Scope::kGroup ? 2 : 4) * kValues);
        }
      }
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(done) << "scope " << int(scope) << " never worked again after the restart";
  }
}

// Raw Joins, as a buggy or hostile aggregator would send them.
struct RawJoin {
  explicit RawJoin(const std::string& address)
      : stub(v1::Aggregator::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}
  grpc::Status Join(const std::string& job, int node_rank, int member_nodes, int group_nodes,
                    v1::MemberKind kind = v1::MEMBER_KIND_AGGREGATOR) {
    v1::JoinRequest req;
    req.set_protocol_version(v1::PROTOCOL_VERSION_2);
    req.set_job_id(job);
    req.set_kind(kind);
    req.set_world_size(4);
    req.set_local_world_size(1);
    req.set_node_rank(node_rank);
    req.set_rank(kind == v1::MEMBER_KIND_WORKER ? node_rank : -1);
    req.set_local_rank(kind == v1::MEMBER_KIND_WORKER ? 0 : -1);
    req.set_member_nodes(member_nodes);
    req.set_group_nodes(group_nodes);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::JoinResponse resp;
    return stub->Join(&ctx, req, &resp);
  }
  std::unique_ptr<v1::Aggregator::Stub> stub;
};

bool Has(const grpc::Status& s, const std::string& text) {
  return s.error_message().find(text) != std::string::npos;
}

TEST(GroupTier, JoinsThatDoNotFitTheTreeAreRefusedNamingBothNumbers) {
  auto c = StartTier(4, 1, 2);
  ASSERT_TRUE(c);
  RawJoin group0(c->group_address(0));
  ASSERT_TRUE(group0.Join("r1", 0, 1, 2).ok());
  grpc::Status s = group0.Join("r1", 2, 1, 2);  // node 2 is in group 1
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(s, "belongs to group 1") && Has(s, "serves group 0")) << s.error_message();
  s = group0.Join("r2", 0, 1, 0);  // a job without groups
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(s, "HSBN_GROUP_NODES")) << s.error_message();
  s = group0.Join("r3", 0, 2, 2);  // a group aggregator below a group aggregator
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(s, "sidecars only")) << s.error_message();
  s = group0.Join("r4", 0, 1, 2, v1::MEMBER_KIND_WORKER);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Has(s, "is a group aggregator")) << s.error_message();

  RawJoin root(c->root_address());
  s = root.Join("r5", 0, 4, 2);  // covers 4 nodes, but groups have 2
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(s, "covering 4 nodes") && Has(s, "HSBN_GROUP_NODES=2")) << s.error_message();
  s = root.Join("r6", 1, 2, 2);  // not the first node of a group
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(root.Join("r7", 0, 2, 2).ok());
  s = root.Join("r7", 2, 1, 2);  // a sidecar joining directly where groups joined
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(s, "a node's sidecar") && Has(s, "a group aggregator (2 nodes)"))
      << s.error_message();
}

// Tokens per level: every aggregator of the tree reads the same token file; the group
// aggregator presents its sidecars' job token at the root. A Join with a wrong token is refused
// at the group aggregator, before anything of the job exists there.
TEST(GroupTier, TheJobTokenReachesTheRootThroughTheGroupAggregators) {
  char dir[] = "/tmp/hsbn-tier-tokens-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string tokens = std::string(dir) + "/tokens";
  {
    std::ofstream f(tokens);
    f << "tjob token-of-tjob\n";
  }
  ASSERT_EQ(chmod(tokens.c_str(), 0600), 0);
  auto c = StartTier(4, 1, 2, {"--token-file=" + tokens});
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Client>> job;
  for (int r = 0; r < 4; ++r) {
    ClientOptions o = testing::RankOptions(*c, r, "tjob");
    o.group_nodes = 2;
    o.token = "token-of-tjob";
    auto client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    job.push_back(std::move(*client));
  }
  const std::vector<Out> global = Round(*c, job, 1, 0, Scope::kGlobal);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(global[r].count, 4 * kValues);
  RawJoin stranger(c->group_address(0));
  grpc::Status s = stranger.Join("tjob", 0, 1, 2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  std::remove(tokens.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace hsbn

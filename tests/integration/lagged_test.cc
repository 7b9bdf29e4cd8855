// Lagged scope with real aggregator processes: both phases answered by the node at once, the
// job's statistics and sums afterwards (Client::GlobalStats, Client::GlobalSums), the same bits
// on every rank and on both node transports, flat and through the group tier; what a dead root
// does to them; what is refused.
#include <signal.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/v1/hsbn.pb.h"
#include "local_cluster.h"
#include "test_cluster.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;

constexpr int64_t kChannels = 3;
constexpr int kValues = 5;

bool SameBits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// Rank r's input x and upstream gradient dy: kValues per channel, from distributions that
// differ by node (so node and job statistics differ) and over magnitudes (so that another
// order of operations would change low bits).
struct RankData {
  std::vector<double> x, dy;
};
RankData Data(int rank, int node, uint64_t seq) {
  std::mt19937_64 gen(uint64_t(rank) * 7919u + seq * 104729u + 1);
  std::normal_distribution<double> dx(1.5 * node, 1.0 + 0.25 * node), ddy(0.1 * node, 1.0);
  RankData d;
  for (int i = 0; i < kChannels * kValues; ++i) {
    const double scale = std::pow(10.0, double(i / kValues) - 1.0);
    d.x.push_back(dx(gen) * scale);
    d.dy.push_back(ddy(gen));
  }
  return d;
}

// Per channel: mean and m2 of x.
void Moments(const RankData& d, std::vector<double>* mean, std::vector<double>* m2) {
  mean->assign(kChannels, 0.0);
  m2->assign(kChannels, 0.0);
  for (int c = 0; c < kChannels; ++c) {
    double s = 0;
    for (int i = 0; i < kValues; ++i) s += d.x[c * kValues + i];
    (*mean)[c] = s / kValues;
    for (int i = 0; i < kValues; ++i) {
      const double e = d.x[c * kValues + i] - (*mean)[c];
      (*m2)[c] += e * e;
    }
  }
}

// Per channel: sum dy and sum dy (x - center).
void Sums(const RankData& d, const std::vector<double>& center, std::vector<double>* sum_dy,
          std::vector<double>* sum_dy_xmu) {
  sum_dy->assign(kChannels, 0.0);
  sum_dy_xmu->assign(kChannels, 0.0);
  for (int c = 0; c < kChannels; ++c) {
    for (int i = 0; i < kValues; ++i) {
      (*sum_dy)[c] += d.dy[c * kValues + i];
      (*sum_dy_xmu)[c] += d.dy[c * kValues + i] * (d.x[c * kValues + i] - center[c]);
    }
  }
}

struct Out {
  absl::Status status;
  int64_t count = 0;
  std::vector<double> a, b;
};

// One seq of one rank: a lagged forward (op 21) and a node and a global forward of the same
// input (ops 22, 23); then the backward rounds, lagged and node around the node's mean, global
// around the job's; then the lagged round's late results.
struct Seq {
  Out lagged_fwd, node_fwd, global_fwd, lagged_bwd, node_bwd, global_bwd, late_fwd, late_bwd;
};

Seq RunSeq(Client& client, int rank, int node, uint64_t seq) {
  Seq s;
  const RankData d = Data(rank, node, seq);
  std::vector<double> mean, m2;
  Moments(d, &mean, &m2);
  auto round = [&](Phase phase, uint32_t op, Scope scope, const std::vector<double>& a,
                   const std::vector<double>& b) {
    Out o;
    o.a.resize(kChannels);
    o.b.resize(kChannels);
    o.status = phase == Phase::kForward
                   ? client.Forward(op, seq, scope, kChannels, kValues, a.data(), b.data(),
                                    &o.count, o.a.data(), o.b.data())
                   : client.Backward(op, seq, scope, kChannels, kValues, a.data(), b.data(),
                                     &o.count, o.a.data(), o.b.data());
    return o;
  };
  s.lagged_fwd = round(Phase::kForward, 21, Scope::kLagged, mean, m2);
  s.node_fwd = round(Phase::kForward, 22, Scope::kNode, mean, m2);
  s.global_fwd = round(Phase::kForward, 23, Scope::kGlobal, mean, m2);
  std::vector<double> dy, dyxmu;
  Sums(d, s.lagged_fwd.a, &dy, &dyxmu);  // around the node's mean, as the protocol says
  s.lagged_bwd = round(Phase::kBackward, 21, Scope::kLagged, dy, dyxmu);
  s.node_bwd = round(Phase::kBackward, 22, Scope::kNode, dy, dyxmu);
  Sums(d, s.global_fwd.a, &dy, &dyxmu);  // around the job's mean
  s.global_bwd = round(Phase::kBackward, 23, Scope::kGlobal, dy, dyxmu);
  for (Out* late : {&s.late_fwd, &s.late_bwd}) {
    late->a.resize(kChannels);
    late->b.resize(kChannels);
  }
  s.late_fwd.status = client.GlobalStats(21, seq, kChannels, &s.late_fwd.count,
                                         s.late_fwd.a.data(), s.late_fwd.b.data());
  s.late_bwd.status = client.GlobalSums(21, seq, kChannels, &s.late_bwd.count,
                                        s.late_bwd.a.data(), s.late_bwd.b.data());
  return s;
}

// runs[rank][seq]
std::vector<std::vector<Seq>> RunJob(const LocalCluster& c,
                                     std::vector<std::unique_ptr<Client>>& job, int seqs) {
  std::vector<std::vector<Seq>> runs(job.size());
  testing::OnEveryRank(int(job.size()), [&](int r) {
    for (int s = 0; s < seqs; ++s) {
      runs[size_t(r)].push_back(RunSeq(*job[size_t(r)], r, r / c.workers_per_node(), uint64_t(s)));
    }
  });
  return runs;
}

std::vector<std::unique_ptr<Client>> Connect(const LocalCluster& c, const std::string& job,
                                             const std::string& transport, int group_nodes) {
  std::vector<std::unique_ptr<Client>> out;
  for (int r = 0; r < c.world_size(); ++r) {
    ClientOptions o = testing::RankOptions(c, r, job);
    o.transport = transport;
    o.group_nodes = group_nodes;
    auto client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    out.push_back(client.ok() ? std::move(*client) : nullptr);
  }
  return out;
}

// Checks one job's runs: node answers at once, late results with global's forward bits and
// the job's backward sums, the same bits on every rank (and as `reference`'s, another run).
void CheckRuns(const LocalCluster& c, const std::vector<std::vector<Seq>>& runs,
               const std::vector<std::vector<Seq>>* reference, bool flat) {
  const int nodes = c.world_size() / c.workers_per_node();
  for (size_t r = 0; r < runs.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    for (size_t s = 0; s < runs[r].size(); ++s) {
      SCOPED_TRACE(absl::StrCat("seq ", s));
      const Seq& q = runs[r][s];
      for (const Out* o : {&q.lagged_fwd, &q.node_fwd, &q.global_fwd, &q.lagged_bwd, &q.node_bwd,
                           &q.global_bwd, &q.late_fwd, &q.late_bwd}) {
        ASSERT_TRUE(o->status.ok()) << o->status;
      }
      // At once: the node's statistics and sums, bit for bit a node round's.
      EXPECT_TRUE(SameBits(q.lagged_fwd.a, q.node_fwd.a) && SameBits(q.lagged_fwd.b, q.node_fwd.b));
      EXPECT_EQ(q.lagged_bwd.count, q.node_bwd.count);
      EXPECT_TRUE(SameBits(q.lagged_bwd.a, q.node_bwd.a) && SameBits(q.lagged_bwd.b, q.node_bwd.b));
      // Late, forward: the job's statistics, bit for bit a global round's.
      EXPECT_EQ(q.late_fwd.count, q.global_fwd.count);
      EXPECT_TRUE(SameBits(q.late_fwd.a, q.global_fwd.a) && SameBits(q.late_fwd.b, q.global_fwd.b));
      EXPECT_FALSE(SameBits(q.late_fwd.a, q.node_fwd.a));
      // Late, backward: the job's sum dy (a global round's bits) and sum dy (x - job mean),
      // which a global round computes from other inputs (each rank's sums around the job's
      // mean): equal to round-off.
      EXPECT_EQ(q.late_bwd.count, q.global_bwd.count);
      EXPECT_EQ(q.late_bwd.count, q.late_fwd.count);
      EXPECT_TRUE(SameBits(q.late_bwd.a, q.global_bwd.a));
      for (int ch = 0; ch < kChannels; ++ch) {
        EXPECT_NEAR(q.late_bwd.b[ch], q.global_bwd.b[ch],
                    1e-12 * (1.0 + std::fabs(q.global_bwd.b[ch])));
      }
      // Every rank holds the same late bits (and every run of the same inputs).
      const Seq& first = reference != nullptr ? (*reference)[0][s] : runs[0][s];
      EXPECT_TRUE(SameBits(q.late_fwd.a, first.late_fwd.a) &&
                  SameBits(q.late_fwd.b, first.late_fwd.b));
      EXPECT_TRUE(SameBits(q.late_bwd.a, first.late_bwd.a) &&
                  SameBits(q.late_bwd.b, first.late_bwd.b));
      if (flat) {
        // The root's re-centring, as docs/PROTOCOL.md states it: in node order,
        // sum over nodes of (S_k + (mean_k - mean) * D_k), S_k and D_k the node's sums around
        // its mean mean_k (its lagged answers), mean the job's (the late forward's).
        std::vector<double> want(kChannels, 0.0);
        for (int k = 0; k < nodes; ++k) {
          const Seq& nq = runs[size_t(k * c.workers_per_node())][s];
          for (int ch = 0; ch < kChannels; ++ch) {
            want[ch] += nq.lagged_bwd.b[ch] + (nq.lagged_fwd.a[ch] - q.late_fwd.a[ch]) *
                                                  nq.lagged_bwd.a[ch];
          }
        }
        EXPECT_TRUE(SameBits(q.late_bwd.b, want));
      }
    }
  }
}

TEST(Lagged, BothPhasesNodeAtOnceThenTheJobsResultsOnEveryRankBothTransportsFlat) {
  auto c = testing::StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto shm = Connect(*c, "lagged-shm", "auto", 0);
  auto grpc = Connect(*c, "lagged-grpc", "grpc", 0);
  for (auto& p : shm) ASSERT_TRUE(p);
  for (auto& p : grpc) ASSERT_TRUE(p);
  constexpr int kSeqs = 4;
  auto a = RunJob(*c, shm, kSeqs);
  auto b = RunJob(*c, grpc, kSeqs);
  CheckRuns(*c, a, nullptr, /*flat=*/true);
  CheckRuns(*c, b, &a, /*flat=*/true);
  for (size_t r = 0; r < shm.size(); ++r) {
    EXPECT_EQ(shm[r]->Stats().transport, "shm");
    const ClientStats st = grpc[r]->Stats();
    EXPECT_EQ(st.of(Scope::kLagged, Phase::kForward).completed, kSeqs);
    EXPECT_EQ(st.of(Scope::kLagged, Phase::kBackward).completed, kSeqs);
    EXPECT_EQ(st.global_stats.completed, 2 * kSeqs);
    EXPECT_EQ(st.late_dropped, 0);
  }
  // A result stays: asked again, the same bits; a round never run is not there.
  std::vector<double> dy(kChannels), dyxmu(kChannels);
  int64_t count = 0;
  ASSERT_TRUE(shm[3]->GlobalSums(21, 1, kChannels, &count, dy.data(), dyxmu.data()).ok());
  EXPECT_TRUE(SameBits(dy, a[3][1].late_bwd.a) && SameBits(dyxmu, a[3][1].late_bwd.b));
  EXPECT_TRUE(shm[3]->GlobalSumsReady(21, 1));
  EXPECT_FALSE(shm[3]->GlobalSumsReady(21, 1000));
}

TEST(Lagged, BothPhasesThroughTheGroupTierOnBothTransports) {
  cluster::ClusterOptions opts;
  opts.nodes = 4;
  opts.workers_per_node = 2;
  opts.group_tier = true;
  opts.group_nodes = 2;
  auto started = LocalCluster::Start(opts);
  ASSERT_TRUE(started.ok()) << started.status();
  auto c = std::move(*started);
  auto shm = Connect(*c, "lagged-tier-shm", "auto", 2);
  auto grpc = Connect(*c, "lagged-tier-grpc", "grpc", 2);
  for (auto& p : shm) ASSERT_TRUE(p);
  for (auto& p : grpc) ASSERT_TRUE(p);
  auto a = RunJob(*c, shm, 3);
  auto b = RunJob(*c, grpc, 3);
  CheckRuns(*c, a, nullptr, /*flat=*/false);
  CheckRuns(*c, b, &a, /*flat=*/false);
}

TEST(Lagged, AOneNodeJobsLateResultsAreItsNodeAnswersWithoutARoot) {
  auto c = testing::StartCluster(1, 2);
  ASSERT_TRUE(c);
  auto job = Connect(*c, "lagged-one", "", 0);
  for (auto& p : job) ASSERT_TRUE(p);
  auto runs = RunJob(*c, job, 2);
  for (const auto& rank : runs) {
    for (const Seq& q : rank) {
      ASSERT_TRUE(q.late_fwd.status.ok()) << q.late_fwd.status;
      ASSERT_TRUE(q.late_bwd.status.ok()) << q.late_bwd.status;
      EXPECT_TRUE(SameBits(q.late_fwd.a, q.lagged_fwd.a) && SameBits(q.late_fwd.b, q.lagged_fwd.b));
      EXPECT_TRUE(SameBits(q.late_bwd.a, q.lagged_bwd.a) && SameBits(q.late_bwd.b, q.lagged_bwd.b));
      EXPECT_EQ(q.late_bwd.count, q.lagged_bwd.count);
    }
  }
}

// Every rank: a lagged forward and backward (answered by the node), then the waits for the
// job's statistics and sums.
struct Waits {
  absl::Status rounds, stats, sums;
};
std::vector<Waits> LaggedThenWait(std::vector<std::unique_ptr<Client>>& job, uint64_t seq) {
  std::vector<Waits> out(job.size());
  testing::OnEveryRank(int(job.size()), [&](int r) {
    std::vector<double> a{double(r)}, b{1.0}, oa(1), ob(1);
    int64_t count = 0;
    Waits& w = out[size_t(r)];
    w.rounds = job[size_t(r)]->Forward(7, seq, Scope::kLagged, 1, 2, a.data(), b.data(), &count,
                                       oa.data(), ob.data());
    if (w.rounds.ok()) {
      w.rounds = job[size_t(r)]->Backward(7, seq, Scope::kLagged, 1, 2, a.data(), b.data(),
                                          &count, oa.data(), ob.data());
    }
    w.stats = job[size_t(r)]->GlobalStats(7, seq, 1, &count, oa.data(), ob.data());
    w.sums = job[size_t(r)]->GlobalSums(7, seq, 1, &count, oa.data(), ob.data());
  });
  return out;
}

TEST(Lagged, AKilledRootFailsBothWaitsNamingTheRoundAndNodeRoundsGoOn) {
  auto c = testing::StartCluster(2, 2);
  ASSERT_TRUE(c);
  for (const char* transport : {"auto", "grpc"}) {
    SCOPED_TRACE(transport);
    auto job = Connect(*c, absl::StrCat("lagged-killed-", transport), transport, 0);
    for (auto& p : job) ASSERT_TRUE(p);
    for (const Waits& w : LaggedThenWait(job, 0)) {
      ASSERT_TRUE(w.rounds.ok()) << w.rounds;
      ASSERT_TRUE(w.stats.ok()) << w.stats;
      ASSERT_TRUE(w.sums.ok()) << w.sums;
    }
  }
  c->root()->Signal(SIGKILL);
  ASSERT_NE(c->root()->Wait(std::chrono::seconds(30)), -1);
  for (const char* transport : {"auto", "grpc"}) {
    SCOPED_TRACE(transport);
    auto job = Connect(*c, absl::StrCat("lagged-after-", transport), transport, 0);
    for (auto& p : job) ASSERT_TRUE(p);
    for (const Waits& w : LaggedThenWait(job, 1)) {
      // The node answered both phases; the late results name the round and the lost root.
      EXPECT_TRUE(w.rounds.ok()) << w.rounds;
      EXPECT_EQ(w.stats.code(), absl::StatusCode::kUnavailable) << w.stats;
      EXPECT_NE(w.stats.message().find("global statistics of lagged round op 7, seq 1"),
                std::string::npos)
          << w.stats;
      EXPECT_EQ(w.sums.code(), absl::StatusCode::kUnavailable) << w.sums;
      EXPECT_NE(w.sums.message().find("global sums of lagged round op 7, seq 1"),
                std::string::npos)
          << w.sums;
      EXPECT_NE(w.sums.message().find("root"), std::string::npos) << w.sums;
    }
    // Node rounds do not need the root.
    std::vector<absl::Status> node(job.size());
    testing::OnEveryRank(int(job.size()), [&](int r) {
      std::vector<double> mean{1.0}, m2{0.0};
      int64_t count = 0;
      node[size_t(r)] = job[size_t(r)]->Forward(8, 0, Scope::kNode, 1, 1, mean.data(), m2.data(),
                                                &count, mean.data(), m2.data());
    });
    for (const absl::Status& s : node) EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(Lagged, ABackwardWithoutItsForwardIsRefusedToThatRankOnly) {
  auto c = testing::StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto job = Connect(*c, "lagged-hostile", "grpc", 0);
  for (auto& p : job) ASSERT_TRUE(p);
  std::vector<double> a{1.0}, b{0.5}, oa(1), ob(1);
  int64_t count = 0;
  absl::Status s = job[1]->Backward(9, 0, Scope::kLagged, 1, 2, a.data(), b.data(), &count,
                                    oa.data(), ob.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("sent no lagged forward contribution to op 9, seq 0"),
            std::string::npos)
      << s;
  // The job goes on: every rank runs the round properly, rank 1 included.
  for (const Waits& w : LaggedThenWait(job, 0)) {
    EXPECT_TRUE(w.rounds.ok()) << w.rounds;
    EXPECT_TRUE(w.stats.ok()) << w.stats;
    EXPECT_TRUE(w.sums.ok()) << w.sums;
  }
}

TEST(Lagged, ALateResultForARoundThisClientDidNotStartIsDroppedNotKept) {
  auto c = testing::StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto job = Connect(*c, "lagged-unasked", "grpc", 0);
  for (auto& p : job) ASSERT_TRUE(p);
  // The root holds the round's answer back while rank 0 is replaced by a new process, which
  // never started the round; the sidecar relays the late result to every member it has.
  c->root()->Signal(SIGSTOP);
  testing::OnEveryRank(int(job.size()), [&](int r) {
    std::vector<double> a{double(r)}, b{1.0}, oa(1), ob(1);
    int64_t count = 0;
    EXPECT_TRUE(job[size_t(r)]->Forward(40, 0, Scope::kLagged, 1, 2, a.data(), b.data(), &count,
                                        oa.data(), ob.data()).ok());
  });
  job[0].reset();
  ClientOptions o = testing::RankOptions(*c, 0, "lagged-unasked");
  o.transport = "grpc";
  auto replaced = Client::Connect(o);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  job[0] = std::move(*replaced);
  // The sidecar relays the late result to the members attached when it arrives: wait until
  // it has the new rank 0's stream (Connect returns once the attach frame is written, not
  // once the sidecar has read it).
  for (bool attached = false; !attached;) {
    auto st = job[1]->Status(false);
    ASSERT_TRUE(st.ok()) << st.status();
    for (const auto& j : st->jobs()) {
      for (const auto& m : j.members()) attached = attached || (m.index() == 0 && m.connected());
    }
  }
  c->root()->Signal(SIGCONT);
  std::vector<double> m(1), m2(1);
  int64_t count = 0;
  ASSERT_TRUE(job[1]->GlobalStats(40, 0, 1, &count, m.data(), m2.data()).ok());
  EXPECT_EQ(count, 8);
  // A node round after it on the same ordered stream: the late result reached rank 0 first.
  testing::OnEveryRank(2, [&](int r) {
    std::vector<double> a{1.0}, b{0.0};
    int64_t n = 0;
    EXPECT_TRUE(job[size_t(r)]->Forward(41, 0, Scope::kNode, 1, 1, a.data(), b.data(), &n,
                                        a.data(), b.data()).ok());
  });
  EXPECT_EQ(job[0]->Stats().late_dropped, 1);
  EXPECT_FALSE(job[0]->GlobalStatsReady(40, 0));
  EXPECT_EQ(job[1]->Stats().late_dropped, 0);
}

// On the shared-memory path the sidecar sees no rank's contribution: a rank whose backward
// count disagrees with its forward's is caught at the root, in its node's partial, and told to
// that node's ranks as their late result; the other node's wait ends at the root's deadline.
TEST(Lagged, ACountThatDisagreesIsRefusedAtTheRootToItsNodeOnTheSharedMemoryPath) {
  auto c = testing::StartCluster(2, 2, {"--round-timeout-ms=2000"});
  ASSERT_TRUE(c);
  auto job = Connect(*c, "lagged-count", "auto", 0);
  for (auto& p : job) ASSERT_TRUE(p);
  std::vector<absl::Status> sums(job.size());
  testing::OnEveryRank(int(job.size()), [&](int r) {
    std::vector<double> a{double(r)}, b{1.0}, oa(1), ob(1);
    int64_t count = 0;
    Client& client = *job[size_t(r)];
    absl::Status s = client.Forward(7, 0, Scope::kLagged, 1, 2, a.data(), b.data(), &count,
                                    oa.data(), ob.data());
    if (s.ok()) {
      s = client.Backward(7, 0, Scope::kLagged, 1, r == 0 ? 3 : 2, a.data(), b.data(), &count,
                          oa.data(), ob.data());
    }
    if (s.ok()) s = client.GlobalSums(7, 0, 1, &count, oa.data(), ob.data());
    sums[size_t(r)] = s;
  });
  EXPECT_EQ(job[0]->Stats().transport, "shm");
  for (int r : {0, 1}) {
    EXPECT_EQ(sums[size_t(r)].code(), absl::StatusCode::kInvalidArgument) << sums[size_t(r)];
    EXPECT_NE(sums[size_t(r)].message().find("field 'count' is 5 but its lagged forward "
                                             "contribution to op 7, seq 0 had count 4"),
              std::string::npos)
        << sums[size_t(r)];
  }
  for (int r : {2, 3}) {
    EXPECT_EQ(sums[size_t(r)].code(), absl::StatusCode::kDeadlineExceeded) << sums[size_t(r)];
    EXPECT_NE(sums[size_t(r)].message().find("node 0"), std::string::npos) << sums[size_t(r)];
  }
}

}  // namespace
}  // namespace hsbn

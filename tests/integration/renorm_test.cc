// Renorm scope with real aggregator processes: the node answer at once, the job's statistics
// afterwards (Client::GlobalStats), the same bits on every rank and on both node transports,
// and what a root that dies or stops answering does to them.
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
#include "test_cluster.h"

namespace hsbn {
namespace {

using testing::RankOptions;
using testing::StartCluster;

std::vector<std::unique_ptr<Client>> ConnectJob(const cluster::LocalCluster& c,
                                                const std::string& job,
                                                const std::string& transport) {
  std::vector<std::unique_ptr<Client>> out;
  for (int r = 0; r < c.world_size(); ++r) {
    ClientOptions o = RankOptions(c, r, job);
    o.transport = transport;
    auto client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    out.push_back(client.ok() ? std::move(*client) : nullptr);
  }
  return out;
}

struct Stats {
  absl::Status status;
  int64_t count = 0;
  std::vector<double> mean, m2;
  bool operator==(const Stats& o) const {
    return count == o.count && mean.size() == o.mean.size() && m2.size() == o.m2.size() &&
           std::memcmp(mean.data(), o.mean.data(), mean.size() * sizeof(double)) == 0 &&
           std::memcmp(m2.data(), o.m2.data(), m2.size() * sizeof(double)) == 0;
  }
};

// A rank's forward input for (seq): values over several magnitudes, so that another merge
// order would change low bits.
void Input(int rank, uint64_t seq, int64_t channels, int64_t* count, std::vector<double>* mean,
           std::vector<double>* m2) {
  std::mt19937_64 gen(uint64_t(rank) * 7919u + seq * 104729u + 1);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  *count = 1 + int64_t(gen() % 50);
  mean->clear();
  m2->clear();
  for (int64_t c = 0; c < channels; ++c) {
    const double scale = std::pow(10.0, double(c % 7) - 3.0);
    mean->push_back(u(gen) * scale + rank);
    m2->push_back(std::fabs(u(gen)) * scale * double(*count));
  }
}

struct RankRun {
  std::vector<Stats> renorm_node, node, global, late;
  absl::Status backward;
};

// Per seq: a renorm forward (op 11) and its backward, a node forward and a global forward of
// the same input (ops 12, 13), then the renorm round's global statistics.
RankRun RunRank(Client& client, int rank, int seqs, int64_t channels) {
  RankRun run;
  for (int s = 0; s < seqs; ++s) {
    const uint64_t seq = uint64_t(s);
    int64_t count;
    std::vector<double> mean, m2;
    Input(rank, seq, channels, &count, &mean, &m2);
    auto forward = [&](uint32_t op, Scope scope) {
      Stats out;
      out.mean.resize(size_t(channels));
      out.m2.resize(size_t(channels));
      out.status = client.Forward(op, seq, scope, channels, count, mean.data(), m2.data(),
                                  &out.count, out.mean.data(), out.m2.data());
      return out;
    };
    run.renorm_node.push_back(forward(11, Scope::kRenorm));
    std::vector<double> a(size_t(channels), 0.5), b(size_t(channels), -0.25), oa(a), ob(b);
    int64_t total = 0;
    absl::Status back = client.Backward(11, seq, Scope::kRenorm, channels, count, a.data(),
                                        b.data(), &total, oa.data(), ob.data());
    if (run.backward.ok()) run.backward = back;
    run.node.push_back(forward(12, Scope::kNode));
    run.global.push_back(forward(13, Scope::kGlobal));
    Stats late;
    late.mean.resize(size_t(channels));
    late.m2.resize(size_t(channels));
    late.status = client.GlobalStats(11, seq, channels, &late.count, late.mean.data(),
                                     late.m2.data());
    run.late.push_back(std::move(late));
  }
  return run;
}

std::vector<RankRun> RunJob(std::vector<std::unique_ptr<Client>>& clients, int seqs,
                            int64_t channels) {
  std::vector<RankRun> runs(clients.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < clients.size(); ++r) {
    threads.emplace_back([&, r] { runs[r] = RunRank(*clients[r], int(r), seqs, channels); });
  }
  for (auto& t : threads) t.join();
  return runs;
}

TEST(Renorm, NodeAnswerAtOnceThenTheJobsStatisticsWithGlobalsBitsOnEveryRankAndTransport) {
  auto c = StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto shm = ConnectJob(*c, "renorm-shm", "auto");
  auto grpc = ConnectJob(*c, "renorm-grpc", "grpc");
  for (auto& p : shm) ASSERT_TRUE(p);
  for (auto& p : grpc) ASSERT_TRUE(p);
  constexpr int kSeqs = 5;
  constexpr int64_t kChannels = 23;
  std::vector<RankRun> a = RunJob(shm, kSeqs, kChannels);
  std::vector<RankRun> b = RunJob(grpc, kSeqs, kChannels);
  for (size_t r = 0; r < 4; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_EQ(shm[r]->Stats().transport, "shm");
    EXPECT_TRUE(a[r].backward.ok()) << a[r].backward;
    EXPECT_TRUE(b[r].backward.ok()) << b[r].backward;
    for (int s = 0; s < kSeqs; ++s) {
      SCOPED_TRACE(absl::StrCat("seq ", s));
      for (const RankRun* run : {&a[r], &b[r]}) {
        ASSERT_TRUE(run->renorm_node[size_t(s)].status.ok()) << run->renorm_node[size_t(s)].status;
        ASSERT_TRUE(run->late[size_t(s)].status.ok()) << run->late[size_t(s)].status;
        // The forward answer is the node's statistics; the late one the job's, bit for bit
        // what a global round of the same inputs gives.
        EXPECT_TRUE(run->renorm_node[size_t(s)] == run->node[size_t(s)]);
        EXPECT_TRUE(run->late[size_t(s)] == run->global[size_t(s)]);
        EXPECT_FALSE(run->late[size_t(s)] == run->node[size_t(s)]);
      }
      // Every rank of the job, on either transport, holds the same global bits.
      EXPECT_TRUE(a[r].late[size_t(s)] == a[0].late[size_t(s)]);
      EXPECT_TRUE(b[r].late[size_t(s)] == a[0].late[size_t(s)]);
    }
    const ClientStats st = shm[r]->Stats();
    EXPECT_EQ(st.of(Scope::kRenorm, Phase::kForward).completed, kSeqs);
    EXPECT_EQ(st.of(Scope::kRenorm, Phase::kBackward).completed, kSeqs);
    EXPECT_EQ(st.global_stats.completed, kSeqs);
    EXPECT_EQ(st.global_stats.failed, 0);
  }
  // The job's count is every rank's.
  int64_t want = 0;
  for (int r = 0; r < 4; ++r) {
    int64_t count;
    std::vector<double> mean, m2;
    Input(r, 0, kChannels, &count, &mean, &m2);
    want += count;
  }
  EXPECT_EQ(a[0].late[0].count, want);
  // A result stays available: asking again gives the same bits without a round.
  Stats again;
  again.mean.resize(kChannels);
  again.m2.resize(kChannels);
  again.status = shm[1]->GlobalStats(11, 0, kChannels, &again.count, again.mean.data(),
                                     again.m2.data());
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_TRUE(again == a[1].late[0]);
  EXPECT_TRUE(shm[1]->GlobalStatsReady(11, 0));
  EXPECT_FALSE(shm[1]->GlobalStatsReady(11, 1000));
}

TEST(Renorm, AOneNodeJobsGlobalStatisticsAreItsNodesWithoutARoot) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "renorm-one", "");
  for (auto& p : job) ASSERT_TRUE(p);
  std::vector<RankRun> runs = RunJob(job, 3, 5);
  for (size_t r = 0; r < 2; ++r) {
    for (size_t s = 0; s < 3; ++s) {
      ASSERT_TRUE(runs[r].late[s].status.ok()) << runs[r].late[s].status;
      EXPECT_TRUE(runs[r].late[s] == runs[r].node[s]);
      EXPECT_TRUE(runs[r].late[s] == runs[r].global[s]);
    }
  }
}

// The two ranks of one node each: a renorm forward (answered by the node at once), then the
// wait for its global statistics.
std::vector<absl::Status> RenormThenWait(std::vector<std::unique_ptr<Client>>& job,
                                         uint64_t seq) {
  std::vector<absl::Status> out(job.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < job.size(); ++r) {
    threads.emplace_back([&, r] {
      std::vector<double> mean{double(r)}, m2{1.0}, om(1), om2(1);
      int64_t count = 0;
      absl::Status s = job[r]->Forward(7, seq, Scope::kRenorm, 1, 2, mean.data(), m2.data(),
                                       &count, om.data(), om2.data());
      if (s.ok()) s = job[r]->GlobalStats(7, seq, 1, &count, om.data(), om2.data());
      out[r] = s;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(Renorm, ARootThatStopsAnsweringFailsTheGlobalStatisticsNamingTheRoundOnEveryRank) {
  auto c = StartCluster(2, 1, {"--round-timeout-ms=2000"});
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "renorm-frozen", "");
  for (auto& p : job) ASSERT_TRUE(p);
  for (const absl::Status& s : RenormThenWait(job, 0)) ASSERT_TRUE(s.ok()) << s;
  c->root()->Signal(SIGSTOP);
  std::vector<absl::Status> got = RenormThenWait(job, 1);
  c->root()->Signal(SIGCONT);
  for (const absl::Status& s : got) {
    // The sidecar's backstop (DEADLINE_EXCEEDED) or its keepalive (UNAVAILABLE), whichever
    // comes first; either way the forward itself was answered and the wait names the round.
    EXPECT_TRUE(s.code() == absl::StatusCode::kDeadlineExceeded ||
                s.code() == absl::StatusCode::kUnavailable)
        << s;
    EXPECT_NE(s.message().find("global statistics of renorm round op 7, seq 1"),
              std::string::npos)
        << s;
    EXPECT_NE(s.message().find("root aggregator"), std::string::npos) << s;
  }
}

TEST(Renorm, AKilledRootFailsTheWaitAtOnceAndNodeRoundsGoOn) {
  auto c = StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "renorm-killed", "");
  for (auto& p : job) ASSERT_TRUE(p);
  for (const absl::Status& s : RenormThenWait(job, 0)) ASSERT_TRUE(s.ok()) << s;
  c->root()->Signal(SIGKILL);
  ASSERT_NE(c->root()->Wait(std::chrono::seconds(30)), -1);
  for (const absl::Status& s : RenormThenWait(job, 1)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("global statistics of renorm round op 7, seq 1"),
              std::string::npos)
        << s;
  }
  // Node rounds do not need the root.
  std::vector<std::thread> threads;
  std::vector<absl::Status> node(job.size());
  for (size_t r = 0; r < job.size(); ++r) {
    threads.emplace_back([&, r] {
      std::vector<double> mean{1.0}, m2{0.0};
      int64_t count = 0;
      node[r] = job[r]->Forward(8, 0, Scope::kNode, 1, 1, mean.data(), m2.data(), &count,
                                mean.data(), m2.data());
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : node) EXPECT_TRUE(s.ok()) << s;
}

// Shared-memory rounds never read the stream, which carries the late results: a layer that does
// not ask for them (a warm-up) must not let them pile up at the sidecar, which ends a stream
// more than --max-queued-bytes behind (and then counts the worker as gone).
TEST(Renorm, LateResultsNobodyAsksForDoNotPileUpAtTheSidecar) {
  // The sidecars' limit is small; the root's is not (its results to the sidecars are not
  // what this tests).
  cluster::ClusterOptions opts;
  opts.nodes = 2;
  opts.workers_per_node = 2;
  opts.extra_flags = {"--max-queued-bytes=1048576"};
  opts.root_flags = {"--max-queued-bytes=1073741824"};
  auto started = cluster::LocalCluster::Start(opts);
  ASSERT_TRUE(started.ok()) << started.status();
  auto c = std::move(*started);
  auto job = ConnectJob(*c, "renorm-unread", "auto");
  for (auto& p : job) ASSERT_TRUE(p);
  constexpr int64_t kChannels = 4096;  // 64 KiB of statistics per late result
  constexpr int kRounds = 200;         // 12.5 MiB of late results per worker
  std::vector<absl::Status> status(job.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < job.size(); ++r) {
    threads.emplace_back([&, r] {
      std::vector<double> mean(kChannels, double(r)), m2(kChannels, 1.0), om(kChannels),
          om2(kChannels);
      int64_t count = 0;
      for (int seq = 0; seq < kRounds && status[r].ok(); ++seq) {
        status[r] = job[r]->Forward(9, uint64_t(seq), Scope::kRenorm, kChannels, 2, mean.data(),
                                    m2.data(), &count, om.data(), om2.data());
        // A global round now and then paces the partials to the root (the sidecar's link to
        // the root has the same small limit); it does not read the stream either.
        if (seq % 8 == 7 && status[r].ok()) {
          status[r] = job[r]->Forward(10, uint64_t(seq), Scope::kGlobal, 1, 2, mean.data(),
                                      m2.data(), &count, om.data(), om2.data());
        }
      }
      if (status[r].ok()) {
        status[r] = job[r]->GlobalStats(9, kRounds - 1, kChannels, &count, om.data(), om2.data());
      }
      if (status[r].ok() && count != 8) status[r] = absl::InternalError("wrong count");
      if (status[r].ok()) {  // the first one is still kept
        status[r] = job[r]->GlobalStats(9, 0, kChannels, &count, om.data(), om2.data());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < job.size(); ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(job[r]->Stats().transport, "shm");
  }
}

// Layer names reach the root, which shows them in its divergence record (renorm rounds are
// recorded there like shadow rounds; a renorm round's global statistics arriving means the
// root has recorded it).
TEST(Renorm, GlobalStatsOfARoundNotStartedWithALateScopeFailNamingWhyInsteadOfWaiting) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "renorm-not-late", "");
  for (auto& p : job) ASSERT_TRUE(p);
  std::vector<absl::Status> node(job.size()), never(job.size()), renorm(job.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < job.size(); ++r) {
    threads.emplace_back([&, r] {
      std::vector<double> mean{double(r)}, m2{1.0}, om(1), om2(1);
      int64_t count = 0;
      absl::Status s = job[r]->Forward(3, 0, Scope::kNode, 1, 2, mean.data(), m2.data(), &count,
                                       om.data(), om2.data());
      // A node round (the op's earlier scope), and a round never started: no late result.
      node[r] = s.ok() ? job[r]->GlobalStats(3, 0, 1, &count, om.data(), om2.data()) : s;
      never[r] = job[r]->GlobalStats(3, 1, 1, &count, om.data(), om2.data());
      s = job[r]->Forward(3, 2, Scope::kRenorm, 1, 2, mean.data(), m2.data(), &count, om.data(),
                          om2.data());
      renorm[r] = s.ok() ? job[r]->GlobalStats(3, 2, 1, &count, om.data(), om2.data()) : s;
      if (renorm[r].ok() && count != 4) renorm[r] = absl::InternalError("wrong count");
    });
  }
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < job.size(); ++r) {
    EXPECT_EQ(node[r].code(), absl::StatusCode::kFailedPrecondition) << node[r];
    EXPECT_NE(std::string(node[r].message())
                  .find("did not start that round with renorm or lagged scope"),
              std::string::npos)
        << node[r];
    EXPECT_EQ(never[r].code(), absl::StatusCode::kFailedPrecondition) << never[r];
    EXPECT_TRUE(renorm[r].ok()) << renorm[r];  // the client is still in step
  }
  EXPECT_EQ(job[0]->Stats().global_stats.failed, 2);
}

TEST(Renorm, TheRootsDivergenceRecordNamesTheLayersTheWorkersNamed) {
  auto c = StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "renorm-names", "");
  for (auto& p : job) ASSERT_TRUE(p);
  std::vector<absl::Status> status(job.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < job.size(); ++r) {
    threads.emplace_back([&, r] {
      absl::Status s = job[r]->NameLayers({{5, "net:layer1.bn"}, {6, std::string("bad\x01name")}});
      if (s.ok() && r == 0) s = job[r]->NameLayers({{5, "a second name"}});  // the first stays
      std::vector<double> mean{double(r), 1.0}, m2{1.0, 2.0}, om(2), om2(2);
      int64_t count = 0;
      for (uint32_t op : {5u, 6u}) {
        if (s.ok()) {
          s = job[r]->Forward(op, 0, Scope::kRenorm, 2, 3, mean.data(), m2.data(), &count,
                              om.data(), om2.data());
        }
        if (s.ok()) s = job[r]->GlobalStats(op, 0, 2, &count, om.data(), om2.data());
      }
      status[r] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : status) ASSERT_TRUE(s.ok()) << s;
  auto st = job[0]->Status(/*include_upstream=*/true);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_TRUE(st->has_upstream());
  ASSERT_EQ(st->upstream().jobs_size(), 1);
  int named = 0, unnamed = 0;
  for (const v1::Divergence& d : st->upstream().jobs(0).divergence()) {
    if (d.op() == 5) {
      EXPECT_EQ(d.layer(), "net:layer1.bn");
      ++named;
    } else if (d.op() == 6) {
      EXPECT_EQ(d.layer(), "");  // not printable: dropped
      ++unnamed;
    }
  }
  EXPECT_EQ(named, 2);  // one record per node
  EXPECT_EQ(unnamed, 2);
}

}  // namespace
}  // namespace hsbn

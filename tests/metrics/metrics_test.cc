// Metrics: real hsbn-aggregator processes with --metrics-listen=127.0.0.1:0, real rounds run by
// in-process C++ clients, /metrics scraped over plain HTTP, exact values asserted.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "aggregator_process.h"
#include "grpcpp/grpcpp.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "wire.h"
#include "gtest/gtest.h"
#include "hsbn/v1/hsbn.pb.h"

namespace hsbn {
namespace {

using testing::ForwardRound;
using testing::HttpGet;
using testing::Sample;
using testing::StartAggregator;
using testing::TempDir;
using testing::WorkerOptions;

std::string Scrape(const testing::Aggregator& a) {
  auto body = HttpGet(a.metrics);
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? *body : "";
}

std::map<std::string, std::string> L(std::initializer_list<std::pair<const std::string, std::string>> l) {
  return std::map<std::string, std::string>(l);
}

TEST(Metrics, SidecarCountsRoundsLatencyMembersBytesAndTimeouts) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "node0",
                             {"--role=node", "--listen=unix:" + (dir / "node0.sock"),
                              "--metrics-listen=127.0.0.1:0", "--round-timeout-ms=400",
                              "--max-jobs=7"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  // The ready file: the gRPC address first, then the metrics URL.
  ASSERT_EQ(agg->ready_lines.size(), 2u);
  EXPECT_EQ(agg->ready_lines[0], "unix:" + (dir / "node0.sock"));
  EXPECT_EQ(agg->ready_lines[1].rfind("metrics=http://127.0.0.1:", 0), 0u) << agg->ready_lines[1];

  std::string text = Scrape(*agg);
  EXPECT_EQ(Sample(text, "hsbn_jobs", L({{"role", "node"}})), 0);
  EXPECT_EQ(Sample(text, "hsbn_max_jobs"), 7);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "node"}, {"phase", "forward"}, {"outcome", "ok"}})), 0);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_upstream_connected")));  // no --upstream

  std::vector<std::unique_ptr<Client>> owned;
  std::vector<Client*> clients;
  for (int rank = 0; rank < 2; ++rank) {
    auto c = Client::Connect(WorkerOptions(agg->address, "m-job", rank, 2, 2));
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(c->get());
    owned.push_back(std::move(*c));
  }
  constexpr int kForward = 5, kBackward = 3;
  for (int seq = 0; seq < kForward; ++seq) {
    for (const auto& r : ForwardRound(clients, 1, seq, Scope::kNode)) {
      ASSERT_TRUE(r.status.ok()) << r.status;
    }
  }
  for (int seq = 0; seq < kBackward; ++seq) {
    std::vector<std::thread> threads;
    for (Client* c : clients) {
      threads.emplace_back([c, seq] {
        double dy[2] = {1, 2}, dyx[2] = {3, 4}, oa[2], ob[2];
        int64_t n;
        EXPECT_TRUE(c->Backward(1, seq, Scope::kNode, 2, 10, dy, dyx, &n, oa, ob).ok());
      });
    }
    for (auto& t : threads) t.join();
  }

  text = Scrape(*agg);
  const auto ok_fwd = L({{"role", "node"}, {"scope", "node"}, {"phase", "forward"}});
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "node"}, {"phase", "forward"}, {"outcome", "ok"}})), kForward);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "node"}, {"phase", "backward"}, {"outcome", "ok"}})), kBackward);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "global"}, {"phase", "forward"}, {"outcome", "ok"}})), 0);
  EXPECT_EQ(Sample(text, "hsbn_round_duration_seconds_count", ok_fwd), kForward);
  auto inf = ok_fwd;
  inf["le"] = "+Inf";
  EXPECT_EQ(Sample(text, "hsbn_round_duration_seconds_bucket", inf), kForward);
  EXPECT_GT(Sample(text, "hsbn_round_duration_seconds_sum", ok_fwd), 0);
  EXPECT_LT(Sample(text, "hsbn_round_duration_seconds_sum", ok_fwd), 30);
  EXPECT_EQ(Sample(text, "hsbn_jobs"), 1);
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "m-job"}})), 2);
  EXPECT_EQ(Sample(text, "hsbn_members_expected", L({{"job_id", "m-job"}})), 2);
  EXPECT_EQ(Sample(text, "hsbn_open_rounds", L({{"job_id", "m-job"}})), 0);
  EXPECT_EQ(Sample(text, "hsbn_joins_total", L({{"outcome", "ok"}})), 2);
  // Every contribution (2 clients x 8 rounds, each 4 or 2 channels) came in, every result out.
  const double received = Sample(text, "hsbn_received_bytes_total", L({{"link", "members"}}));
  const double sent = Sample(text, "hsbn_sent_bytes_total", L({{"link", "members"}}));
  EXPECT_GT(received, 2 * (kForward * 4 * 16 + kBackward * 2 * 16));
  EXPECT_GT(sent, 2 * (kForward * 4 * 16 + kBackward * 2 * 16));
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_round_timeouts_total")));  // none yet

  // A forced timeout: rank 0 contributes, rank 1 does not.
  double mean[4] = {0, 1, 2, 3}, m2[4] = {1, 1, 1, 1}, om[4], om2[4];
  int64_t n;
  absl::Status s = clients[0]->Forward(2, 0, Scope::kNode, 4, 10, mean, m2, &n, om, om2);
  ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;

  text = Scrape(*agg);
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total",
                   L({{"role", "node"}, {"job_id", "m-job"}, {"member", "rank1"}})), 1);
  EXPECT_TRUE(std::isnan(
      Sample(text, "hsbn_round_timeouts_total", L({{"member", "rank0"}}))));
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "node"}, {"phase", "forward"}, {"outcome", "deadline_exceeded"}})),
            1);
  // A failed round is not a latency sample.
  EXPECT_EQ(Sample(text, "hsbn_round_duration_seconds_count", ok_fwd), kForward);

  // A Join refused (bad layout) is counted by outcome, and the job is dropped when all leave.
  auto bad = Client::Connect(WorkerOptions(agg->address, "m-job", 1, 3, 3));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  owned.clear();
  for (int i = 0; i < 200; ++i) {
    text = Scrape(*agg);
    if (Sample(text, "hsbn_jobs") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Sample(text, "hsbn_jobs"), 0);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_members", L({{"job_id", "m-job"}}))));
  EXPECT_EQ(Sample(text, "hsbn_joins_total", L({{"outcome", "invalid_argument"}})), 1);
}

TEST(Metrics, RootAndSidecarsCountGlobalRoundsAndTheRootExportsShadowDivergence) {
  TempDir dir;
  auto root = StartAggregator(dir.path(), "root",
                              {"--role=root", "--listen=127.0.0.1:0",
                               "--metrics-listen=127.0.0.1:0", "--round-timeout-ms=300"});
  ASSERT_TRUE(root.ok()) << root.status();
  std::vector<testing::Aggregator> sidecars;
  std::vector<std::unique_ptr<Client>> owned;
  std::vector<Client*> clients;
  for (int node = 0; node < 2; ++node) {
    const std::string name = "node" + std::to_string(node);
    auto s = StartAggregator(dir.path(), name,
                             {"--role=node", "--listen=unix:" + (dir / (name + ".sock")),
                              "--upstream=" + root->address, "--metrics-listen=127.0.0.1:0",
                              // longer than the root's, so that the root times out first
                              "--round-timeout-ms=3000"});
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(Sample(Scrape(*s), "hsbn_upstream_connected"), 0);  // connects on first use
    ClientOptions o = WorkerOptions(s->address, "g-job", node, 2, 1);
    o.group_nodes = 2;  // one group of both nodes: its statistics are the global ones
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(c->get());
    owned.push_back(std::move(*c));
    sidecars.push_back(std::move(*s));
  }
  constexpr int kGlobal = 4, kShadow = 3;
  for (int seq = 0; seq < kGlobal; ++seq) {
    for (const auto& r : ForwardRound(clients, 0, seq, Scope::kGlobal)) {
      ASSERT_TRUE(r.status.ok()) << r.status;
      EXPECT_EQ(r.count, 20);
    }
  }
  // Shadow rounds of op 3: node 0's batch has mean 0, node 1's mean 2, both variance 1 (one
  // channel). Global: mean 1, variance 1 + 1 = 2. So each node's mean is 1/sqrt(2) global
  // standard deviations off, and its variance is half the global one.
  const std::vector<double> means = {0.0, 2.0};
  for (int seq = 0; seq < kShadow; ++seq) {
    auto out = ForwardRound(clients, 3, seq, Scope::kShadow, 1, &means);
    for (const auto& r : out) {
      ASSERT_TRUE(r.status.ok()) << r.status;
      EXPECT_EQ(r.count, 10);  // answered with the node's statistics
    }
  }
  // The root reduces shadow rounds off the critical path: wait until it has all of them.
  std::string text;
  for (int i = 0; i < 500; ++i) {
    text = Scrape(*root);
    if (Sample(text, "hsbn_shadow_rounds", L({{"job_id", "g-job"}, {"op", "3"}, {"node", "1"}})) ==
            kShadow &&
        Sample(text, "hsbn_rounds_total",
               L({{"scope", "shadow"}, {"phase", "forward"}, {"outcome", "ok"}})) == kShadow) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double eps = 1e-5;
  const double shift = 1.0 / std::sqrt(2.0 + eps), ratio = (1.0 + eps) / (2.0 + eps);
  for (const char* node : {"0", "1"}) {
    const auto l = L({{"role", "root"}, {"job_id", "g-job"}, {"op", "3"}, {"node", node}});
    EXPECT_EQ(Sample(text, "hsbn_shadow_rounds", l), kShadow) << node;
    EXPECT_NEAR(Sample(text, "hsbn_shadow_mean_shift", l), shift, 1e-12) << node;
    EXPECT_NEAR(Sample(text, "hsbn_shadow_mean_shift_max", l), shift, 1e-12) << node;
    EXPECT_NEAR(Sample(text, "hsbn_shadow_var_ratio", l), ratio, 1e-12) << node;
    EXPECT_NEAR(Sample(text, "hsbn_shadow_log_var_ratio_abs", l), -std::log(ratio), 1e-12);
  }
  // The group's record: both nodes merged in node order, as the root merges the global
  // statistics, so no shift and the same spread, to the bit.
  const auto g = L({{"role", "root"}, {"job_id", "g-job"}, {"op", "3"}, {"group", "0"}});
  EXPECT_EQ(Sample(text, "hsbn_shadow_rounds", g), kShadow);
  EXPECT_EQ(Sample(text, "hsbn_shadow_mean_shift", g), 0.0);
  EXPECT_EQ(Sample(text, "hsbn_shadow_mean_shift_max", g), 0.0);
  EXPECT_EQ(Sample(text, "hsbn_shadow_var_ratio", g), 1.0);
  EXPECT_EQ(Sample(text, "hsbn_shadow_log_var_ratio_abs", g), 0.0);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"role", "root"}, {"scope", "global"}, {"phase", "forward"},
                      {"outcome", "ok"}})), kGlobal);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "shadow"}, {"phase", "forward"}, {"outcome", "ok"}})), kShadow);
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "g-job"}})), 2);  // two sidecars
  EXPECT_EQ(Sample(text, "hsbn_joins_total", L({{"outcome", "ok"}})), 2);
  for (auto& s : sidecars) {
    const std::string st = Scrape(s);
    EXPECT_EQ(Sample(st, "hsbn_rounds_total",
                     L({{"role", "node"}, {"scope", "global"}, {"phase", "forward"},
                        {"outcome", "ok"}})), kGlobal);
    EXPECT_EQ(Sample(st, "hsbn_rounds_total",
                     L({{"scope", "shadow"}, {"phase", "forward"}, {"outcome", "ok"}})), kShadow);
    EXPECT_EQ(Sample(st, "hsbn_round_duration_seconds_count",
                     L({{"scope", "global"}, {"phase", "forward"}})), kGlobal);
    EXPECT_EQ(Sample(st, "hsbn_upstream_connected"), 1);
    EXPECT_GT(Sample(st, "hsbn_sent_bytes_total", L({{"link", "upstream"}})),
              (kGlobal * 4 + kShadow) * 16);
    EXPECT_GT(Sample(st, "hsbn_received_bytes_total", L({{"link", "upstream"}})),
              kGlobal * 4 * 16);
  }

  // Node 1 misses a global round: the root times out waiting for node 1 and says so.
  double mean[4] = {0, 1, 2, 3}, m2[4] = {1, 1, 1, 1}, om[4], om2[4];
  int64_t n;
  absl::Status s = clients[0]->Forward(0, 100, Scope::kGlobal, 4, 10, mean, m2, &n, om, om2);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  for (int i = 0; i < 200; ++i) {
    text = Scrape(*root);
    if (Sample(text, "hsbn_round_timeouts_total", L({{"member", "node1"}})) == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total",
                   L({{"role", "root"}, {"job_id", "g-job"}, {"member", "node1"}})), 1);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_round_timeouts_total", L({{"member", "node 0"}}))));
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"role", "root"}, {"scope", "global"}, {"phase", "forward"},
                      {"outcome", "deadline_exceeded"}})), 1);
}

// Node rounds through shared memory never pass through the sidecar: the workers count them in
// the segment, and the sidecar moves those counts into its metrics before every scrape, so a
// scrape after a round's answer counts it, as over the stream. (The suite's environment forces
// the stream; these workers ask for shared memory themselves.)
TEST(Metrics, SidecarCountsTheRoundsItsWorkersRanThroughSharedMemory) {
  TempDir dir;
  auto root = StartAggregator(dir.path(), "root", {"--role=root", "--listen=127.0.0.1:0"});
  ASSERT_TRUE(root.ok()) << root.status();
  auto agg = StartAggregator(dir.path(), "node0",
                             {"--role=node", "--listen=unix:" + (dir / "node0.sock"),
                              "--upstream=" + root->address, "--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  std::vector<std::unique_ptr<Client>> owned;
  std::vector<Client*> clients;
  for (int rank = 0; rank < 2; ++rank) {
    ClientOptions o = WorkerOptions(agg->address, "shm-job", rank, 2, 2);
    o.transport = "auto";
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(c->get());
    owned.push_back(std::move(*c));
  }
  constexpr int kForward = 4, kGlobal = 2;
  for (int seq = 0; seq < kForward; ++seq) {
    for (const auto& r : ForwardRound(clients, 1, seq, Scope::kNode)) {
      ASSERT_TRUE(r.status.ok()) << r.status;
    }
  }
  for (int seq = 0; seq < kGlobal; ++seq) {
    for (const auto& r : ForwardRound(clients, 2, seq, Scope::kGlobal)) {
      ASSERT_TRUE(r.status.ok()) << r.status;
    }
  }
  for (Client* c : clients) ASSERT_EQ(c->Stats().transport, "shm");
  // A node round with a NaN in one rank's mean (not strict: it propagates), and a backward
  // round whose ranks disagree on the channels (INVALID_ARGUMENT for both).
  const std::vector<double> means = {std::nan(""), 1.0};
  for (const auto& r : ForwardRound(clients, 3, 0, Scope::kNode, 1, &means)) {
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_TRUE(std::isnan(r.a[0]));
  }
  {
    std::vector<absl::Status> got(2);
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        double dy[3] = {1, 2, 3}, dyx[3] = {3, 4, 5}, oa[3], ob[3];
        int64_t n;
        got[size_t(i)] = clients[size_t(i)]->Backward(4, 0, Scope::kNode, 2 + i, 10, dy, dyx, &n,
                                                      oa, ob);
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& st : got) EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
  const std::string text = Scrape(*agg);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "node"}, {"phase", "forward"}, {"outcome", "ok"}})), kForward + 1);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "global"}, {"phase", "forward"}, {"outcome", "ok"}})), kGlobal);
  EXPECT_EQ(Sample(text, "hsbn_rounds_total",
                   L({{"scope", "node"}, {"phase", "backward"}, {"outcome", "invalid_argument"}})),
            1);
  EXPECT_EQ(Sample(text, "hsbn_nonfinite_values_total", L({{"phase", "forward"}})), 1);
  // Status counts them too (rounds through the segment add to the job's totals).
  auto st = clients[0]->Status(false);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->jobs_size(), 1);
  EXPECT_EQ(st->jobs(0).node_transport(), "shm");
  EXPECT_EQ(st->jobs(0).rounds_completed(), kForward + kGlobal + 1);
  EXPECT_EQ(st->jobs(0).rounds_failed(), 1);
}

// Many global rounds in flight: a sidecar sends what queued while its previous write to the
// root was in flight as one batch message, and the root answers a batch-capable sidecar the
// same way. Every round must still get exactly its own result. Batching depends on timing (a
// write that completes before the next round is ready goes alone), so bursts repeat until both
// directions have been seen batching, at most 20 times.
TEST(Metrics, ConcurrentGlobalRoundsTravelInBatchesBetweenSidecarAndRoot) {
  TempDir dir;
  auto root = StartAggregator(dir.path(), "root",
                              {"--role=root", "--listen=127.0.0.1:0",
                               "--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(root.ok()) << root.status();
  std::vector<testing::Aggregator> sidecars;
  std::vector<std::unique_ptr<Client>> clients;
  for (int node = 0; node < 2; ++node) {
    const std::string name = "node" + std::to_string(node);
    auto s = StartAggregator(dir.path(), name,
                             {"--role=node", "--listen=unix:" + (dir / (name + ".sock")),
                              "--upstream=" + root->address, "--metrics-listen=127.0.0.1:0"});
    ASSERT_TRUE(s.ok()) << s.status();
    auto c = Client::Connect(WorkerOptions(s->address, "b-job", node, 2, 1));
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(std::move(*c));
    sidecars.push_back(std::move(*s));
  }
  constexpr int kChannels = 8, kRounds = 300;
  // Round r of node n: count 10 + n, mean (n + r) in every channel, m2 = count (variance 1).
  auto start_burst = [&](int burst, int node, std::vector<std::shared_ptr<PendingRound>>* out) {
    std::vector<double> mean(kChannels), m2(kChannels, 10.0 + node);
    for (int r = 0; r < kRounds; ++r) {
      std::fill(mean.begin(), mean.end(), double(node + r));
      auto p = clients[node]->Start(Phase::kForward, uint32_t(r), uint64_t(burst), Scope::kGlobal,
                                    kChannels, 10 + node, mean.data(), m2.data());
      ASSERT_TRUE(p.ok()) << p.status();
      out->push_back(*p);
    }
  };
  double up_sent = 0, root_received = 0, root_sent = 0;
  int bursts = 0;
  bool batched_up = false, batched_down = false;
  for (; bursts < 20 && !(batched_up && batched_down); ++bursts) {
    std::vector<std::shared_ptr<PendingRound>> p0, p1;
    std::thread t([&] { start_burst(bursts, 1, &p1); });
    start_burst(bursts, 0, &p0);
    t.join();
    ASSERT_EQ(p0.size(), size_t(kRounds));
    ASSERT_EQ(p1.size(), size_t(kRounds));
    for (int node = 0; node < 2; ++node) {
      for (int r = 0; r < kRounds; ++r) {
        int64_t n = 0;
        std::vector<double> mean(kChannels), m2(kChannels);
        absl::Status st =
            clients[node]->Wait(*(node == 0 ? p0 : p1)[r], &n, mean.data(), m2.data());
        ASSERT_TRUE(st.ok()) << st;
        // Global: 10 values at mean r and 11 at mean r + 1, each with variance 1.
        ASSERT_EQ(n, 21);
        const double mu = (10.0 * r + 11.0 * (r + 1)) / 21.0;
        const double want_m2 = 21.0 + 10.0 * (r - mu) * (r - mu) + 11.0 * (r + 1 - mu) * (r + 1 - mu);
        for (int c = 0; c < kChannels; ++c) {
          ASSERT_NEAR(mean[c], mu, 1e-12 * (1 + std::abs(mu))) << "round " << r;
          ASSERT_NEAR(m2[c], want_m2, 1e-10 * want_m2) << "round " << r;
        }
      }
    }
    const double rounds = double(kRounds) * (bursts + 1);
    up_sent = Sample(Scrape(sidecars[0]), "hsbn_sent_messages_total", L({{"link", "upstream"}}));
    const std::string rt = Scrape(*root);
    root_received = Sample(rt, "hsbn_received_messages_total", L({{"link", "members"}}));
    root_sent = Sample(rt, "hsbn_sent_messages_total", L({{"link", "members"}}));
    // Each sidecar forwards `rounds` partials (plus an Attach); the root receives 2 * rounds
    // partials and sends 2 * rounds results. Fewer messages than that means batches.
    batched_up = up_sent < rounds && root_received < 2 * rounds;
    batched_down = root_sent < 2 * rounds;
  }
  EXPECT_TRUE(batched_up) << bursts << " bursts of " << kRounds << " rounds: node 0 sent "
                          << up_sent << " messages upstream, the root received " << root_received;
  EXPECT_TRUE(batched_down) << bursts << " bursts of " << kRounds << " rounds: the root sent "
                            << root_sent << " messages";
  const std::string rt = Scrape(*root);
  EXPECT_EQ(Sample(rt, "hsbn_rounds_total",
                   L({{"role", "root"}, {"scope", "global"}, {"phase", "forward"},
                      {"outcome", "ok"}})),
            double(kRounds) * bursts);
}

TEST(Metrics, MetricsAreOffWithoutTheFlagAndABadAddressIsRefused) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "plain",
                             {"--role=node", "--listen=unix:" + (dir / "plain.sock")});
  ASSERT_TRUE(agg.ok()) << agg.status();
  EXPECT_EQ(agg->ready_lines.size(), 1u);
  EXPECT_TRUE(agg->metrics.empty());
  auto [code, log] = testing::RunAggregatorToExit(
      dir.path(), "bad", {"--role=node", "--listen=unix:" + (dir / "bad.sock"),
                          "--metrics-listen=no-port-here"});
  EXPECT_NE(code, 0);
  EXPECT_NE(log.find("--metrics-listen"), std::string::npos) << log;
}

// A TCP connection to host:port that sends nothing; -1 if it cannot connect.
int IdleConnection(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(std::stoi(host_port.substr(colon + 1))));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(Metrics, IdleConnectionsToTheMetricsPortDoNotHoldBackAScrape) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "idle",
                             {"--role=node", "--listen=unix:" + (dir / "idle.sock"),
                              "--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  // Three clients connect and send nothing. The metrics server once served one connection at
  // a time and waited 30 s for each request, so the scrape below waited behind all three.
  std::vector<int> idle;
  for (int i = 0; i < 3; ++i) {
    idle.push_back(IdleConnection(agg->metrics));
    ASSERT_GE(idle.back(), 0);
  }
  // The scrape is answered while the idle connections are still open. (The 60 s receive
  // timeout is only a backstop so that a regression fails instead of hanging.)
  auto body = HttpGet(agg->metrics, "/metrics", std::chrono::seconds(60));
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(Sample(*body, "hsbn_jobs"), 0);
  // ...and it did not wait for the server to give up on them: each is still open (a read
  // finds no data and no end of stream).
  for (int fd : idle) {
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
    EXPECT_EQ(n, -1);
    EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << std::strerror(errno);
    close(fd);
  }
}

TEST(Metrics, JobLabelsAreCappedByMetricsMaxJobsAndMembersHaveNoSpaces) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "cap",
                             {"--role=node", "--listen=unix:" + (dir / "cap.sock"),
                              "--metrics-listen=127.0.0.1:0", "--metrics-max-jobs=2",
                              "--round-timeout-ms=300"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  // Four one-rank jobs (a single member: every round completes at once) and one two-rank job
  // whose rank 1 never contributes.
  std::vector<std::unique_ptr<Client>> owned;
  for (const char* job : {"a-job", "b-job", "c-job", "d-job"}) {
    auto c = Client::Connect(WorkerOptions(agg->address, job, 0, 1, 1));
    ASSERT_TRUE(c.ok()) << c.status();
    owned.push_back(std::move(*c));
  }
  std::string text = Scrape(*agg);
  EXPECT_EQ(Sample(text, "hsbn_jobs"), 4);
  // Status lists jobs in id order: the first two get labels, the others sum under _other.
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "a-job"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "b-job"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "_other"}})), 2);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_members", L({{"job_id", "c-job"}}))));

  auto t0 = Client::Connect(WorkerOptions(agg->address, "t-job", 0, 2, 2));
  ASSERT_TRUE(t0.ok()) << t0.status();
  auto t1 = Client::Connect(WorkerOptions(agg->address, "t-job", 1, 2, 2));
  ASSERT_TRUE(t1.ok()) << t1.status();
  double mean[2] = {0, 1}, m2[2] = {1, 1}, om[2], om2[2];
  int64_t n;
  absl::Status s = (*t0)->Forward(1, 0, Scope::kNode, 2, 10, mean, m2, &n, om, om2);
  ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  text = Scrape(*agg);
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "_other"}, {"member", "rank1"}})),
            1);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "t-job"}}))));
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, "hsbn_round_timeouts_total{")) {
      EXPECT_FALSE(absl::StrContains(line, "member=\"rank 1\"")) << line;
    }
  }
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "_other"}})), 4);
}

TEST(Metrics, BuildInfoAndVersionFlagAgree) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "info",
                             {"--role=root", "--listen=127.0.0.1:0",
                              "--metrics-listen=127.0.0.1:0", "--memory-budget-bytes=123456789",
                              "--max-world-size=77"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  const std::string text = Scrape(*agg);
  auto [code, version] = testing::RunAggregatorToExit(dir.path(), "version", {"--version"});
  ASSERT_EQ(code, 0) << version;
  // "hsbn-aggregator VERSION (commit COMMIT)"
  const std::vector<std::string> words = absl::StrSplit(version, absl::ByAnyChar(" ()\n"),
                                                        absl::SkipEmpty());
  ASSERT_EQ(words.size(), 4u) << version;
  EXPECT_EQ(words[0], "hsbn-aggregator");
  EXPECT_EQ(words[2], "commit");
  EXPECT_EQ(Sample(text, "hsbn_build_info",
                   L({{"role", "root"}, {"version", words[1]}, {"commit", words[3]}})), 1)
      << version << text;
  EXPECT_EQ(Sample(text, "hsbn_memory_budget_bytes"), 123456789);
  EXPECT_EQ(Sample(text, "hsbn_max_world_size"), 77);
  EXPECT_EQ(Sample(text, "hsbn_memory_used_bytes"), 0);
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "memory_budget"}})), 0);
}

// A refused Join says why as a value (the status details' Reason, read by wire::FromGrpc), and
// the refusal metric is counted by that value, not by words in the message.
TEST(Metrics, JoinRefusalsCarryTheirReasonAndAreCountedByIt) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "node0",
                             {"--role=node", "--listen=unix:" + (dir / "node0.sock"),
                              "--metrics-listen=127.0.0.1:0", "--max-world-size=2",
                              "--max-jobs=1"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  auto stub = v1::Aggregator::NewStub(
      grpc::CreateChannel(agg->address, grpc::InsecureChannelCredentials()));
  auto join = [&](const std::string& job, int world) {
    v1::JoinRequest req;
    req.set_protocol_version(v1::PROTOCOL_VERSION_2);
    req.set_job_id(job);
    req.set_kind(v1::MEMBER_KIND_WORKER);
    req.set_rank(0);
    req.set_world_size(world);
    req.set_local_rank(0);
    req.set_local_world_size(world);
    req.set_node_rank(0);
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    return wire::FromGrpc(stub->Join(&ctx, req, &resp));
  };
  absl::Status s = join("big", 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(wire::ReasonOf(s), v1::REASON_MAX_WORLD_SIZE) << s;
  s = join("bad id", 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(wire::ReasonOf(s), v1::REASON_JOB_ID) << s;
  ASSERT_TRUE(join("first", 1).ok());
  s = join("second", 1);
  EXPECT_EQ(wire::ReasonOf(s), v1::REASON_MAX_JOBS) << s;
  const std::string text = Scrape(*agg);
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "world_size"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "job_id"}})), 1);
  // --max-jobs has no label of its own (kRefusedReasons): "other".
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "other"}})), 1);
}

}  // namespace
}  // namespace hsbn

// Failure semantics with real aggregator and worker processes: a killed worker is reported at
// once, deadlines name the missing ranks, bad input fails only its round, a restarted sidecar
// costs only the rounds in flight, SIGTERM exits cleanly.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/hsbn.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "local_cluster.h"
#include "test_cluster.h"
#include "wire.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;
using cluster::Subprocess;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool WaitForText(const std::string& path, const std::string& text, milliseconds timeout) {
  const auto until = steady_clock::now() + timeout;
  while (steady_clock::now() < until) {
    if (ReadFile(path).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return false;
}

using testing::StartCluster;

std::unique_ptr<Subprocess> SpawnWorker(LocalCluster& c, int rank, const std::string& job,
                                        std::vector<std::string> extra) {
  std::vector<std::string> argv = {HSBN_SYNTHETIC, "--worker", "--rounds=20", "--channels=8",
                                   "--scopes=global",
                                   absl::StrCat("--report=", c.dir(), "/report", rank)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto p = Subprocess::Spawn(argv, c.WorkerEnv(rank, job),
                             absl::StrCat(c.dir(), "/worker", rank, ".log"));
  EXPECT_TRUE(p.ok());
  return std::move(*p);
}

TEST(Failures, KilledWorkerIsNamedToEveryOtherMemberWithinTwoSeconds) {
  auto c = StartCluster(2, 2);  // round timeout 30 s: only the broken stream can explain speed
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Subprocess>> w;
  for (int r = 0; r < 4; ++r) {
    w.push_back(SpawnWorker(*c, r, "kill", r == 3 ? std::vector<std::string>{"--hang-at=5"}
                                                   : std::vector<std::string>{}));
  }
  ASSERT_TRUE(WaitForText(c->dir() + "/report3", "hang 5", milliseconds(30000)));
  std::this_thread::sleep_for(milliseconds(300));  // the others are now waiting in round 5
  const auto killed = steady_clock::now();
  w[3]->Signal(SIGKILL);
  for (int r = 0; r < 3; ++r) {
    const int code = w[r]->Wait(milliseconds(2000) - std::chrono::duration_cast<milliseconds>(steady_clock::now() - killed));
    EXPECT_EQ(code, 4) << "worker " << r << " did not fail within 2 s of the kill";
    const std::string report = ReadFile(absl::StrCat(c->dir(), "/report", r));
    EXPECT_NE(report.find("error forward 5 14 "), std::string::npos) << report;  // UNAVAILABLE
    EXPECT_NE(report.find("rank 3"), std::string::npos) << report;
  }
}

// The only worker of node 1 is killed while node 0 waits in a global round that node 1 never
// opened (it hung before the round): no sidecar has the round open to abort it, so before the
// node's sidecar told the root "node down", node 0 waited for the 30 s deadline.
TEST(Failures, KilledLastWorkerOfANodeIsNamedToTheOtherNodesWithinTwoSeconds) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Subprocess>> w;
  for (int r = 0; r < 2; ++r) {
    w.push_back(SpawnWorker(*c, r, "kill-node", r == 1 ? std::vector<std::string>{"--hang-at=5"}
                                                        : std::vector<std::string>{}));
  }
  ASSERT_TRUE(WaitForText(c->dir() + "/report1", "hang 5", milliseconds(30000)));
  std::this_thread::sleep_for(milliseconds(300));  // rank 0 now waits in round 5
  const auto killed = steady_clock::now();
  w[1]->Signal(SIGKILL);
  const int code = w[0]->Wait(milliseconds(2000));
  const double seconds = std::chrono::duration<double>(steady_clock::now() - killed).count();
  const std::string report = ReadFile(absl::StrCat(c->dir(), "/report0"));
  EXPECT_EQ(code, 4) << "rank 0 did not fail within 2 s of the kill (" << seconds << " s)\n"
                     << report;
  EXPECT_NE(report.find("error forward 5 14 "), std::string::npos) << report;  // UNAVAILABLE
  EXPECT_NE(report.find("rank 1"), std::string::npos) << report;
}

TEST(Failures, DeadlineErrorNamesTheMissingRanks) {
  auto c = StartCluster(1, 3, {"--round-timeout-ms=800"});
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Subprocess>> w;
  for (int r = 0; r < 3; ++r) {
    w.push_back(SpawnWorker(*c, r, "deadline", r == 2 ? std::vector<std::string>{"--hang-at=2"}
                                                      : std::vector<std::string>{}));
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(w[r]->Wait(milliseconds(20000)), 4);
    const std::string report = ReadFile(absl::StrCat(c->dir(), "/report", r));
    EXPECT_NE(report.find("error forward 2 4 "), std::string::npos) << report;  // DEADLINE
    EXPECT_NE(report.find("waiting for rank 2"), std::string::npos) << report;
  }
}

// In-process clients (threads) against real aggregator processes.
std::unique_ptr<Client> Connect(LocalCluster& c, int rank, const std::string& job) {
  return testing::ConnectRank(c, rank, job);
}

// One client per rank of the cluster, all in `job`.
std::vector<std::unique_ptr<Client>> ConnectAll(LocalCluster& c, const std::string& job) {
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < c.world_size(); ++r) clients.push_back(Connect(c, r, job));
  return clients;
}

struct Contribution {
  int64_t count;
  std::vector<double> a, b;
};

// Starts one forward round on every client, then waits for all; returns their statuses.
std::vector<absl::Status> Round(std::vector<std::unique_ptr<Client>>& clients, uint32_t op,
                                uint64_t seq, const std::vector<Contribution>& in,
                                std::vector<std::vector<double>>* means = nullptr) {
  std::vector<absl::StatusOr<std::shared_ptr<PendingRound>>> started;
  for (size_t i = 0; i < clients.size(); ++i) {
    started.push_back(clients[i]->Start(Phase::kForward, op, seq, Scope::kNode,
                                        int64_t(in[i].a.size()), in[i].count, in[i].a.data(),
                                        in[i].b.data()));
  }
  std::vector<absl::Status> out;
  if (means) means->assign(clients.size(), {});
  for (size_t i = 0; i < clients.size(); ++i) {
    if (!started[i].ok()) {
      out.push_back(started[i].status());
      continue;
    }
    std::vector<double> a(in[i].a.size()), b(in[i].a.size());
    int64_t n = 0;
    out.push_back(clients[i]->Wait(**started[i], &n, a.data(), b.data()));
    if (means) (*means)[i] = a;
  }
  return out;
}

Contribution Good(double mean) { return {2, {mean, mean, mean, mean}, {1, 1, 1, 1}}; }

TEST(Failures, BadInputFailsItsRoundNamingRankAndFieldAndNothingElse) {
  auto c = StartCluster(1, 2, {"--max-channels=64"});
  ASSERT_TRUE(c);
  auto job = ConnectAll(*c, "bad-input");
  std::vector<std::unique_ptr<Client>> other;  // an unrelated job on the same sidecar
  other.push_back(Connect(*c, 0, "other-job"));
  other.push_back(Connect(*c, 1, "other-job"));
  ASSERT_TRUE(job[0] && job[1] && other[0] && other[1]);
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    const char* name;
    Contribution bad;
    absl::StatusCode code;
    const char* field;
  } cases[] = {
      {"-Inf m2", {2, {0, 0, 0, 0}, {1, 1, -inf, 1}}, absl::StatusCode::kInvalidArgument, "m2[2]"},
      {"negative count", {-3, {0, 0, 0, 0}, {1, 1, 1, 1}}, absl::StatusCode::kInvalidArgument,
       "'count'"},
      {"negative m2", {2, {0, 0, 0, 0}, {1, 1, 1, -0.5}}, absl::StatusCode::kInvalidArgument,
       "m2[3]"},
      {"channel mismatch", {2, {0, 0, 0}, {1, 1, 1}}, absl::StatusCode::kInvalidArgument,
       "'channels'"},
      {"oversized", {2, std::vector<double>(65, 0.0), std::vector<double>(65, 1.0)},
       absl::StatusCode::kResourceExhausted, "--max-channels=64"},
  };
  uint64_t seq = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    auto st = Round(job, 0, seq++, {Good(1.0), k.bad});
    for (const auto& s : st) {
      EXPECT_EQ(s.code(), k.code) << s;
      EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
      EXPECT_NE(s.message().find(k.field), std::string::npos) << s;
    }
    // The next round of the same job works, and so does another job.
    std::vector<std::vector<double>> means;
    auto ok = Round(job, 0, seq++, {Good(1.0), Good(3.0)}, &means);
    EXPECT_TRUE(ok[0].ok() && ok[1].ok()) << ok[0] << ok[1];
    EXPECT_EQ(means[0][0], 2.0);
    auto ok2 = Round(other, 0, seq, {Good(5.0), Good(7.0)}, &means);
    EXPECT_TRUE(ok2[0].ok() && ok2[1].ok());
    EXPECT_EQ(means[1][3], 6.0);
  }
}

// Non-finite values are data: a NaN or Inf from one rank reaches every rank of the round
// identically (as torch's SyncBatchNorm's all-reduce would), so GradScaler skips the step on
// every rank. A strict job (HSBN_STRICT_FINITE) fails the round instead, naming the rank.
// Ranks of a node that disagree on a round's scope (node or global) fail it with
// INVALID_ARGUMENT on every rank of the job, whichever contribution opened it at the sidecar:
// the sidecar tells the root, so the other node's ranks are not left to their deadline (30 s).
TEST(Failures, ScopesThatDisagreeWithinANodeFailTheRoundOnEveryNode) {
  auto c = StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto clients = ConnectAll(*c, "scope-clash");
  for (auto& p : clients) ASSERT_TRUE(p);
  const Contribution in = Good(1.0);
  for (int node_rank = 0; node_rank < 2; ++node_rank) {
    SCOPED_TRACE(absl::StrCat("rank ", node_rank, " asks for node scope, the others global"));
    // The node-scope rank starts first, so that (on node 0) its contribution opens the round.
    std::vector<int> order = {node_rank, 1 - node_rank, 2, 3};
    std::vector<std::shared_ptr<PendingRound>> started(4);
    for (int r : order) {
      auto p = clients[size_t(r)]->Start(Phase::kForward, 7, uint64_t(node_rank),
                                         r == node_rank ? Scope::kNode : Scope::kGlobal, 4,
                                         in.count, in.a.data(), in.b.data());
      ASSERT_TRUE(p.ok()) << "rank " << r << ": " << p.status();
      started[size_t(r)] = *p;
    }
    for (int r = 0; r < 4; ++r) {
      double a[4], b[4];
      int64_t n = 0;
      absl::Status s = clients[size_t(r)]->Wait(*started[size_t(r)], &n, a, b);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "scope")) << "rank " << r << ": " << s;
    }
  }
}

TEST(Failures, NonFiniteValuesReachEveryRankUnlessTheJobIsStrict) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto lax = ConnectAll(*c, "lax");
  ASSERT_TRUE(lax[0] && lax[1]);
  std::vector<std::vector<double>> means;
  auto st = Round(lax, 0, 0, {Good(1.0), {2, {0, nan, 0, inf}, {1, 1, 1, 1}}}, &means);
  ASSERT_TRUE(st[0].ok() && st[1].ok()) << st[0] << st[1];
  for (const auto& m : means) {
    EXPECT_EQ(m[0], 0.5);
    EXPECT_TRUE(std::isnan(m[1]));
    EXPECT_TRUE(std::isinf(m[3]));
    EXPECT_EQ(std::memcmp(m.data(), means[0].data(), m.size() * sizeof(double)), 0);
  }
  std::vector<std::unique_ptr<Client>> strict;
  for (int rank = 0; rank < 2; ++rank) {
    ClientOptions o = testing::RankOptions(*c, rank, "strict");
    o.strict_finite = true;
    auto client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    strict.push_back(std::move(*client));
  }
  st = Round(strict, 0, 0, {Good(1.0), {2, {0, nan, 0, 0}, {1, 1, 1, 1}}});
  for (const auto& s : st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
    EXPECT_NE(s.message().find("mean[1]"), std::string::npos) << s;
  }
  // Every process of a job must agree on strictness.
  ClientOptions mixed = testing::RankOptions(*c, 0, "lax");
  mixed.strict_finite = true;
  auto refused = Client::Connect(mixed);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("strict_finite"), std::string::npos)
      << refused.status();
}

// A root with --divergence-dir keeps a job's shadow record after the job ends: when the last
// worker leaves, the root writes DIR/JOB.divergence.json with each layer's divergence per node.
TEST(Failures, ShadowDivergenceIsWrittenWhenTheJobEnds) {
  char tmpl[] = "/tmp/hsbn-div-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  cluster::ClusterOptions opts;
  opts.nodes = 2;
  opts.workers_per_node = 1;
  opts.root_flags = {"--divergence-dir=" + dir};  // a sidecar refuses it
  auto started = LocalCluster::Start(opts);
  ASSERT_TRUE(started.ok()) << started.status();
  auto c = std::move(*started);
  {
    std::vector<std::unique_ptr<Client>> clients;
    for (int rank = 0; rank < 2; ++rank) clients.push_back(testing::ConnectRank(*c, rank, "div/1"));
    ASSERT_TRUE(clients[0] && clients[1]);
    // Three shadow rounds, then a global one: it completes only once the root has both
    // nodes' earlier frames (each sidecar's stream is in order), so the shadow record is whole
    // before the job ends.
    for (uint64_t seq = 0; seq < 4; ++seq) {
      std::vector<absl::StatusOr<std::shared_ptr<PendingRound>>> started;
      for (int r = 0; r < 2; ++r) {
        const double mean[1] = {double(r)}, m2[1] = {1.0};
        started.push_back(clients[r]->Start(Phase::kForward, seq < 3 ? 7 : 8, seq,
                                            seq < 3 ? Scope::kShadow : Scope::kGlobal, 1, 2,
                                            mean, m2));
        ASSERT_TRUE(started.back().ok()) << started.back().status();
      }
      for (int r = 0; r < 2; ++r) {
        double a[1], b[1];
        int64_t n = 0;
        ASSERT_TRUE(clients[r]->Wait(**started[r], &n, a, b).ok());
      }
    }
  }  // the clients leave: the sidecars drop the job and leave it at the root
  // The id's '/' must not make a path: it is escaped in the file name.
  const std::string path = dir + "/div%2F1.divergence.json";
  const auto backstop = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string json;
  while (json.empty()) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    json = ss.str();
    if (json.empty()) {
      ASSERT_LT(std::chrono::steady_clock::now(), backstop) << "no " << path;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  EXPECT_NE(json.find("\"jobId\": \"div/1\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"op\": 7"), std::string::npos) << json;
  EXPECT_NE(json.find("\"rounds\": \"3\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"node\": 1"), std::string::npos) << json;
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Raw protocol access for what the client library refuses to send.
struct Raw {
  explicit Raw(const std::string& address)
      : stub(v1::Aggregator::NewStub(grpc::CreateChannel(address,
                                                         grpc::InsecureChannelCredentials()))) {}
  grpc::Status Join(int rank, int world, int local_rank, int lws, int node,
                    std::string* session) {
    v1::JoinRequest req;
    req.set_protocol_version(v1::PROTOCOL_VERSION_2);
    req.set_job_id("raw");
    req.set_kind(v1::MEMBER_KIND_WORKER);
    req.set_rank(rank);
    req.set_world_size(world);
    req.set_local_rank(local_rank);
    req.set_local_world_size(lws);
    req.set_node_rank(node);
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub->Join(&ctx, req, &resp);
    if (session) *session = resp.session();
    return s;
  }
  std::unique_ptr<v1::Aggregator::Stub> stub;
};

TEST(Failures, JoinValidatesTheLayout) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  Raw raw(c->sidecar_address(0));
  grpc::Status s = raw.Join(5, 2, 1, 2, 0, nullptr);  // rank >= world size
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("rank 5"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("RANK"), std::string::npos) << s.error_message();
  ASSERT_TRUE(raw.Join(0, 2, 0, 2, 0, nullptr).ok());
  s = raw.Join(1, 4, 1, 2, 0, nullptr);  // a different world size than rank 0 declared
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("world_size=4"), std::string::npos) << s.error_message();
  s = raw.Join(0, 2, 0, 2, 0, nullptr);  // rank 0 again while its session is unattached: ok
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST(Failures, ConflictingDuplicateFailsTheRound) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  Raw raw(c->sidecar_address(0));
  std::string s0, s1;
  ASSERT_TRUE(raw.Join(0, 2, 0, 2, 0, &s0).ok());
  ASSERT_TRUE(raw.Join(1, 2, 1, 2, 0, &s1).ok());
  grpc::ClientContext ctx;
  auto stream = raw.stub->Exchange(&ctx);
  v1::ClientFrame attach;
  attach.mutable_attach()->add_sessions(s0);
  attach.mutable_attach()->add_sessions(s1);
  ASSERT_TRUE(stream->Write(attach));
  auto send = [&](const std::string& session, double mean) {
    v1::ClientFrame f;
    v1::Contribution* c = f.mutable_contribution();
    c->set_session(session);
    c->set_op(1);
    c->set_seq(0);
    c->set_phase(v1::PHASE_FORWARD);
    c->set_scope(v1::SCOPE_NODE);
    c->set_channels(1);
    c->set_count(1);
    double m2 = 0;
    wire::PackPayload(&mean, &m2, 1, c->mutable_data());
    return stream->Write(f);
  };
  ASSERT_TRUE(send(s1, 1.0));
  ASSERT_TRUE(send(s1, 2.0));  // same round, different payload
  v1::ServerFrame frame;
  ASSERT_TRUE(stream->Read(&frame));
  EXPECT_EQ(frame.result().code(), int(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(frame.result().message().find("rank 1"), std::string::npos);
  EXPECT_NE(frame.result().message().find("duplicate"), std::string::npos)
      << frame.result().message();
  ctx.TryCancel();
}

// Node 1 loses rank 3 (its stream breaks) while rank 2 stays: the root's Status says node 1 is
// down and why, and a new global round from node 0 fails at once naming rank 3.
TEST(Failures, RootStatusShowsADownNodeAndRefusesItsNewRoundsAtOnce) {
  auto c = StartCluster(2, 2);
  ASSERT_TRUE(c);
  Raw node0(c->sidecar_address(0)), node1(c->sidecar_address(1));
  std::string s[4];
  ASSERT_TRUE(node0.Join(0, 4, 0, 2, 0, &s[0]).ok());
  ASSERT_TRUE(node0.Join(1, 4, 1, 2, 0, &s[1]).ok());
  ASSERT_TRUE(node1.Join(2, 4, 0, 2, 1, &s[2]).ok());
  ASSERT_TRUE(node1.Join(3, 4, 1, 2, 1, &s[3]).ok());
  // Node 0's ranks share a stream; ranks 2 and 3 have one each.
  grpc::ClientContext ctx0, ctx2, ctx3;
  auto st0 = node0.stub->Exchange(&ctx0);
  auto st2 = node1.stub->Exchange(&ctx2);
  auto st3 = node1.stub->Exchange(&ctx3);
  auto attach = [](auto& stream, std::vector<std::string> sessions) {
    v1::ClientFrame f;
    for (const std::string& x : sessions) f.mutable_attach()->add_sessions(x);
    return stream->Write(f);
  };
  ASSERT_TRUE(attach(st0, {s[0], s[1]}));
  ASSERT_TRUE(attach(st2, {s[2]}));
  ASSERT_TRUE(attach(st3, {s[3]}));
  auto send = [](auto& stream, const std::string& session, uint32_t op) {
    v1::ClientFrame f;
    v1::Contribution* c = f.mutable_contribution();
    c->set_session(session);
    c->set_op(op);
    c->set_seq(0);
    c->set_phase(v1::PHASE_FORWARD);
    c->set_scope(v1::SCOPE_GLOBAL);
    c->set_channels(1);
    c->set_count(1);
    double mean = 1.0, m2 = 0.0;
    wire::PackPayload(&mean, &m2, 1, c->mutable_data());
    return stream->Write(f);
  };
  // One global round, so node 1's sidecar has joined the job at the root.
  ASSERT_TRUE(send(st0, s[0], 0) && send(st0, s[1], 0) && send(st2, s[2], 0) &&
              send(st3, s[3], 0));
  v1::ServerFrame frame;
  for (auto* st : {&st0, &st0, &st2, &st3}) {
    ASSERT_TRUE((*st)->Read(&frame));
    ASSERT_EQ(frame.result().code(), 0) << frame.result().message();
    ASSERT_EQ(frame.result().count(), 4);
  }
  ctx3.TryCancel();  // rank 3's stream breaks; rank 2 stays
  Raw root(c->root_address());
  std::string down;
  for (int i = 0; i < 200 && down.empty(); ++i) {
    v1::StatusRequest req;
    req.set_job_id("raw");
    v1::StatusResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(root.stub->Status(&ctx, req, &resp).ok());
    if (resp.jobs_size() == 1 && resp.jobs(0).members_size() == 2) {
      down = resp.jobs(0).members(1).down();
      EXPECT_EQ(resp.jobs(0).members(0).down(), "");
    }
    if (down.empty()) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_NE(down.find("rank 3 (node 1, local rank 1) disconnected"), std::string::npos) << down;
  const auto t0 = steady_clock::now();
  ASSERT_TRUE(send(st0, s[0], 1) && send(st0, s[1], 1));
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(st0->Read(&frame));
    EXPECT_EQ(frame.result().code(), int(grpc::StatusCode::UNAVAILABLE));
    EXPECT_NE(frame.result().message().find("rank 3"), std::string::npos)
        << frame.result().message();
  }
  EXPECT_LT(steady_clock::now() - t0, std::chrono::seconds(2));  // not the 30 s deadline
  ctx0.TryCancel();
  ctx2.TryCancel();
}

TEST(Failures, RestartedSidecarFailsRoundsInFlightAndClientsReconnect) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  auto job = ConnectAll(*c, "restart");
  ASSERT_TRUE(job[0] && job[1]);
  auto ok = Round(job, 0, 0, {Good(1.0), Good(3.0)});
  ASSERT_TRUE(ok[0].ok() && ok[1].ok());
  Contribution in = Good(1.0);
  auto pending = job[0]->Start(Phase::kForward, 0, 1, Scope::kNode, 4, 2, in.a.data(),
                               in.b.data());
  ASSERT_TRUE(pending.ok());
  std::this_thread::sleep_for(milliseconds(100));
  // SIGTERM: the sidecar fails the open round with UNAVAILABLE and exits with status 0.
  EXPECT_EQ(c->sidecar(0)->Stop(), 0);
  std::vector<double> a(4), b(4);
  absl::Status s = job[0]->Wait(**pending, nullptr, a.data(), b.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(wire::ReasonOf(s), v1::REASON_SHUTTING_DOWN) << s;
  ASSERT_TRUE(c->RestartSidecar(0).ok());
  // Rank 1 was between rounds: its next call names the stop (once), as rank 0's round did.
  int64_t n = 0;
  s = job[1]->Forward(0, 1, Scope::kNode, 4, 2, in.a.data(), in.b.data(), &n, a.data(),
                      b.data());
  EXPECT_EQ(wire::ReasonOf(s), v1::REASON_SHUTTING_DOWN) << s;
  std::vector<std::vector<double>> means;
  auto again = Round(job, 0, 2, {Good(1.0), Good(5.0)}, &means);
  EXPECT_TRUE(again[0].ok()) << again[0];
  EXPECT_TRUE(again[1].ok()) << again[1];
  ASSERT_EQ(means[1].size(), 4u);
  EXPECT_EQ(means[1][0], 3.0);
}

// A polite stop (SIGTERM) while the ranks compute between rounds, the usual moment: each rank's
// next call fails at once with the sidecar's own words and reason SHUTTING_DOWN (through the
// segment it invalidated, or the refused Join on the stream transport), never with a bare
// CANCELLED after the connect timeout; once a new process is there, the call after rejoins.
TEST(Failures, SidecarStoppedBetweenRoundsIsNamedOnEveryRank) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  auto job = ConnectAll(*c, "stop-between");
  ASSERT_TRUE(job[0] && job[1]);
  auto ok = Round(job, 0, 0, {Good(1.0), Good(3.0)});
  ASSERT_TRUE(ok[0].ok() && ok[1].ok()) << ok[0] << " " << ok[1];
  EXPECT_EQ(c->sidecar(0)->Stop(), 0);  // returns once the process exited
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    Contribution in = Good(1.0);
    std::vector<double> a(4), b(4);
    int64_t n = 0;
    absl::Status s = job[size_t(r)]->Forward(0, 1, Scope::kNode, 4, 2, in.a.data(), in.b.data(),
                                             &n, a.data(), b.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_EQ(wire::ReasonOf(s), v1::REASON_SHUTTING_DOWN) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "sidecar node0 is shutting down (SIGTERM)")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "Restart the job from its last checkpoint")) << s;
  }
  ASSERT_TRUE(c->RestartSidecar(0).ok());
  std::vector<std::vector<double>> means;
  auto again = Round(job, 0, 2, {Good(1.0), Good(5.0)}, &means);
  EXPECT_TRUE(again[0].ok()) << again[0];
  EXPECT_TRUE(again[1].ok()) << again[1];
  ASSERT_EQ(means[1].size(), 4u);
  EXPECT_EQ(means[1][0], 3.0);
}

// Sidecars restarted under load (SIGTERM, then a new process on the same address), in turn,
// while every rank runs node rounds back to back and retries a round that failed. A sidecar
// stops admitting Joins and new rounds before it fails the open ones and invalidates its
// segments, so no rank can rejoin the dying process: every rank of the node learns of the
// restart from one status that says the step is lost and what to do, and the node's ranks
// meet again at the new process (issue 26: ranks that landed on the dying sidecar and the new
// one respectively waited for each other until the deadline, every round, for good). Node
// rounds take shared memory, or the stream in the grpc: run of these tests (HSBN_TRANSPORT).
TEST(Failures, SidecarsRestartedUnderLoadFailTheStepAlikeAndTheirRanksMeetAgain) {
  constexpr int kNodes = 2, kPerNode = 2, kRestarts = 4, kRoundsBetween = 3;
  auto c = StartCluster(kNodes, kPerNode);
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < kNodes * kPerNode; ++r) {
    clients.push_back(testing::ConnectRank(*c, r, "restart-load"));
    ASSERT_TRUE(clients.back());
  }
  struct Failure {
    int rank;
    int restart;  // the restart it followed (1-based)
    absl::Status status;
  };
  std::mutex mu;
  std::condition_variable cv;
  int restart = 0;                               // restarts begun
  uint64_t stop_at = ~uint64_t{0};               // the seq every rank stops before
  std::vector<int64_t> done(clients.size(), 0);  // rounds completed, per rank
  std::vector<Failure> failures;
  int wrong = 0;  // rounds completed with a result other than the node's merge
  std::vector<std::thread> workers;
  for (int r = 0; r < int(clients.size()); ++r) {
    workers.emplace_back([&, r] {
      const int node = r / kPerNode;
      // Rank r contributes mean r + 1; the node's merge is the mean of its ranks' means.
      const double mean[4] = {r + 1.0, r + 1.0, r + 1.0, r + 1.0}, m2[4] = {1, 1, 1, 1};
      const double merged = node * kPerNode + (kPerNode + 1) / 2.0;
      for (uint64_t seq = 0;;) {
        {
          std::lock_guard<std::mutex> lock(mu);
          if (seq >= stop_at) return;
        }
        double a[4], b[4];
        int64_t n = 0;
        absl::Status s = clients[size_t(r)]->Forward(1, seq, Scope::kNode, 4, 2, mean, m2, &n,
                                                     a, b);
        std::lock_guard<std::mutex> lock(mu);
        if (s.ok()) {
          if (a[0] != merged || n != 2 * kPerNode) ++wrong;
          ++done[size_t(r)];
          ++seq;
          cv.notify_all();
        } else {
          failures.push_back({r, restart, s});  // and the same round again
        }
      }
    });
  }
  // Every rank completes `more` rounds beyond `from` (a node round completes only when all its
  // ranks are in it: they met). A backstop of 60 s each, never reached when they meet.
  auto all_done = [&](std::unique_lock<std::mutex>& lock, const std::vector<int64_t>& from) {
    return cv.wait_for(lock, std::chrono::seconds(60), [&] {
      for (size_t r = 0; r < done.size(); ++r) {
        if (done[r] < from[r] + kRoundsBetween) return false;
      }
      return true;
    });
  };
  std::vector<int64_t> base(clients.size(), 0);
  for (int k = 1; k <= kRestarts; ++k) {
    {
      std::unique_lock<std::mutex> lock(mu);
      EXPECT_TRUE(all_done(lock, base)) << "before restart " << k;
      restart = k;
    }
    absl::Status restarted = c->RestartSidecar((k - 1) % kNodes);
    std::lock_guard<std::mutex> lock(mu);
    base = done;
    if (!restarted.ok()) {
      ADD_FAILURE() << "restart " << k << ": " << restarted;
      break;
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(all_done(lock, base)) << "after the last restart: the ranks did not meet again";
    stop_at = uint64_t(*std::max_element(done.begin(), done.end())) + 2;
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(wrong, 0);
  // Per rank and restart, the first failure is the dying sidecar's: the step is lost, restart
  // the job. Only ranks of the restarted node fail, and never at a deadline.
  std::set<std::pair<int, int>> seen;
  for (const Failure& f : failures) {
    SCOPED_TRACE(absl::StrCat("rank ", f.rank, " after restart ", f.restart, ": ",
                              f.status.ToString()));
    EXPECT_EQ(f.status.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(f.rank / kPerNode, (f.restart - 1) % kNodes);
    if (!seen.insert({f.rank, f.restart}).second) continue;
    EXPECT_TRUE(absl::StrContains(
        f.status.message(), absl::StrCat("sidecar node", (f.restart - 1) % kNodes,
                                         " is shutting down (SIGTERM): the training step in "
                                         "flight is lost on every rank. Restart the job")));
  }
}

TEST(Failures, RootRestartFailsGlobalRoundsInFlightAndLaterRoundsSucceed) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  auto job = ConnectAll(*c, "root-restart");
  ASSERT_TRUE(job[0] && job[1]);
  auto global = [&](uint64_t seq, double m0, double m1, std::vector<double>* mean) {
    Contribution in0 = Good(m0), in1 = Good(m1);
    auto p0 = job[0]->Start(Phase::kForward, 0, seq, Scope::kGlobal, 4, 2, in0.a.data(),
                            in0.b.data());
    auto p1 = job[1]->Start(Phase::kForward, 0, seq, Scope::kGlobal, 4, 2, in1.a.data(),
                            in1.b.data());
    std::vector<double> a(4), b(4);
    absl::Status s0 = p0.ok() ? job[0]->Wait(**p0, nullptr, a.data(), b.data()) : p0.status();
    if (mean) *mean = a;
    absl::Status s1 = p1.ok() ? job[1]->Wait(**p1, nullptr, a.data(), b.data()) : p1.status();
    return s0.ok() ? s1 : s0;
  };
  std::vector<double> mean;
  ASSERT_TRUE(global(0, 1.0, 3.0, &mean).ok());
  EXPECT_EQ(mean[0], 2.0);
  ASSERT_TRUE(c->RestartRoot().ok());
  // The first global round after the restart may fail while the sidecars notice; within a few
  // rounds they reconnect and rounds succeed again.
  absl::Status s;
  for (uint64_t seq = 1; seq < 6; ++seq) {
    s = global(seq, 2.0, 6.0, &mean);
    if (s.ok()) break;
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(mean[0], 4.0);
}

// A root that stops answering without closing its connections (its machine froze or vanished:
// here SIGSTOP) is noticed by the sidecars' keepalive pings (every 10 s, 5 s to answer), so a
// global round waiting on it fails with UNAVAILABLE naming the link within about 15 s, not at
// the 60 s round deadline.
TEST(Failures, FrozenRootIsNoticedByKeepaliveLongBeforeTheRoundDeadline) {
  auto c = StartCluster(2, 1, {"--round-timeout-ms=60000"});
  ASSERT_TRUE(c);
  auto job = ConnectAll(*c, "frozen-root");
  ASSERT_TRUE(job[0] && job[1]);
  auto global = [&](uint64_t seq, std::string* message) {
    Contribution in = Good(1.0);
    auto p0 = job[0]->Start(Phase::kForward, 0, seq, Scope::kGlobal, 4, 2, in.a.data(),
                            in.b.data());
    auto p1 = job[1]->Start(Phase::kForward, 0, seq, Scope::kGlobal, 4, 2, in.a.data(),
                            in.b.data());
    std::vector<double> a(4), b(4);
    absl::Status s0 = p0.ok() ? job[0]->Wait(**p0, nullptr, a.data(), b.data()) : p0.status();
    absl::Status s1 = p1.ok() ? job[1]->Wait(**p1, nullptr, a.data(), b.data()) : p1.status();
    if (message) *message = absl::StrCat(s0.ToString(), " | ", s1.ToString());
    return s0.ok() ? s1 : s0;
  };
  ASSERT_TRUE(global(0, nullptr).ok());  // both sidecars are connected to the root
  c->root()->Signal(SIGSTOP);
  const auto t0 = steady_clock::now();
  std::string message;
  absl::Status s = global(1, &message);
  const double seconds = std::chrono::duration<double>(steady_clock::now() - t0).count();
  c->root()->Signal(SIGCONT);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << message;
  EXPECT_NE(message.find("lost its link to the root aggregator"), std::string::npos) << message;
  EXPECT_LT(seconds, 30.0) << message;
}

TEST(Failures, UnreachableRootFailsGlobalRoundsWithoutQueueingBehindTheConnectTimeout) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  auto job = ConnectAll(*c, "no-root");
  ASSERT_TRUE(job[0] && job[1]);
  EXPECT_EQ(c->root()->Stop(), 0);
  std::vector<double> a(4), b(4);
  Contribution in = Good(1.0);
  for (uint64_t seq = 0; seq < 4; ++seq) {
    const auto t0 = steady_clock::now();
    auto p0 = job[0]->Start(Phase::kForward, 0, seq, Scope::kGlobal, 4, 2, in.a.data(),
                            in.b.data());
    auto p1 = job[1]->Start(Phase::kForward, 0, seq, Scope::kGlobal, 4, 2, in.a.data(),
                            in.b.data());
    ASSERT_TRUE(p0.ok() && p1.ok());
    absl::Status s0 = job[0]->Wait(**p0, nullptr, a.data(), b.data());
    absl::Status s1 = job[1]->Wait(**p1, nullptr, a.data(), b.data());
    const auto took = steady_clock::now() - t0;
    EXPECT_EQ(s0.code(), absl::StatusCode::kUnavailable) << s0;
    EXPECT_NE(s0.message().find(c->root_address()), std::string::npos) << s0;
    EXPECT_EQ(s1.code(), absl::StatusCode::kUnavailable) << s1;
    // The first round waits for the connect attempt (5 s); the next ones fail at once.
    if (seq > 0) {
      EXPECT_LT(took, milliseconds(1500)) << "round " << seq;
    }
  }
}

TEST(Failures, GlobalDeadlineNamesTheNodeWhoseWorkersAreAllGone) {
  auto c = StartCluster(2, 1, {"--round-timeout-ms=1000"});
  ASSERT_TRUE(c);
  auto rank0 = Connect(*c, 0, "node-gone");
  auto rank1 = Connect(*c, 1, "node-gone");
  ASSERT_TRUE(rank0 && rank1);
  rank1.reset();  // node 1 has no worker left: its sidecar never opens the round
  Contribution in = Good(1.0);
  std::vector<double> a(4), b(4);
  absl::Status s = rank0->Forward(0, 0, Scope::kGlobal, 4, 2, in.a.data(), in.b.data(), nullptr,
                                  a.data(), b.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("waiting for node 1 (ranks 1-1)"), std::string::npos) << s;
}

TEST(Failures, FinishedJobIsDroppedAtTheRootToo) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  {
    auto job = ConnectAll(*c, "finished");
    ASSERT_TRUE(job[0] && job[1]);
    Contribution in = Good(1.0);
    auto p0 = job[0]->Start(Phase::kForward, 0, 0, Scope::kGlobal, 4, 2, in.a.data(),
                            in.b.data());
    auto p1 = job[1]->Start(Phase::kForward, 0, 0, Scope::kGlobal, 4, 2, in.a.data(),
                            in.b.data());
    ASSERT_TRUE(p0.ok() && p1.ok());
    std::vector<double> a(4), b(4);
    ASSERT_TRUE(job[0]->Wait(**p0, nullptr, a.data(), b.data()).ok());
    ASSERT_TRUE(job[1]->Wait(**p1, nullptr, a.data(), b.data()).ok());
  }  // both workers leave: the sidecars drop the job and leave it at the root
  Raw root(c->root_address());
  int jobs = -1;
  for (int i = 0; i < 200 && jobs != 0; ++i) {
    v1::StatusRequest req;
    v1::StatusResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(root.stub->Status(&ctx, req, &resp).ok());
    jobs = resp.jobs_size();
    if (jobs != 0) std::this_thread::sleep_for(milliseconds(25));
  }
  EXPECT_EQ(jobs, 0) << "the root still holds the finished job";
}

// A job restarted under the same job id (torchrun restarts every worker, seqs start again from
// 0) with a higher incarnation ends the old run at the sidecars and the root: the old run's open
// rounds fail ABORTED, and no round of it can answer the new run, not even for a member whose
// contribution is byte-identical to its old one. A process of the old run cannot join again.
TEST(Failures, RestartedRunNeverMeetsTheOldRunsRounds) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  auto connect = [&](int rank, uint64_t incarnation) -> absl::StatusOr<std::unique_ptr<Client>> {
    ClientOptions o = testing::RankOptions(*c, rank, "restarted");
    o.incarnation = incarnation;
    return Client::Connect(o);
  };
  auto global = [](std::vector<Client*> clients, uint32_t op, const std::vector<double>& means,
                   std::vector<std::vector<double>>* out) {
    std::vector<absl::StatusOr<std::shared_ptr<PendingRound>>> started;
    for (size_t i = 0; i < clients.size(); ++i) {
      const std::vector<double> a(2, means[i]), b(2, 1.0);
      started.push_back(
          clients[i]->Start(Phase::kForward, op, 0, Scope::kGlobal, 2, 2, a.data(), b.data()));
    }
    std::vector<absl::Status> st;
    out->assign(clients.size(), std::vector<double>(2));
    for (size_t i = 0; i < clients.size(); ++i) {
      std::vector<double> b(2);
      st.push_back(started[i].ok() ? clients[i]->Wait(**started[i], nullptr, (*out)[i].data(),
                                                      b.data())
                                   : started[i].status());
    }
    return st;
  };
  auto old0 = connect(0, 0), old1 = connect(1, 0);
  ASSERT_TRUE(old0.ok() && old1.ok()) << old0.status() << old1.status();
  std::vector<std::vector<double>> means;
  auto st = global({old0->get(), old1->get()}, 0, {1.0, 3.0}, &means);
  ASSERT_TRUE(st[0].ok() && st[1].ok()) << st[0] << st[1];
  EXPECT_EQ(means[0][0], 2.0);
  // A round of the old run left open at the root: rank 0 contributed, rank 1 never will.
  const std::vector<double> a(2, 5.0), b(2, 1.0);
  auto open = (*old0)->Start(Phase::kForward, 1, 0, Scope::kGlobal, 2, 2, a.data(), b.data());
  ASSERT_TRUE(open.ok()) << open.status();

  // The restart: both ranks join run 1 while the old run's processes still hold their streams.
  auto new0 = connect(0, 1), new1 = connect(1, 1);
  ASSERT_TRUE(new0.ok() && new1.ok()) << new0.status() << new1.status();
  std::vector<double> ra(2), rb(2);
  absl::Status aborted = (*old0)->Wait(**open, nullptr, ra.data(), rb.data());
  // ABORTED from the stream's job; UNAVAILABLE from a shared-memory segment the restart ended.
  EXPECT_TRUE(aborted.code() == absl::StatusCode::kAborted ||
              aborted.code() == absl::StatusCode::kUnavailable)
      << aborted;
  EXPECT_NE(aborted.message().find("restarted"), std::string::npos) << aborted;
  // Rank 0 sends exactly what it sent in run 0 under the same key; rank 1 sends new data.
  st = global({new0->get(), new1->get()}, 0, {1.0, 7.0}, &means);
  ASSERT_TRUE(st[0].ok() && st[1].ok()) << st[0] << st[1];
  EXPECT_EQ(means[0][0], 4.0);  // (1 + 7) / 2, not run 0's 2
  EXPECT_EQ(means[1][0], 4.0);
  // The old run's process cannot join the job again: its run is over.
  auto stale = connect(0, 0);
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_NE(stale.status().message().find("incarnation"), std::string::npos) << stale.status();
}

TEST(CApi, ForwardRoundAndErrors) {
  auto c = StartCluster(1, 1);
  ASSERT_TRUE(c);
  hsbn_options o;
  hsbn_options_init(&o);
  const std::string address = c->sidecar_address(0);
  o.address = address.c_str();
  o.job_id = "c-abi";
  o.rank = 0;
  o.world_size = 1;
  o.local_rank = 0;
  o.local_world_size = 1;
  o.node_rank = 0;
  hsbn_client* client = nullptr;
  ASSERT_EQ(hsbn_client_create(&o, &client), HSBN_OK) << hsbn_last_error();
  hsbn_client_info info;
  ASSERT_EQ(hsbn_client_get_info(client, &info), HSBN_OK);
  EXPECT_EQ(info.num_nodes, 1);
  const double mean[2] = {1.5, -2.0}, m2[2] = {4.0, 0.25};
  double out_mean[2], out_m2[2];
  int64_t count = 0;
  ASSERT_EQ(hsbn_forward(client, 3, 0, HSBN_SCOPE_NODE, 2, 7, mean, m2, &count, out_mean, out_m2),
            HSBN_OK);
  EXPECT_EQ(count, 7);
  EXPECT_EQ(out_mean[0], 1.5);
  EXPECT_EQ(out_m2[1], 0.25);
  const double bad_m2[2] = {1.0, -1.0};  // never a sum of squares
  EXPECT_EQ(
      hsbn_forward(client, 3, 1, HSBN_SCOPE_NODE, 2, 7, mean, bad_m2, &count, out_mean, out_m2),
      HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("m2[1]"), std::string::npos);
  EXPECT_STREQ(hsbn_result_string(HSBN_INVALID_ARGUMENT), "INVALID_ARGUMENT");
  // Round statistics: one node forward round completed, one failed (refused by the sidecar).
  hsbn_stats st;
  std::memset(&st, 0xff, sizeof st);
  st.struct_size = sizeof st;
  ASSERT_EQ(hsbn_client_stats(client, &st), HSBN_OK) << hsbn_last_error();
  EXPECT_EQ(st.struct_size, sizeof st);
  const hsbn_round_stats& nf = st.rounds[HSBN_SCOPE_NODE - 1][HSBN_PHASE_FORWARD - 1];
  EXPECT_EQ(nf.completed, 1);
  EXPECT_EQ(nf.failed, 1);
  EXPECT_GT(nf.blocked_seconds, 0.0);
  EXPECT_GT(nf.max_blocked_seconds, 0.0);
  EXPECT_LE(nf.max_blocked_seconds, nf.blocked_seconds);
  EXPECT_LE(nf.blocked_seconds, st.elapsed_seconds);
  for (int sc = 0; sc < 3; ++sc) {
    for (int ph = 0; ph < 2; ++ph) {
      if (sc == HSBN_SCOPE_NODE - 1 && ph == HSBN_PHASE_FORWARD - 1) continue;
      EXPECT_EQ(st.rounds[sc][ph].completed + st.rounds[sc][ph].failed, 0) << sc << ph;
      EXPECT_EQ(st.rounds[sc][ph].blocked_seconds, 0.0) << sc << ph;
    }
  }
  EXPECT_GE(st.bytes_sent, 2 * 2 * 2 * int64_t(sizeof(double)));  // two contributions
  EXPECT_GE(st.bytes_received, 2 * 2 * int64_t(sizeof(double)));  // one result with data
  // A caller built against a later, larger hsbn_stats: only what this library knows is
  // written, and struct_size says how much.
  struct {
    hsbn_stats known;
    double later_field;
  } larger;
  larger.known.struct_size = sizeof larger;
  larger.later_field = 42.0;
  ASSERT_EQ(hsbn_client_stats(client, &larger.known), HSBN_OK);
  EXPECT_EQ(larger.known.struct_size, sizeof(hsbn_stats));
  EXPECT_EQ(larger.known.rounds[HSBN_SCOPE_NODE - 1][HSBN_PHASE_FORWARD - 1].completed, 1);
  EXPECT_EQ(larger.later_field, 42.0);
  // A struct_size that is not set is refused.
  st.struct_size = 8;
  EXPECT_EQ(hsbn_client_stats(client, &st), HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("struct_size"), std::string::npos);
  EXPECT_EQ(hsbn_client_stats(nullptr, &st), HSBN_INVALID_ARGUMENT);
  EXPECT_EQ(hsbn_client_reset_stats(nullptr), HSBN_INVALID_ARGUMENT);
  // Reset, then one more round through the asynchronous calls (a backward one).
  ASSERT_EQ(hsbn_client_reset_stats(client), HSBN_OK);
  st.struct_size = sizeof st;
  ASSERT_EQ(hsbn_client_stats(client, &st), HSBN_OK);
  EXPECT_EQ(st.rounds[HSBN_SCOPE_NODE - 1][HSBN_PHASE_FORWARD - 1].completed, 0);
  EXPECT_EQ(st.rounds[HSBN_SCOPE_NODE - 1][HSBN_PHASE_FORWARD - 1].failed, 0);
  EXPECT_EQ(st.bytes_sent, 0);
  hsbn_round* round = nullptr;
  ASSERT_EQ(hsbn_round_start(client, HSBN_PHASE_BACKWARD, 3, 2, HSBN_SCOPE_NODE, 2, 7, mean, m2,
                             &round),
            HSBN_OK);
  ASSERT_EQ(hsbn_round_wait(round, &count, out_mean, out_m2), HSBN_OK);
  ASSERT_EQ(hsbn_client_stats(client, &st), HSBN_OK);
  EXPECT_EQ(st.rounds[HSBN_SCOPE_NODE - 1][HSBN_PHASE_BACKWARD - 1].completed, 1);
  EXPECT_EQ(st.rounds[HSBN_SCOPE_NODE - 1][HSBN_PHASE_FORWARD - 1].completed, 0);
  size_t needed = 0;
  char buf[4096];
  ASSERT_EQ(hsbn_status_json(client, 0, buf, sizeof buf, &needed), HSBN_OK);
  EXPECT_NE(std::string(buf).find("\"jobId\":\"c-abi\""), std::string::npos) << buf;
  hsbn_client_destroy(client);

  o.address = "unix:/nonexistent/hsbn.sock";
  o.connect_timeout_ms = 300;
  EXPECT_EQ(hsbn_client_create(&o, &client), HSBN_UNAVAILABLE);
  EXPECT_NE(std::string(hsbn_last_error()).find("no hsbn sidecar answered"), std::string::npos)
      << hsbn_last_error();
}

TEST(ClientOptions, FromEnvNamesWhatIsWrong) {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "HSBN_JOB_ID", "TORCHELASTIC_RUN_ID", "HSBN_ADDRESS", "MASTER_ADDR",
                        "MASTER_PORT"}) {
    unsetenv(v);
  }
  auto o = ClientOptions::FromEnv();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("RANK is not set"), std::string::npos);
  setenv("RANK", "5", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  setenv("GROUP_RANK", "1", 1);
  o = ClientOptions::FromEnv();
  EXPECT_NE(o.status().message().find("HSBN_JOB_ID"), std::string::npos) << o.status();
  setenv("TORCHELASTIC_RUN_ID", "none", 1);  // torchrun without --rdzv_id: not a job id
  o = ClientOptions::FromEnv();
  EXPECT_NE(o.status().message().find("HSBN_JOB_ID"), std::string::npos) << o.status();
  // Plain torchrun: the rendezvous store's address names the job.
  setenv("MASTER_ADDR", "10.1.2.3", 1);
  setenv("MASTER_PORT", "29500", 1);
  o = ClientOptions::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "torchrun-10.1.2.3-29500");
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  unsetenv("TORCHELASTIC_RUN_ID");
  setenv("HSBN_JOB_ID", "j", 1);
  o = ClientOptions::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->address, "unix:/tmp/hsbn.sock");
  EXPECT_EQ(o->rank, 5);
  setenv("GROUP_RANK", "0", 1);
  o = ClientOptions::FromEnv();
  EXPECT_NE(o.status().message().find("GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK"),
            std::string::npos)
      << o.status();
  setenv("WORLD_SIZE", "x", 1);
  o = ClientOptions::FromEnv();
  EXPECT_NE(o.status().message().find("WORLD_SIZE='x'"), std::string::npos) << o.status();
}

}  // namespace
}  // namespace hsbn

// The shared-memory node path with real aggregator processes: results bitwise equal to the
// gRPC stream's, the node-wide fallback to the stream, --shm=off, a full ring, rounds wider
// than the segment. (Every other integration test also runs over both transports: ctest runs
// them as they are, where shared memory is the default, and again with HSBN_TRANSPORT=grpc.)
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/v1/hsbn.pb.h"
#include "test_cluster.h"

namespace hsbn {
namespace {

using testing::RankOptions;
using testing::StartCluster;

std::unique_ptr<Client> ConnectWith(const cluster::LocalCluster& c, int rank,
                                    const std::string& job, const std::string& transport) {
  ClientOptions o = RankOptions(c, rank, job);
  o.transport = transport;
  auto client = Client::Connect(o);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

std::vector<std::unique_ptr<Client>> ConnectJob(const cluster::LocalCluster& c,
                                                const std::string& job,
                                                const std::string& transport) {
  std::vector<std::unique_ptr<Client>> out;
  for (int r = 0; r < c.world_size(); ++r) out.push_back(ConnectWith(c, r, job, transport));
  return out;
}

// A rank's input to a round: values spread over many magnitudes, so that a different merge
// order or formula would change low bits.
struct Input {
  int64_t count;
  std::vector<double> a, b;
};
Input MakeInput(int rank, uint32_t op, uint64_t seq, Phase phase, int64_t channels) {
  std::mt19937_64 gen(uint64_t(rank) * 1000003u + op * 7919u + seq * 31u + uint64_t(phase));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  Input in;
  in.count = 1 + int64_t(gen() % 97);
  for (int64_t c = 0; c < channels; ++c) {
    const double scale = std::pow(10.0, double(c % 9) - 4.0);
    in.a.push_back(u(gen) * scale + 0.1 * rank);
    in.b.push_back(phase == Phase::kForward ? std::fabs(u(gen)) * scale * double(in.count)
                                            : u(gen) * scale);
  }
  return in;
}

struct Output {
  absl::Status status;
  int64_t count = 0;
  std::vector<double> a, b;
};

// Every rank (one thread each) runs the same rounds; returns [rank][round] outputs.
std::vector<std::vector<Output>> RunRounds(std::vector<std::unique_ptr<Client>>& clients,
                                           const std::vector<Scope>& scopes, int seqs,
                                           int64_t channels) {
  std::vector<std::vector<Output>> out(clients.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < clients.size(); ++r) {
    threads.emplace_back([&, r] {
      for (Scope scope : scopes) {
        for (int seq = 0; seq < seqs; ++seq) {
          for (Phase phase : {Phase::kForward, Phase::kBackward}) {
            const uint32_t op = uint32_t(scope);
            Input in = MakeInput(int(r), op, uint64_t(seq), phase, channels);
            Output o;
            o.a.resize(size_t(channels));
            o.b.resize(size_t(channels));
            o.status = phase == Phase::kForward
                           ? clients[r]->Forward(op, uint64_t(seq), scope, channels, in.count,
                                                 in.a.data(), in.b.data(), &o.count, o.a.data(),
                                                 o.b.data())
                           : clients[r]->Backward(op, uint64_t(seq), scope, channels, in.count,
                                                  in.a.data(), in.b.data(), &o.count,
                                                  o.a.data(), o.b.data());
            out[r].push_back(std::move(o));
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

bool SameBits(const Output& x, const Output& y) {
  return x.count == y.count && x.a.size() == y.a.size() &&
         std::memcmp(x.a.data(), y.a.data(), x.a.size() * sizeof(double)) == 0 &&
         std::memcmp(x.b.data(), y.b.data(), x.b.size() * sizeof(double)) == 0;
}

std::string NodeTransport(Client& client) {
  auto s = client.Status(false);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok() || s->jobs_size() != 1) return "";
  return s->jobs(0).node_transport();
}

TEST(SharedMemory, NodeGlobalAndShadowResultsAreBitwiseEqualToTheStreamsOnEveryRank) {
  auto c = StartCluster(2, 2);
  ASSERT_TRUE(c);
  auto shm = ConnectJob(*c, "bits-shm", "auto");
  auto grpc = ConnectJob(*c, "bits-grpc", "grpc");
  for (auto& p : shm) ASSERT_TRUE(p);
  for (auto& p : grpc) ASSERT_TRUE(p);
  const std::vector<Scope> scopes = {Scope::kNode, Scope::kGlobal, Scope::kShadow};
  constexpr int kSeqs = 6;
  constexpr int64_t kChannels = 37;
  auto a = RunRounds(shm, scopes, kSeqs, kChannels);
  auto b = RunRounds(grpc, scopes, kSeqs, kChannels);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(shm[size_t(r)]->Stats().transport, "shm") << "rank " << r;
    EXPECT_EQ(grpc[size_t(r)]->Stats().transport, "grpc: HSBN_TRANSPORT=grpc") << "rank " << r;
  }
  EXPECT_EQ(NodeTransport(*shm[0]), "shm");
  EXPECT_TRUE(absl::StartsWith(NodeTransport(*grpc[2]), "grpc: ")) << NodeTransport(*grpc[2]);
  const size_t rounds = scopes.size() * kSeqs * 2;
  for (size_t r = 0; r < 4; ++r) {
    ASSERT_EQ(a[r].size(), rounds);
    ASSERT_EQ(b[r].size(), rounds);
    for (size_t k = 0; k < rounds; ++k) {
      SCOPED_TRACE(absl::StrCat("rank ", r, " round ", k));
      ASSERT_TRUE(a[r][k].status.ok()) << a[r][k].status;
      ASSERT_TRUE(b[r][k].status.ok()) << b[r][k].status;
      EXPECT_TRUE(SameBits(a[r][k], b[r][k])) << "shared memory and the stream differ";
      // Every member of a round gets the same bits: node and shadow rounds per node,
      // global rounds across nodes.
      const bool global = k >= kSeqs * 2 && k < 2 * kSeqs * 2;
      const size_t peer = global ? (r + 2) % 4 : (r ^ 1);
      EXPECT_TRUE(SameBits(a[r][k], a[peer][k])) << "rank " << peer << " got other bits";
    }
  }
  // The arithmetic is right too: a node forward round's count is the ranks' counts summed, and
  // its mean their count-weighted mean.
  for (int node = 0; node < 2; ++node) {
    const Input x = MakeInput(2 * node, 1, 0, Phase::kForward, kChannels);
    const Input y = MakeInput(2 * node + 1, 1, 0, Phase::kForward, kChannels);
    const Output& got = a[size_t(2 * node)][0];
    EXPECT_EQ(got.count, x.count + y.count);
    for (int64_t ch = 0; ch < kChannels; ++ch) {
      const double want = (x.a[size_t(ch)] * double(x.count) + y.a[size_t(ch)] * double(y.count)) /
                          double(x.count + y.count);
      EXPECT_NEAR(got.a[size_t(ch)], want, 1e-12 * (1 + std::fabs(want)));
    }
  }
}

TEST(SharedMemory, OneRankWithoutSharedMemoryPutsItsWholeNodeOnTheStream) {
  auto c = StartCluster(1, 3);
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Client>> job;
  job.push_back(ConnectWith(*c, 0, "fallback", "auto"));
  job.push_back(ConnectWith(*c, 1, "fallback", "grpc"));
  job.push_back(ConnectWith(*c, 2, "fallback", "auto"));
  for (auto& p : job) ASSERT_TRUE(p);
  auto out = RunRounds(job, {Scope::kNode}, 3, 5);
  for (size_t r = 0; r < 3; ++r) {
    for (const Output& o : out[r]) ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_TRUE(SameBits(out[r].back(), out[0].back()));
  }
  const std::string why = "grpc: local rank 1 does not offer shared memory";
  EXPECT_TRUE(absl::StartsWith(job[0]->Stats().transport, why)) << job[0]->Stats().transport;
  EXPECT_TRUE(absl::StartsWith(job[2]->Stats().transport, why)) << job[2]->Stats().transport;
  EXPECT_EQ(job[1]->Stats().transport, "grpc: HSBN_TRANSPORT=grpc");
  EXPECT_TRUE(absl::StartsWith(NodeTransport(*job[0]), why)) << NodeTransport(*job[0]);
  // The node's transport is fixed once chosen: a rank that rejoins offering shared memory
  // takes the stream like the others (its note says why).
  job[1].reset();
  auto again = ConnectWith(*c, 1, "fallback", "auto");
  ASSERT_TRUE(again);
  EXPECT_TRUE(absl::StartsWith(again->Stats().transport, why)) << again->Stats().transport;
}

// A worker that cannot reach the hand-off socket (another host or container) joins again
// without the offer: the node takes the stream at once, not after --shm-wait-ms (here far
// longer than the rounds' own timeout, so a node left waiting would fail them).
TEST(SharedMemory, AWorkerThatCannotReachTheSocketPutsTheNodeOnTheStreamAtOnce) {
  auto c = StartCluster(1, 2, {"--shm-wait-ms=600000"});
  ASSERT_TRUE(c);
  const std::string sock = c->sidecar_address(0).substr(5) + ".shm";  // unix:<path>
  ASSERT_EQ(::unlink(sock.c_str()), 0) << sock;
  std::vector<std::unique_ptr<Client>> job;
  for (int r = 0; r < 2; ++r) {
    ClientOptions o = RankOptions(*c, r, "unreachable", std::chrono::milliseconds(20000));
    o.transport = "auto";
    auto client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    job.push_back(std::move(*client));
  }
  auto out = RunRounds(job, {Scope::kNode}, 2, 3);
  for (auto& rank : out) {
    for (const Output& o : rank) ASSERT_TRUE(o.status.ok()) << o.status;
  }
  EXPECT_TRUE(SameBits(out[0].back(), out[1].back()));
  // Rank 0 joined first and declined; rank 1 joined a node already on the stream.
  EXPECT_TRUE(absl::StartsWith(job[0]->Stats().transport,
                               "grpc: this worker cannot reach the sidecar's shared-memory"))
      << job[0]->Stats().transport;
  EXPECT_TRUE(absl::StartsWith(job[1]->Stats().transport, "grpc: local rank 0 does not offer"))
      << job[1]->Stats().transport;
  EXPECT_TRUE(absl::StartsWith(NodeTransport(*job[0]), "grpc: local rank 0 does not offer"))
      << NodeTransport(*job[0]);
}

// A restarted run (a higher incarnation) replaces the job and its segment, so it may come back
// on the other transport; the old run's workers, still connected, are refused, not met.
TEST(SharedMemory, ARestartedRunChoosesItsTransportAfresh) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  auto old_run = ConnectJob(*c, "restarted", "auto");
  for (auto& p : old_run) ASSERT_TRUE(p);
  for (auto& rank : RunRounds(old_run, {Scope::kNode}, 1, 3)) {
    for (const Output& o : rank) ASSERT_TRUE(o.status.ok()) << o.status;
  }
  ASSERT_EQ(old_run[0]->Stats().transport, "shm");
  std::vector<std::unique_ptr<Client>> new_run;
  for (int r = 0; r < 2; ++r) {
    ClientOptions o = RankOptions(*c, r, "restarted");
    o.transport = "grpc";
    o.incarnation = 1;
    auto client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << "rank " << r << ": " << client.status();
    new_run.push_back(std::move(*client));
  }
  auto out = RunRounds(new_run, {Scope::kNode}, 2, 3);
  for (auto& rank : out) {
    for (const Output& o : rank) ASSERT_TRUE(o.status.ok()) << o.status;
  }
  EXPECT_TRUE(SameBits(out[0].back(), out[1].back()));
  EXPECT_EQ(new_run[0]->Stats().transport, "grpc: HSBN_TRANSPORT=grpc");
  EXPECT_TRUE(absl::StartsWith(NodeTransport(*new_run[0]), "grpc: local rank 0 does not offer"))
      << NodeTransport(*new_run[0]);
  // The old run's segment was invalidated when run 1 joined: its next round finds it dead,
  // and its rejoin as run 0 is refused, naming both runs.
  double a[3] = {1, 2, 3}, b[3] = {1, 1, 1}, oa[3], ob[3];
  int64_t n = 0;
  absl::Status st = old_run[0]->Forward(9, 0, Scope::kNode, 3, 4, a, b, &n, oa, ob);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "belongs to run (incarnation) 0") &&
              absl::StrContains(st.message(), "already serves run 1"))
      << st;
}

TEST(SharedMemory, SidecarWithShmOffServesTheNodeOverTheStream) {
  auto c = StartCluster(1, 2, {"--shm=off"});
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "shm-off", "auto");
  for (auto& p : job) ASSERT_TRUE(p);
  auto out = RunRounds(job, {Scope::kNode}, 2, 3);
  for (auto& rank : out) {
    for (const Output& o : rank) ASSERT_TRUE(o.status.ok()) << o.status;
  }
  EXPECT_EQ(job[0]->Stats().transport, "grpc: the sidecar runs with --shm=off");
  EXPECT_EQ(NodeTransport(*job[1]), "grpc: the sidecar runs with --shm=off");
}

// More rounds in flight than the ring has slots: a Start that finds the ring full waits for a
// slot (taking finished rounds' answers aside); nothing is dropped or mixed up.
TEST(SharedMemory, AFullRingWaitsAndEveryRoundArrivesCorrect) {
  auto c = StartCluster(1, 2, {"--shm-ring=2"});
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "ring", "auto");
  for (auto& p : job) ASSERT_TRUE(p);
  constexpr int kInFlight = 12;
  constexpr int64_t kChannels = 6;
  std::vector<std::vector<Output>> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::shared_ptr<PendingRound>> pending;
      for (int seq = 0; seq < kInFlight; ++seq) {
        Input in = MakeInput(r, 3, uint64_t(seq), Phase::kForward, kChannels);
        auto p = job[size_t(r)]->Start(Phase::kForward, 3, uint64_t(seq), Scope::kNode,
                                       kChannels, in.count, in.a.data(), in.b.data());
        EXPECT_TRUE(p.ok()) << p.status();
        if (p.ok()) pending.push_back(*p);
      }
      for (auto& p : pending) {
        Output o;
        o.a.resize(kChannels);
        o.b.resize(kChannels);
        o.status = job[size_t(r)]->Wait(*p, &o.count, o.a.data(), o.b.data());
        out[size_t(r)].push_back(std::move(o));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(job[0]->Stats().transport, "shm");
  ASSERT_EQ(out[0].size(), size_t(kInFlight));
  ASSERT_EQ(out[1].size(), size_t(kInFlight));
  for (int seq = 0; seq < kInFlight; ++seq) {
    const Input x = MakeInput(0, 3, uint64_t(seq), Phase::kForward, kChannels);
    const Input y = MakeInput(1, 3, uint64_t(seq), Phase::kForward, kChannels);
    for (int r = 0; r < 2; ++r) {
      const Output& o = out[size_t(r)][size_t(seq)];
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.count, x.count + y.count) << "seq " << seq;
      const double want = (x.a[0] * double(x.count) + y.a[0] * double(y.count)) /
                          double(x.count + y.count);
      EXPECT_NEAR(o.a[0], want, 1e-12) << "seq " << seq;
    }
  }
}

// Rounds wider than --shm-max-channels take the stream (every rank decides by the channel
// count alone); narrower ones stay in shared memory, on the same clients.
TEST(SharedMemory, RoundsWiderThanTheSegmentTakeTheStream) {
  auto c = StartCluster(1, 2, {"--shm-max-channels=8"});
  ASSERT_TRUE(c);
  auto job = ConnectJob(*c, "wide", "auto");
  for (auto& p : job) ASSERT_TRUE(p);
  auto narrow = RunRounds(job, {Scope::kNode}, 2, 8);
  const int64_t sent = job[0]->Stats().bytes_sent;
  auto wide = RunRounds(job, {Scope::kGlobal}, 2, 64);  // one node: global is the node
  for (auto* out : {&narrow, &wide}) {
    for (auto& rank : *out) {
      for (const Output& o : rank) ASSERT_TRUE(o.status.ok()) << o.status;
    }
    EXPECT_TRUE(SameBits((*out)[0].back(), (*out)[1].back()));
  }
  EXPECT_EQ(job[0]->Stats().transport, "shm");
  // The sidecar counts both kinds: 4 rounds through the segment, 4 through the stream.
  auto s = job[0]->Status(false);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->jobs_size(), 1);
  EXPECT_EQ(s->jobs(0).rounds_completed(), 8);
  // The wide rounds went through the stream: protobuf frames carry more than the 16 bytes per
  // channel a round through shared memory counts.
  EXPECT_GT(job[0]->Stats().bytes_sent - sent, 4 * 16 * 64);
}

}  // namespace
}  // namespace hsbn

// Client::Stats with real aggregators: rounds are counted exactly per scope and phase, blocked
// time is real wall time spent waiting (the whole call for Forward/Backward, the time inside
// Wait for Start/Wait), failed rounds (refused by the aggregator, refused by Start, past their
// deadline) are counted as failed, ResetStats starts over, and the counters hold under several
// threads at once.
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "local_cluster.h"
#include "test_cluster.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

double Since(steady_clock::time_point t) {
  return std::chrono::duration<double>(steady_clock::now() - t).count();
}

using testing::StartCluster;

std::unique_ptr<Client> Connect(LocalCluster& c, int rank, const std::string& job,
                                milliseconds round_timeout = milliseconds(0)) {
  return testing::ConnectRank(c, rank, job, round_timeout);
}

constexpr int kChannels = 8;
// A contribution's payload: two arrays of kChannels doubles.
constexpr int64_t kPayloadBytes = 2 * kChannels * int64_t(sizeof(double));

struct Arrays {
  std::vector<double> a = std::vector<double>(kChannels, 1.0);
  std::vector<double> b = std::vector<double>(kChannels, 2.0);
};

absl::Status Fwd(Client& c, uint32_t op, uint64_t seq, Scope scope, Arrays& x) {
  int64_t n = 0;
  return c.Forward(op, seq, scope, kChannels, 3, x.a.data(), x.b.data(), &n, x.a.data(),
                   x.b.data());
}

absl::Status Bwd(Client& c, uint32_t op, uint64_t seq, Scope scope, Arrays& x) {
  int64_t n = 0;
  return c.Backward(op, seq, scope, kChannels, 3, x.a.data(), x.b.data(), &n, x.a.data(),
                    x.b.data());
}

void ExpectEmpty(const RoundStats& r, const std::string& what) {
  EXPECT_EQ(r.completed, 0) << what;
  EXPECT_EQ(r.failed, 0) << what;
  EXPECT_EQ(r.blocked_seconds, 0.0) << what;
  EXPECT_EQ(r.max_blocked_seconds, 0.0) << what;
}

// Two nodes of one worker each, with a root: node rounds stay at the sidecar, global and shadow
// rounds go through the root. Each rank runs on its own thread (rounds block).
TEST(ClientStats, CountsRoundsPerScopeAndPhaseAndTimeBlocked) {
  auto c = StartCluster(2, 1);
  ASSERT_TRUE(c);
  std::unique_ptr<Client> clients[2] = {Connect(*c, 0, "stats"), Connect(*c, 1, "stats")};
  ASSERT_TRUE(clients[0] && clients[1]);
  for (auto& cl : clients) {  // Nothing yet (joining is not a round).
    const ClientStats s = cl->Stats();
    ExpectEmpty(s.total(), "fresh client");
    EXPECT_GT(s.bytes_sent, 0);  // the stream's attach frame
  }
  constexpr int kNode = 7, kGlobal = 5, kShadow = 4;
  constexpr double kDelay = 0.3;  // rank 1 is late for one global round by this much
  double wall[2] = {0, 0};
  double async_wait_rank0 = 0;
  std::vector<std::string> errors[2];
  auto run = [&](int rank) {
    Client& cl = *clients[rank];
    auto check = [&](const absl::Status& s, const char* what) {
      if (!s.ok()) errors[rank].push_back(absl::StrCat(what, ": ", s.ToString()));
    };
    Arrays x;
    const auto t0 = steady_clock::now();
    for (int i = 0; i < kNode; ++i) {
      check(Fwd(cl, 0, i, Scope::kNode, x), "node forward");
      check(Bwd(cl, 0, i, Scope::kNode, x), "node backward");
    }
    for (int i = 0; i < kGlobal; ++i) {
      if (rank == 1 && i == 2) std::this_thread::sleep_for(milliseconds(int(kDelay * 1000)));
      check(Fwd(cl, 1, i, Scope::kGlobal, x), "global forward");
    }
    for (int i = 0; i < kShadow; ++i) check(Fwd(cl, 2, i, Scope::kShadow, x), "shadow forward");
    // One asynchronous global backward round: rank 0 starts it, does 300 ms of other work
    // (the result arrives meanwhile), then waits; only the wait counts as blocked.
    if (rank == 0) {
      auto p = cl.Start(Phase::kBackward, 1, 0, Scope::kGlobal, kChannels, 3, x.a.data(),
                        x.b.data());
      if (!p.ok()) {
        check(p.status(), "global backward start");
      } else {
        std::this_thread::sleep_for(milliseconds(300));
        int64_t n = 0;
        const auto w = steady_clock::now();
        check(cl.Wait(**p, &n, x.a.data(), x.b.data()), "global backward wait");
        async_wait_rank0 = Since(w);
      }
    } else {
      check(Bwd(cl, 1, 0, Scope::kGlobal, x), "global backward");
    }
    wall[rank] = Since(t0);
  };
  std::thread t1(run, 1);
  run(0);
  t1.join();
  for (int r = 0; r < 2; ++r) {
    for (const auto& e : errors[r]) ADD_FAILURE() << "rank " << r << ": " << e;
  }

  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    const ClientStats s = clients[r]->Stats();
    const RoundStats& nf = s.of(Scope::kNode, Phase::kForward);
    const RoundStats& nb = s.of(Scope::kNode, Phase::kBackward);
    const RoundStats& gf = s.of(Scope::kGlobal, Phase::kForward);
    const RoundStats& gb = s.of(Scope::kGlobal, Phase::kBackward);
    const RoundStats& sf = s.of(Scope::kShadow, Phase::kForward);
    EXPECT_EQ(nf.completed, kNode);
    EXPECT_EQ(nb.completed, kNode);
    EXPECT_EQ(gf.completed, kGlobal);
    EXPECT_EQ(gb.completed, 1);
    EXPECT_EQ(sf.completed, kShadow);
    ExpectEmpty(s.of(Scope::kShadow, Phase::kBackward), "shadow backward");
    EXPECT_EQ(s.total().failed, 0);
    EXPECT_EQ(s.total().completed, 2 * kNode + kGlobal + 1 + kShadow);
    EXPECT_EQ(s.of(Scope::kNode).completed, 2 * kNode);
    for (const RoundStats* x : {&nf, &nb, &gf, &gb, &sf}) {
      EXPECT_GT(x->blocked_seconds, 0.0);
      EXPECT_GT(x->max_blocked_seconds, 0.0);
      EXPECT_LE(x->max_blocked_seconds, x->blocked_seconds);
    }
    // Blocked time is part of the wall time around the calls (one thread per client).
    EXPECT_LE(s.total().blocked_seconds, wall[r]);
    EXPECT_GE(s.elapsed_seconds, wall[r]);
    // Each round's contribution went out and its result came back.
    const int64_t rounds = s.total().completed;
    EXPECT_GE(s.bytes_sent, rounds * kPayloadBytes);
    EXPECT_GE(s.bytes_received, rounds * kPayloadBytes);
    EXPECT_LT(s.bytes_sent, rounds * (kPayloadBytes + 64) + 64);
  }
  const ClientStats s0 = clients[0]->Stats();
  // Rank 0 waited for late rank 1 in one global round (about kDelay; the two ranks leave the
  // previous round a few milliseconds apart, more on a loaded machine).
  EXPECT_GE(s0.of(Scope::kGlobal, Phase::kForward).max_blocked_seconds, kDelay / 2);
  // The asynchronous round counted only the wait (the 300 ms between Start and Wait not).
  const RoundStats& gb0 = s0.of(Scope::kGlobal, Phase::kBackward);
  EXPECT_LE(gb0.blocked_seconds, async_wait_rank0);
  EXPECT_LT(gb0.blocked_seconds, 0.25);

  // Reset: everything starts over, and the next round counts in the new period.
  clients[0]->ResetStats();
  ClientStats z = clients[0]->Stats();
  ExpectEmpty(z.total(), "after reset");
  EXPECT_EQ(z.bytes_sent, 0);
  EXPECT_EQ(z.bytes_received, 0);
  EXPECT_LT(z.elapsed_seconds, 1.0);
  Arrays x;
  ASSERT_TRUE(Fwd(*clients[0], 9, 0, Scope::kNode, x).ok());
  z = clients[0]->Stats();
  EXPECT_EQ(z.total().completed, 1);
  EXPECT_EQ(z.of(Scope::kNode, Phase::kForward).completed, 1);
  EXPECT_GE(z.bytes_sent, kPayloadBytes);
  EXPECT_GE(z.bytes_received, kPayloadBytes);
  // Rank 1 was not reset.
  EXPECT_EQ(clients[1]->Stats().total().completed, 2 * kNode + kGlobal + 1 + kShadow);
}

// Failed rounds: refused by the aggregator (bad input), refused by Start (no channels), and
// past the client's deadline (the other member never comes): each counted once as failed in
// its scope and phase, with its blocked time.
TEST(ClientStats, CountsFailedRounds) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  constexpr milliseconds kTimeout(600);
  auto a = Connect(*c, 0, "stats-fail", kTimeout);
  auto b = Connect(*c, 1, "stats-fail", kTimeout);
  ASSERT_TRUE(a && b);
  Arrays good, bad;
  bad.b[3] = -1.0;  // a negative sum of squares
  // Bad input from rank 1: the sidecar fails the round for both members.
  absl::Status sb;
  std::thread t([&] { sb = Fwd(*b, 0, 0, Scope::kNode, bad); });
  absl::Status sa = Fwd(*a, 0, 0, Scope::kNode, good);
  t.join();
  EXPECT_EQ(sa.code(), absl::StatusCode::kInvalidArgument) << sa;
  EXPECT_EQ(sb.code(), absl::StatusCode::kInvalidArgument) << sb;
  // Refused by Start before anything is sent.
  int64_t n = 0;
  EXPECT_EQ(a->Forward(0, 1, Scope::kNode, 0, 3, good.a.data(), good.b.data(), &n, nullptr,
                       nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  auto started = a->Start(Phase::kBackward, 0, 1, Scope::kNode, kChannels, 3, nullptr, nullptr);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  // Rank 1 never contributes to this one: rank 0's blocking call passes its deadline.
  const auto t0 = steady_clock::now();
  absl::Status late = Bwd(*a, 1, 0, Scope::kGlobal, good);
  const double waited = Since(t0);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  // An asynchronous round past its deadline, waited for twice: counted once.
  auto p = a->Start(Phase::kForward, 2, 0, Scope::kShadow, kChannels, 3, good.a.data(),
                    good.b.data());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(a->Wait(**p, &n, nullptr, nullptr).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(a->Wait(**p, &n, nullptr, nullptr).code(), absl::StatusCode::kDeadlineExceeded);
  // And a good round after all that.
  std::thread t2([&] { sb = Fwd(*b, 0, 2, Scope::kNode, good); });
  sa = Fwd(*a, 0, 2, Scope::kNode, good);
  t2.join();
  EXPECT_TRUE(sa.ok() && sb.ok()) << sa << sb;

  const ClientStats s = a->Stats();
  const RoundStats& nf = s.of(Scope::kNode, Phase::kForward);
  EXPECT_EQ(nf.completed, 1);
  EXPECT_EQ(nf.failed, 2);  // the aggregator's refusal and Start's
  const RoundStats& nb = s.of(Scope::kNode, Phase::kBackward);
  EXPECT_EQ(nb.completed, 0);
  EXPECT_EQ(nb.failed, 1);  // a Start refused (no time blocked: Start is not counted)
  EXPECT_EQ(nb.blocked_seconds, 0.0);
  const RoundStats& gb = s.of(Scope::kGlobal, Phase::kBackward);
  EXPECT_EQ(gb.completed, 0);
  EXPECT_EQ(gb.failed, 1);
  EXPECT_GE(gb.blocked_seconds, std::chrono::duration<double>(kTimeout).count());
  EXPECT_LE(gb.blocked_seconds, waited);
  const RoundStats& sf = s.of(Scope::kShadow, Phase::kForward);
  EXPECT_EQ(sf.completed, 0);
  EXPECT_EQ(sf.failed, 1);
  EXPECT_GE(sf.blocked_seconds, 2 * std::chrono::duration<double>(kTimeout).count());
  EXPECT_EQ(s.total().failed, 5);
  EXPECT_EQ(s.total().completed, 1);
  // Rank 1: its bad round failed, its good one completed.
  const ClientStats s1 = b->Stats();
  EXPECT_EQ(s1.of(Scope::kNode, Phase::kForward).failed, 1);
  EXPECT_EQ(s1.of(Scope::kNode, Phase::kForward).completed, 1);
}

// Several threads per client with rounds in flight (Start ahead, Wait later): every round is
// counted exactly once.
TEST(ClientStats, ExactUnderConcurrentRounds) {
  auto c = StartCluster(1, 2);
  ASSERT_TRUE(c);
  std::unique_ptr<Client> clients[2] = {Connect(*c, 0, "stats-mt"), Connect(*c, 1, "stats-mt")};
  ASSERT_TRUE(clients[0] && clients[1]);
  constexpr int kThreads = 3, kRounds = 40;
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  const auto t0 = steady_clock::now();
  for (int rank = 0; rank < 2; ++rank) {
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, rank, t] {
        Client& cl = *clients[rank];
        const Scope scope = t == 2 ? Scope::kShadow : Scope::kNode;
        const Phase phase = t == 1 ? Phase::kBackward : Phase::kForward;
        for (int i = 0; i < kRounds; i += 2) {
          Arrays x, y;
          auto p = cl.Start(phase, t, i, scope, kChannels, 3, x.a.data(), x.b.data());
          auto q = cl.Start(phase, t, i + 1, scope, kChannels, 3, y.a.data(), y.b.data());
          int64_t n = 0;
          if (!p.ok() || !cl.Wait(**p, &n, x.a.data(), x.b.data()).ok()) ++errors;
          if (!q.ok() || !cl.Wait(**q, &n, y.a.data(), y.b.data()).ok()) ++errors;
        }
      });
    }
  }
  for (auto& th : threads) th.join();
  const double wall = Since(t0);
  EXPECT_EQ(errors.load(), 0);
  for (int r = 0; r < 2; ++r) {
    const ClientStats s = clients[r]->Stats();
    EXPECT_EQ(s.of(Scope::kNode, Phase::kForward).completed, kRounds);
    EXPECT_EQ(s.of(Scope::kNode, Phase::kBackward).completed, kRounds);
    EXPECT_EQ(s.of(Scope::kShadow, Phase::kForward).completed, kRounds);
    EXPECT_EQ(s.total().completed, kThreads * kRounds);
    EXPECT_EQ(s.total().failed, 0);
    // Three threads wait at once at most.
    EXPECT_LE(s.total().blocked_seconds, kThreads * wall);
    EXPECT_GT(s.total().blocked_seconds, 0.0);
  }
}

}  // namespace
}  // namespace hsbn

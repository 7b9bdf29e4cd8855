// The client with several rounds in flight from several threads on one Client: the waiting
// callers read the stream themselves (one at a time, the others sleep), so these tests check
// that every result reaches its waiter, that deadlines hold whoever is reading, and that a broken
// stream fails every waiter and is replaced.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/hsbn.h"
#include "local_cluster.h"
#include "test_cluster.h"
#include "wire.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

std::unique_ptr<LocalCluster> StartCluster(int per_node) {
  return testing::StartCluster(1, per_node);
}

std::unique_ptr<Client> Connect(LocalCluster& c, int rank, const std::string& job,
                                milliseconds round_timeout = milliseconds(0)) {
  return testing::ConnectRank(c, rank, job, round_timeout);
}

constexpr int kChannels = 16;

// Rank r's contribution to round (op, seq): count 2, mean op*1000 + seq + r per channel (plus
// the channel index), m2 1. With two ranks the merged mean is op*1000 + seq + 0.5 + channel.
struct Input {
  std::vector<double> mean, m2;
};
Input MakeInput(int rank, uint32_t op, uint64_t seq) {
  Input in{std::vector<double>(kChannels), std::vector<double>(kChannels, 1.0)};
  for (int ch = 0; ch < kChannels; ++ch) in.mean[ch] = op * 1000.0 + double(seq) + rank + ch;
  return in;
}

// Checks a merged result of two ranks; returns "" or what is wrong.
std::string CheckMerged(uint32_t op, uint64_t seq, int64_t count, const double* mean) {
  if (count != 4) return absl::StrCat("op ", op, " seq ", seq, ": count ", count);
  for (int ch = 0; ch < kChannels; ++ch) {
    const double want = op * 1000.0 + double(seq) + 0.5 + ch;
    if (mean[ch] != want) {
      return absl::StrCat("op ", op, " seq ", seq, " channel ", ch, ": mean ", mean[ch],
                          " want ", want);
    }
  }
  return "";
}

// Several threads per client, each with its own layer (op) and up to three rounds of it in
// flight (Start ahead, Wait the oldest), on both members of a job at once: every result is
// correct and reaches its waiter. The outputs alias the inputs (Start copies them).
TEST(ClientConcurrency, ManyRoundsInFlightFromSeveralThreadsAllArriveCorrect) {
  auto c = StartCluster(2);
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<Client>> clients;
  clients.push_back(Connect(*c, 0, "many"));
  clients.push_back(Connect(*c, 1, "many"));
  ASSERT_TRUE(clients[0] && clients[1]);
  constexpr int kThreads = 4, kRounds = 60, kAhead = 3;
  std::mutex errors_mu;
  std::vector<std::string> errors;
  std::atomic<int> ok_rounds{0};
  auto worker = [&](int rank, uint32_t op) {
    Client& client = *clients[rank];
    struct InFlight {
      uint64_t seq;
      Input io;
      std::shared_ptr<PendingRound> round;
    };
    std::deque<InFlight> flight;
    auto wait_oldest = [&] {
      InFlight& f = flight.front();
      int64_t count = 0;
      absl::Status s = client.Wait(*f.round, &count, f.io.mean.data(), f.io.m2.data());
      std::string err = s.ok() ? CheckMerged(op, f.seq, count, f.io.mean.data())
                               : absl::StrCat("op ", op, " seq ", f.seq, ": ", s.ToString());
      if (err.empty()) {
        ++ok_rounds;
      } else {
        std::lock_guard<std::mutex> lock(errors_mu);
        errors.push_back(absl::StrCat("rank ", rank, ": ", err));
      }
      flight.pop_front();
    };
    for (uint64_t seq = 0; seq < kRounds; ++seq) {
      InFlight f{seq, MakeInput(rank, op, seq), nullptr};
      auto p = client.Start(Phase::kForward, op, seq, Scope::kNode, kChannels, 2,
                            f.io.mean.data(), f.io.m2.data());
      if (!p.ok()) {
        std::lock_guard<std::mutex> lock(errors_mu);
        errors.push_back(absl::StrCat("rank ", rank, " op ", op, " seq ", seq, " start: ",
                                      p.status().ToString()));
        continue;
      }
      f.round = std::move(*p);
      flight.push_back(std::move(f));
      if (int(flight.size()) >= kAhead) wait_oldest();
    }
    while (!flight.empty()) wait_oldest();
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, rank, uint32_t(t));
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
  EXPECT_EQ(ok_rounds.load(), 2 * kThreads * kRounds);
}

// Through the C ABI: rounds started on one thread and waited for on others (a queue between
// them), so waiters of one client come and go while others read.
TEST(ClientConcurrency, CApiRoundsStartedOnOneThreadAndWaitedOnOthers) {
  auto c = StartCluster(2);
  ASSERT_TRUE(c);
  const std::string address = c->sidecar_address(0);
  hsbn_client* clients[2] = {nullptr, nullptr};
  for (int rank = 0; rank < 2; ++rank) {
    hsbn_options o;
    hsbn_options_init(&o);
    o.address = address.c_str();
    o.job_id = "c-threads";
    o.rank = rank;
    o.world_size = 2;
    o.local_rank = rank;
    o.local_world_size = 2;
    o.node_rank = 0;
    ASSERT_EQ(hsbn_client_create(&o, &clients[rank]), HSBN_OK) << hsbn_last_error();
  }
  constexpr int kRounds = 80, kWaiters = 3;
  struct Item {
    uint64_t seq;
    hsbn_round* round;
  };
  std::mutex mu;
  std::vector<std::string> errors;
  std::atomic<int> ok_rounds{0};
  auto run_rank = [&](int rank) {
    std::mutex qmu;
    std::condition_variable qcv;
    std::deque<Item> queue;
    bool closed = false;
    std::vector<std::thread> waiters;
    for (int w = 0; w < kWaiters; ++w) {
      waiters.emplace_back([&] {
        for (;;) {
          Item item;
          {
            std::unique_lock<std::mutex> lock(qmu);
            qcv.wait(lock, [&] { return closed || !queue.empty(); });
            if (queue.empty()) return;
            item = queue.front();
            queue.pop_front();
          }
          double mean[kChannels], m2[kChannels];
          int64_t count = 0;
          hsbn_result r = hsbn_round_wait(item.round, &count, mean, m2);
          std::string err = r == HSBN_OK ? CheckMerged(7, item.seq, count, mean)
                                         : absl::StrCat("seq ", item.seq, ": ", r, " ", hsbn_last_error());
          if (err.empty()) {
            ++ok_rounds;
          } else {
            std::lock_guard<std::mutex> lock(mu);
            errors.push_back(absl::StrCat("rank ", rank, ": ", err));
          }
        }
      });
    }
    for (uint64_t seq = 0; seq < kRounds; ++seq) {
      Input in = MakeInput(rank, 7, seq);
      hsbn_round* round = nullptr;
      hsbn_result r = hsbn_round_start(clients[rank], HSBN_PHASE_FORWARD, 7, seq,
                                       HSBN_SCOPE_NODE, kChannels, 2, in.mean.data(),
                                       in.m2.data(), &round);
      if (r != HSBN_OK) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(absl::StrCat("rank ", rank, " start ", seq, ": ", hsbn_last_error()));
        continue;
      }
      std::lock_guard<std::mutex> lock(qmu);
      queue.push_back({seq, round});
      qcv.notify_one();
    }
    {
      std::lock_guard<std::mutex> lock(qmu);
      closed = true;
      qcv.notify_all();
    }
    for (auto& t : waiters) t.join();
  };
  std::thread r0(run_rank, 0), r1(run_rank, 1);
  r0.join();
  r1.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
  EXPECT_EQ(ok_rounds.load(), 2 * kRounds);
  hsbn_client_destroy(clients[0]);
  hsbn_client_destroy(clients[1]);
}

struct Waiter {
  std::thread thread;
  absl::Status status;
  int64_t count = 0;
  double mean[kChannels] = {};
  steady_clock::time_point returned;
};

void StartWait(Client& client, std::shared_ptr<PendingRound> round, Waiter* w) {
  w->thread = std::thread([&client, round, w] {
    double m2[kChannels];
    w->status = client.Wait(*round, &w->count, w->mean, m2);
    w->returned = steady_clock::now();
  });
}

std::shared_ptr<PendingRound> StartRound(Client& client, int rank, uint32_t op, uint64_t seq) {
  Input in = MakeInput(rank, op, seq);
  auto p = client.Start(Phase::kForward, op, seq, Scope::kNode, kChannels, 2, in.mean.data(),
                        in.m2.data());
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : nullptr;
}

// Deadlines hold for whoever reads the stream. Rank 0's rounds 0, 1, 2 have three waiters
// (thread C on round 0 reads first; B on round 2 and A on round 1 sleep). Round 0 completes, so
// C hands the reader role to A (the lowest round waiting). B's deadline passes while A reads:
// B returns DEADLINE_EXCEEDED on time, and A still gets its result. Then a reader whose own
// deadline passes gives the role up without losing the result another waiter needs.
TEST(ClientConcurrency, WaitTimesOutWhileAnotherThreadReads) {
  auto c = StartCluster(2);
  ASSERT_TRUE(c);
  const milliseconds timeout(1500);
  auto r0 = Connect(*c, 0, "timeouts", timeout);
  auto r1 = Connect(*c, 1, "timeouts");
  ASSERT_TRUE(r0 && r1);
  auto p0 = StartRound(*r0, 0, 0, 0);
  auto p1 = StartRound(*r0, 0, 1, 0);
  auto p2 = StartRound(*r0, 0, 2, 0);
  ASSERT_TRUE(p0 && p1 && p2);
  Waiter wc, wb, wa;
  StartWait(*r0, p0, &wc);
  std::this_thread::sleep_for(milliseconds(100));
  const auto b_began = steady_clock::now();
  StartWait(*r0, p2, &wb);
  std::this_thread::sleep_for(milliseconds(500));
  StartWait(*r0, p1, &wa);
  std::this_thread::sleep_for(milliseconds(100));
  // Rank 1 completes round 0: C returns and A takes over reading.
  {
    Input in = MakeInput(1, 0, 0);
    int64_t n = 0;
    ASSERT_TRUE(r1->Forward(0, 0, Scope::kNode, kChannels, 2, in.mean.data(), in.m2.data(), &n,
                            in.mean.data(), in.m2.data())
                    .ok());
  }
  wc.thread.join();
  ASSERT_TRUE(wc.status.ok()) << wc.status;
  EXPECT_EQ(CheckMerged(0, 0, wc.count, wc.mean), "");
  wb.thread.join();
  EXPECT_EQ(wb.status.code(), absl::StatusCode::kDeadlineExceeded) << wb.status;
  EXPECT_NE(wb.status.message().find("within 1500 ms"), std::string::npos) << wb.status;
  const auto b_took = wb.returned - b_began;
  EXPECT_GE(b_took, timeout);
  EXPECT_LT(b_took, timeout + milliseconds(400)) << "the waiter overstayed its deadline";
  // A is still waiting (its deadline is 500 ms after B's): rank 1 completes round 1.
  auto q1 = StartRound(*r1, 1, 1, 0);
  ASSERT_TRUE(q1);
  {
    double mean[kChannels], m2[kChannels];
    ASSERT_TRUE(r1->Wait(*q1, nullptr, mean, m2).ok());
  }
  wa.thread.join();
  ASSERT_TRUE(wa.status.ok()) << wa.status;
  EXPECT_EQ(CheckMerged(1, 0, wa.count, wa.mean), "");
  // Round 2's late result (rank 1 now contributes) is dropped: rank 0 gave up on it.
  auto q2 = StartRound(*r1, 1, 2, 0);
  ASSERT_TRUE(q2);
  {
    double mean[kChannels], m2[kChannels];
    ASSERT_TRUE(r1->Wait(*q2, nullptr, mean, m2).ok());
  }

  // The reader times out: D reads for round 3 (nobody else contributes), E sleeps on round 4.
  // D's deadline passes first; E takes the reader role and gets round 4 when rank 1 sends it.
  auto p3 = StartRound(*r0, 0, 3, 0);
  auto p4 = StartRound(*r0, 0, 4, 0);
  ASSERT_TRUE(p3 && p4);
  Waiter wd, we;
  const auto d_began = steady_clock::now();
  StartWait(*r0, p3, &wd);
  std::this_thread::sleep_for(milliseconds(600));
  StartWait(*r0, p4, &we);
  wd.thread.join();
  EXPECT_EQ(wd.status.code(), absl::StatusCode::kDeadlineExceeded) << wd.status;
  EXPECT_LT(wd.returned - d_began, timeout + milliseconds(400)) << "the reader overstayed";
  auto q4 = StartRound(*r1, 1, 4, 0);
  ASSERT_TRUE(q4);
  {
    double mean[kChannels], m2[kChannels];
    ASSERT_TRUE(r1->Wait(*q4, nullptr, mean, m2).ok());
  }
  we.thread.join();
  ASSERT_TRUE(we.status.ok()) << we.status;
  EXPECT_EQ(CheckMerged(4, 0, we.count, we.mean), "");

  // Both members go on as before.
  auto p5 = StartRound(*r0, 0, 5, 0);
  auto q5 = StartRound(*r1, 1, 5, 0);
  ASSERT_TRUE(p5 && q5);
  double mean[kChannels], m2[kChannels];
  int64_t n = 0;
  ASSERT_TRUE(r0->Wait(*p5, &n, mean, m2).ok());
  EXPECT_EQ(CheckMerged(5, 0, n, mean), "");
  ASSERT_TRUE(r1->Wait(*q5, &n, mean, m2).ok());
}

// The sidecar restarts while two threads of rank 0 wait (one reading, one sleeping): both get
// UNAVAILABLE (reason SHUTTING_DOWN), long before the round timeout; rank 1, between rounds,
// is told at its next call; later rounds of both members succeed on new streams (joined
// again).
TEST(ClientConcurrency, StreamBreaksWhileTwoThreadsWaitBothFailAndLaterRoundsSucceed) {
  auto c = StartCluster(2);
  ASSERT_TRUE(c);
  auto r0 = Connect(*c, 0, "restart");
  auto r1 = Connect(*c, 1, "restart");
  ASSERT_TRUE(r0 && r1);
  auto p0 = StartRound(*r0, 0, 0, 0);
  auto p1 = StartRound(*r0, 0, 1, 0);
  ASSERT_TRUE(p0 && p1);
  Waiter w0, w1;
  StartWait(*r0, p0, &w0);
  StartWait(*r0, p1, &w1);
  std::this_thread::sleep_for(milliseconds(200));
  const auto restarted = steady_clock::now();
  ASSERT_TRUE(c->RestartSidecar(0).ok());
  w0.thread.join();
  w1.thread.join();
  EXPECT_EQ(w0.status.code(), absl::StatusCode::kUnavailable) << w0.status;
  EXPECT_EQ(w1.status.code(), absl::StatusCode::kUnavailable) << w1.status;
  // Named as a stop (once: the next call rejoins).
  EXPECT_EQ(wire::ReasonOf(w0.status), v1::REASON_SHUTTING_DOWN) << w0.status;
  EXPECT_EQ(wire::ReasonOf(w1.status), v1::REASON_SHUTTING_DOWN) << w1.status;
  EXPECT_LT(w0.returned - restarted, milliseconds(10000));
  EXPECT_LT(w1.returned - restarted, milliseconds(10000));
  // Rank 1 was between rounds: on the stream its next call names the stop, once. On shared
  // memory it never mapped the segment (it ran no round), so nothing tells it of the stop and
  // it joins the new process at once; either way its round then completes.
  {
    Input in = MakeInput(1, 9, 0);
    auto q = r1->Start(Phase::kForward, 9, 0, Scope::kNode, kChannels, 2, in.mean.data(),
                       in.m2.data());
    if (!q.ok()) {
      EXPECT_EQ(wire::ReasonOf(q.status()), v1::REASON_SHUTTING_DOWN) << q.status();
      q = r1->Start(Phase::kForward, 9, 0, Scope::kNode, kChannels, 2, in.mean.data(),
                    in.m2.data());
    }
    ASSERT_TRUE(q.ok()) << q.status();
    auto p = StartRound(*r0, 0, 9, 0);
    ASSERT_TRUE(p);
    double mean[kChannels], m2[kChannels];
    int64_t n = 0;
    // Rank 1's first: a round started before its node's transport was decided is sent at its
    // Wait.
    ASSERT_TRUE(r1->Wait(**q, &n, mean, m2).ok());
    ASSERT_TRUE(r0->Wait(*p, &n, mean, m2).ok());
    EXPECT_EQ(CheckMerged(9, 0, n, mean), "");
  }
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    SCOPED_TRACE(seq);
    auto a = StartRound(*r0, 0, 9, seq);
    auto b = StartRound(*r1, 1, 9, seq);
    ASSERT_TRUE(a && b);
    double mean[kChannels], m2[kChannels];
    int64_t n = 0;
    absl::Status sa = r0->Wait(*a, &n, mean, m2);
    ASSERT_TRUE(sa.ok()) << sa;
    EXPECT_EQ(CheckMerged(9, seq, n, mean), "");
    absl::Status sb = r1->Wait(*b, &n, mean, m2);
    ASSERT_TRUE(sb.ok()) << sb;
    EXPECT_EQ(CheckMerged(9, seq, n, mean), "");
  }
}

}  // namespace
}  // namespace hsbn

// client/round_stats.h — what a client counts of its rounds (Client::Stats): rounds completed
// and failed per scope and phase, the time its callers were blocked, GlobalStats calls, bytes
// each way, and how its node's rounds travel.
//
// Thread safety: all methods are thread-safe; one leaf lock, taken once per round and never
// while waiting (the byte counters are atomics).
#ifndef HSBN_CLIENT_ROUND_STATS_H_
#define HSBN_CLIENT_ROUND_STATS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "hsbn/client.h"

namespace hsbn::client_internal {

class RoundCounters {
 public:
  using Clock = std::chrono::steady_clock;

  // One blocked call; count_round: also count its round as completed (ok) or failed. Scopes and
  // phases that are not valid (refused calls) are not counted.
  void Record(Scope scope, Phase phase, bool ok, bool count_round, Clock::duration blocked)
      ABSL_LOCKS_EXCLUDED(mu_);
  // One GlobalStats call that ended; `waited`: it had to wait for the late result.
  void RecordGlobal(bool ok, bool waited, Clock::duration blocked) ABSL_LOCKS_EXCLUDED(mu_);
  void Sent(int64_t bytes) { sent_.fetch_add(bytes, std::memory_order_relaxed); }
  void Received(int64_t bytes) { received_.fetch_add(bytes, std::memory_order_relaxed); }
  // How node rounds travel ("shm", "grpc: <why>", "pending"); true if that changed.
  bool SetTransport(const std::string& transport) ABSL_LOCKS_EXCLUDED(mu_);
  // Everything counted since the last Reset (or the start); `late_dropped` is the stream's.
  ClientStats Snapshot(int64_t late_dropped) const ABSL_LOCKS_EXCLUDED(mu_);
  // Starts counting afresh (the transport stays).
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Counters {
    int64_t completed = 0;
    int64_t failed = 0;
    Clock::duration blocked{0};
    Clock::duration max_blocked{0};
    void Add(bool ok, bool count_round, Clock::duration d);
    RoundStats Stats() const;
  };

  mutable absl::Mutex mu_;
  Counters rounds_[ClientStats::kScopes][ClientStats::kPhases] ABSL_GUARDED_BY(mu_);
  Counters global_ ABSL_GUARDED_BY(mu_);  // GlobalStats calls
  int64_t global_waited_ ABSL_GUARDED_BY(mu_) = 0;
  Clock::time_point since_ ABSL_GUARDED_BY(mu_) = Clock::now();
  std::string transport_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> sent_{0};
  std::atomic<int64_t> received_{0};
};

}  // namespace hsbn::client_internal

#endif  // HSBN_CLIENT_ROUND_STATS_H_

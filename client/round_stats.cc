#include "round_stats.h"

namespace hsbn::client_internal {
namespace {
double Seconds(RoundCounters::Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}
}  // namespace

void RoundCounters::Counters::Add(bool ok, bool count_round, Clock::duration d) {
  if (count_round) ++(ok ? completed : failed);
  blocked += d;
  if (d > max_blocked) max_blocked = d;
}

RoundStats RoundCounters::Counters::Stats() const {
  RoundStats r;
  r.completed = completed;
  r.failed = failed;
  r.blocked_seconds = Seconds(blocked);
  r.max_blocked_seconds = Seconds(max_blocked);
  return r;
}

void RoundCounters::Record(Scope scope, Phase phase, bool ok, bool count_round,
                           Clock::duration blocked) {
  const int si = int(scope) - 1, pi = int(phase) - 1;
  if (si < 0 || si >= ClientStats::kScopes || pi < 0 || pi >= ClientStats::kPhases) return;
  absl::MutexLock lock(&mu_);
  rounds_[si][pi].Add(ok, count_round, blocked);
}

void RoundCounters::RecordGlobal(bool ok, bool waited, Clock::duration blocked) {
  absl::MutexLock lock(&mu_);
  global_.Add(ok, /*count_round=*/true, blocked);
  if (waited) ++global_waited_;
}

bool RoundCounters::SetTransport(const std::string& transport) {
  absl::MutexLock lock(&mu_);
  if (transport_ == transport) return false;
  transport_ = transport;
  return true;
}

ClientStats RoundCounters::Snapshot(int64_t late_dropped) const {
  ClientStats out;
  const auto now = Clock::now();
  absl::MutexLock lock(&mu_);
  for (int si = 0; si < ClientStats::kScopes; ++si) {
    for (int pi = 0; pi < ClientStats::kPhases; ++pi) out.rounds[si][pi] = rounds_[si][pi].Stats();
  }
  out.global_stats = global_.Stats();
  out.global_stats_waited = global_waited_;
  out.late_dropped = late_dropped;
  out.bytes_sent = sent_.load(std::memory_order_relaxed);
  out.bytes_received = received_.load(std::memory_order_relaxed);
  out.elapsed_seconds = Seconds(now - since_);
  out.transport = transport_;
  return out;
}

void RoundCounters::Reset() {
  absl::MutexLock lock(&mu_);
  for (auto& row : rounds_) {
    for (Counters& c : row) c = Counters{};
  }
  global_ = Counters{};
  global_waited_ = 0;
  sent_.store(0, std::memory_order_relaxed);
  received_.store(0, std::memory_order_relaxed);
  since_ = Clock::now();
}

}  // namespace hsbn::client_internal

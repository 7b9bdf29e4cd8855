// GlobalStats and GlobalSums: waiting for the late global results of renorm and lagged
// rounds, whole or in slices.
#include "client_impl.h"

namespace hsbn {

absl::Status Client::Impl::GlobalStats(Phase phase, uint32_t op, uint64_t seq, int64_t channels,
                                       int64_t* out_count, double* out_mean, double* out_m2,
                                       Clock::time_point slice_end,
                                       bool* done) {
  WantLate(phase, op, seq);
  GlobalWait wait;
  bool pending = false;
  absl::Status s = WaitGlobal(phase, op, seq, channels, out_count, out_mean, out_m2, slice_end,
                              &pending, &wait);
  if (done != nullptr) *done = !pending;
  if (pending) return absl::OkStatus();
  counters_.RecordGlobal(s.ok(), wait.waited, Clock::now() - wait.since);
  return s;
}

Scope Client::Impl::LateScopeOf(const Key& key) {
  absl::MutexLock lock(&rounds_mu_);
  if (auto it = late_.find(key); it != late_.end()) return it->second.scope;
  if (auto e = late_expected_.find(key); e != late_expected_.end()) return e->second;
  return Phase(std::get<2>(key)) == Phase::kForward ? Scope::kRenorm : Scope::kLagged;
}

absl::Status Client::Impl::WaitGlobal(
    Phase phase, uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
    double* out_mean, double* out_m2, Clock::time_point slice_end, bool* pending,
    GlobalWait* wait) {
  const Key key{op, seq, int(phase)};
  const Scope scope = LateScopeOf(key);
  auto what = [&] {
    return absl::StrCat("the global ", phase == Phase::kForward ? "statistics" : "sums",
                        " of ", ScopeName(scope), " round op ", op, ", seq ", seq);
  };
  if (channels <= 0 || out_count == nullptr || out_mean == nullptr || out_m2 == nullptr) {
    *wait = GlobalWait{Clock::now(), Clock::now()};
    return absl::InvalidArgumentError(absl::StrCat(
        what(), ": channels must be at least 1 and the outputs not null"));
  }
  std::shared_ptr<RoundStream> conn;
  {
    absl::MutexLock lock(&mu_);
    conn = conn_;
  }
  absl::MutexLock lock(&rounds_mu_);
  const auto emplaced = global_waits_.try_emplace(key);
  const auto entry = emplaced.first;
  const bool first = emplaced.second;
  if (first) {
    entry->second.since = Clock::now();
    entry->second.deadline = entry->second.since + RoundTimeout();
  }
  // Ends the wait (not a slice): its record goes to the caller.
  auto end = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    *wait = entry->second;
    global_waits_.erase(entry);
    return s;
  };
  const Clock::time_point deadline = entry->second.deadline;
  for (int pass = 0;; ++pass) {
    if (auto it = late_.find(key); it != late_.end()) {
      const Late& late = it->second;
      if (!late.status.ok()) {
        return end(wire::WithMessage(late.status,
                                     absl::StrCat(what(), ": ", late.status.message())));
      }
      if (late.channels != channels) {
        return end(absl::InvalidArgumentError(absl::StrCat(
            what(), " have ", late.channels, " channels; the caller asked for ", channels)));
      }
      *out_count = late.count;
      wire::UnpackPayload(late.data, channels, out_mean, out_m2);
      return end(absl::OkStatus());
    }
    if (late_expected_.count(key) == 0) {
      // Neither here nor on its way: this client never started the round with a late scope
      // (or its result was pushed out by kLateKept newer ones), so nothing can come.
      return end(absl::FailedPreconditionError(absl::StrCat(
          what(), ": this client did not start that round with renorm or lagged scope (or "
          "its result is older than the last ", kLateKept, " kept), so none will come. Ask "
          "only for rounds this client started with renorm or lagged scope")));
    }
    if (absl::Status aborted = Aborted(); !aborted.ok()) return end(aborted);
    if (conn == nullptr || conn->broken) {
      const std::string why =
          conn != nullptr && conn->finished ? conn->final_status.error_message() : "";
      return end(absl::UnavailableError(absl::StrCat(
          what(), " did not arrive: the stream to the hsbn sidecar at ", options_.address,
          " broke (", why.empty() ? "the sidecar restarted or stopped, or ended the stream"
                                  : why,
          "). The next call reconnects; the round's global statistics are lost")));
    }
    if (pass > 0 || !first) entry->second.waited = true;
    const Clock::time_point now = Clock::now();
    if (now >= deadline && pass > 0) {
      return end(absl::DeadlineExceededError(absl::StrCat(
          what(), " did not arrive within ", RoundTimeout().count(), " ms: the job's root "
          "aggregator (the sidecar's --upstream) did not answer, or this round was never "
          "started with ", ScopeName(scope), " scope on every rank")));
    }
    if (now >= slice_end && pass > 0) {
      *pending = true;
      return absl::OkStatus();
    }
    const Clock::time_point until = std::min(deadline, slice_end);
    if (!conn->polling) {
      conn->polling = true;
      // The first pass only handles what is ready (twice: see GlobalStatsReady): a result
      // already in the socket counts as no wait.
      for (int ready = 0; ready < (pass == 0 ? 2 : 1); ++ready) {
        Poll(conn, pass == 0 ? now : until, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
          return late_.count(key) > 0 || conn->broken ||
                 aborted_flag_.load(std::memory_order_acquire);
        });
      }
      conn->polling = false;
      HandOff(*conn);
    } else if (pass > 0) {
      ++late_waiters_;
      ++conn->waiters;
      late_cv_.WaitWithDeadline(&rounds_mu_, AbslTime(until));
      --conn->waiters;
      --late_waiters_;
    }
  }
}

void Client::Impl::WantLate(Phase phase, uint32_t op, uint64_t seq) {
  const Key key{op, seq, int(phase)};
  {
    absl::MutexLock lock(&rounds_mu_);
    // Not at a later slice of the same wait, nor for a result that cannot come.
    if (late_.count(key) > 0 || late_expected_.count(key) == 0 || global_waits_.count(key) > 0) {
      return;
    }
  }
  if (GlobalStatsReady(phase, op, seq)) return;  // it was in the socket
  v1::ClientFrame frame;
  v1::LateWanted* w = frame.mutable_late_wanted();
  w->set_op(op);
  w->set_seq(seq);
  w->set_phase(phase == Phase::kForward ? v1::PHASE_FORWARD : v1::PHASE_BACKWARD);
  // Never on a new stream: the wait must find the broken one and report the result lost. A
  // failed write shows as a broken stream, which the wait reports too.
  (void)SendFrame(&frame, "a late-result wait", /*reconnect=*/false);
}

bool Client::Impl::GlobalStatsReady(Phase phase, uint32_t op, uint64_t seq) {
  std::shared_ptr<RoundStream> conn;
  {
    absl::MutexLock lock(&mu_);
    conn = conn_;
  }
  const Key key{op, seq, int(phase)};
  absl::MutexLock lock(&rounds_mu_);
  if (late_.count(key) > 0) return true;
  if (conn != nullptr && !conn->polling && !conn->broken) {
    conn->polling = true;
    // Two passes, as in Start: bytes already in the socket may take one pass to be read and
    // another to complete the Read.
    for (int pass = 0; pass < 2 && late_.count(key) == 0 && !conn->broken; ++pass) {
      Poll(conn, Clock::now(),
           [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) { return late_.count(key) > 0; });
    }
    conn->polling = false;
    HandOff(*conn);
  }
  return late_.count(key) > 0;
}

}  // namespace hsbn

// Client: starting and waiting for rounds (each transport's own steps are in stream.cc and
// shm_rounds.cc), Abort, and the public API's forwarding to Client::Impl (client_impl.h).
#include "client_impl.h"

namespace hsbn {

absl::Status Client::Impl::Connect() {
  absl::MutexLock lock(&mu_);
  return ConnectLocked();
}

absl::Status Client::Impl::CheckRound(Phase phase, uint32_t op, uint64_t seq, Scope scope,
                                      int64_t channels, const double* a,
                                      const double* b) const {
  // The round's name is only built for an error message.
  auto round = [&] { return wire::RoundName(op, seq, v1::Phase(int(phase))); };
  if (phase != Phase::kForward && phase != Phase::kBackward) {
    return absl::InvalidArgumentError("phase must be forward or backward");
  }
  if (scope != Scope::kNode && scope != Scope::kGlobal && scope != Scope::kShadow &&
      scope != Scope::kGroup && scope != Scope::kAuto && scope != Scope::kRenorm &&
      scope != Scope::kLagged) {
    return absl::InvalidArgumentError(
        "scope must be node, global, shadow, group, auto, renorm or lagged");
  }
  if (scope == Scope::kGroup && options_.group_nodes <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "round ", round(), ": group scope, but this client joined without a group size; set "
        "HSBN_GROUP_NODES (ClientOptions::group_nodes) on every process of the job"));
  }
  if (channels <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("round ", round(), ": channels=", channels,
                                                   " must be at least 1"));
  }
  if (a == nullptr || b == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("round ", round(), ": null statistics array"));
  }
  // Large enough to hold the payload; gRPC refuses bigger messages.
  if (wire::PayloadBytes(channels) > (60 << 20)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "round ", round(), ": ", channels, " channels do not fit in one message"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Impl::Start(
    Phase phase, uint32_t op, uint64_t seq, Scope scope, int64_t channels, int64_t count,
    const double* a, const double* b) {
  if (absl::Status s = Aborted(); !s.ok()) return s;
  if (absl::Status s = CheckRound(phase, op, seq, scope, channels, a, b); !s.ok()) return s;
  RoundRequest r{phase, op, seq, scope, scope, channels, count, a, b, false, {}, {}};
  // Group and auto-scope rounds take the stream even where the node has shared memory: the
  // segment carries neither a group nor a decision, and an auto layer's shadow partials must
  // reach the root ahead of its decision round, which one path keeps in order. Every rank
  // of a layer asks for the same scope, so a round still never mixes transports.
  const bool stream_only = scope == Scope::kAuto || scope == Scope::kGroup;
  if (scope == Scope::kAuto) {
    if (absl::Status s = auto_.Resolve(op, seq, phase, &r.scope, &r.decide, &r.decision);
        !s.ok()) {
      return s;
    }
  }
  // What the wire says: a renorm layer's backward round is a node round (its sums are the
  // node's); the round is still counted under renorm.
  r.wire_scope =
      r.scope == Scope::kRenorm && phase == Phase::kBackward ? Scope::kNode : r.scope;
  r.deadline = Clock::now() + RoundTimeout();
  if ((r.scope == Scope::kRenorm && phase == Phase::kForward) || r.scope == Scope::kLagged) {
    absl::MutexLock lock(&rounds_mu_);
    ExpectLate(Key{op, seq, int(phase)}, r.scope);
  }
  // Twice at most: when the stream turns out broken before the contribution left (the
  // previous write failed, or ours did), it is sent again once on a new stream.
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<RoundStream> conn;
    std::shared_ptr<client_internal::ShmChannel> shm;
    std::string session;
    if (absl::Status s = CurrentConnection(&conn, &shm, &session); !s.ok()) return s;
    if (!stream_only) {
      bool taken = false;
      auto pending = StartOnShm(r, conn, std::move(shm), &taken);
      if (!pending.ok() || taken) return pending;
    }
    bool retry = false;
    auto pending = SendOnStream(r, conn, session, &retry);
    if (retry && attempt == 0) continue;
    return pending;
  }
}

absl::Status Client::Impl::CurrentConnection(std::shared_ptr<RoundStream>* conn,
                                             std::shared_ptr<client_internal::ShmChannel>* shm,
                                             std::string* session) {
  absl::MutexLock lock(&mu_);
  // A sidecar that stopped politely said so: this call fails with its words, and the next one
  // rejoins (the process that follows it on the address, if any).
  if (absl::Status stopping = StoppingLocked(); !stopping.ok()) {
    Debug(absl::StrCat("the sidecar is stopping: ", stopping.message()));
    conn_.reset();
    shm_.reset();
    return stopping;
  }
  // A sidecar that closed the shared-memory socket is gone (restarted): rejoin, as for a
  // broken stream, which nobody reads while rounds travel through shared memory.
  if (!conn_ || conn_->broken || ShmGoneLocked()) {
    if (conn_) {
      Debug(conn_->broken ? "reconnecting: the stream to the sidecar broke"
                          : "reconnecting: the sidecar's shared-memory segment is gone");
    }
    if (absl::Status s = ConnectLocked(); !s.ok()) return s;
  }
  *conn = conn_;
  *shm = shm_;
  *session = session_;
  return absl::OkStatus();
}

std::shared_ptr<PendingRound> Client::Impl::NewPending(const RoundRequest& r,
                                                       const RoundStream& via) const {
  auto pending = std::make_shared<PendingRound>();
  pending->op = r.op;
  pending->seq = r.seq;
  pending->phase = r.phase;
  pending->scope = r.scope;
  pending->channels = r.channels;
  pending->generation = via.generation;
  return pending;
}

absl::Status Client::Impl::Blocking(
    Phase phase, uint32_t op, uint64_t seq, Scope scope, int64_t channels, int64_t count,
    const double* a, const double* b, int64_t* out_count, double* out_a, double* out_b) {
  const auto since = Clock::now();
  auto p = Start(phase, op, seq, scope, channels, count, a, b);
  if (!p.ok()) {
    counters_.Record(scope, phase, false, true, Clock::now() - since);
    return p.status();
  }
  return Wait(**p, out_count, out_a, out_b, since);
}

absl::Status Client::Impl::Wait(PendingRound& p, int64_t* out_count, double* out_a, double* out_b,
                                Clock::time_point blocked_since) {
  absl::Status s = WaitResult(p, out_count, out_a, out_b);
  return Waited(p, s, blocked_since);
}

absl::Status Client::Impl::WaitFor(PendingRound& p, Clock::time_point slice_end, bool* done,
                                   int64_t* out_count, double* out_a, double* out_b) {
  const bool first = !p.wait_started;
  if (first) p.blocked_since = Clock::now();
  bool pending = false;
  absl::Status s = WaitResult(p, out_count, out_a, out_b, slice_end, &pending);
  *done = !pending;
  if (pending) return absl::OkStatus();
  return Waited(p, s, p.blocked_since);
}

void Client::Impl::Abort(const std::string& reason) {
  const std::string why = reason.empty() ? std::string("no reason given")
                                         : wire::Printable(reason, 512);
  const absl::Status status = wire::WithReason(
      absl::AbortedError(absl::StrCat("rank ", options_.rank, " of job '", options_.job_id,
                                      "' was aborted (", why,
                                      "); its rounds fail, and the job's other ranks are told")),
      v1::REASON_CLIENT_ABORTED);
  {
    absl::MutexLock lock(&abort_mu_);
    if (!aborted_.ok()) return;  // the first abort's reason stands
    aborted_ = status;
  }
  aborted_flag_.store(true, std::memory_order_release);
  Debug(absl::StrCat("aborting: ", why));
  AbortShm(status);
  AbortStream(status, why);
}

absl::Status Client::Impl::Aborted() const {
  if (!aborted_flag_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&abort_mu_);
  return aborted_;
}

absl::Status Client::Impl::Waited(
    PendingRound& p, absl::Status s, Clock::time_point blocked_since) {
  if (p.decide) s = auto_.Take(p.op, p.seq, p.answer, s);
  const Clock::duration blocked = Clock::now() - blocked_since;
  if (options_.debug && blocked > options_.debug_slow) {
    Debug(absl::StrCat(
        "round ", wire::RoundName(p.op, p.seq, v1::Phase(int(p.phase))), " (", ScopeName(p.scope),
        ") waited ", std::chrono::duration_cast<std::chrono::milliseconds>(blocked).count(),
        " ms: ", s.ok() ? std::string("ok") : absl::StatusCodeToString(s.code())));
  }
  counters_.Record(p.scope, p.phase, s.ok(), !p.counted, blocked);
  p.counted = true;
  if (wire::ReasonOf(s) == v1::REASON_SHUTTING_DOWN) ForgetStoppedSidecar(p.generation);
  return s;
}

absl::Status Client::Impl::WaitResult(
    PendingRound& p, int64_t* out_count, double* out_a, double* out_b,
    Clock::time_point slice_end, bool* pending) {
  if (!p.wait_started) {
    p.wait_started = true;
    p.wait_deadline = Clock::now() + RoundTimeout();
  }
  absl::Status s;
  if (((p.scope == Scope::kRenorm && p.phase == Phase::kForward) ||
       p.scope == Scope::kLagged) &&
      num_nodes_.load() == 1) {
    // A job of one node: the node's statistics are the job's, kept as the round's global
    // ones here (the sidecar sends none).
    std::vector<double> a(size_t(p.channels)), b(size_t(p.channels));
    int64_t count = 0;
    s = WaitUntil(p, p.wait_deadline, &count, a.data(), b.data(), slice_end, pending);
    if (s.ok() && (pending == nullptr || !*pending)) {
      v1::Result own;
      own.set_op(p.op);
      own.set_seq(p.seq);
      own.set_phase(v1::Phase(int(p.phase)));
      own.set_channels(uint32_t(p.channels));
      own.set_count(count);
      wire::PackPayload(a.data(), b.data(), p.channels, own.mutable_data());
      {
        absl::MutexLock lock(&rounds_mu_);
        late_expected_.erase(Key{p.op, p.seq, int(p.phase)});
        KeepLate(&own, p.scope);
      }
      if (out_count != nullptr) *out_count = count;
      if (out_a != nullptr) std::copy(a.begin(), a.end(), out_a);
      if (out_b != nullptr) std::copy(b.begin(), b.end(), out_b);
    }
  } else {
    s = WaitUntil(p, p.wait_deadline, out_count, out_a, out_b, slice_end, pending);
  }
  if (pending == nullptr || !*pending) p.wait_started = false;
  return s;
}

absl::Status Client::Impl::WaitUntil(
    PendingRound& p, Clock::time_point deadline, int64_t* out_count, double* out_a, double* out_b,
    Clock::time_point slice_end, bool* pending) {
  if (p.restarted) {  // a deferred round, started by an earlier slice
    absl::Status s = WaitResult(*p.restarted, out_count, out_a, out_b, slice_end, pending);
    if (pending != nullptr && *pending) return s;
    p.restarted.reset();
    p.waited = true;
    p.outcome = s;
    return s;
  }
  if (p.waited) {
    // Waited for before: its answer was taken then (a failed round fails again).
    return p.outcome.ok() ? absl::FailedPreconditionError("this round was already waited for")
                          : p.outcome;
  }
  if (p.wait == nullptr) return absl::FailedPreconditionError("this round was never sent");
  return (this->*p.wait)(p, deadline, out_count, out_a, out_b, slice_end, pending);
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& given) {
  ClientOptions options = given;
  if (options.transport.empty()) {
    absl::StatusOr<std::string> t = env::Resolve(env::Source::Process(), "HSBN_TRANSPORT");
    if (!t.ok()) return t.status();
    options.transport = *t;
  }
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Connect(); !s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Start(Phase phase, uint32_t op,
                                                            uint64_t seq, Scope scope,
                                                            int64_t channels, int64_t count,
                                                            const double* a, const double* b) {
  auto p = impl_->Start(phase, op, seq, scope, channels, count, a, b);
  // Start's own time is not blocked time (see RoundStats); a failed Start is a failed round.
  if (!p.ok()) impl_->counters_.Record(scope, phase, false, true, Impl::Clock::duration::zero());
  return p;
}

absl::Status Client::Wait(PendingRound& round, int64_t* out_count, double* out_a,
                          double* out_b) {
  return impl_->Wait(round, out_count, out_a, out_b, Impl::Clock::now());
}

absl::Status Client::Forward(uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                             int64_t count, const double* mean, const double* m2,
                             int64_t* out_count, double* out_mean, double* out_m2) {
  return impl_->Blocking(Phase::kForward, op, seq, scope, channels, count, mean, m2, out_count,
                         out_mean, out_m2);
}

absl::Status Client::Backward(uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                              int64_t count, const double* sum_dy, const double* sum_dy_xmu,
                              int64_t* out_count, double* out_sum_dy, double* out_sum_dy_xmu) {
  return impl_->Blocking(Phase::kBackward, op, seq, scope, channels, count, sum_dy, sum_dy_xmu,
                         out_count, out_sum_dy, out_sum_dy_xmu);
}

absl::Status Client::WaitFor(PendingRound& round, std::chrono::milliseconds slice, bool* done,
                             int64_t* out_count, double* out_a, double* out_b) {
  return impl_->WaitFor(round, Impl::Clock::now() + slice, done, out_count, out_a, out_b);
}

void Client::Abort(const std::string& reason) { impl_->Abort(reason); }

ClientStats Client::Stats() const {
  return impl_->Stats();
}

absl::Status Client::GlobalStats(uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
                                 double* out_mean, double* out_m2) {
  return impl_->GlobalStats(Phase::kForward, op, seq, channels, out_count, out_mean, out_m2);
}
absl::Status Client::GlobalStatsFor(uint32_t op, uint64_t seq, int64_t channels,
                                    std::chrono::milliseconds slice, bool* done,
                                    int64_t* out_count, double* out_mean, double* out_m2) {
  return impl_->GlobalStats(Phase::kForward, op, seq, channels, out_count, out_mean, out_m2,
                            Impl::Clock::now() + slice, done);
}

absl::Status Client::NameLayers(const std::vector<std::pair<uint32_t, std::string>>& names) {
  return impl_->NameLayers(names);
}

absl::Status Client::ReportLaggedTrip(uint32_t op, uint64_t seq, double drift,
                                      int64_t exact_calls) {
  return impl_->ReportLaggedTrip(op, seq, drift, exact_calls);
}
bool Client::GlobalStatsReady(uint32_t op, uint64_t seq) {
  return impl_->GlobalStatsReady(Phase::kForward, op, seq);
}

absl::Status Client::GlobalSums(uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
                                double* out_sum_dy, double* out_sum_dy_xmu) {
  return impl_->GlobalStats(Phase::kBackward, op, seq, channels, out_count, out_sum_dy,
                            out_sum_dy_xmu);
}
absl::Status Client::GlobalSumsFor(uint32_t op, uint64_t seq, int64_t channels,
                                   std::chrono::milliseconds slice, bool* done,
                                   int64_t* out_count, double* out_sum_dy,
                                   double* out_sum_dy_xmu) {
  return impl_->GlobalStats(Phase::kBackward, op, seq, channels, out_count, out_sum_dy,
                            out_sum_dy_xmu, Impl::Clock::now() + slice, done);
}
bool Client::GlobalSumsReady(uint32_t op, uint64_t seq) {
  return impl_->GlobalStatsReady(Phase::kBackward, op, seq);
}

absl::Status Client::SetAutoPolicy(uint32_t op, const AutoPolicy& policy) {
  return impl_->auto_.SetPolicy(op, policy);
}
AutoDecision Client::AutoDecisionOf(uint32_t op) const { return impl_->auto_.DecisionOf(op); }
absl::Status Client::SetAutoDecision(uint32_t op, Scope scope) {
  return impl_->auto_.SetDecision(op, scope);
}
void Client::ResetStats() { impl_->counters_.Reset(); }

absl::StatusOr<v1::StatusResponse> Client::Status(bool include_upstream) {
  return impl_->Status(include_upstream);
}

absl::StatusOr<std::string> Client::StatusJson(bool include_upstream) {
  auto s = impl_->Status(include_upstream);
  if (!s.ok()) return s.status();
  return StatusToJson(*s);
}

const ClientOptions& Client::options() const { return impl_->options_; }
int32_t Client::num_nodes() const { return impl_->num_nodes_; }
int32_t Client::max_channels() const { return impl_->max_channels_; }
std::chrono::milliseconds Client::aggregator_round_timeout() const {
  return std::chrono::milliseconds(impl_->aggregator_timeout_ms_.load());
}

}  // namespace hsbn

// Client: starting and waiting for rounds on either transport, Abort, and the public API's
// forwarding to Client::Impl (client_impl.h).
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
  RoundRequest r{phase, op, seq, scope, scope, channels, count, a, b};
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
    if (shm != nullptr && !stream_only) {
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
  if (!conn_ || conn_->broken || (shm_ && !shm_->AliveRecently())) {
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

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Impl::StartOnShm(
    const RoundRequest& r, const std::shared_ptr<RoundStream>& conn,
    std::shared_ptr<client_internal::ShmChannel> shm, bool* taken) {
  *taken = true;
  if (!shm->decided()) {
    // The sidecar answers once every local rank of the job presented its session. Wait
    // briefly: when the other ranks are not there yet (they may be started by this very
    // thread, as tests do), the round is sent at its Wait instead.
    absl::Status s = shm->Await(std::min(r.deadline, Clock::now() + kDecisionWait));
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      auto pending = NewPending(r, *conn);
      pending->shm = std::move(shm);
      pending->deferred_count = r.count;
      pending->deferred.assign(r.a, r.a + r.channels);
      pending->deferred.insert(pending->deferred.end(), r.b, r.b + r.channels);
      return pending;
    }
    if (!s.ok()) return s;
    absl::MutexLock lock(&mu_);
    SetTransport(shm->note());
    if (!shm->mapped() && shm_ == shm) shm_.reset();
  }
  // Every rank chooses by the channel count alone, so a round never mixes transports; one
  // wider than the aggregator allows goes into the segment to fail there for all.
  if (!shm->mapped() || (r.channels > shm->max_channels() &&
                         !(max_channels_ > 0 && r.channels > max_channels_))) {
    *taken = false;
    return nullptr;
  }
  auto slot = shm->Start(shm::Key{r.op, r.seq, int32_t(r.phase)}, int32_t(r.wire_scope),
                         r.channels, r.count, r.a, r.b, r.deadline);
  if (!slot.ok()) return slot.status();
  counters_.Sent(wire::PayloadBytes(std::min<int64_t>(r.channels, shm->max_channels())));
  auto pending = NewPending(r, *conn);
  pending->shm = std::move(shm);
  pending->shm_round = *slot;
  // Late global results come on the stream, which shared-memory rounds never read: take what
  // has arrived, so that they cannot pile up at the sidecar (a stream more than
  // --max-queued-bytes behind is ended) while nobody asks for them (a warm-up).
  if (r.scope == Scope::kRenorm || r.scope == Scope::kLagged) DrainStream(conn);
  return pending;
}

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Impl::SendOnStream(
    const RoundRequest& r, const std::shared_ptr<RoundStream>& conn, const std::string& session,
    bool* retry) {
  auto round = [&] { return wire::RoundName(r.op, r.seq, v1::Phase(int(r.phase))); };
  v1::ClientFrame frame;
  v1::Contribution* c = frame.mutable_contribution();
  c->set_op(r.op);
  c->set_seq(r.seq);
  c->set_phase(v1::Phase(int(r.phase)));
  c->set_scope(v1::Scope(int(r.wire_scope)));
  if (r.decide) *c->mutable_decide() = r.decision;
  c->set_channels(uint32_t(r.channels));
  c->set_count(r.count);
  wire::PackPayload(r.a, r.b, r.channels, c->mutable_data());
  c->set_session(session);
  auto pending = NewPending(r, *conn);
  pending->decide = r.decide;
  pending->conn = conn;
  absl::ReleasableMutexLock lk(&rounds_mu_);
  // Nobody polls: handle what is ready without blocking (results read meanwhile, and a stream
  // closed meanwhile, which is replaced before sending). gRPC's poller handles one ready
  // socket per pass, hence more than one pass. A sidecar stopped between rounds must be seen
  // here, before our write: writing to its closed socket draws a reset that discards its final
  // status (the words and reason SHUTTING_DOWN) unread. With 2 passes that happened in 1 of 75
  // runs of test_failures' between-rounds test under load (the round failed "broke (Broken
  // pipe)", reason unspecified); with 4, in none of 75.
  if (!conn->polling) {
    conn->polling = true;
    for (int pass = 0; pass < 4 && !conn->broken; ++pass) {
      Poll(conn, Clock::now(), [] { return false; });
    }
    conn->polling = false;
    HandOff(*conn);
    if (conn->broken) {
      *retry = true;
      return Broken(round());
    }
  }
  const Key key{r.op, r.seq, int(r.phase)};
  if (!pending_.emplace(key, pending).second) {
    return absl::AlreadyExistsError(absl::StrCat(
        "round ", round(), " is already in flight on this client; each (op, seq, phase) is "
        "one round"));
  }
  // An Abort between Start's first check and here failed the rounds in pending_ before ours
  // was in it (it sets the flag before taking rounds_mu_, so it shows now); sent anyway, ours
  // would wait for an answer the sidecar never gives an aborted rank.
  if (absl::Status s = Aborted(); !s.ok()) {
    Forget(*pending);
    return s;
  }
  // One write in flight per stream: wait for the previous one to complete.
  if (absl::Status s = AwaitWriteSlot(conn, r.deadline, [&] { return "round " + round(); });
      !s.ok()) {
    Forget(*pending);
    return s;
  }
  if (conn->broken) {  // our contribution was not sent
    Forget(*pending);
    *retry = true;
    return Broken(round());
  }
  conn->write_in_flight = true;
  conn->write_failed = false;
  counters_.Sent(int64_t(frame.ByteSizeLong()));
  conn->stream->Write(frame, TagOf(kWrite));  // serialised here: frame may go
  // Like a sync Write, see it complete when nobody else polls (usually it already has: the
  // transport writes inline). A failed write means the stream was dead before the
  // contribution left: send it again on a new stream. When another thread polls, return at
  // once; that thread sees the completion, and a failure fails the round at its Wait.
  if (conn->polling) return pending;
  AwaitWrite(conn, r.deadline);
  if (!conn->write_in_flight && conn->write_failed) {
    Forget(*pending);
    *retry = true;
    return Broken(round());
  }
  return pending;  // a write still in flight at the deadline fails the round at its Wait
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
  std::shared_ptr<RoundStream> conn;
  std::shared_ptr<client_internal::ShmChannel> shm;
  std::string session;
  {
    absl::MutexLock lock(&mu_);
    conn = conn_;
    shm = shm_;
    session = session_;
  }
  if (shm) shm->Abort(status);
  if (!conn) return;
  absl::MutexLock lk(&rounds_mu_);
  for (auto it = pending_.begin(); it != pending_.end(); it = pending_.erase(it)) {
    PendingRound& p = *it->second;
    p.answer.status = status;
    p.done = true;
    if (p.waiting) p.cv.Signal();
  }
  conn->write_cv.SignalAll();
  if (late_waiters_ > 0) late_cv_.SignalAll();  // GlobalStats waits end too
  if (conn->broken) return;  // the sidecar already reports this rank as disconnected
  conn->abort_frame = std::make_unique<v1::ClientFrame>();
  v1::Abort* frame = conn->abort_frame->mutable_abort();
  frame->set_session(session);
  frame->set_code(int(absl::StatusCode::kAborted));
  frame->set_message(why);
  if (conn->polling) {
    // The poller writes the frame when the slot is free; wake it from AsyncNext.
    if (!conn->woken) {
      conn->woken = true;
      conn->wake.Set(&conn->cq, gpr_now(GPR_CLOCK_MONOTONIC), TagOf(kWake));
    }
    return;
  }
  // Nobody polls: see the frame out (a bounded wait, as a sync Write would).
  conn->polling = true;
  FlushAbortFrame(*conn);
  Poll(conn, Clock::now() + kAbortFlush, [&] {
    return (conn->abort_frame == nullptr && !conn->write_in_flight) || conn->broken;
  });
  conn->polling = false;
  HandOff(*conn);
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
    p.shm_waited = true;
    p.shm_status = s;
    return s;
  }
  if (p.shm_waited) {
    // Waited for before: its answer was taken then (a failed round fails again).
    return p.shm_status.ok() ? absl::FailedPreconditionError("this round was already waited for")
                             : p.shm_status;
  }
  if (p.shm && !p.deferred.empty()) {
    return WaitDeferred(p, deadline, out_count, out_a, out_b, slice_end, pending);
  }
  if (p.shm) return WaitOnShm(p, deadline, out_count, out_a, out_b, slice_end, pending);
  return WaitOnStream(p, deadline, out_count, out_a, out_b, slice_end, pending);
}

absl::Status Client::Impl::WaitDeferred(
    PendingRound& p, Clock::time_point deadline, int64_t* out_count, double* out_a, double* out_b,
    Clock::time_point slice_end, bool* pending) {
  // Started before the node's transport was decided: decide, then start it for real.
  std::shared_ptr<client_internal::ShmChannel> shm = p.shm;
  absl::Status s;
  for (;;) {  // in short slices, so that an abort ends it
    s = shm->Await(std::min({deadline, slice_end, Clock::now() + kAbortCheck}));
    if (s.code() != absl::StatusCode::kDeadlineExceeded || Clock::now() >= deadline) break;
    if (absl::Status a = Aborted(); !a.ok()) {
      s = a;
      break;
    }
    if (pending != nullptr && Clock::now() >= slice_end) {
      *pending = true;
      return absl::OkStatus();
    }
  }
  p.shm.reset();
  if (!s.ok()) {
    p.shm_waited = true;
    p.shm_status = s;
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    SetTransport(shm->note());
    if (!shm->mapped() && shm_ == shm) shm_.reset();
  }
  std::vector<double> in = std::move(p.deferred);
  const int64_t ch = p.channels;
  auto q = Start(p.phase, p.op, p.seq, p.scope, ch, p.deferred_count, in.data(),
                 in.data() + ch);
  if (!q.ok()) {
    p.shm_waited = true;
    p.shm_status = q.status();
    return q.status();
  }
  p.restarted = *std::move(q);
  return WaitUntil(p, deadline, out_count, out_a, out_b, slice_end, pending);
}

absl::Status Client::Impl::WaitOnShm(
    PendingRound& p, Clock::time_point deadline, int64_t* out_count, double* out_a, double* out_b,
    Clock::time_point slice_end, bool* pending) {
  absl::Status s = p.shm->Wait(p.shm_round, deadline, RoundTimeout(), out_count, out_a,
                               out_b, slice_end, pending);
  if (pending != nullptr && *pending) return s;
  if (s.ok()) {
    counters_.Received(wire::PayloadBytes(p.channels));
  }
  if (s.code() == absl::StatusCode::kDeadlineExceeded && p.shm->Posted(p.shm_round)) {
    return s;  // the caller's own timeout: as on the stream, it may wait again
  }
  p.shm.reset();
  p.shm_waited = true;
  p.shm_status = s;
  return s;
}

absl::Status Client::Impl::WaitOnStream(
    PendingRound& p, Clock::time_point deadline, int64_t* out_count, double* out_a, double* out_b,
    Clock::time_point slice_end, bool* pending) {
  // A slice that ends before the deadline may return "still open".
  auto slice_over = [&] { return pending != nullptr && Clock::now() >= slice_end; };
  if (!p.conn) return absl::FailedPreconditionError("this round was never sent");
  {
    absl::ReleasableMutexLock lk(&rounds_mu_);
    RoundStream& conn = *p.conn;
    while (!p.done) {
      if (Clock::now() < deadline && slice_over()) {
        if (!conn.polling) HandOff(conn);
        *pending = true;
        return absl::OkStatus();
      }
      if (Clock::now() >= deadline) {
        Forget(p);
        if (!conn.polling) HandOff(conn);
        lk.Release();
        return absl::DeadlineExceededError(absl::StrCat(
            "round ", wire::RoundName(p.op, p.seq, v1::Phase(int(p.phase))),
            ": no answer from the hsbn sidecar at ", options_.address, " within ",
            RoundTimeout().count(), " ms"));
      }
      const auto until = std::min(deadline, slice_end);
      if (!conn.polling) {
        conn.polling = true;
        Poll(p.conn, until, [&] { return p.done; });
        conn.polling = false;
        HandOff(conn);
      } else {
        p.waiting = true;
        ++conn.waiters;
        p.cv.WaitWithDeadline(&rounds_mu_, AbslTime(until));
        --conn.waiters;
        p.waiting = false;
      }
    }
    if (!conn.polling) HandOff(conn);  // a hand-off meant for us may have raced our result
  }
  // Done: nobody else touches p now. A round that failed after this client aborted failed
  // because of the abort (its Abort frame may have reached the sidecar before the round's
  // contribution, which the sidecar then no longer knows): the caller gets the abort.
  if (!p.answer.status.ok()) {
    if (absl::Status aborted = Aborted(); !aborted.ok()) return aborted;
  }
  return client_internal::DeliverAnswer(p.answer, p.channels, out_count, out_a, out_b);
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

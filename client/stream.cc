// The stream to the sidecar (client_impl.h, "How results reach the caller"): what the poller
// does with each event (results, write completions, the stream's end), the write slot, the
// frames that are not rounds, and the late results of renorm and lagged rounds as they arrive.
#include "client_impl.h"

namespace hsbn {

void Client::Impl::Forget(PendingRound& p) {
  auto it = pending_.find(Key{p.op, p.seq, int(p.phase)});
  if (it != pending_.end() && it->second.get() == &p) pending_.erase(it);
}

void Client::Impl::HandOff(RoundStream& conn) {
  if (conn.waiters == 0) return;
  conn.write_cv.SignalAll();  // Starts waiting for the write slot (rare)
  if (late_waiters_ > 0) late_cv_.SignalAll();  // GlobalStats waiters may poll in turn
  for (auto& [key, r] : pending_) {
    if (r->conn.get() == &conn && r->waiting && !r->done) {
      r->cv.Signal();
      return;
    }
  }
}

void Client::Impl::FlushAbortFrame(RoundStream& conn) {
  if (!conn.abort_frame || conn.write_in_flight || conn.broken) return;
  conn.write_in_flight = true;
  conn.write_failed = false;
  conn.stream->Write(*conn.abort_frame, TagOf(kWrite));  // serialised here
  conn.abort_frame.reset();
}

void Client::Impl::Dispatch(RoundStream& conn) {
  if (!conn.in.has_result()) return;
  v1::Result* r = conn.in.mutable_result();
  if (r->late()) {
    auto expected = late_expected_.find(Key{r->op(), r->seq(), int(r->phase())});
    if (expected == late_expected_.end()) {
      // Not a round this client started with renorm or lagged scope (or its result came
      // already): kept, it could shadow the real one.
      late_dropped_.fetch_add(1, std::memory_order_relaxed);
      Debug(absl::StrCat("dropped a late result for round ",
                         wire::RoundName(r->op(), r->seq(), r->phase()),
                         ", which this client did not start with renorm or lagged scope"));
      return;
    }
    const Scope scope = expected->second;
    late_expected_.erase(expected);
    KeepLate(r, scope);
    return;
  }
  auto it = pending_.find(Key{r->op(), r->seq(), int(r->phase())});
  // A round we gave up on, a repeat, or a key reused on a newer stream: drop it.
  if (it == pending_.end() || it->second->conn.get() != &conn) return;
  PendingRound& p = *it->second;
  p.answer = client_internal::TakeAnswer(r);
  p.done = true;
  if (p.waiting) p.cv.Signal();
  pending_.erase(it);  // p stays alive: its waiter holds it
}

void Client::Impl::ExpectLate(const Key& key, Scope scope) {
  if (!late_expected_.emplace(key, scope).second) return;
  late_expected_order_.push_back(key);
  while (late_expected_order_.size() > kLateKept ||
         (!late_expected_order_.empty() && !late_expected_.count(late_expected_order_.front()))) {
    late_expected_.erase(late_expected_order_.front());
    late_expected_order_.pop_front();
  }
}

void Client::Impl::KeepLate(v1::Result* r, Scope scope) {
  const Key key{r->op(), r->seq(), int(r->phase())};
  Late late;
  late.scope = scope;
  if (r->code() != 0) {
    late.status = wire::StatusFromCode(r->code(), r->message(), r->reason());
  } else if (r->channels() < 1 ||
             int64_t(r->data().size()) != wire::PayloadBytes(r->channels()) || r->count() < 0) {
    late.status = absl::InternalError(absl::StrCat(
        "the sidecar sent a malformed global result (", r->channels(), " channels, ",
        r->data().size(), " bytes); check that it runs the same hsbn version"));
  } else {
    late.count = r->count();
    late.channels = r->channels();
    late.data = std::move(*r->mutable_data());
  }
  late_bytes_ += int64_t(late.data.size());
  if (auto it = late_.find(key); it != late_.end()) {  // a repeat: the newer one counts
    late_bytes_ -= int64_t(it->second.data.size());
    it->second = std::move(late);
  } else {
    late_.emplace(key, std::move(late));
    late_order_.push_back(key);
  }
  while (!late_order_.empty() && (late_.size() > kLateKept || late_bytes_ > kLateBytes)) {
    auto old = late_.find(late_order_.front());
    if (old != late_.end()) {
      late_bytes_ -= int64_t(old->second.data.size());
      late_.erase(old);
    }
    late_order_.pop_front();
  }
  if (late_waiters_ > 0) late_cv_.SignalAll();
}

void Client::Impl::FailRounds(RoundStream& conn) {
  const std::string why = conn.final_status.error_message();
  // The sidecar's reason (a polite stop says SHUTTING_DOWN) travels with the failure.
  const absl::Status lost = wire::WithReason(
      absl::UnavailableError(absl::StrCat(
          "the stream to the hsbn sidecar at ", options_.address, " broke (",
          why.empty() ? "closed" : why, "); rounds in flight were lost. The next call "
          "reconnects")),
      wire::ReasonOf(wire::FromGrpc(conn.final_status)));
  for (auto it = pending_.begin(); it != pending_.end();) {
    PendingRound& p = *it->second;
    if (p.conn.get() != &conn) {
      ++it;
      continue;
    }
    p.answer.status = lost;
    p.done = true;
    if (p.waiting) p.cv.Signal();
    it = pending_.erase(it);
  }
}

void Client::Impl::AwaitWrite(
    const std::shared_ptr<RoundStream>& conn, Clock::time_point deadline) {
  conn->polling = true;
  Poll(conn, deadline, [&] { return !conn->write_in_flight; });
  conn->polling = false;
  HandOff(*conn);
}

void Client::Impl::DrainStream(const std::shared_ptr<RoundStream>& conn) {
  absl::MutexLock lock(&rounds_mu_);
  if (conn == nullptr || conn->polling || conn->broken) return;
  conn->polling = true;
  for (int pass = 0; pass < 2 && !conn->broken; ++pass) {
    Poll(conn, Clock::now(), [] { return false; });
  }
  conn->polling = false;
  HandOff(*conn);
}

absl::Status Client::Impl::SendFrame(v1::ClientFrame* frame, const char* what, bool reconnect) {
  std::shared_ptr<RoundStream> conn;
  {
    absl::MutexLock lock(&mu_);
    if (!reconnect && (!conn_ || conn_->broken)) {
      return absl::UnavailableError(absl::StrCat("could not send ", what, ": no stream"));
    }
    if (!conn_ || conn_->broken) {
      if (absl::Status s = ConnectLocked(); !s.ok()) return s;
    }
    conn = conn_;
    if (frame->has_layer_names()) frame->mutable_layer_names()->set_session(session_);
    if (frame->has_lagged_trip()) frame->mutable_lagged_trip()->set_session(session_);
    if (frame->has_late_wanted()) frame->mutable_late_wanted()->set_session(session_);
  }
  const auto deadline = Clock::now() + RoundTimeout();
  absl::MutexLock lock(&rounds_mu_);
  if (absl::Status s = AwaitWriteSlot(conn, deadline, [&] { return std::string(what); });
      !s.ok()) {
    return s;
  }
  if (conn->broken) {
    return absl::UnavailableError(absl::StrCat("could not send ", what, ": the stream to the "
                                               "hsbn sidecar at ", options_.address,
                                               " broke; the next call reconnects"));
  }
  conn->write_in_flight = true;
  conn->write_failed = false;
  counters_.Sent(int64_t(frame->ByteSizeLong()));
  conn->stream->Write(*frame, TagOf(kWrite));
  if (!conn->polling) AwaitWrite(conn, deadline);
  return absl::OkStatus();
}

absl::Status Client::Impl::NameLayers(const std::vector<std::pair<uint32_t, std::string>>& names) {
  if (names.empty()) return absl::OkStatus();
  v1::ClientFrame frame;
  for (const auto& [op, name] : names) {
    v1::LayerName* n = frame.mutable_layer_names()->add_layers();
    n->set_op(op);
    n->set_name(name);
  }
  return SendFrame(&frame, "layer names");
}

absl::Status Client::Impl::ReportLaggedTrip(uint32_t op, uint64_t seq, double drift,
                                            int64_t exact_calls) {
  if (std::isnan(drift) || drift < 0 || exact_calls < 1 || exact_calls > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lagged trip report for op ", op, ": drift ", drift, " must be >= 0 and exact_calls ",
        exact_calls, " in [1, 2^30]"));
  }
  v1::ClientFrame frame;
  v1::LaggedTrip* t = frame.mutable_lagged_trip();
  t->set_op(op);
  t->set_seq(seq);
  t->set_drift(drift);
  t->set_exact_calls(exact_calls);
  return SendFrame(&frame, "a lagged trip report");
}

absl::Status Client::Impl::Broken(const std::string& round) const {
  return absl::UnavailableError(absl::StrCat(
      "round ", round, ": the stream to the hsbn sidecar at ", options_.address,
      " broke while sending; the next call reconnects"));
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
  pending->wait = &Client::Impl::WaitOnStream;
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

void Client::Impl::AbortStream(const absl::Status& status, const std::string& why) {
  std::shared_ptr<RoundStream> conn;
  std::string session;
  {
    absl::MutexLock lock(&mu_);
    conn = conn_;
    session = session_;
  }
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

}  // namespace hsbn

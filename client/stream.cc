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

absl::Status Client::Impl::SendFrame(v1::ClientFrame* frame, const char* what) {
  std::shared_ptr<RoundStream> conn;
  {
    absl::MutexLock lock(&mu_);
    if (!conn_ || conn_->broken) {
      if (absl::Status s = ConnectLocked(); !s.ok()) return s;
    }
    conn = conn_;
    if (frame->has_layer_names()) frame->mutable_layer_names()->set_session(session_);
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

absl::Status Client::Impl::Broken(const std::string& round) const {
  return absl::UnavailableError(absl::StrCat(
      "round ", round, ": the stream to the hsbn sidecar at ", options_.address,
      " broke while sending; the next call reconnects"));
}

}  // namespace hsbn

// The node's shared-memory transport as Client::Impl uses it (the segment itself is
// shm_channel.h's): offering and opening it at the join, starting a round through it (or
// deferring it to its Wait while the node has not decided), waiting for its answer, and its
// part of a stop and of Abort. Nothing else in the client asks whether a round or a connection
// uses shared memory; a round's way back is its PendingRound::wait.
#include "client_impl.h"

namespace hsbn {

bool Client::Impl::ChooseNodeTransportLocked(const v1::JoinResponse& resp) {
  shm_.reset();
  if (!OfferShm()) {
    SetTransport(shm_unreachable_.empty()
                     ? std::string("grpc: HSBN_TRANSPORT=grpc")
                     : absl::StrCat("grpc: this worker cannot reach the sidecar's "
                                    "shared-memory socket: ", shm_unreachable_));
  } else if (resp.shm_socket().empty()) {
    SetTransport(resp.shm_note().empty()
                     ? std::string("grpc: the sidecar does not offer shared memory")
                     : wire::Printable(resp.shm_note(), 512));
  } else if (absl::Status opened = OpenShmLocked(resp);
             !opened.ok() && shm_unreachable_.empty()) {
    // Another host or container: tell the sidecar now, by joining again without the offer,
    // so that the node takes the stream at once instead of after --shm-wait-ms.
    shm_unreachable_ = std::string(opened.message());
    return false;
  }
  return true;
}

absl::Status Client::Impl::OpenShmLocked(const v1::JoinResponse& resp) {
  client_internal::ShmConfig config;
  config.socket = resp.shm_socket();
  config.session = session_;
  config.token = options_.token;
  config.job_id = options_.job_id;
  config.local_rank = options_.local_rank;
  config.local_world_size = options_.local_world_size;
  config.node_rank = options_.node_rank;
  config.num_nodes = resp.num_nodes();
  config.strict_finite = options_.strict_finite;
  config.max_channels = resp.max_channels();
  config.round_timeout = std::chrono::milliseconds(
      std::clamp<int64_t>(resp.round_timeout_ms(), 1, client_internal::kMaxWaitMs));
  auto opened = client_internal::ShmChannel::Open(std::move(config));
  if (!opened.ok()) return opened.status();
  shm_ = std::move(*opened);
  SetTransport("pending");
  return absl::OkStatus();
}

bool Client::Impl::OfferShm() const {
  if (!shm_unreachable_.empty()) return false;
  return options_.transport != "grpc";
}

bool Client::Impl::ShmGoneLocked() const {
  return shm_ != nullptr && !shm_->AliveRecently();
}

absl::Status Client::Impl::ShmStoppingLocked() {
  return shm_ != nullptr ? shm_->Stopping() : absl::OkStatus();
}

void Client::Impl::AbortShm(const absl::Status& status) {
  std::shared_ptr<client_internal::ShmChannel> shm;
  {
    absl::MutexLock lock(&mu_);
    shm = shm_;
  }
  if (shm) shm->Abort(status);
}

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Impl::StartOnShm(
    const RoundRequest& r, const std::shared_ptr<RoundStream>& conn,
    std::shared_ptr<client_internal::ShmChannel> shm, bool* taken) {
  *taken = shm != nullptr;
  if (shm == nullptr) return nullptr;  // the node uses the stream
  if (!shm->decided()) {
    // The sidecar answers once every local rank of the job presented its session. Wait
    // briefly: when the other ranks are not there yet (they may be started by this very
    // thread, as tests do), the round is sent at its Wait instead.
    absl::Status s = shm->Await(std::min(r.deadline, Clock::now() + kDecisionWait));
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      auto pending = NewPending(r, *conn);
      pending->shm = std::move(shm);
      pending->wait = &Client::Impl::WaitDeferred;
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
  pending->wait = &Client::Impl::WaitOnShm;
  // Late global results come on the stream, which shared-memory rounds never read: take what
  // has arrived, so that they cannot pile up at the sidecar (a stream more than
  // --max-queued-bytes behind is ended) while nobody asks for them (a warm-up).
  if (r.scope == Scope::kRenorm || r.scope == Scope::kLagged) DrainStream(conn);
  return pending;
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
    p.waited = true;
    p.outcome = s;
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
    p.waited = true;
    p.outcome = q.status();
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
  p.waited = true;
  p.outcome = s;
  return s;
}

}  // namespace hsbn

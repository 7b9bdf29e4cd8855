#include "member_stream.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "wire.h"

namespace hsbn::server {

namespace {
constexpr const char* kStaleSession =
    "this session was replaced by a newer Join of the same rank, or it left the job; this "
    "connection is stale";
}  // namespace

absl::Status MemberStream::Read(const v1::ClientFrame& message) {
  // Sized only while nothing is bound: after an Attach the limit no longer applies.
  const bool unbound = bound_.empty();
  const int64_t size = unbound ? int64_t(message.ByteSizeLong()) : 0;
  if (message.has_batch()) {
    for (const v1::ClientFrame& frame : message.batch().frames()) Handle(frame);
  } else {
    Handle(message);
  }
  if (unbound && bound_.empty()) {
    unbound_bytes_ += size;
    if (unbound_bytes_ > max_unbound_bytes_) {
      host_->Refused("unbound_bytes");
      return absl::ResourceExhaustedError(absl::StrCat(
          "this stream sent ", unbound_bytes_, " bytes without attaching a session; at most "
          "--max-unbound-bytes=", max_unbound_bytes_, " are accepted before an Attach (Join "
          "first, then Attach its session on the stream)"));
    }
  }
  return absl::OkStatus();
}

void MemberStream::Handle(const v1::ClientFrame& frame) {
  switch (frame.frame_case()) {
    case v1::ClientFrame::kAttach:
      if (frame.attach().accepts_batches()) sink_->EnableBatches();
      for (const std::string& s : frame.attach().sessions()) Bind(s, frame.attach().token());
      break;
    case v1::ClientFrame::kContribution:
      HandleContribution(frame.contribution());
      break;
    case v1::ClientFrame::kAbort:
      HandleAbort(frame.abort());
      break;
    case v1::ClientFrame::kNodeState:
      HandleNodeState(frame.node_state());
      break;
    case v1::ClientFrame::kLeave:
      HandleLeave(frame.leave());
      break;
    case v1::ClientFrame::kLayerNames:
      HandleLayerNames(frame.layer_names());
      break;
    case v1::ClientFrame::kLaggedTrip:
      HandleLaggedTrip(frame.lagged_trip());
      break;
    case v1::ClientFrame::kLateWanted:
      HandleLateWanted(frame.late_wanted());
      break;
    default:  // an empty frame, or a batch nested in a batch: nothing to do
      break;
  }
}

void MemberStream::Bind(const std::string& bytes, const std::string& token) {
  SessionId session;
  if (!SessionId::FromBytes(bytes, &session)) {
    host_->LogInvalid("Attach with a session that is not 16 bytes");
    return;
  }
  absl::StatusOr<Registry::SessionRef> ref = host_->registry().Authorize(session, token);
  if (!ref.ok()) {
    host_->LogInvalid(absl::StrCat("Attach refused: ", ref.status().ToString()));
    return;
  }
  if (!ref->job->Attach(ref->index, session, sink_, host_->Now()).ok()) return;
  host_->Attached(*ref, session);
  for (auto& [s, r] : bound_) {
    if (s == session) {
      r = *ref;
      return;
    }
  }
  sessions_.push_back(session);
  bound_.emplace_back(session, *std::move(ref));
}

const Registry::SessionRef* MemberStream::Bound(const std::string& bytes,
                                                SessionId* session) const {
  if (!SessionId::FromBytes(bytes, session)) return nullptr;
  for (const auto& [s, r] : bound_) {
    if (s == *session) return &r;
  }
  return nullptr;
}

void MemberStream::SendError(const v1::Contribution& c, const absl::Status& status) {
  v1::Result r = wire::ErrorResult(c.op(), c.seq(), c.phase(), status);
  r.set_session(c.session());
  sink_->Send(std::move(r));
}

void MemberStream::HandleContribution(const v1::Contribution& c) {
  // The sessions bound to this stream are kept here: no aggregator-wide lock per round.
  SessionId session;
  const Registry::SessionRef* ref = Bound(c.session(), &session);
  if (ref == nullptr) {
    if (c.session().size() != 16) {
      host_->LogInvalid("a contribution without a 16-byte session");
      return;  // nobody to answer: the sender's session is not even well formed
    }
    SendError(c, absl::NotFoundError(
                     "unknown session on this stream: the aggregator restarted, the job was "
                     "dropped, or the session was never attached here; the client must Join "
                     "again and Attach its session (hsbn clients do this by themselves)"));
    return;
  }
  Actions actions;
  if (!ref->job->Contribute(ref->index, session, c, host_->Now(), &actions)) {
    SendError(c, absl::NotFoundError(kStaleSession));
    return;
  }
  host_->Contributed(*ref, session, c);
  host_->Execute(ref->job, actions);
}

const Registry::SessionRef* MemberStream::FromAggregator(const std::string& bytes,
                                                         const char* what, SessionId* session) {
  const Registry::SessionRef* ref = Bound(bytes, session);
  if (ref == nullptr) {
    host_->LogInvalid(absl::StrCat(what, " on a session not attached to this stream"));
    return nullptr;
  }
  if (ref->job->layout().member_kind != v1::MEMBER_KIND_AGGREGATOR) {
    host_->LogInvalid(absl::StrCat(what, " from a worker of job '", ref->job->id(),
                                   "' (only aggregators may send it); ignored"));
    return nullptr;
  }
  return ref;
}

void MemberStream::HandleAbort(const v1::Abort& a) {
  SessionId session;
  const Registry::SessionRef* worker = Bound(a.session(), &session);
  if (worker != nullptr && worker->job->layout().member_kind == v1::MEMBER_KIND_WORKER) {
    // "This rank is gone, because ...": the round key is not looked at, so the frame can only
    // ever fail the rounds of the job of this stream's own session.
    const Registry::SessionRef ref = *worker;
    Unbind(session);  // its rounds fail once, here, not again when the stream ends
    host_->Aborted(ref, session, a.message().empty() ? std::string("no reason given")
                                                     : wire::Printable(a.message(), 512));
    return;
  }
  const Registry::SessionRef* ref = FromAggregator(a.session(), "an Abort", &session);
  if (ref == nullptr) return;
  Actions actions;
  ref->job->ChildAbort(ref->index, a, &actions);
  host_->Execute(ref->job, actions);
}

void MemberStream::HandleNodeState(const v1::NodeState& state) {
  SessionId session;
  const Registry::SessionRef* ref = FromAggregator(state.session(), "a NodeState", &session);
  if (ref == nullptr) return;
  Actions actions;
  ref->job->ChildState(ref->index, state, &actions);
  host_->Execute(ref->job, actions);
}

void MemberStream::HandleLayerNames(const v1::LayerNames& names) {
  SessionId session;
  const Registry::SessionRef* ref = Bound(names.session(), &session);
  if (ref == nullptr) {
    host_->LogInvalid("layer names on a session not attached to this stream");
    return;
  }
  Actions actions;
  ref->job->NameLayers(names, &actions);
  host_->Execute(ref->job, actions);
}

void MemberStream::HandleLaggedTrip(const v1::LaggedTrip& trip) {
  SessionId session;
  const Registry::SessionRef* ref = Bound(trip.session(), &session);
  if (ref == nullptr) {
    host_->LogInvalid("a lagged trip report on a session not attached to this stream");
    return;
  }
  if (absl::Status s = ref->job->RecordTrip(trip); !s.ok()) {
    host_->LogInvalid(absl::StrCat("refused: ", s.message()));
  }
}

void MemberStream::HandleLateWanted(const v1::LateWanted& wanted) {
  SessionId session;
  const Registry::SessionRef* ref = Bound(wanted.session(), &session);
  if (ref == nullptr) {
    host_->LogInvalid("a late-result wait on a session not attached to this stream");
    return;
  }
  if (wanted.phase() != v1::PHASE_FORWARD && wanted.phase() != v1::PHASE_BACKWARD) {
    host_->LogInvalid("a late-result wait with no phase");
    return;
  }
  host_->LateWanted(ref->job->id(), RoundKey{wanted.op(), wanted.seq(), wanted.phase()});
}

void MemberStream::HandleLeave(const v1::LeaveRequest& leave) {
  SessionId session;
  if (FromAggregator(leave.session(), "a Leave frame", &session) == nullptr) return;
  Unbind(session);
  host_->Leave(session);
}

void MemberStream::Unbind(const SessionId& session) {
  for (size_t i = 0; i < bound_.size(); ++i) {
    if (bound_[i].first == session) {
      bound_.erase(bound_.begin() + ptrdiff_t(i));
      break;
    }
  }
  sessions_.erase(std::remove(sessions_.begin(), sessions_.end(), session), sessions_.end());
}

}  // namespace hsbn::server

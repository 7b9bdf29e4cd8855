// Job's members: joining (and rejoining) and attaching a stream, when a job may be dropped, and
// what a child aggregator reports besides its partials (an abort, layer names) (job.h).
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "job.h"
#include "wire.h"

namespace hsbn::server {

absl::Status Job::AddMember(int32_t index, const SessionId& session,
                            const SessionId& previous_session, Clock::time_point now,
                            Actions* out) {
  absl::MutexLock lock(&mu_);
  Member& m = members_.at(index);
  if (m.joined && m.connected && (previous_session.empty() || m.session != previous_session)) {
    return absl::AlreadyExistsError(absl::StrCat(
        MemberName(index), " of job '", id_,
        "' is already joined from a live connection; two processes were probably started with "
        "the same RANK, or the job id is reused by another job (set a unique HSBN_JOB_ID)"));
  }
  if (m.joined && !m.session.empty() && m.session != session) {
    out->log.push_back(absl::StrCat("job '", id_, "': ", MemberName(index), " rejoined"));
  }
  m.session = session;
  last_change_ = now;
  m.joined = true;
  m.connected = false;
  m.gone = false;
  m.aborted.clear();
  m.sink.reset();
  m.down.clear();  // a child aggregator's new session starts healthy; it says so if not
  if (reported_down_) {
    bool all_back = true;
    for (const Member& other : members_) {
      all_back = all_back && !other.gone && (&other == &m || other.down.empty());
    }
    if (all_back) {
      reported_down_ = false;
      out->node_states.push_back(Actions::NodeState{true, ""});
    }
  }
  return absl::OkStatus();
}

absl::Status Job::Attach(int32_t index, const SessionId& session,
                         std::shared_ptr<ResultSink> sink, Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  Member& m = members_.at(index);
  if (!m.joined || m.session != session || m.gone) {
    // A session whose stream broke stays gone: its rounds already failed, so it must Join
    // again (hsbn's client does) rather than quietly resume.
    return absl::NotFoundError(absl::StrCat(
        "session of ", MemberName(index), " in job '", id_,
        "' was replaced by a newer Join or lost its stream; this connection must rejoin"));
  }
  m.connected = true;
  m.sink = std::move(sink);
  last_change_ = now;
  return absl::OkStatus();
}

bool Job::Droppable(Clock::time_point now, Clock::duration attach_timeout,
                    bool* expired) const {
  absl::MutexLock lock(&mu_);
  bool live = false;       // joined, not gone
  bool attached = false;   // on a live stream
  for (const Member& m : members_) {
    live = live || (m.joined && !m.gone);
    attached = attached || m.connected;
  }
  if (!live) return true;
  const bool idle = !attached && now - last_change_ >= attach_timeout;
  if (expired) *expired = idle;
  return idle;
}

void Job::ChildAbort(int32_t index, const v1::Abort& abort, Actions* out) {
  absl::MutexLock lock(&mu_);
  absl::Status s = wire::StatusFromCode(abort.code() == 0 ? int(absl::StatusCode::kAborted)
                                                          : abort.code(),
                                        wire::Printable(abort.message(), 1024), abort.reason());
  // An abort does not say the round's scope: with groups it may be the node's group round.
  const RoundKey key{abort.op(), abort.seq(), abort.phase()};
  if (layout_.keyed_groups()) {
    const RoundKey group_key{abort.op(), abort.seq(), abort.phase(),
                             index * std::max(1, layout_.member_nodes) / layout_.group_nodes + 1};
    if (open_.count(group_key)) {
      FailRoundLocked(group_key, s, /*tell_parent=*/true, out);
      return;
    }
    if (!open_.count(key) && !finished_.count(key) && !finished_.count(group_key)) {
      FinishLocked(group_key, Finished{s, nullptr, {}});
    }
  }
  if (finished_.count(key)) return;
  if (open_.count(key)) {
    FailRoundLocked(key, s, /*tell_parent=*/true, out);
  } else {
    ++rounds_failed_;
    out->outcomes.push_back(
        Actions::Outcome{v1::SCOPE_UNSPECIFIED, key.phase, s.code(), Clock::time_point{}});
    FinishLocked(key, Finished{s, nullptr, {}});  // later partials of this round get the error
    // A group aggregator: the round may be a global one that other groups' nodes are waiting
    // for at the root (its scope is unknown here; a key names one round per job, so telling
    // the root about a group round only leaves a tombstone nothing asks for).
    if (limits_.has_parent && !layout_.workers()) out->aborts.push_back(Actions::Abort{key, s});
  }
}

void Job::NameLayers(const v1::LayerNames& names, Actions* out) {
  absl::MutexLock lock(&mu_);
  for (const v1::LayerName& n : names.layers()) {
    if (names_.size() >= kMaxNames) break;
    if (n.name().empty() || n.name().size() > kMaxNameBytes || names_.count(n.op()) > 0) continue;
    if (wire::Printable(n.name(), kMaxNameBytes) != n.name()) continue;  // not printable ASCII
    // Charged like shadow records (within a quarter of the budget): names never crowd out
    // round data; past that they are dropped.
    const int64_t bytes = int64_t(n.name().size()) + 64;
    if (limits_.budget && !limits_.budget->TryChargeWithin(bytes, limits_.budget->limit() / 4)) {
      break;
    }
    held_ += bytes;
    names_.emplace(n.op(), n.name());
    if (limits_.has_parent) out->names.push_back(n);
  }
}

absl::Status Job::RecordTrip(const v1::LaggedTrip& trip) {
  if (std::isnan(trip.drift()) || trip.drift() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lagged trip report for op ", trip.op(), ": drift ", trip.drift(),
                     " is not a number >= 0"));
  }
  if (trip.exact_calls() < 1 || trip.exact_calls() > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lagged trip report for op ", trip.op(), ": exact_calls ",
                     trip.exact_calls(), " is outside [1, 2^30]"));
  }
  absl::MutexLock lock(&mu_);
  auto it = trips_.find(trip.op());
  if (it == trips_.end()) {
    if (trips_.size() >= kMaxNames) {
      return absl::ResourceExhaustedError(
          absl::StrCat("lagged trip report for op ", trip.op(), ": this job already has ",
                       kMaxNames, " ops with trips recorded"));
    }
    const int64_t bytes = 96;
    if (limits_.budget && !limits_.budget->TryChargeWithin(bytes, limits_.budget->limit() / 4)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("lagged trip report for op ", trip.op(), ": memory budget"));
    }
    held_ += bytes;
    it = trips_.emplace(trip.op(), v1::LaggedTripStatus()).first;
    it->second.set_op(trip.op());
  } else if (trip.seq() <= it->second.last_seq()) {
    return absl::OkStatus();  // another rank's report of a counted trip, or an older one
  }
  v1::LaggedTripStatus& t = it->second;
  t.set_trips(t.trips() + 1);
  t.set_last_seq(trip.seq());
  t.set_last_drift(trip.drift());
  t.set_exact_calls(trip.exact_calls());
  return absl::OkStatus();
}

}  // namespace hsbn::server

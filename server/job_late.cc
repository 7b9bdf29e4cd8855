// Job's late results (renorm and lagged rounds: the parent's answer reaching every worker after
// the node's own), the kept lagged forwards a lagged backward is re-centred on, and the
// parent's answers to forwarded rounds (job.h; docs/PROTOCOL.md, "Renorm scope", "Lagged scope").
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "job.h"
#include "wire.h"

namespace hsbn::server {

void Job::ForgetLaggedLocked(
    std::map<std::pair<uint32_t, uint64_t>, LaggedForward>::iterator it) {
  ReleaseLocked(it->second.charged);
  lagged_.erase(it);  // its entry in lagged_order_ goes when it reaches the front
}

void Job::KeepLaggedForwardLocked(const Round& round, const double* center, Actions* out) {
  const std::pair<uint32_t, uint64_t> key{round.key.op, round.key.seq};
  while (!lagged_order_.empty() &&
         (int64_t(lagged_.size()) >= limits_.max_open_rounds ||
          int64_t(lagged_order_.size()) >= 2 * int64_t(limits_.max_open_rounds) ||
          !lagged_.count(lagged_order_.front()))) {
    if (auto old = lagged_.find(lagged_order_.front()); old != lagged_.end()) {
      ForgetLaggedLocked(old);
    }
    lagged_order_.pop_front();
  }
  if (auto old = lagged_.find(key); old != lagged_.end()) ForgetLaggedLocked(old);
  LaggedForward f;
  f.channels = round.channels;
  const size_t members = round.slots.size();
  const size_t channels = round.channels;
  const bool means = !layout_.workers();
  const int64_t bytes = int64_t(sizeof(LaggedForward) + members * sizeof(int64_t) +
                                (means ? (members + 1) * channels * sizeof(double) : 0));
  // Like shadow records, within a quarter of the budget: never crowding out round data.
  if (limits_.budget && !limits_.budget->TryChargeWithin(bytes, limits_.budget->limit() / 4)) {
    out->refused.push_back("memory_budget");
    f.status = wire::WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            "round ", Describe(RoundKey{key.first, key.second, v1::PHASE_BACKWARD}), " of job '",
            id_, "': the record of its lagged forward was not kept, since lagged records took a "
            "quarter of the aggregator's memory budget (--memory-budget-bytes); raise it, or "
            "run fewer lagged layers ahead of their backward")),
        v1::REASON_MEMORY_BUDGET);
  } else {
    f.charged = bytes;
    held_ += bytes;
    f.counts.resize(members);
    if (means) {
      f.means.resize(members * channels);
      f.center.assign(center, center + channels);
    }
    std::vector<double> m2(channels);
    for (size_t i = size_t(round.lo); i < size_t(round.hi); ++i) {
      f.counts[i] = round.slots[i].count;
      if (means) wire::UnpackPayload(round.slots[i].data, int64_t(channels),
                                     f.means.data() + i * channels, m2.data());
    }
  }
  lagged_.emplace(key, std::move(f));
  lagged_order_.push_back(key);
  if (!means) return;
  const RoundKey backward{key.first, key.second, v1::PHASE_BACKWARD, round.key.group};
  if (auto b = open_.find(backward); b != open_.end() && b->second.waits_forward) {
    CompleteLocked(b->second, out);
  }
}

absl::Status Job::CheckLaggedBackwardLocked(int32_t index, const v1::Contribution& c) const {
  const std::string who = MemberName(index);
  const std::string round = Describe(RoundKey{c.op(), c.seq(), c.phase()});
  const RoundKey forward{c.op(), c.seq(), v1::PHASE_FORWARD};
  int64_t count = -1;
  uint32_t channels = 0;
  if (auto f = lagged_.find({c.op(), c.seq()}); f != lagged_.end()) {
    if (!f->second.status.ok()) return f->second.status;
    count = f->second.counts[size_t(index)];
    channels = f->second.channels;
  } else if (auto o = open_.find(forward); o != open_.end() &&
                                           o->second.scope == v1::SCOPE_LAGGED &&
                                           o->second.slots[size_t(index)].filled) {
    count = o->second.slots[size_t(index)].count;
    channels = o->second.channels;
  } else if (auto d = finished_.find(forward); d != finished_.end() && !d->second.status.ok()) {
    return wire::WithMessage(d->second.status,
                             absl::StrCat("round ", round, ": its forward round failed: ",
                                          d->second.status.message()));
  } else if (d != finished_.end()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "round ", round, " of job '", id_, "': the record of its lagged forward round was "
        "forgotten, since more than --max-open-rounds lagged forwards waited for their backward "
        "here; run each lagged layer's backward before its next forwards, or raise the limit"));
  } else {
    return wire::InvalidContribution(
        who, round, "phase",
        absl::StrCat("is backward, but ", who, " sent no lagged forward contribution to op ",
                     c.op(), ", seq ", c.seq(), " here; a lagged layer's backward round follows "
                     "its forward round with the same op and seq, and every rank runs both"));
  }
  if (c.count() != count) {
    return wire::InvalidContribution(
        who, round, "count",
        absl::StrCat("is ", c.count(), " but its lagged forward contribution to op ", c.op(),
                     ", seq ", c.seq(), " had count ", count,
                     "; a backward contribution carries the count of its forward"));
  }
  if (c.channels() != channels) {
    return wire::InvalidContribution(
        who, round, "channels",
        absl::StrCat("is ", c.channels(), " but its lagged forward round had ", channels));
  }
  return absl::OkStatus();
}

void Job::ExpectLate(const RoundKey& key, uint32_t channels, Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  ExpectLateLocked(key, channels, now);
}

void Job::ExpectLateLocked(const RoundKey& key, uint32_t channels, Clock::time_point now) {
  if (int64_t(late_.size()) >= limits_.max_open_rounds) return;
  late_[key] = Late{channels, now + wire::ForwardedBackstop(limits_.round_timeout)};
}

void Job::DeliverLateLocked(const RoundKey& key, std::shared_ptr<const v1::Result> result,
                            const absl::Status& status, Actions* out) {
  if (!result) {
    auto error = std::make_shared<v1::Result>(wire::ErrorResult(key.op, key.seq, key.phase,
                                                                status));
    error->set_scope(v1::SCOPE_GLOBAL);
    error->set_late(true);
    result = std::move(error);
  }
  Actions::Delivery d;
  d.result = std::move(result);
  for (const Member& m : members_) {
    if (m.sink) d.to.emplace_back(m.session, m.sink);
  }
  if (!d.to.empty()) out->deliveries.push_back(std::move(d));
}

void Job::ParentResult(const v1::Result& result, Actions* out) {
  absl::MutexLock lock(&mu_);
  const RoundKey key{result.op(), result.seq(), result.phase()};
  if (auto l = late_.find(key); l != late_.end()) {
    const uint32_t channels = l->second.channels;
    late_.erase(l);
    if (result.code() != 0) {
      DeliverLateLocked(key, nullptr,
                        wire::StatusFromCode(result.code(), result.message(), result.reason()),
                        out);
      return;
    }
    if (result.channels() != channels ||
        int64_t(result.data().size()) != wire::PayloadBytes(channels) || result.count() < 0) {
      DeliverLateLocked(key, nullptr,
                        absl::InternalError(absl::StrCat(
                            "round ", Describe(key), " of job '", id_, "': the parent aggregator "
                            "answered with a malformed result (", result.channels(),
                            " channels, ", result.data().size(), " bytes; expected ", channels,
                            " channels); check that it runs the same hsbn version")),
                        out);
      return;
    }
    CountNonFinite(result.data(), key.phase, out);
    auto copy = std::make_shared<v1::Result>();
    copy->set_op(key.op);
    copy->set_seq(key.seq);
    copy->set_phase(key.phase);
    copy->set_scope(v1::SCOPE_GLOBAL);
    copy->set_channels(channels);
    copy->set_count(result.count());
    copy->set_data(result.data());
    copy->set_late(true);
    DeliverLateLocked(key, std::move(copy), absl::OkStatus(), out);
    return;
  }
  auto it = open_.find(key);
  if (it == open_.end() || !it->second.forwarded) {
    if (!finished_.count(key)) {  // not failed here already: nothing here asked for it
      ++late_dropped_;
      out->round_failures.push_back(absl::StrCat(
          "job '", id_, "': dropped the parent's result for round ", Describe(key),
          ", which this aggregator did not forward (an unknown or future round)"));
    }
    return;
  }
  if (result.code() != 0) {
    FailRoundLocked(key, wire::StatusFromCode(result.code(), result.message(), result.reason()),
                    /*tell_parent=*/false, out);
    return;
  }
  if (result.channels() != it->second.channels ||
      int64_t(result.data().size()) != wire::PayloadBytes(it->second.channels) ||
      result.count() < 0) {
    FailRoundLocked(key,
                    absl::InternalError(absl::StrCat(
                        "round ", Describe(key), " of job '", id_, "': the parent aggregator "
                        "answered with a malformed result (", result.channels(), " channels, ",
                        result.data().size(), " bytes; expected ", it->second.channels,
                        " channels); check that it runs the same hsbn version")),
                    /*tell_parent=*/false, out);
    return;
  }
  CountNonFinite(result.data(), key.phase, out);
  auto copy = std::make_shared<v1::Result>(result);
  copy->clear_session();
  copy->set_scope(it->second.scope);  // what the members asked for, whatever the root says
  // The answer to a forwarded round, never a late result (only a sidecar sends those, as its
  // own copy above), whatever the parent's flag says: members would take it as one.
  copy->clear_late();
  std::shared_ptr<const v1::Result> shared = copy;
  if (it->second.scope == v1::SCOPE_SHADOW) {
    // A group aggregator's shadow round: its sidecars were answered long ago; the global
    // statistics are for the per-node record.
    if (key.phase == v1::PHASE_FORWARD) RecordDivergenceLocked(it->second, *copy, out);
  } else {
    DeliverLocked(it->second, shared, out);
  }
  ++rounds_completed_;
  out->outcomes.push_back(Actions::Outcome{it->second.scope, key.phase, absl::StatusCode::kOk,
                                           it->second.opened});
  std::vector<uint64_t> hashes = HashContributions(it->second);
  EraseOpenLocked(it);
  FinishLocked(key, Finished{absl::OkStatus(), shared, std::move(hashes)});
}

}  // namespace hsbn::server

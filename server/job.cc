#include "job.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "hsbn/moments.h"
#include "round.h"
#include "wire.h"

namespace hsbn::server {

namespace {
uint64_t ContributionHash(int64_t count, const std::string& data) {
  const uint64_t h = std::hash<std::string>{}(data);
  return h ^ (uint64_t(count) * 0x9e3779b97f4a7c15ull);
}
}  // namespace

std::vector<uint64_t> Job::HashContributions(const Round& round) {
  std::vector<uint64_t> hashes;
  hashes.reserve(round.slots.size());
  for (const Slot& slot : round.slots) hashes.push_back(ContributionHash(slot.count, slot.data));
  return hashes;
}

std::string Describe(const RoundKey& key) {
  std::string name = wire::RoundName(key.op, key.seq, key.phase);
  if (key.group > 0) absl::StrAppend(&name, ", group ", key.group - 1);
  return name;
}

Job::Job(std::string id, JobLayout layout, JobLimits limits)
    : id_(std::move(id)),
      layout_(layout),
      limits_(std::move(limits)),
      members_(layout.expected_members()),
      last_change_(Clock::now()) {}

Job::~Job() {
  if (limits_.budget) limits_.budget->Release(held_);
}

bool Job::ChargeLocked(int64_t bytes) {
  if (limits_.budget && !limits_.budget->TryCharge(bytes)) return false;
  held_ += bytes;
  return true;
}

void Job::ReleaseLocked(int64_t bytes) {
  if (limits_.budget) limits_.budget->Release(bytes);
  held_ -= bytes;
}

int64_t Job::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

int64_t Job::CountNonFinite(const std::string& data, v1::Phase phase, Actions* out) {
  const int64_t n = wire::CountNonFinite(data.data(), int64_t(data.size() / sizeof(double)));
  if (out != nullptr && n > 0) out->nonfinite[phase == v1::PHASE_BACKWARD ? 1 : 0] += n;
  return n;
}

wire::MemberNames Job::Names() const {
  wire::MemberNames names;
  names.nodes = !layout_.workers();
  names.node_rank = layout_.workers() ? layout_.node_rank : layout_.first_node();
  names.local_world_size = layout_.local_world_size;
  names.member_nodes = std::max(1, layout_.member_nodes);
  return names;
}

std::string Job::MemberName(int32_t index) const { return Names()(index); }

absl::Status Job::CheckLayout(const JobLayout& d, const std::string& who) const {
  absl::Status s = LayoutDiffers(d, who);
  if (s.ok()) return s;
  const bool groups_only = d.member_kind == layout_.member_kind &&
                           d.world_size == layout_.world_size &&
                           d.local_world_size == layout_.local_world_size &&
                           d.strict_finite == layout_.strict_finite &&
                           d.group_nodes != layout_.group_nodes;
  return wire::WithReason(std::move(s),
                          groups_only ? v1::REASON_GROUP_NODES : v1::REASON_LAYOUT);
}

absl::Status Job::LayoutDiffers(const JobLayout& d, const std::string& who) const {
  auto mismatch = [&](const char* field, int64_t got, int64_t want) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", field, "=", got, " but job '", id_, "' was joined with ", field, "=", want,
        "; every process of a job must be launched with the same layout"));
  };
  if (d.member_kind != layout_.member_kind) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": joins job '", id_, "' as a different kind of member than its other members"));
  }
  if (d.world_size != layout_.world_size) return mismatch("world_size", d.world_size, layout_.world_size);
  if (d.local_world_size != layout_.local_world_size)
    return mismatch("local_world_size", d.local_world_size, layout_.local_world_size);
  if (d.strict_finite != layout_.strict_finite) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": strict_finite=", d.strict_finite ? "on" : "off", " but job '", id_,
        "' was joined with strict_finite=", layout_.strict_finite ? "on" : "off",
        "; every process of a job must set HSBN_STRICT_FINITE the same way"));
  }
  if (d.group_nodes != layout_.group_nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": group_nodes=", d.group_nodes, " but job '", id_, "' was joined with group_nodes=",
        layout_.group_nodes, "; every process of a job must set HSBN_GROUP_NODES (group_nodes) "
        "the same way"));
  }
  if (d.member_nodes != layout_.member_nodes) {
    auto kind = [](int32_t member_nodes) {
      return member_nodes > 1 ? absl::StrCat("a group aggregator (", member_nodes, " nodes)")
                              : std::string("a node's sidecar");
    };
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": joins job '", id_, "' as ", kind(d.member_nodes), " but its first member joined "
        "as ", kind(layout_.member_nodes), "; every node of a job reaches the root the same "
        "way: all sidecars through group aggregators (their --upstream), or all directly"));
  }
  if (d.group != layout_.group) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " belongs to group ", d.group, " (node_rank / HSBN_GROUP_NODES = ", d.group,
        ") but this group aggregator serves group ", layout_.group, " of job '", id_,
        "'; each node's sidecar must name its own group's aggregator as --upstream"));
  }
  if (d.node_rank != layout_.node_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": node_rank (GROUP_RANK)=", d.node_rank, " but this aggregator serves node ",
        layout_.node_rank, " of job '", id_,
        "'; each node's workers must use their own node's sidecar"));
  }
  return absl::OkStatus();
}

void Job::MemberGone(int32_t index, const SessionId& session, bool left, Clock::time_point now,
                     Actions* out, absl::string_view aborted) {
  absl::MutexLock lock(&mu_);
  Member& m = members_.at(index);
  if (m.session != session) return;  // already replaced by a newer session
  last_change_ = now;
  m.connected = false;
  m.gone = true;
  m.sink.reset();
  if (left) m.joined = false;
  if (!aborted.empty()) m.aborted = wire::Printable(aborted, 512);
  const std::string why =
      left ? absl::StrCat(MemberName(index), " left job '", id_, "' while this round waited for it")
           : absl::StrCat(MemberName(index), " disconnected from job '", id_,
                          "' (its stream broke: the process probably exited or was killed) "
                          "while this round waited for it");
  const int failed = FailOpenRoundsLocked(
      [&](const Round& round) {
        // An aborted member takes back what it sent: its rounds cannot complete either.
        return index >= round.lo && index < round.hi &&
               (!round.slots[index].filled || !m.aborted.empty());
      },
      [&](const RoundKey& key) {
        if (!m.aborted.empty()) {
          return wire::MemberAborted(wire::RoundRef{Describe(key), id_}, MemberName(index),
                                     m.aborted);
        }
        return wire::WithReason(
            absl::UnavailableError(absl::StrCat("round ", Describe(key), ": ", why)),
            left ? v1::REASON_MEMBER_LEFT : v1::REASON_MEMBER_DISCONNECTED);
      },
      /*tell_parent=*/true, out);
  out->log.push_back(absl::StrCat("job '", id_, "': ", MemberName(index),
                                  left                  ? " left"
                                  : m.aborted.empty()   ? " disconnected"
                                                        : " aborted (" + m.aborted + ")",
                                  "; ", failed, " open round(s) failed"));
  // A crashed worker (not one that left when it was done): the node cannot contribute to new
  // rounds until it rejoins, so the root need not wait for the deadline of rounds other nodes
  // open meanwhile.
  if (!left && !reported_down_ && limits_.has_parent &&
      layout_.covered_nodes() < layout_.num_nodes) {
    reported_down_ = true;
    down_message_ =
        !layout_.workers()
            ? absl::StrCat(MemberName(index), " lost its link to group aggregator of group ",
                           layout_.group)
        : m.aborted.empty()
            ? absl::StrCat(MemberName(index),
                           " disconnected from its node's sidecar (its stream broke: the "
                           "process probably exited or was killed)")
            : absl::StrCat(MemberName(index), " aborted (", m.aborted, ")");
    out->node_states.push_back(Actions::NodeState{false, down_message_});
  }
}

template <typename Waits, typename Why>
int Job::FailOpenRoundsLocked(Waits waits, Why why, bool tell_parent, Actions* out) {
  std::vector<RoundKey> doomed;
  for (auto& [key, round] : open_) {
    if (waits(round)) doomed.push_back(key);
  }
  int failed = 0;
  for (const RoundKey& key : doomed) {
    if (!open_.count(key)) continue;  // failed meanwhile with its lagged forward
    FailRoundLocked(key, why(key), tell_parent, out);
    ++failed;
  }
  return failed;
}

void Job::EraseOpenLocked(std::map<RoundKey, Round>::iterator it) {
  ReleaseLocked(it->second.charged);
  open_.erase(it);
}

bool Job::ScopeReachesParent(v1::Scope scope) const {
  // A group of one node is the node: its sidecar answers; a group aggregator answers its group.
  return layout_.covered_nodes() < layout_.SpanOf(scope);
}

RoundKey Job::KeyOf(int32_t index, const v1::Contribution& c) const {
  RoundKey key{c.op(), c.seq(), c.phase()};
  if (c.scope() == v1::SCOPE_GROUP && layout_.keyed_groups()) {
    key.group = index * std::max(1, layout_.member_nodes) / layout_.group_nodes + 1;
  }
  return key;
}

absl::Status Job::ValidateLocked(int32_t index, const v1::Contribution& c, const Round* open,
                                 Actions* out) const {
  auto who = [&] { return MemberName(index); };
  auto round = [&] { return Describe(RoundKey{c.op(), c.seq(), c.phase()}); };
  auto bad = [&](absl::string_view field, absl::string_view what) {
    return wire::InvalidContribution(who(), round(), field, what);
  };
  if (c.phase() != v1::PHASE_FORWARD && c.phase() != v1::PHASE_BACKWARD) {
    return bad("phase", absl::StrCat("is ", int(c.phase()), "; expected forward or backward"));
  }
  wire::ContributionView view;
  view.scope = c.scope();
  view.channels = c.channels();
  view.count = c.count();
  view.data = c.data().data();
  wire::RoundRules rules;
  rules.forward = c.phase() == v1::PHASE_FORWARD;
  rules.strict_finite = layout_.strict_finite;
  rules.max_channels = limits_.max_channels;
  if (absl::Status s = wire::CheckFields(view, rules, who, round); !s.ok()) return s;
  if (int64_t(c.data().size()) != wire::PayloadBytes(c.channels())) {
    return bad("data", absl::StrCat("holds ", c.data().size(), " bytes; ", c.channels(),
                                    " channels need ", wire::PayloadBytes(c.channels())));
  }
  if (c.scope() == v1::SCOPE_GROUP && layout_.group_nodes <= 0) {
    return bad("scope", absl::StrCat("is group, but job '", id_, "' was joined without a group "
                                     "size: set HSBN_GROUP_NODES (group_nodes) to the nodes per "
                                     "group on every process of the job"));
  }
  if (c.has_decide()) {
    const v1::AutoDecide& d = c.decide();
    if (c.phase() != v1::PHASE_FORWARD || c.scope() != v1::SCOPE_GLOBAL) {
      return bad("decide", "is set on a round that is not a global forward round");
    }
    if (!(d.max_mean_shift() >= 0) || !std::isfinite(d.max_mean_shift()) ||
        !(d.max_log_var_ratio() >= 0) || !std::isfinite(d.max_log_var_ratio()) ||
        d.warmup_rounds() < 0) {
      return bad("decide", absl::StrCat("holds max_mean_shift=", d.max_mean_shift(),
                                        ", max_log_var_ratio=", d.max_log_var_ratio(),
                                        ", warmup_rounds=", d.warmup_rounds(),
                                        "; thresholds are finite and >= 0, warm-up >= 0"));
    }
  }
  if (!layout_.workers() && c.scope() == v1::SCOPE_NODE) {
    return bad("scope", "is node, which only a node's sidecar reduces");
  }
  if (!layout_.workers() && c.scope() == v1::SCOPE_GROUP &&
      layout_.member_nodes >= layout_.group_nodes) {
    return bad("scope", "is group, which the group aggregators reduce; it never reaches the root");
  }
  // NaN and Inf are data (they propagate to every member, as in torch's SyncBatchNorm) unless
  // the job is strict; the values check is the shared-memory path's too (round.h).
  if (CountNonFinite(c.data(), c.phase(), out) > 0 && layout_.strict_finite) {
    out->refused.push_back("strict_nonfinite");
  }
  if (absl::Status s = wire::CheckValues(view, rules, who, round); !s.ok()) return s;
  if (open != nullptr) {
    auto first = [&] { return MemberName(open->first_contributor); };
    if (absl::Status s = wire::CheckSameRound(view, open->channels, open->scope, who, first, round);
        !s.ok()) {
      return s;
    }
    if (c.has_decide() != (open->decide != nullptr) ||
        (c.has_decide() && (c.decide().max_mean_shift() != open->decide->max_mean_shift() ||
                            c.decide().max_log_var_ratio() != open->decide->max_log_var_ratio() ||
                            c.decide().warmup_rounds() != open->decide->warmup_rounds()))) {
      auto text = [](const v1::AutoDecide* d) {
        return d == nullptr ? std::string("no auto-scope decision request")
                            : absl::StrCat("an auto-scope decision request (max_mean_shift=",
                                           d->max_mean_shift(), ", max_log_var_ratio=",
                                           d->max_log_var_ratio(), ", warm-up ",
                                           d->warmup_rounds(), ")");
      };
      return bad("decide", absl::StrCat("is ", text(c.has_decide() ? &c.decide() : nullptr),
                                        " but ", first(), " sent ", text(open->decide.get()),
                                        "; every worker must give an auto-scope layer the same "
                                        "warm-up and thresholds"));
    }
    const Slot& slot = open->slots[index];
    if (slot.filled && (slot.count != c.count() || slot.data != c.data())) {
      return bad("data", "differs from the contribution it already sent to this round "
                         "(a conflicting duplicate)");
    }
  }
  if (ScopeReachesParent(c.scope()) && !limits_.has_parent) {
    return absl::FailedPreconditionError(absl::StrCat(
        who(), " asked for ", wire::ScopeName(c.scope()), " scope in round ", round(),
        ", but job '", id_, "' spans ", layout_.num_nodes,
        " nodes and this sidecar has no root: start it with --upstream=<root address>"));
  }
  return absl::OkStatus();
}

namespace {
std::shared_ptr<const v1::Result> MakeError(const RoundKey& key, const absl::Status& s) {
  return std::make_shared<const v1::Result>(wire::ErrorResult(key.op, key.seq, key.phase, s));
}
}  // namespace

void Job::TellSenderLocked(int32_t index, const SessionId& session, const RoundKey& key,
                           const absl::Status& s, Actions* out) const {
  if (!members_[index].sink) return;
  Actions::Delivery d;
  d.result = MakeError(key, s);
  d.to.emplace_back(session, members_[index].sink);
  out->deliveries.push_back(std::move(d));
}

void Job::FinishLocked(const RoundKey& key, Finished finished) {
  int64_t bytes = finished.result ? int64_t(finished.result->data().size()) : 0;
  // A kept result is memory like any other, and less urgent than round data: kept results may
  // fill at most half the budget. Past that the outcome is kept without the result (a
  // retransmission is then answered RESOURCE_EXHAUSTED), so no job's kept results can crowd
  // out the rounds of other jobs.
  if (bytes > 0 && limits_.budget &&
      !limits_.budget->TryChargeWithin(bytes, limits_.budget->limit() / 2)) {
    finished.status = absl::ResourceExhaustedError(absl::StrCat(
        "round ", Describe(key), " of job '", id_, "' completed, but its result was not kept "
        "for retransmissions: the aggregator's memory budget (--memory-budget-bytes) is full"));
    finished.result.reset();
    finished.contribution_hashes.clear();
    bytes = 0;
  }
  // The small rest (the outcome and the hashes) is bookkeeping, accounted for and never refused.
  const int64_t rest =
      int64_t(finished.contribution_hashes.size() * sizeof(uint64_t) + sizeof(Finished));
  if (limits_.budget) limits_.budget->Charge(rest);
  finished.charged = bytes + rest;
  held_ += finished.charged;
  auto [it, inserted] = finished_.emplace(key, std::move(finished));
  if (!inserted) {
    ReleaseLocked(finished.charged);
    return;
  }
  finished_order_.push_back(key);
  finished_bytes_ += bytes;
  while (!finished_order_.empty() &&
         (int64_t(finished_order_.size()) > limits_.finished_rounds_kept ||
          finished_bytes_ > limits_.finished_bytes_kept)) {
    auto old = finished_.find(finished_order_.front());
    if (old != finished_.end()) {
      if (old->second.result) finished_bytes_ -= int64_t(old->second.result->data().size());
      ReleaseLocked(old->second.charged);
      finished_.erase(old);
    }
    finished_order_.pop_front();
  }
}

void Job::FailRoundLocked(RoundKey key, const absl::Status& status, bool tell_parent,
                          Actions* out, v1::Scope scope) {
  auto error = MakeError(key, status);
  auto it = open_.find(key);
  out->outcomes.push_back(Actions::Outcome{it != open_.end() ? it->second.scope : scope,
                                           key.phase, status.code(),
                                           it != open_.end() ? it->second.opened
                                                             : Clock::time_point{}});
  if (it != open_.end()) {
    Actions::Delivery d;
    d.result = error;
    for (size_t i = 0; i < it->second.slots.size(); ++i) {
      if (it->second.slots[i].filled && members_[i].sink) {
        d.to.emplace_back(members_[i].session, members_[i].sink);
      }
    }
    if (!d.to.empty()) out->deliveries.push_back(std::move(d));
    // The round's scope, or the failing contribution's: a node whose ranks disagree on node and
    // global scope must tell the root, where the other nodes' global partials wait for it.
    if (tell_parent && limits_.has_parent &&
        (ScopeReachesParent(it->second.scope) ||
         (scope != v1::SCOPE_UNSPECIFIED && ScopeReachesParent(scope)))) {
      out->aborts.push_back(Actions::Abort{key, status});
    }
    EraseOpenLocked(it);
  } else if (tell_parent && limits_.has_parent && ScopeReachesParent(scope)) {
    // The round never opened here (rejected first contribution). Other nodes may be waiting.
    // (A node-scope round never reaches the root; an unknown scope might.)
    out->aborts.push_back(Actions::Abort{key, status});
  }
  ++rounds_failed_;
  out->round_failures.push_back(
      absl::StrCat("job '", id_, "': round ", Describe(key), " failed: ", status.ToString()));
  FinishLocked(key, Finished{status, nullptr, {}});
  if (key.phase == v1::PHASE_FORWARD) {
    // A lagged backward round re-centred on this forward's mean cannot complete without it.
    const RoundKey backward{key.op, key.seq, v1::PHASE_BACKWARD, key.group};
    if (auto b = open_.find(backward);
        b != open_.end() && b->second.scope == v1::SCOPE_LAGGED) {
      FailRoundLocked(backward,
                      wire::WithMessage(status, absl::StrCat("round ", Describe(backward), ": its "
                                                             "forward round failed: ",
                                                             status.message())),
                      tell_parent, out);
    }
  }
}

void Job::DeliverLocked(const Round& round, std::shared_ptr<const v1::Result> result,
                        Actions* out) {
  Actions::Delivery d;
  d.result = std::move(result);
  for (size_t i = size_t(round.lo); i < size_t(round.hi); ++i) {
    if (members_[i].sink) d.to.emplace_back(members_[i].session, members_[i].sink);
  }
  if (!d.to.empty()) out->deliveries.push_back(std::move(d));
}

void Job::SendFinishedLocked(int32_t index, const SessionId& session, const RoundKey& key,
                             const Finished& finished, Actions* out) {
  const Member& m = members_[index];
  if (!m.sink) return;
  Actions::Delivery d;
  d.result = finished.status.ok() && finished.result ? finished.result
                                                     : MakeError(key, finished.status);
  d.to.emplace_back(session, m.sink);
  out->deliveries.push_back(std::move(d));
}

bool Job::Contribute(int32_t index, const SessionId& session, const v1::Contribution& c,
                     Clock::time_point now, Actions* out) {
  absl::MutexLock lock(&mu_);
  if (!members_[index].joined || members_[index].session != session) return false;
  const RoundKey key = KeyOf(index, c);
  if (!closed_.ok()) {
    TellSenderLocked(index, session, key, closed_, out);
    return true;
  }
  if (auto f = finished_.find(key); f != finished_.end()) {
    AnswerRepeatLocked(index, session, key, c, f->second, out);
    return true;
  }
  auto it = open_.find(key);
  Round* open = it == open_.end() ? nullptr : &it->second;
  if (!AdmitLocked(index, session, key, c, open, out)) return true;
  ++members_[index].contributions;
  if (open == nullptr) open = OpenRoundLocked(index, session, key, c, now, out);
  if (open != nullptr) FillSlotLocked(*open, index, session, c, out);
  return true;
}

void Job::AnswerRepeatLocked(int32_t index, const SessionId& session, const RoundKey& key,
                             const v1::Contribution& c, const Finished& finished, Actions* out) {
  const auto& hashes = finished.contribution_hashes;
  if (finished.status.ok() && size_t(index) < hashes.size() &&
      hashes[index] != ContributionHash(c.count(), c.data())) {
    // Not a retransmission: the same key was reused for new data. Answering with the old
    // result would be silently wrong.
    TellSenderLocked(index, session, key,
                     absl::InvalidArgumentError(absl::StrCat(
                         MemberName(index), " sent a new contribution to round ", Describe(key),
                         " of job '", id_, "', which already completed with a different "
                         "contribution from it. Round keys (op, seq, phase) must not be reused "
                         "in a job: count seq up on every call of a layer, or use a new "
                         "HSBN_JOB_ID for a new run")),
                     out);
    return;
  }
  SendFinishedLocked(index, session, key, finished, out);  // late or repeated contribution
}

bool Job::AdmitLocked(int32_t index, const SessionId& session, const RoundKey& key,
                      const v1::Contribution& c, const Round* open, Actions* out) {
  absl::Status valid = ValidateLocked(index, c, open, out);
  if (valid.ok() && open == nullptr && layout_.keyed_groups()) {
    // At the root a group round and a round of another scope under the same (op, seq, phase)
    // have different keys: catch the scope mismatch here rather than at the deadline.
    auto sibling = open_.lower_bound(RoundKey{key.op, key.seq, key.phase, 0});
    if (sibling != open_.end() && sibling->first.op == key.op && sibling->first.seq == key.seq &&
        sibling->first.phase == key.phase && sibling->second.scope != c.scope()) {
      valid = wire::DiffersFromFirst(MemberName(index), Describe(key), "scope",
                                     wire::ScopeName(c.scope()),
                                     MemberName(sibling->second.first_contributor),
                                     wire::ScopeName(sibling->second.scope));
      FailRoundLocked(sibling->first, valid, /*tell_parent=*/true, out);
    }
  }
  if (!valid.ok()) {
    // The sender gets the error even if it has no slot in the open round (FailRoundLocked
    // answers the members whose slots are filled).
    if (open == nullptr || !open->slots[index].filled) {
      TellSenderLocked(index, session, key, valid, out);
    }
    FailRoundLocked(key, valid, /*tell_parent=*/true, out, c.scope());
    return false;
  }
  if (c.scope() == v1::SCOPE_LAGGED && c.phase() == v1::PHASE_BACKWARD &&
      (open == nullptr || !open->slots[index].filled)) {
    // Refused to its sender only: the round goes on for the others (and completes if the
    // sender contributes again, correctly); other members' forwards are not its fault.
    if (absl::Status s = CheckLaggedBackwardLocked(index, c); !s.ok()) {
      out->round_failures.push_back(absl::StrCat("job '", id_, "': refused a contribution to "
                                                 "round ", Describe(key), ": ", s.ToString()));
      TellSenderLocked(index, session, key, s, out);
      return false;
    }
  }
  return true;
}

void Job::RefuseLocked(int32_t index, const SessionId& session, const RoundKey& key,
                       v1::Scope scope, const absl::Status& status, Actions* out) {
  TellSenderLocked(index, session, key, status, out);
  FailRoundLocked(key, status, /*tell_parent=*/true, out, scope);
}

Job::Round* Job::OpenRoundLocked(int32_t index, const SessionId& session, const RoundKey& key,
                                 const v1::Contribution& c, Clock::time_point now,
                                 Actions* out) {
  int32_t lo = 0, hi = int32_t(members_.size());
  if (key.group > 0) {
    const int32_t per_group = layout_.group_nodes / std::max(1, layout_.member_nodes);
    lo = (key.group - 1) * per_group;
    hi = lo + per_group;
  }
  if (absl::Status s = BlockedLocked(key, lo, hi); !s.ok()) {
    RefuseLocked(index, session, key, c.scope(), s, out);
    return nullptr;
  }
  if (int32_t(open_.size()) >= limits_.max_open_rounds) {
    RefuseLocked(index, session, key, c.scope(),
                 absl::ResourceExhaustedError(absl::StrCat(
                     "job '", id_, "' already has ", open_.size(),
                     " rounds in flight, the limit (--max-open-rounds); round ", Describe(key),
                     " was refused. Workers are out of step: some run far ahead of others")),
                 out);
    return nullptr;
  }
  const int64_t bytes = int64_t(sizeof(Round) + members_.size() * sizeof(Slot));
  if (!ChargeLocked(bytes)) {
    out->refused.push_back("memory_budget");
    RefuseLocked(index, session, key, c.scope(),
                 absl::ResourceExhaustedError(absl::StrCat(
                     "aggregator memory budget exhausted (--memory-budget-bytes): round ",
                     Describe(key), " of job '", id_, "' cannot open; jobs on this aggregator "
                     "hold too much round data")),
                 out);
    return nullptr;
  }
  Round round;
  round.key = key;
  round.scope = c.scope();
  round.channels = c.channels();
  round.first_contributor = index;
  round.slots.resize(members_.size());
  round.lo = lo;
  round.hi = hi;
  if (c.has_decide()) round.decide = std::make_shared<const v1::AutoDecide>(c.decide());
  round.charged = bytes;
  round.opened = now;
  round.deadline = now + limits_.round_timeout;
  return &open_.emplace(key, std::move(round)).first->second;
}

void Job::FillSlotLocked(Round& open, int32_t index, const SessionId& session,
                         const v1::Contribution& c, Actions* out) {
  Slot& slot = open.slots[index];
  if (slot.filled) return;  // an identical repeat of what it sent before
  if (!ChargeLocked(int64_t(c.data().size()))) {
    out->refused.push_back("memory_budget");
    RefuseLocked(index, session, open.key, c.scope(),
                 absl::ResourceExhaustedError(absl::StrCat(
                     "aggregator memory budget exhausted (--memory-budget-bytes): the "
                     "contribution of ", MemberName(index), " to round ", Describe(open.key),
                     " of job '", id_, "' cannot be held; jobs on this aggregator hold too "
                     "much round data")),
                 out);
    return;
  }
  open.charged += int64_t(c.data().size());
  slot.filled = true;
  slot.count = c.count();
  slot.data = c.data();
  if (++open.filled == open.hi - open.lo) CompleteLocked(open, out);
}

void Job::CompleteLocked(Round& round, Actions* out) {
  const bool lagged_backward =
      round.scope == v1::SCOPE_LAGGED && round.key.phase == v1::PHASE_BACKWARD;
  const LaggedForward* forward = nullptr;
  if (lagged_backward && !layout_.workers() && !LaggedForwardOfLocked(round, &forward, out)) {
    return;
  }
  round.waits_forward = false;
  const int64_t channels = round.channels;
  std::vector<double> scratch(4 * size_t(channels), 0.0);  // one allocation: a, b, sa, sb
  double* a = scratch.data();
  double* b = a + channels;
  int64_t count = 0;
  wire::ReduceFault fault;
  absl::Status reduced = ReduceSlots(round, forward, scratch.data(), &count, &fault);
  if (lagged_backward) {
    // Its record's last use here (a repeat is answered from finished_).
    auto f = lagged_.find({round.key.op, round.key.seq});
    if (f != lagged_.end()) ForgetLaggedLocked(f);
    forward = nullptr;
  }
  if (!reduced.ok()) {
    out->refused.push_back(fault == wire::ReduceFault::kCountOverflow ? "count_overflow"
                                                                      : "strict_nonfinite");
    FailRoundLocked(round.key, reduced, /*tell_parent=*/true, out);
    return;
  }
  auto result = std::make_shared<v1::Result>();
  result->set_op(round.key.op);
  result->set_seq(round.key.seq);
  result->set_phase(round.key.phase);
  result->set_channels(round.channels);
  result->set_count(count);
  wire::PackPayload(a, b, channels, result->mutable_data());

  const RoundKey key = round.key;
  const bool forwards = ScopeReachesParent(round.scope) && limits_.has_parent;
  if (forwards) {
    out->forwards.push_back(Actions::Forward{key, round.scope, round.channels, count,
                                             std::make_shared<const std::string>(result->data()),
                                             round.decide});
  }
  // After the forward went up: the parent must see this aggregator's forward partial before
  // its backward partial, which may complete in here.
  if (round.scope == v1::SCOPE_LAGGED && key.phase == v1::PHASE_FORWARD) {
    KeepLaggedForwardLocked(round, a, out);
  }
  if (!AnswerNowLocked(round, forwards, result.get(), out)) return;  // the parent answers
  if (round.decide) DecideRoundLocked(round, result.get(), out);
  std::shared_ptr<const v1::Result> shared = result;
  // At the root, shadow partials of sidecars are fire-and-forget: the nodes are not waiting.
  // Group aggregators get the global statistics back, for their per-node record.
  if (!(!layout_.workers() && round.scope == v1::SCOPE_SHADOW && layout_.member_nodes <= 1)) {
    DeliverLocked(round, shared, out);
  }
  ++rounds_completed_;
  out->outcomes.push_back(Actions::Outcome{round.scope, key.phase, absl::StatusCode::kOk,
                                           round.opened});
  std::vector<uint64_t> hashes = HashContributions(round);
  EraseOpenLocked(open_.find(key));
  FinishLocked(key, Finished{absl::OkStatus(), shared, std::move(hashes)});
}

bool Job::LaggedForwardOfLocked(Round& round, const LaggedForward** forward, Actions* out) {
  // Above the sidecars a lagged backward partial is a sum around its member's forward mean;
  // the members' sums are re-centred on this aggregator's forward mean before they are added.
  auto f = lagged_.find({round.key.op, round.key.seq});
  if (f == lagged_.end()) {
    round.waits_forward = true;  // KeepLaggedForwardLocked completes it
    return false;
  }
  if (!f->second.status.ok()) {
    FailRoundLocked(round.key, f->second.status, /*tell_parent=*/true, out);
    return false;
  }
  *forward = &f->second;
  return true;
}

absl::Status Job::ReduceSlots(const Round& round, const LaggedForward* forward, double* scratch,
                              int64_t* count, wire::ReduceFault* fault) const {
  const int64_t channels = round.channels;
  double* a = scratch;
  double* b = a + channels;
  double* sa = b + channels;
  double* sb = sa + channels;
  // Fixed order: member index lo, lo + 1, ... — the same bits for every member and every rerun,
  // and the same reduction as the shared-memory node path (round.h).
  return wire::ReduceRound(
      round.key.phase == v1::PHASE_FORWARD, channels, int(round.hi - round.lo),
      [&](int i) { return round.slots[size_t(round.lo + i)].count; },
      [&](int i, const double** ai, const double** bi) {
        const Slot& slot = round.slots[size_t(round.lo + i)];
        wire::UnpackPayload(slot.data, channels, sa, sb);
        if (forward != nullptr) {
          // sum dy (x - center) = sum dy (x - mean_i) + (mean_i - center) sum dy
          const double* mean_i = forward->means.data() + size_t(round.lo + i) * size_t(channels);
          const double* center = forward->center.data();
          for (int64_t ch = 0; ch < channels; ++ch) sb[ch] += (mean_i[ch] - center[ch]) * sa[ch];
        }
        *ai = sa;
        *bi = sb;
        return slot.count;
      },
      [&](int i) { return MemberName(round.lo + i); }, layout_.strict_finite,
      [&] { return wire::RoundRef{Describe(round.key), id_}; }, a, b, count, fault);
}

bool Job::AnswerNowLocked(Round& round, bool forwards, v1::Result* result, Actions* out) {
  // At a sidecar, shadow, renorm and lagged rounds are answered with the node's statistics at
  // once; the global result of a renorm or lagged round follows as a late result
  // (DeliverLateLocked). Above the sidecars, a forwarded round waits for the parent's result:
  // shadow rounds too, whose global statistics a group aggregator needs for its per-node record.
  const bool late_scope = round.scope == v1::SCOPE_RENORM || round.scope == v1::SCOPE_LAGGED;
  const bool answered_now =
      layout_.workers() && (round.scope == v1::SCOPE_SHADOW || late_scope);
  if (forwards && !answered_now) {
    round.forwarded = true;
    // The root's own deadline for this round fires first (its round opened no later than
    // ours was forwarded), and its error names the missing nodes and ranks; ours is only the
    // backstop for a parent that does not answer at all.
    round.deadline = Clock::now() + wire::ForwardedBackstop(limits_.round_timeout);
    return false;
  }
  if (forwards) {
    result->set_scope(v1::SCOPE_NODE);  // answer with the node's statistics now
    if (late_scope) ExpectLateLocked(round.key, round.channels, Clock::now());
  } else if (late_scope && layout_.workers()) {
    // A job of one node: the node's statistics are the job's; its clients keep this answer as
    // the round's global statistics too, so no late result is sent.
    result->set_scope(v1::SCOPE_NODE);
  } else {
    result->set_scope(round.scope);
  }
  if (!forwards && !layout_.workers() &&
      (round.scope == v1::SCOPE_SHADOW || late_scope) && round.key.phase == v1::PHASE_FORWARD) {
    RecordDivergenceLocked(round, *result, out);
  }
  return true;
}

void Job::DecideRoundLocked(const Round& round, v1::Result* result, Actions* out) {
  if (layout_.workers()) {
    // One node: node (group) and global are the same statistics.
    v1::AutoDecision* d = result->mutable_decision();
    d->set_scope(layout_.group_nodes > 0 ? v1::SCOPE_GROUP : v1::SCOPE_NODE);
    return;
  }
  *result->mutable_decision() = DecideLocked(round.key.op, *round.decide);
  out->log.push_back(absl::StrCat(
      "job '", id_, "': auto scope of op ", round.key.op, " decided at seq ", round.key.seq, ": ",
      wire::ScopeName(result->decision().scope()), " (largest average mean shift ",
      result->decision().mean_shift(), ", |log var ratio| ", result->decision().log_var_ratio(),
      ", over ", result->decision().rounds(), " shadow rounds)"));
}

bool Job::NodeDown(std::string* message) const {
  absl::MutexLock lock(&mu_);
  if (reported_down_ && message) *message = down_message_;
  return reported_down_;
}

absl::Status Job::BlockedLocked(const RoundKey& key, int32_t lo, int32_t hi) const {
  if (!refused_.ok()) return refused_;
  for (size_t i = size_t(lo); i < size_t(hi); ++i) {
    if (members_[i].gone && !members_[i].aborted.empty()) {
      return wire::MemberAborted(wire::RoundRef{Describe(key), id_}, MemberName(int32_t(i)),
                                 members_[i].aborted);
    }
    if (members_[i].gone) {
      // A member that took part before and whose stream is gone cannot contribute.
      return wire::MemberGone(wire::RoundRef{Describe(key), id_}, MemberName(int32_t(i)),
                              members_[i].joined ? wire::Gone::kDisconnected : wire::Gone::kLeft);
    }
    if (!members_[i].down.empty()) {
      return wire::MemberDown(wire::RoundRef{Describe(key), id_}, MemberName(int32_t(i)),
                              members_[i].down);
    }
  }
  return absl::OkStatus();
}

void Job::ChildState(int32_t index, const v1::NodeState& state, Actions* out) {
  absl::MutexLock lock(&mu_);
  Member& m = members_.at(index);
  // A group aggregator relays its group's state: down while a node of it is, back when none is.
  const bool relays = limits_.has_parent && !layout_.workers() &&
                      layout_.covered_nodes() < layout_.num_nodes;
  if (state.healthy()) {
    if (!m.down.empty()) {
      out->log.push_back(absl::StrCat("job '", id_, "': ", MemberName(index), " is back"));
    }
    m.down.clear();
    if (relays && reported_down_) {
      bool all_back = true;
      for (const Member& other : members_) all_back = all_back && !other.gone && other.down.empty();
      if (all_back) {
        reported_down_ = false;
        out->node_states.push_back(Actions::NodeState{true, ""});
      }
    }
    return;
  }
  m.down = state.message().empty() ? "a worker there disconnected"
                                    : wire::Printable(state.message(), 512);
  const int failed = FailOpenRoundsLocked(
      [&](const Round& round) {
        return index >= round.lo && index < round.hi && !round.slots[index].filled;
      },
      [&](const RoundKey& key) {
        return wire::MemberDown(wire::RoundRef{Describe(key), id_}, MemberName(index), m.down);
      },
      /*tell_parent=*/true, out);
  out->log.push_back(absl::StrCat("job '", id_, "': ", MemberName(index), " is down (", m.down,
                                  "); ", failed, " open round(s) failed"));
  if (relays && !reported_down_) {
    reported_down_ = true;
    down_message_ = absl::StrCat(MemberName(index), " is down: ", m.down);
    out->node_states.push_back(Actions::NodeState{false, down_message_});
  }
}

template <typename Why>
void Job::FailLateLocked(Why why, Actions* out) {
  std::map<RoundKey, Late> late;
  late.swap(late_);
  for (const auto& [key, l] : late) DeliverLateLocked(key, nullptr, why(key), out);
}

void Job::ParentLost(const absl::Status& status, Actions* out) {
  absl::MutexLock lock(&mu_);
  FailLateLocked([&](const RoundKey&) { return status; }, out);
  FailOpenRoundsLocked([](const Round& round) { return round.forwarded; },
                       [&](const RoundKey&) { return status; }, /*tell_parent=*/false, out);
}

void Job::Retire(const absl::Status& status, Actions* out) {
  absl::MutexLock lock(&mu_);
  FailLateLocked([&](const RoundKey&) { return status; }, out);
  FailOpenRoundsLocked([](const Round&) { return true; },
                       [&](const RoundKey&) { return status; }, /*tell_parent=*/false, out);
}

void Job::Expire(Clock::time_point now, Actions* out) {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<RoundKey, absl::Status>> doomed;
  for (auto& [key, round] : open_) {
    if (round.deadline > now) continue;
    const wire::RoundRef ref{Describe(key), id_};
    if (round.forwarded) {
      out->timed_out.push_back("upstream");
      doomed.emplace_back(key, wire::RootSilent(ref, limits_.round_timeout));
      continue;
    }
    if (round.waits_forward) {
      doomed.emplace_back(key, wire::WithReason(
          absl::DeadlineExceededError(absl::StrCat(
              "round ", ref.round, " of job '", id_, "': every member sent its lagged backward "
              "partial, but the forward round of this op and seq did not complete within ",
              limits_.round_timeout.count(), " ms (--round-timeout-ms); its error names who is "
              "missing")),
          v1::REASON_TIMED_OUT));
      continue;
    }
    std::vector<std::string> missing;
    for (size_t i = size_t(round.lo); i < size_t(round.hi); ++i) {
      if (!round.slots[i].filled) {
        missing.push_back(MemberName(int32_t(i)));
        out->timed_out.push_back(
            layout_.workers()
                ? absl::StrCat("rank ", layout_.node_rank * layout_.local_world_size + int32_t(i))
            : layout_.member_nodes > 1 ? absl::StrCat("group ", i)
                                       : absl::StrCat("node ", layout_.first_node() + int32_t(i)));
      }
    }
    doomed.emplace_back(key, wire::TimedOut(ref, limits_.round_timeout, missing));
  }
  for (auto& [key, status] : doomed) {
    if (open_.count(key)) FailRoundLocked(key, status, /*tell_parent=*/true, out);
  }
  for (auto l = late_.begin(); l != late_.end();) {
    if (l->second.deadline > now) {
      ++l;
      continue;
    }
    out->timed_out.push_back("upstream");
    const wire::RoundRef ref{Describe(l->first), id_};
    DeliverLateLocked(l->first, nullptr,
                      wire::RootSilent(ref, wire::ForwardedBackstop(limits_.round_timeout)), out);
    l = late_.erase(l);
  }
}

void Job::FailAll(const absl::Status& status, Actions* out) {
  absl::MutexLock lock(&mu_);
  closed_ = status;
  FailLateLocked([&](const RoundKey&) { return status; }, out);
  FailOpenRoundsLocked([](const Round&) { return true; }, [&](const RoundKey&) { return status; },
                       /*tell_parent=*/false, out);
}

void Job::Refused(const absl::Status& refusal, Actions* out) {
  absl::MutexLock lock(&mu_);
  if (!refused_.ok()) return;
  refused_ = refusal;
  const int failed = FailOpenRoundsLocked([](const Round&) { return true; },
                                          [&](const RoundKey&) { return refusal; },
                                          /*tell_parent=*/true, out);
  out->log.push_back(absl::StrCat(refusal.message(), "; ", failed, " open round(s) failed"));
}

absl::Status Job::refusal() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

void Job::SetToken(const std::string& token) {
  absl::MutexLock lock(&mu_);
  if (token_ && *token_ == token) return;
  token_ = std::make_shared<const std::string>(token);
}

std::shared_ptr<const std::string> Job::token() const {
  absl::MutexLock lock(&mu_);
  return token_;
}

void Job::FillStatus(v1::JobStatus* s) const {
  absl::MutexLock lock(&mu_);
  s->set_job_id(id_);
  s->set_world_size(layout_.world_size);
  s->set_num_nodes(layout_.num_nodes);
  s->set_group_size(layout_.expected_members());
  for (size_t i = 0; i < members_.size(); ++i) {
    v1::MemberStatus* m = s->add_members();
    m->set_index(int32_t(i));
    m->set_rank(layout_.member_kind == v1::MEMBER_KIND_WORKER
                    ? layout_.node_rank * layout_.local_world_size + int32_t(i)
                    : -1);
    m->set_connected(members_[i].connected);
    m->set_contributions(members_[i].contributions);
    m->set_down(members_[i].down);
  }
  s->set_open_rounds(int64_t(open_.size()));
  s->set_late_due(int64_t(late_.size()));
  s->set_lagged_forwards(int64_t(lagged_.size()));
  s->set_late_dropped(late_dropped_);
  s->set_rounds_completed(rounds_completed_);
  s->set_rounds_failed(rounds_failed_);
  s->set_group_nodes(layout_.group_nodes);
  s->set_member_nodes(layout_.member_nodes);
  if (layout_.group >= 0) s->set_group(layout_.group);
  auto fill = [&](const std::pair<uint32_t, int32_t>& k, const DivergenceAcc& acc,
                  v1::Divergence* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    d->set_op(k.first);
    if (auto name = names_.find(k.first); name != names_.end()) d->set_layer(name->second);
    d->set_node(k.second);
    d->set_rounds(acc.rounds);
    const double n = double(std::max<int64_t>(acc.rounds, 1));
    d->set_mean_shift_avg(acc.mean_shift_sum / n);
    d->set_mean_shift_max(acc.mean_shift_max);
    d->set_var_ratio_avg(acc.var_ratio_sum / n);
    d->set_log_var_ratio_abs_avg(acc.log_var_ratio_abs_sum / n);
  };
  for (const auto& [k, acc] : divergence_) fill(k, acc, s->add_divergence());
  for (const auto& [k, acc] : group_divergence_) fill(k, acc, s->add_group_divergence());
  for (const auto& [op, trip] : trips_) {
    v1::LaggedTripStatus* t = s->add_lagged_trips();
    *t = trip;
    if (auto name = names_.find(op); name != names_.end()) t->set_layer(name->second);
  }
}

}  // namespace hsbn::server

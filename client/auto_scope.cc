#include "auto_scope.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "wire.h"

namespace hsbn::client_internal {

absl::Status AutoScopes::SetPolicy(uint32_t op, const AutoPolicy& policy) {
  if (absl::Status s = policy.Validate(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  AutoOp& a = ops_[op];
  const AutoPolicy& now = a.has_policy ? a.policy : default_policy_;
  const bool same = now.warmup_rounds == policy.warmup_rounds &&
                    now.max_mean_shift == policy.max_mean_shift &&
                    now.max_log_var_ratio == policy.max_log_var_ratio &&
                    now.recheck_every == policy.recheck_every;
  if (a.started && !same) {
    return absl::FailedPreconditionError(absl::StrCat(
        "auto scope of op ", op, ": its policy cannot change after its first round"));
  }
  a.policy = policy;
  a.has_policy = true;
  return absl::OkStatus();
}

AutoDecision AutoScopes::DecisionOf(uint32_t op) const {
  absl::MutexLock lock(&mu_);
  auto it = ops_.find(op);
  return it == ops_.end() ? AutoDecision{} : it->second.last;
}

absl::Status AutoScopes::SetDecision(uint32_t op, Scope scope) {
  if (scope != Scope::kNode && scope != Scope::kGroup && scope != Scope::kGlobal) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto scope of op ", op, ": a decision is node, group or global, not ",
        ScopeName(scope)));
  }
  if (scope == Scope::kGroup && group_nodes_ <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "auto scope of op ", op, ": the saved decision is group, but this job has no groups "
        "(HSBN_GROUP_NODES is not set)"));
  }
  absl::MutexLock lock(&mu_);
  AutoOp& a = ops_[op];
  if (a.open_decide >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "auto scope of op ", op, ": its decision round (seq ", a.open_decide,
        ") is in flight"));
  }
  a.epochs.clear();
  a.epochs.push_back(Epoch{-1, scope});
  a.last = AutoDecision{};
  a.last.decided = true;
  a.last.scope = scope;
  return absl::OkStatus();
}

absl::Status AutoScopes::Resolve(uint32_t op, uint64_t seq_u, Phase phase, Scope* scope,
                                bool* decide, v1::AutoDecide* request) {
  absl::MutexLock lock(&mu_);
  AutoOp& a = ops_[op];
  a.started = true;
  const AutoPolicy& policy = a.has_policy ? a.policy : default_policy_;
  const int64_t seq = int64_t(seq_u & ((uint64_t(1) << 62) - 1));
  const bool forward = phase == Phase::kForward;
  const Scope sample = forward ? Scope::kShadow : Scope::kNode;  // shadow's answer is node's
  auto decision_round = [&]() -> absl::Status {
    if (a.open_decide >= 0 && a.open_decide != seq) {
      return absl::FailedPreconditionError(absl::StrCat(
          "auto scope of op ", op, ": round seq ", seq, " started before the decision round "
          "(seq ", a.open_decide, ") was waited for; wait for it first, so that every rank "
          "uses the same decision"));
    }
    *scope = Scope::kGlobal;
    if (forward) {
      *decide = true;
      request->set_max_mean_shift(policy.max_mean_shift);
      request->set_max_log_var_ratio(policy.max_log_var_ratio);
      request->set_warmup_rounds(policy.warmup_rounds);
      a.open_decide = seq;
    }
    return absl::OkStatus();
  };
  // The decision that governs seq: the last one made before it.
  const Epoch* epoch = nullptr;
  for (const Epoch& e : a.epochs) {
    if (e.decided_at < seq) epoch = &e;
    if (e.decided_at == seq) {  // the decision round itself (its backward, a retransmission)
      *scope = Scope::kGlobal;
      return absl::OkStatus();
    }
  }
  if (epoch == nullptr) {
    if (seq < policy.warmup_rounds) {
      *scope = sample;
      return absl::OkStatus();
    }
    return decision_round();
  }
  if (policy.recheck_every > 0) {
    const int64_t k = seq - std::max<int64_t>(epoch->decided_at, 0);
    if (k > 0 && k % policy.recheck_every == 0) {
      const int64_t j = k / policy.recheck_every;
      if (j <= policy.warmup_rounds) {
        *scope = sample;
        return absl::OkStatus();
      }
      if (j == policy.warmup_rounds + 1) return decision_round();
    }
  }
  if (a.open_decide >= 0 && a.open_decide < seq && forward) return decision_round();
  *scope = epoch->scope;
  return absl::OkStatus();
}

absl::Status AutoScopes::Take(uint32_t op, uint64_t seq, const Answer& answer, absl::Status s) {
  absl::MutexLock lock(&mu_);
  AutoOp& a = ops_[op];
  if (a.open_decide == int64_t(seq)) a.open_decide = -1;
  if (!s.ok()) return s;
  const v1::Scope got = answer.decision.scope();
  if (!answer.has_decision ||
      (got != v1::SCOPE_NODE && got != v1::SCOPE_GLOBAL &&
       !(got == v1::SCOPE_GROUP && group_nodes_ > 0))) {
    return absl::InternalError(absl::StrCat(
        "round ", wire::RoundName(op, seq, v1::PHASE_FORWARD), ": the aggregator answered "
        "the auto-scope decision round without a valid decision; check that the sidecars and "
        "the root run the same hsbn version as this client"));
  }
  const Scope decided = Scope(int(got));
  a.epochs.push_back(Epoch{int64_t(seq), decided});
  if (a.epochs.size() > 8) a.epochs.erase(a.epochs.begin());
  a.last.decided = true;
  a.last.scope = decided;
  a.last.mean_shift = answer.decision.mean_shift();
  a.last.log_var_ratio = answer.decision.log_var_ratio();
  a.last.rounds = answer.decision.rounds();
  a.last.decided_at = int64_t(seq);
  return s;
}

}  // namespace hsbn::client_internal

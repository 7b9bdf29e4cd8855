// client/auto_scope.h — auto scope on the worker (docs/PROTOCOL.md, "Auto scope"): which wire
// scope each round of an auto-scope layer takes, and the decisions the root made for it.
//
// A round's wire scope is a pure function of its seq and the op's decisions so far, so every
// rank of the job picks the same: shadow (node) rounds during a warm-up, then a decision round
// (global, carrying the policy) whose answer names the scope until the next re-check.
//
// Thread safety: all methods are thread-safe (one leaf lock).
#ifndef HSBN_CLIENT_AUTO_SCOPE_H_
#define HSBN_CLIENT_AUTO_SCOPE_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "hsbn/client.h"
#include "hsbn/v1/hsbn.pb.h"
#include "result.h"

namespace hsbn::client_internal {

class AutoScopes {
 public:
  // `default_policy`: an op's policy until SetPolicy gives it its own; `group_nodes`: the job's
  // group size (0: no groups, so a decision is node or global).
  AutoScopes(AutoPolicy default_policy, int32_t group_nodes)
      : default_policy_(default_policy), group_nodes_(group_nodes) {}

  // Client::SetAutoPolicy, Client::AutoDecisionOf, Client::SetAutoDecision.
  absl::Status SetPolicy(uint32_t op, const AutoPolicy& policy) ABSL_LOCKS_EXCLUDED(mu_);
  AutoDecision DecisionOf(uint32_t op) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetDecision(uint32_t op, Scope scope) ABSL_LOCKS_EXCLUDED(mu_);
  // The wire scope of auto-scope round (op, seq, phase) in *scope. Sets *decide (and *request)
  // on a decision round's forward. FAILED_PRECONDITION for a round started before the op's
  // decision round was waited for.
  absl::Status Resolve(uint32_t op, uint64_t seq, Phase phase, Scope* scope, bool* decide,
                       v1::AutoDecide* request) ABSL_LOCKS_EXCLUDED(mu_);
  // Decision round (op, seq) was waited for, ending with `s` and `answer`: keeps its decision
  // (the same in every rank's answer). Returns s, or INTERNAL for an answer without a valid
  // decision.
  absl::Status Take(uint32_t op, uint64_t seq, const Answer& answer, absl::Status s)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Epoch {
    int64_t decided_at;
    Scope scope;
  };
  struct AutoOp {
    AutoPolicy policy;
    bool has_policy = false;
    bool started = false;        // it made a round: its policy is fixed
    std::vector<Epoch> epochs;   // in seq order, the last few
    int64_t open_decide = -1;    // seq of a decision round started and not waited for
    AutoDecision last;
  };

  const AutoPolicy default_policy_;
  const int32_t group_nodes_;
  mutable absl::Mutex mu_;  // a leaf lock
  std::map<uint32_t, AutoOp> ops_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsbn::client_internal

#endif  // HSBN_CLIENT_AUTO_SCOPE_H_

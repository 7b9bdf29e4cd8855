// The client's options and where they come from (the environment table, env.h), scope names,
// and the arithmetic of its statistics: what hsbn/client.h declares outside Client itself.
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "env.h"
#include "hsbn/client.h"
#include "result.h"
#include "wire.h"

namespace hsbn {

static_assert(int(Scope::kNode) == 1 && int(Scope::kLagged) == wire::kScopeCount,
              "hsbn::Scope is wire::kScopes' API values");

const char* ScopeName(Scope scope) {
  const wire::ScopeEntry* e = wire::ScopeByApi(int(scope));
  return e == nullptr ? "unknown-scope" : e->name;
}

absl::StatusOr<Scope> ParseScope(const std::string& name) {
  const wire::ScopeEntry* e = wire::ScopeByName(name);
  if (e == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("scope '", wire::Printable(name),
                                                   "' is not one of ", wire::ScopeNames()));
  }
  return Scope(e->api);
}

absl::Status AutoPolicy::Validate() const {
  if (warmup_rounds < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto scope: warmup_rounds (HSBN_AUTO_WARMUP) is ", warmup_rounds,
        "; the decision needs at least 1 shadow round"));
  }
  if (!(max_mean_shift >= 0) || !std::isfinite(max_mean_shift)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto scope: max_mean_shift (HSBN_AUTO_MAX_MEAN_SHIFT) is ", max_mean_shift,
        "; it must be a finite number >= 0"));
  }
  if (!(max_log_var_ratio >= 0) || !std::isfinite(max_log_var_ratio)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto scope: max_log_var_ratio (HSBN_AUTO_MAX_LOG_VAR_RATIO) is ", max_log_var_ratio,
        "; it must be a finite number >= 0"));
  }
  if (recheck_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto scope: recheck_every (HSBN_AUTO_RECHECK_EVERY) is ", recheck_every,
        "; 0 (never) or a number of rounds"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ClientOptions> ClientOptions::FromEnv() { return FromEnv(env::Source::Process()); }

absl::StatusOr<ClientOptions> ClientOptions::FromEnv(const env::Source& source) {
  ClientOptions o;
  const std::pair<const char*, int32_t*> fields[] = {{"RANK", &o.rank},
                                                      {"WORLD_SIZE", &o.world_size},
                                                      {"LOCAL_RANK", &o.local_rank},
                                                      {"LOCAL_WORLD_SIZE", &o.local_world_size},
                                                      {"GROUP_RANK", &o.node_rank}};
  for (auto& [name, field] : fields) {
    absl::StatusOr<int64_t> v = env::Int(source, name);  // within int32 (the table's range)
    if (!v.ok()) return v.status();
    *field = int32_t(*v);
  }
  absl::StatusOr<std::string> text = env::Resolve(source, "HSBN_JOB_ID");
  if (!text.ok()) return text.status();
  o.job_id = *text;
  if (text = env::Resolve(source, "HSBN_ADDRESS"); !text.ok()) return text.status();
  o.address = *text;
  absl::StatusOr<int64_t> v = env::Int(source, "HSBN_ROUND_TIMEOUT_MS");
  if (!v.ok()) return v.status();
  o.round_timeout = std::chrono::milliseconds(*v);
  if (v = env::Int(source, "HSBN_CONNECT_TIMEOUT_MS"); !v.ok()) return v.status();
  if (*v > 0) o.connect_timeout = std::chrono::milliseconds(*v);  // 0: the default
  if (text = env::Resolve(source, "HSBN_TOKEN"); !text.ok()) return text.status();
  o.token = *text;
  absl::StatusOr<bool> strict = env::Flag(source, "HSBN_STRICT_FINITE");
  if (!strict.ok()) return strict.status();
  o.strict_finite = *strict;
  if (v = env::Int(source, "HSBN_GROUP_NODES"); !v.ok()) return v.status();
  o.group_nodes = int32_t(*v);
  if (absl::Status s = AutoPolicyFromEnv(source, &o.auto_policy); !s.ok()) return s;
  if (absl::Status s = IncarnationFromEnv(source, &o.incarnation); !s.ok()) return s;
  if (text = env::Resolve(source, "HSBN_TRANSPORT"); !text.ok()) return text.status();
  o.transport = *text;
  if (absl::Status s = DebugFromEnv(source, &o); !s.ok()) return s;
  if (absl::Status s = o.Validate(); !s.ok()) return s;
  return o;
}

absl::Status DebugFromEnv(const env::Source& source, ClientOptions* options) {
  absl::StatusOr<std::string> level = env::Resolve(source, "HSBN_DEBUG");
  if (!level.ok()) return level.status();
  absl::StatusOr<int64_t> slow = env::Int(source, "HSBN_DEBUG_SLOW_MS");
  if (!slow.ok()) return slow.status();
  options->debug = *level == "INFO";
  options->debug_slow = std::chrono::milliseconds(*slow);
  return absl::OkStatus();
}

absl::Status IncarnationFromEnv(uint64_t* incarnation) {
  return IncarnationFromEnv(env::Source::Process(), incarnation);
}

absl::Status IncarnationFromEnv(const env::Source& source, uint64_t* incarnation) {
  absl::StatusOr<int64_t> v = env::Int(source, "HSBN_INCARNATION");
  if (!v.ok()) return v.status();
  *incarnation = uint64_t(*v);
  return absl::OkStatus();
}

absl::Status AutoPolicyFromEnv(AutoPolicy* policy) {
  return AutoPolicyFromEnv(env::Source::Process(), policy);
}

absl::Status AutoPolicyFromEnv(const env::Source& source, AutoPolicy* policy) {
  absl::StatusOr<int64_t> i = env::Int(source, "HSBN_AUTO_WARMUP");
  if (!i.ok()) return i.status();
  policy->warmup_rounds = *i;
  absl::StatusOr<double> d = env::Number(source, "HSBN_AUTO_MAX_MEAN_SHIFT");
  if (!d.ok()) return d.status();
  policy->max_mean_shift = *d;
  if (d = env::Number(source, "HSBN_AUTO_MAX_LOG_VAR_RATIO"); !d.ok()) return d.status();
  policy->max_log_var_ratio = *d;
  if (i = env::Int(source, "HSBN_AUTO_RECHECK_EVERY"); !i.ok()) return i.status();
  policy->recheck_every = *i;
  return absl::OkStatus();
}

absl::Status ClientOptions::Validate() const {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id (HSBN_JOB_ID) is empty");
  if (address.empty()) return absl::InvalidArgumentError("address (HSBN_ADDRESS) is empty");
  if (absl::Status s = env::CheckAddress(address, "HSBN_ADDRESS"); !s.ok()) return s;
  if (connect_timeout.count() < 0 || connect_timeout.count() > client_internal::kMaxWaitMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "connect_timeout (HSBN_CONNECT_TIMEOUT_MS) is ", connect_timeout.count(),
        " ms; it must be within [0, ", client_internal::kMaxWaitMs, "]"));
  }
  if (absl::Status s = auto_policy.Validate(); !s.ok()) return s;
  if (!transport.empty() && transport != "auto" && transport != "grpc") {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport (HSBN_TRANSPORT) is '", wire::Printable(transport, 64),
        "'; expected auto (shared memory where the node can use it) or grpc"));
  }
  return wire::CheckWorkerLayout(rank, world_size, local_rank, local_world_size, node_rank,
                                 /*max_world_size=*/0, group_nodes);
}

RoundStats& RoundStats::operator+=(const RoundStats& other) {
  completed += other.completed;
  failed += other.failed;
  blocked_seconds += other.blocked_seconds;
  if (other.max_blocked_seconds > max_blocked_seconds) {
    max_blocked_seconds = other.max_blocked_seconds;
  }
  return *this;
}

RoundStats ClientStats::of(Scope scope) const {
  RoundStats sum;
  for (int pi = 0; pi < kPhases; ++pi) sum += rounds[int(scope) - 1][pi];
  return sum;
}

RoundStats ClientStats::total() const {
  RoundStats sum;
  for (const auto& row : rounds) {
    for (const RoundStats& r : row) sum += r;
  }
  return sum;
}

}  // namespace hsbn

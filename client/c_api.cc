// The C ABI (hsbn.h) over hsbn::Client.
#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "env.h"
#include "hsbn/client.h"
#include "hsbn/hsbn.h"
#include "hsbn/status.h"
#include "hsbn/v1/hsbn.pb.h"
#include "wire.h"

struct hsbn_client {
  std::unique_ptr<hsbn::Client> client;
};

struct hsbn_round {
  hsbn_client* client;
  std::shared_ptr<hsbn::PendingRound> pending;
};

namespace {

thread_local std::string g_last_error;
thread_local int g_last_reason = 0;  // valid while g_last_error is not empty

hsbn_result Fail(const absl::Status& status) {
  g_last_error = std::string(status.message());
  g_last_reason = int(hsbn::wire::ReasonOf(status));
  return static_cast<hsbn_result>(int(status.code()));
}

hsbn_result Done(const absl::Status& status) {
  if (status.ok()) return HSBN_OK;
  return Fail(status);
}

// Writes `text` NUL-terminated into buf (cut to buf_len), its full size + 1 into *needed.
hsbn_result CopyOut(const std::string& text, char* buf, size_t buf_len, size_t* needed) {
  if (needed != nullptr) *needed = text.size() + 1;
  if (buf != nullptr && buf_len > 0) {
    const size_t n = std::min(buf_len - 1, text.size());
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return HSBN_OK;
}

const std::string& BadScope() {
  static const std::string* text = new std::string(absl::StrCat(
      "scope must be an hsbn_scope, 1 to ", hsbn::wire::kScopeCount, " (",
      hsbn::wire::ScopeNames(), ")"));
  return *text;
}

hsbn_result Invalid(const char* what) {
  g_last_error = what;
  return HSBN_INVALID_ARGUMENT;
}

bool ToScope(hsbn_scope scope, hsbn::Scope* out) {
  if (hsbn::wire::ScopeByApi(int(scope)) == nullptr) return false;
  *out = static_cast<hsbn::Scope>(int(scope));
  return true;
}
static_assert(HSBN_SCOPE_NODE == 1 && HSBN_SCOPE_LAGGED == hsbn::wire::kScopeCount,
              "hsbn_scope is kScopes' API values");

}  // namespace

extern "C" {

const char* hsbn_result_string(hsbn_result code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int c = int(code);
  return c >= 0 && c <= 16 ? kNames[c] : "UNKNOWN";
}

const char* hsbn_last_error(void) { return g_last_error.c_str(); }

int hsbn_last_error_reason(void) { return g_last_error.empty() ? 0 : g_last_reason; }

const char* hsbn_reason_string(int reason) {
  return hsbn::wire::ReasonName(static_cast<hsbn::v1::Reason>(reason));
}

int hsbn_abi_version(void) { return HSBN_ABI_VERSION; }

void hsbn_options_init(hsbn_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof *options);
  options->struct_size = sizeof *options;
  options->rank = options->world_size = options->local_rank = -1;
  options->local_world_size = options->node_rank = -1;
  options->strict_finite = options->group_nodes = -1;
  options->incarnation = options->auto_warmup = options->auto_recheck_every = -1;
  options->auto_max_mean_shift = options->auto_max_log_var_ratio = -1;
}

hsbn_result hsbn_client_create(const hsbn_options* options, hsbn_client** out) {
  g_last_error.clear();
  if (options == nullptr || out == nullptr) return Invalid("null options or output pointer");
  if (options->struct_size < offsetof(hsbn_options, token) + sizeof(const char*)) {
    return Invalid("hsbn_options.struct_size is too small: call hsbn_options_init first");
  }
  hsbn::ClientOptions o;
  if (options->address != nullptr && *options->address != '\0') o.address = options->address;
  if (options->job_id != nullptr) o.job_id = options->job_id;
  o.rank = options->rank;
  o.world_size = options->world_size;
  o.local_rank = options->local_rank;
  o.local_world_size = options->local_world_size;
  o.node_rank = options->node_rank;
  o.round_timeout = std::chrono::milliseconds(options->round_timeout_ms);
  if (options->connect_timeout_ms > 0) {
    o.connect_timeout = std::chrono::milliseconds(options->connect_timeout_ms);
  }
  if (options->token != nullptr) o.token = options->token;
  // Fields a caller built against an older hsbn.h lacks, and fields left unset, come from the
  // environment, through the one table (client/env.h).
  auto has = [&](size_t offset, size_t size) { return options->struct_size >= offset + size; };
  const hsbn::env::Source source =
      has(offsetof(hsbn_options, env), sizeof(options->env)) && options->env != nullptr
          ? hsbn::env::Source::Entries(options->env)
          : hsbn::env::Source::Process();
  hsbn::ClientOptions defaults;
  if (absl::Status s = hsbn::AutoPolicyFromEnv(source, &defaults.auto_policy); !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s = hsbn::IncarnationFromEnv(source, &defaults.incarnation); !s.ok()) {
    return Fail(s);
  }
  absl::StatusOr<bool> strict = hsbn::env::Flag(source, "HSBN_STRICT_FINITE");
  if (!strict.ok()) return Fail(strict.status());
  absl::StatusOr<int64_t> group_nodes = hsbn::env::Int(source, "HSBN_GROUP_NODES");
  if (!group_nodes.ok()) return Fail(group_nodes.status());
  absl::StatusOr<std::string> transport = hsbn::env::Resolve(source, "HSBN_TRANSPORT");
  if (!transport.ok()) return Fail(transport.status());
  o.strict_finite = *strict;
  if (has(offsetof(hsbn_options, strict_finite), sizeof(int32_t)) && options->strict_finite >= 0) {
    o.strict_finite = options->strict_finite != 0;
  }
  o.group_nodes = int32_t(*group_nodes);
  if (has(offsetof(hsbn_options, group_nodes), sizeof(int32_t)) && options->group_nodes >= 0) {
    o.group_nodes = options->group_nodes;
  }
  o.transport = *transport;
  if (absl::Status s = hsbn::DebugFromEnv(source, &o); !s.ok()) return Fail(s);
  o.incarnation = defaults.incarnation;
  o.auto_policy = defaults.auto_policy;
  if (has(offsetof(hsbn_options, auto_recheck_every), sizeof(int64_t))) {
    if (options->transport != nullptr) o.transport = options->transport;
    if (options->incarnation >= 0) o.incarnation = uint64_t(options->incarnation);
    if (options->auto_warmup >= 0) o.auto_policy.warmup_rounds = options->auto_warmup;
    if (options->auto_max_mean_shift >= 0) {
      o.auto_policy.max_mean_shift = options->auto_max_mean_shift;
    }
    if (options->auto_max_log_var_ratio >= 0) {
      o.auto_policy.max_log_var_ratio = options->auto_max_log_var_ratio;
    }
    if (options->auto_recheck_every >= 0) {
      o.auto_policy.recheck_every = options->auto_recheck_every;
    }
  }
  auto client = hsbn::Client::Connect(o);
  if (!client.ok()) return Fail(client.status());
  *out = new hsbn_client{std::move(*client)};
  return HSBN_OK;
}

hsbn_result hsbn_client_create_from_env(hsbn_client** out) {
  g_last_error.clear();
  if (out == nullptr) return Invalid("null output pointer");
  auto o = hsbn::ClientOptions::FromEnv();
  if (!o.ok()) return Fail(o.status());
  auto client = hsbn::Client::Connect(*o);
  if (!client.ok()) return Fail(client.status());
  *out = new hsbn_client{std::move(*client)};
  return HSBN_OK;
}

void hsbn_client_destroy(hsbn_client* client) { delete client; }

hsbn_result hsbn_env_get(const char* const* env, const char* name, char* buf, size_t buf_len,
                         size_t* needed) {
  g_last_error.clear();
  if (name == nullptr) return Invalid("null variable name");
  const hsbn::env::Source source =
      env != nullptr ? hsbn::env::Source::Entries(env) : hsbn::env::Source::Process();
  absl::StatusOr<std::string> value = hsbn::env::Resolve(source, name);
  if (!value.ok()) return Fail(value.status());
  return CopyOut(*value, buf, buf_len, needed);
}

hsbn_result hsbn_check_address(const char* address, const char* label) {
  g_last_error.clear();
  if (address == nullptr || label == nullptr) return Invalid("null address or label");
  return Done(hsbn::env::CheckAddress(address, label));
}

hsbn_result hsbn_env_markdown(char* buf, size_t buf_len, size_t* needed) {
  g_last_error.clear();
  return CopyOut(hsbn::env::Markdown(), buf, buf_len, needed);
}

int hsbn_scope_count(void) { return hsbn::wire::kScopeCount; }

const char* hsbn_scope_name(int scope) {
  const hsbn::wire::ScopeEntry* e = hsbn::wire::ScopeByApi(scope);
  return e == nullptr ? nullptr : e->name;
}

int hsbn_scope_flags(int scope) {
  const hsbn::wire::ScopeEntry* e = hsbn::wire::ScopeByApi(scope);
  if (e == nullptr) return -1;
  return (e->cross_node ? HSBN_SCOPE_CROSS_NODE : 0) |
         (e->round_stats ? HSBN_SCOPE_ROUND_STATS : 0) |
         (e->scope != hsbn::v1::SCOPE_UNSPECIFIED ? HSBN_SCOPE_ON_WIRE : 0) |
         (e->late ? HSBN_SCOPE_LATE : 0) | (e->late_backward ? HSBN_SCOPE_LATE_BACKWARD : 0);
}

const char* hsbn_env_name(int i) {
  const auto table = hsbn::env::Table();
  if (i < 0 || size_t(i) >= table.size()) return nullptr;
  return table[size_t(i)].name;
}

hsbn_result hsbn_client_get_info(const hsbn_client* client, hsbn_client_info* out) {
  if (client == nullptr || out == nullptr) return Invalid("null client or output pointer");
  const hsbn::ClientOptions& o = client->client->options();
  out->rank = o.rank;
  out->world_size = o.world_size;
  out->local_rank = o.local_rank;
  out->local_world_size = o.local_world_size;
  out->node_rank = o.node_rank;
  out->num_nodes = client->client->num_nodes();
  out->max_channels = client->client->max_channels();
  out->round_timeout_ms = client->client->aggregator_round_timeout().count();
  return HSBN_OK;
}

hsbn_result hsbn_forward(hsbn_client* client, uint32_t op, uint64_t seq, hsbn_scope scope,
                         int64_t channels, int64_t count, const double* mean, const double* m2,
                         int64_t* out_count, double* out_mean, double* out_m2) {
  g_last_error.clear();
  hsbn::Scope s;
  if (client == nullptr) return Invalid("null client");
  if (!ToScope(scope, &s)) return Invalid(BadScope().c_str());
  return Done(client->client->Forward(op, seq, s, channels, count, mean, m2, out_count, out_mean,
                                      out_m2));
}

hsbn_result hsbn_client_global_stats(hsbn_client* client, uint32_t op, uint64_t seq,
                                     int64_t channels, int64_t* out_count, double* out_mean,
                                     double* out_m2) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  return Done(client->client->GlobalStats(op, seq, channels, out_count, out_mean, out_m2));
}

hsbn_result hsbn_client_global_stats_for(hsbn_client* client, uint32_t op, uint64_t seq,
                                         int64_t channels, int64_t timeout_ms, int* done,
                                         int64_t* out_count, double* out_mean, double* out_m2) {
  g_last_error.clear();
  if (client == nullptr || done == nullptr) return Invalid("null client or done");
  if (timeout_ms < 0) return Invalid("timeout_ms must be >= 0");
  bool finished = false;
  absl::Status s = client->client->GlobalStatsFor(
      op, seq, channels, std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 1 << 30)),
      &finished, out_count, out_mean, out_m2);
  *done = finished ? 1 : 0;
  return Done(s);
}

hsbn_result hsbn_client_name_layers(hsbn_client* client, const uint32_t* ops,
                                    const char* const* names, size_t n) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  if (n > 0 && (ops == nullptr || names == nullptr)) return Invalid("null ops or names");
  std::vector<std::pair<uint32_t, std::string>> list;
  for (size_t i = 0; i < n; ++i) {
    if (names[i] == nullptr) return Invalid("a null name");
    list.emplace_back(ops[i], names[i]);
  }
  return Done(client->client->NameLayers(list));
}

hsbn_result hsbn_client_report_lagged_trip(hsbn_client* client, uint32_t op, uint64_t seq,
                                           double drift, int64_t exact_calls) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  return Done(client->client->ReportLaggedTrip(op, seq, drift, exact_calls));
}

int hsbn_client_global_stats_ready(hsbn_client* client, uint32_t op, uint64_t seq) {
  if (client == nullptr) return -1;
  return client->client->GlobalStatsReady(op, seq) ? 1 : 0;
}

hsbn_result hsbn_client_global_sums(hsbn_client* client, uint32_t op, uint64_t seq,
                                    int64_t channels, int64_t* out_count, double* out_sum_dy,
                                    double* out_sum_dy_xmu) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  return Done(client->client->GlobalSums(op, seq, channels, out_count, out_sum_dy,
                                         out_sum_dy_xmu));
}

hsbn_result hsbn_client_global_sums_for(hsbn_client* client, uint32_t op, uint64_t seq,
                                        int64_t channels, int64_t timeout_ms, int* done,
                                        int64_t* out_count, double* out_sum_dy,
                                        double* out_sum_dy_xmu) {
  g_last_error.clear();
  if (client == nullptr || done == nullptr) return Invalid("null client or done");
  if (timeout_ms < 0) return Invalid("timeout_ms must be >= 0");
  bool finished = false;
  absl::Status s = client->client->GlobalSumsFor(
      op, seq, channels, std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 1 << 30)),
      &finished, out_count, out_sum_dy, out_sum_dy_xmu);
  *done = finished ? 1 : 0;
  return Done(s);
}

int hsbn_client_global_sums_ready(hsbn_client* client, uint32_t op, uint64_t seq) {
  if (client == nullptr) return -1;
  return client->client->GlobalSumsReady(op, seq) ? 1 : 0;
}

hsbn_result hsbn_backward(hsbn_client* client, uint32_t op, uint64_t seq, hsbn_scope scope,
                          int64_t channels, int64_t count, const double* sum_dy,
                          const double* sum_dy_xmu, int64_t* out_count, double* out_sum_dy,
                          double* out_sum_dy_xmu) {
  g_last_error.clear();
  hsbn::Scope s;
  if (client == nullptr) return Invalid("null client");
  if (!ToScope(scope, &s)) return Invalid(BadScope().c_str());
  return Done(client->client->Backward(op, seq, s, channels, count, sum_dy, sum_dy_xmu,
                                       out_count, out_sum_dy, out_sum_dy_xmu));
}

hsbn_result hsbn_round_start(hsbn_client* client, hsbn_phase phase, uint32_t op, uint64_t seq,
                             hsbn_scope scope, int64_t channels, int64_t count, const double* a,
                             const double* b, hsbn_round** out) {
  g_last_error.clear();
  hsbn::Scope s;
  if (client == nullptr || out == nullptr) return Invalid("null client or output pointer");
  if (!ToScope(scope, &s)) return Invalid(BadScope().c_str());
  if (phase != HSBN_PHASE_FORWARD && phase != HSBN_PHASE_BACKWARD) {
    return Invalid("phase must be HSBN_PHASE_FORWARD or HSBN_PHASE_BACKWARD");
  }
  auto p = client->client->Start(static_cast<hsbn::Phase>(int(phase)), op, seq, s, channels,
                                 count, a, b);
  if (!p.ok()) return Fail(p.status());
  *out = new hsbn_round{client, std::move(*p)};
  return HSBN_OK;
}

hsbn_result hsbn_round_wait(hsbn_round* round, int64_t* out_count, double* out_a,
                            double* out_b) {
  g_last_error.clear();
  if (round == nullptr) return Invalid("null round");
  std::unique_ptr<hsbn_round> owned(round);
  return Done(owned->client->client->Wait(*owned->pending, out_count, out_a, out_b));
}

hsbn_result hsbn_round_wait_for(hsbn_round* round, int64_t timeout_ms, int* done,
                                int64_t* out_count, double* out_a, double* out_b) {
  g_last_error.clear();
  if (round == nullptr || done == nullptr) return Invalid("null round or done pointer");
  const auto slice = std::chrono::milliseconds(std::clamp<int64_t>(timeout_ms, 0, 1 << 30));
  bool finished = false;
  absl::Status s = round->client->client->WaitFor(*round->pending, slice, &finished, out_count,
                                                  out_a, out_b);
  *done = finished ? 1 : 0;
  if (finished) delete round;
  return Done(s);
}

hsbn_result hsbn_client_abort(hsbn_client* client, const char* reason) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  client->client->Abort(reason == nullptr ? std::string() : std::string(reason));
  return HSBN_OK;
}

hsbn_result hsbn_client_stats(const hsbn_client* client, hsbn_stats* out) {
  g_last_error.clear();
  if (client == nullptr || out == nullptr) return Invalid("null client or output pointer");
  // The first version of hsbn_stats ends with elapsed_seconds.
  constexpr size_t kMinSize = offsetof(hsbn_stats, elapsed_seconds) + sizeof(double);
  if (out->struct_size < kMinSize) {
    return Invalid("hsbn_stats.struct_size is too small: set it to sizeof(hsbn_stats)");
  }
  const hsbn::ClientStats s = client->client->Stats();
  hsbn_stats full;
  std::memset(&full, 0, sizeof full);
  // rounds[][] holds node, global and shadow (the first version); group, renorm and lagged come
  // after (auto, index 4, counts as what it sent).
  static_assert(sizeof full.rounds / sizeof full.rounds[0] + 4 == hsbn::ClientStats::kScopes);
  static_assert(sizeof full.rounds[0] / sizeof full.rounds[0][0] == hsbn::ClientStats::kPhases);
  auto copy = [](const hsbn::RoundStats& r) {
    return hsbn_round_stats{r.completed, r.failed, r.blocked_seconds, r.max_blocked_seconds};
  };
  for (int pi = 0; pi < hsbn::ClientStats::kPhases; ++pi) {
    for (int si = 0; si < 3; ++si) full.rounds[si][pi] = copy(s.rounds[si][pi]);
    full.group_rounds[pi] = copy(s.rounds[int(hsbn::Scope::kGroup) - 1][pi]);
    full.renorm_rounds[pi] = copy(s.rounds[int(hsbn::Scope::kRenorm) - 1][pi]);
    full.lagged_rounds[pi] = copy(s.rounds[int(hsbn::Scope::kLagged) - 1][pi]);
  }
  full.global_stats = copy(s.global_stats);
  full.global_stats_waited = s.global_stats_waited;
  full.late_dropped = s.late_dropped;
  full.bytes_sent = s.bytes_sent;
  full.bytes_received = s.bytes_received;
  full.elapsed_seconds = s.elapsed_seconds;
  std::snprintf(full.transport, sizeof full.transport, "%s", s.transport.c_str());
  const size_t n = std::min(out->struct_size, sizeof full);
  full.struct_size = n;
  std::memcpy(out, &full, n);
  return HSBN_OK;
}

hsbn_result hsbn_client_reset_stats(hsbn_client* client) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  client->client->ResetStats();
  return HSBN_OK;
}

hsbn_result hsbn_status_json(hsbn_client* client, int include_upstream, char* buf,
                             size_t buf_len, size_t* needed) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  auto json = client->client->StatusJson(include_upstream != 0);
  if (!json.ok()) return Fail(json.status());
  return CopyOut(*json, buf, buf_len, needed);
}

void hsbn_status_query_init(hsbn_status_query* query) {
  if (query == nullptr) return;
  std::memset(query, 0, sizeof *query);
  query->struct_size = sizeof *query;
}

hsbn_result hsbn_query_status_json(const hsbn_status_query* query, char* buf, size_t buf_len,
                                   size_t* needed) {
  g_last_error.clear();
  if (query == nullptr || query->struct_size < sizeof(hsbn_status_query)) {
    return Invalid("hsbn_status_query not initialised with hsbn_status_query_init");
  }
  auto str = [](const char* s) { return s == nullptr ? std::string() : std::string(s); };
  hsbn::StatusQuery q;
  q.address = str(query->address);
  q.job_id = str(query->job_id);
  q.token = str(query->token);
  q.include_upstream = query->include_upstream != 0;
  if (query->timeout_ms > 0) q.timeout = std::chrono::milliseconds(query->timeout_ms);
  q.tls_ca = str(query->tls_ca_file);
  q.tls_cert = str(query->tls_cert_file);
  q.tls_key = str(query->tls_key_file);
  q.tls_name = str(query->tls_name);
  auto status = hsbn::QueryStatus(q);
  if (!status.ok()) return Fail(status.status());
  auto json = hsbn::StatusToJson(*status);
  if (!json.ok()) return Fail(json.status());
  return CopyOut(*json, buf, buf_len, needed);
}

hsbn_result hsbn_check_layout(int64_t rank, int64_t world_size, int64_t local_rank,
                              int64_t local_world_size, int64_t node_rank) {
  g_last_error.clear();
  return Done(
      hsbn::wire::CheckWorkerLayout(rank, world_size, local_rank, local_world_size, node_rank));
}

hsbn_result hsbn_check_layout_groups(int64_t rank, int64_t world_size, int64_t local_rank,
                                     int64_t local_world_size, int64_t node_rank,
                                     int64_t group_nodes) {
  g_last_error.clear();
  return Done(hsbn::wire::CheckWorkerLayout(rank, world_size, local_rank, local_world_size,
                                            node_rank, /*max_world_size=*/0, group_nodes));
}

hsbn_result hsbn_set_auto_policy(hsbn_client* client, uint32_t op,
                                 const hsbn_auto_policy* policy) {
  g_last_error.clear();
  if (client == nullptr || policy == nullptr) return Invalid("null client or policy");
  hsbn::AutoPolicy p;
  p.warmup_rounds = policy->warmup_rounds;
  p.max_mean_shift = policy->max_mean_shift;
  p.max_log_var_ratio = policy->max_log_var_ratio;
  p.recheck_every = policy->recheck_every;
  return Done(client->client->SetAutoPolicy(op, p));
}

hsbn_result hsbn_get_auto_decision(const hsbn_client* client, uint32_t op,
                                   hsbn_auto_decision* out) {
  g_last_error.clear();
  if (client == nullptr || out == nullptr) return Invalid("null client or output pointer");
  const hsbn::AutoDecision d = client->client->AutoDecisionOf(op);
  out->decided = d.decided ? 1 : 0;
  out->scope = d.decided ? int32_t(d.scope) : 0;
  out->mean_shift = d.mean_shift;
  out->log_var_ratio = d.log_var_ratio;
  out->rounds = d.rounds;
  out->decided_at = d.decided_at;
  return HSBN_OK;
}

hsbn_result hsbn_set_auto_decision(hsbn_client* client, uint32_t op, hsbn_scope scope) {
  g_last_error.clear();
  if (client == nullptr) return Invalid("null client");
  hsbn::Scope s;
  if (!ToScope(scope, &s)) return Invalid(BadScope().c_str());
  return Done(client->client->SetAutoDecision(op, s));
}

}  // extern "C"

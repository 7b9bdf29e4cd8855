#include "metrics.h"

#include <cstring>
#include <exception>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "version.h"
#include "wire.h"

namespace hsbn::server {

namespace {

const char* ScopeLabel(int scope) { return wire::ScopeName(v1::Scope(scope), "unknown"); }

const char* PhaseLabel(int phase) {
  switch (phase) {
    case v1::PHASE_FORWARD: return "forward";
    case v1::PHASE_BACKWARD: return "backward";
    default: return "unknown";
  }
}

// "ok", "deadline_exceeded", ... (gRPC's code names, lower case).
std::string OutcomeLabel(int code) {
  if (code == 0) return "ok";
  return absl::AsciiStrToLower(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
}

int Clamp(int v, int n) { return v >= 0 && v < n ? v : 0; }
// 5 is no wire scope (auto is a client policy): counted as unspecified, like any other.
constexpr int kNoScope = 5;
int ScopeIndex(int scope, int n) { return scope == kNoScope ? 0 : Clamp(scope, n); }
// A code outside gRPC's 0..16 (e.g. from a peer's Abort) counts as "unknown", never as "ok".
int CodeIndex(absl::StatusCode code) {
  const int c = int(code);
  return c >= 0 && c <= 16 ? c : int(absl::StatusCode::kUnknown);
}

// Round latencies from 50 µs (a node round on a Unix socket) to 30 s (the default timeout).
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,     0.25,   0.5,     1,      2.5,   5,      10,    30};
  return *b;
}

const std::string& OtherLabel() {
  static const auto* other = new std::string("_other");
  return *other;
}

}  // namespace

std::string MemberLabel(const std::string& member) {
  std::string out;
  for (const char c : member) {
    if (out.size() == 32) break;
    if (c == ' ') continue;
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' ||
                    c == '.' || c == '-';
    out += ok ? c : '_';
  }
  return out;
}

// Builds the state gauges at scrape time from a StatusResponse snapshot.
class Metrics::StateCollector final : public prometheus::Collectable {
 public:
  StateCollector(std::string role, Metrics* owner) : role_(std::move(role)), owner_(owner) {}

  void SetSource(std::function<v1::StatusResponse()> source) {
    std::lock_guard<std::mutex> lock(mu_);
    source_ = std::move(source);
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    v1::StatusResponse status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!source_) return {};
      status = source_();
    }
    auto family = [](const char* name, const char* help) {
      prometheus::MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = prometheus::MetricType::Gauge;
      return f;
    };
    auto add = [this](prometheus::MetricFamily& f, double value,
                      std::vector<prometheus::ClientMetric::Label> labels) {
      prometheus::ClientMetric m;
      m.label.push_back({"role", role_});
      for (auto& l : labels) m.label.push_back(std::move(l));
      m.gauge.value = value;
      f.metric.push_back(std::move(m));
    };
    prometheus::MetricFamily jobs = family("hsbn_jobs", "Jobs this aggregator serves now.");
    prometheus::MetricFamily open = family(
        "hsbn_open_rounds", "Rounds in flight (waiting for contributions or the parent), per job.");
    prometheus::MetricFamily members = family(
        "hsbn_members", "Members of a job connected here now (workers at a sidecar, sidecars at "
        "the root).");
    prometheus::MetricFamily expected =
        family("hsbn_members_expected", "Members a job has at this aggregator.");
    prometheus::MetricFamily shift = family(
        "hsbn_shadow_mean_shift", "Shadow scope: |mean_node - mean_global| / global std, averaged "
        "over channels and shadow rounds, per job, layer (op) and node (or group, label group).");
    prometheus::MetricFamily shift_max = family(
        "hsbn_shadow_mean_shift_max", "Shadow scope: the largest per-channel mean shift seen.");
    prometheus::MetricFamily ratio = family(
        "hsbn_shadow_var_ratio", "Shadow scope: (var_node + eps) / (var_global + eps), averaged.");
    prometheus::MetricFamily log_ratio = family(
        "hsbn_shadow_log_var_ratio_abs", "Shadow scope: mean of |log var_ratio|.");
    prometheus::MetricFamily shadow_rounds =
        family("hsbn_shadow_rounds", "Shadow rounds behind the divergence averages.");
    prometheus::MetricFamily trips = family(
        "hsbn_lagged_trips", "Lagged scope: times a layer's trip guard sent it exact global, "
        "per job and layer (op), as its workers reported them to this sidecar.");
    prometheus::MetricFamily trip_drift = family(
        "hsbn_lagged_trip_drift", "Lagged scope: the drift v (standard deviations) of the "
        "layer's last trip.");
    add(jobs, double(status.jobs_size()), {});
    std::vector<std::string> ids;
    for (const v1::JobStatus& j : status.jobs()) ids.push_back(j.job_id());
    const std::vector<std::string> labels = owner_->LabelJobs(ids);
    // Jobs without a label of their own are summed under "_other".
    double other_open = 0, other_connected = 0, other_expected = 0;
    bool any_other = false;
    size_t divergence_series = 0;
    for (int i = 0; i < status.jobs_size(); ++i) {
      const v1::JobStatus& j = status.jobs(i);
      int connected = 0;
      for (const auto& m : j.members()) connected += m.connected() ? 1 : 0;
      if (labels[size_t(i)] == OtherLabel()) {
        any_other = true;
        other_open += double(j.open_rounds());
        other_connected += double(connected);
        other_expected += double(j.group_size());
        continue;
      }
      const std::string& label = labels[size_t(i)];
      add(open, double(j.open_rounds()), {{"job_id", label}});
      add(members, double(connected), {{"job_id", label}});
      add(expected, double(j.group_size()), {{"job_id", label}});
      // Per node, and with groups per group (label `group` instead of `node`: the group's
      // merged statistics against the global ones, which auto scope decides on).
      for (const auto* records : {&j.divergence(), &j.group_divergence()}) {
        const char* unit = records == &j.divergence() ? "node" : "group";
        for (const v1::Divergence& d : *records) {
          if (divergence_series++ >= kMaxDivergenceSeries) break;
          std::vector<prometheus::ClientMetric::Label> l = {
              {"job_id", label}, {"op", std::to_string(d.op())},
              {unit, std::to_string(d.node())}};
          add(shift, d.mean_shift_avg(), l);
          add(shift_max, d.mean_shift_max(), l);
          add(ratio, d.var_ratio_avg(), l);
          add(log_ratio, d.log_var_ratio_abs_avg(), l);
          add(shadow_rounds, double(d.rounds()), l);
        }
      }
      for (const v1::LaggedTripStatus& t : j.lagged_trips()) {
        if (divergence_series++ >= kMaxDivergenceSeries) break;
        std::vector<prometheus::ClientMetric::Label> l = {{"job_id", label},
                                                          {"op", std::to_string(t.op())}};
        add(trips, double(t.trips()), l);
        add(trip_drift, t.last_drift(), l);
      }
    }
    if (any_other) {
      add(open, other_open, {{"job_id", OtherLabel()}});
      add(members, other_connected, {{"job_id", OtherLabel()}});
      add(expected, other_expected, {{"job_id", OtherLabel()}});
    }
    std::vector<prometheus::MetricFamily> out;
    for (auto* f : {&jobs, &open, &members, &expected, &shift, &shift_max, &ratio, &log_ratio,
                    &shadow_rounds, &trips, &trip_drift}) {
      if (!f->metric.empty()) out.push_back(std::move(*f));
    }
    return out;
  }

 private:
  const std::string role_;
  Metrics* const owner_;
  mutable std::mutex mu_;
  std::function<v1::StatusResponse()> source_;
};

Metrics::Metrics(const std::string& role, bool has_upstream, size_t max_job_labels)
    : role_(role),
      registry_(std::make_shared<prometheus::Registry>()),
      max_job_labels_(max_job_labels < 1 ? 1 : max_job_labels),
      state_(std::make_shared<StateCollector>(role, this)) {
  const prometheus::Labels constant = {{"role", role}};
  rounds_family_ = &prometheus::BuildCounter()
                        .Name("hsbn_rounds_total")
                        .Help("Rounds finished here, by scope, phase and outcome (ok, or the "
                              "gRPC status code name in lower case).")
                        .Labels(constant)
                        .Register(*registry_);
  timeouts_family_ = &prometheus::BuildCounter()
                          .Name("hsbn_round_timeouts_total")
                          .Help("Rounds that timed out waiting for this member (rankN at a "
                                "sidecar, nodeN at the root, upstream when the parent did not "
                                "answer), by job (at most --metrics-max-jobs job_id labels, the "
                                "rest under _other).")
                          .Labels(constant)
                          .Register(*registry_);
  joins_family_ = &prometheus::BuildCounter()
                       .Name("hsbn_joins_total")
                       .Help("Join calls answered, by outcome (ok, unauthenticated, ...).")
                       .Labels(constant)
                       .Register(*registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name("hsbn_round_duration_seconds")
                      .Help("Completed rounds: first contribution until the result goes out, by "
                            "scope and phase.")
                      .Labels(constant)
                      .Register(*registry_);
  for (int s = 1; s < kScopes; ++s) {
    if (s == kNoScope) continue;
    for (int p = 1; p < kPhases; ++p) {
      latency_[s][p] =
          &latency.Add({{"scope", ScopeLabel(s)}, {"phase", PhaseLabel(p)}}, LatencyBuckets());
      RoundCounter(s, p, 0);  // ok rounds exist from the start, at 0
    }
  }
  auto& nonfinite = prometheus::BuildCounter()
                        .Name("hsbn_nonfinite_values_total")
                        .Help("Non-finite values (NaN, +-Inf) in round data, by phase. They "
                              "propagate as data, as in torch's SyncBatchNorm; a job's strict "
                              "mode refuses them.")
                        .Labels(constant)
                        .Register(*registry_);
  for (int p = 1; p < kPhases; ++p) nonfinite_[p] = &nonfinite.Add({{"phase", PhaseLabel(p)}});
  auto& refused = prometheus::BuildCounter()
                      .Name("hsbn_refused_total")
                      .Help("Requests refused by a resource or validity limit, by reason "
                            "(docs/DEPLOY.md, Limits).")
                      .Labels(constant)
                      .Register(*registry_);
  for (size_t i = 0; i < kRefusedReasons.size(); ++i) {
    refused_[i] = &refused.Add({{"reason", kRefusedReasons[i]}});
  }
  memory_used_ = &prometheus::BuildGauge()
                      .Name("hsbn_memory_used_bytes")
                      .Help("Bytes of the memory budget (--memory-budget-bytes) in use.")
                      .Labels(constant)
                      .Register(*registry_)
                      .Add({});
  prometheus::BuildGauge()
      .Name("hsbn_build_info")
      .Help("1, labelled with this binary's version and the git commit it was built from.")
      .Labels(constant)
      .Register(*registry_)
      .Add({{"version", kHsbnVersion}, {"commit", kHsbnGitCommit}})
      .Set(1);
  auto& received = prometheus::BuildCounter()
                       .Name("hsbn_received_bytes_total")
                       .Help("Protocol bytes received (serialized messages), from the members "
                             "below or from the parent (link=upstream).")
                       .Labels(constant)
                       .Register(*registry_);
  auto& sent = prometheus::BuildCounter()
                   .Name("hsbn_sent_bytes_total")
                   .Help("Protocol bytes sent (serialized messages), to the members below or to "
                         "the parent (link=upstream).")
                   .Labels(constant)
                   .Register(*registry_);
  auto& received_messages =
      prometheus::BuildCounter()
          .Name("hsbn_received_messages_total")
          .Help("Protocol messages received, from the members below or from the parent "
                "(link=upstream). A batch (several frames in one message) counts once.")
          .Labels(constant)
          .Register(*registry_);
  auto& sent_messages =
      prometheus::BuildCounter()
          .Name("hsbn_sent_messages_total")
          .Help("Protocol messages sent, to the members below or to the parent (link=upstream). "
                "A batch (several frames in one message) counts once.")
          .Labels(constant)
          .Register(*registry_);
  received_[0] = &received.Add({{"link", "members"}});
  sent_[0] = &sent.Add({{"link", "members"}});
  received_messages_[0] = &received_messages.Add({{"link", "members"}});
  sent_messages_[0] = &sent_messages.Add({{"link", "members"}});
  if (has_upstream) {
    received_[1] = &received.Add({{"link", "upstream"}});
    sent_[1] = &sent.Add({{"link", "upstream"}});
    received_messages_[1] = &received_messages.Add({{"link", "upstream"}});
    sent_messages_[1] = &sent_messages.Add({{"link", "upstream"}});
    upstream_connected_ = &prometheus::BuildGauge()
                               .Name("hsbn_upstream_connected")
                               .Help("1 while this sidecar's stream to its parent (root) is up.")
                               .Labels(constant)
                               .Register(*registry_)
                               .Add({});
  }
}

Metrics::~Metrics() { StopServing(); }

prometheus::Counter& Metrics::RoundCounter(int scope, int phase, int code) {
  std::atomic<prometheus::Counter*>& slot = rounds_[scope][phase][code];
  prometheus::Counter* c = slot.load(std::memory_order_acquire);
  if (c == nullptr) {
    // First round with these labels: Family::Add returns the existing series if another thread
    // created it meanwhile.
    c = &rounds_family_->Add({{"scope", ScopeLabel(scope)},
                              {"phase", PhaseLabel(phase)},
                              {"outcome", OutcomeLabel(code)}});
    slot.store(c, std::memory_order_release);
  }
  return *c;
}

void Metrics::RoundFinished(v1::Scope scope, v1::Phase phase, absl::StatusCode code,
                            double seconds) {
  const int s = ScopeIndex(int(scope), kScopes), p = Clamp(int(phase), kPhases);
  RoundCounter(s, p, CodeIndex(code)).Increment();
  if (code == absl::StatusCode::kOk && seconds >= 0 && latency_[s][p] != nullptr) {
    latency_[s][p]->Observe(seconds);
  }
}

void Metrics::RoundsFinished(v1::Scope scope, v1::Phase phase, absl::StatusCode code,
                             int64_t n) {
  if (n <= 0) return;
  RoundCounter(ScopeIndex(int(scope), kScopes), Clamp(int(phase), kPhases), CodeIndex(code))
      .Increment(double(n));
}

void Metrics::RoundTimedOut(const std::string& job_id, const std::string& member) {
  prometheus::Counter* c = nullptr;
  {
    absl::MutexLock lock(&labels_mu_);
    auto key = std::make_pair(JobLabelLocked(job_id), MemberLabel(member));
    auto it = timeouts_.find(key);
    if (it == timeouts_.end() && timeouts_.size() >= kMaxTimeoutSeries) {
      key = {OtherLabel(), OtherLabel()};
      it = timeouts_.find(key);
    }
    if (it == timeouts_.end()) {
      c = &timeouts_family_->Add({{"job_id", key.first}, {"member", key.second}});
      timeouts_.emplace(key, c);
    } else {
      c = it->second;
    }
  }
  c->Increment();
}

const std::string& Metrics::JobLabelLocked(const std::string& job_id) {
  auto it = labelled_jobs_.find(job_id);
  if (it != labelled_jobs_.end()) return *it;
  if (labelled_jobs_.size() >= max_job_labels_ || job_id == OtherLabel()) return OtherLabel();
  return *labelled_jobs_.insert(job_id).first;
}

std::vector<std::string> Metrics::LabelJobs(const std::vector<std::string>& present) {
  absl::MutexLock lock(&labels_mu_);
  const std::set<std::string> now(present.begin(), present.end());
  for (auto it = labelled_jobs_.begin(); it != labelled_jobs_.end();) {
    if (now.count(*it) != 0) {
      ++it;
      continue;
    }
    for (auto t = timeouts_.begin(); t != timeouts_.end();) {
      if (t->first.first == *it) {
        timeouts_family_->Remove(t->second);
        t = timeouts_.erase(t);
      } else {
        ++t;
      }
    }
    it = labelled_jobs_.erase(it);
  }
  std::vector<std::string> labels;
  labels.reserve(present.size());
  for (const std::string& id : present) labels.push_back(JobLabelLocked(id));
  return labels;
}

void Metrics::NonFinite(v1::Phase phase, int64_t values) {
  if (values <= 0) return;
  if (auto* c = nonfinite_[Clamp(int(phase), kPhases)]) c->Increment(double(values));
}

void Metrics::Refused(const char* reason) {
  size_t i = 0;
  while (i + 1 < kRefusedReasons.size() &&
         (reason == nullptr || std::strcmp(reason, kRefusedReasons[i]) != 0)) {
    ++i;
  }
  refused_[i]->Increment();
}

void Metrics::SetMemoryUsed(int64_t bytes) { memory_used_->Set(double(bytes)); }

void Metrics::Received(Link link, size_t bytes) {
  if (auto* c = received_[int(link)]) c->Increment(double(bytes));
  if (auto* c = received_messages_[int(link)]) c->Increment();
}

void Metrics::Sent(Link link, size_t bytes) {
  if (auto* c = sent_[int(link)]) c->Increment(double(bytes));
  if (auto* c = sent_messages_[int(link)]) c->Increment();
}

void Metrics::JoinAnswered(absl::StatusCode code) {
  const int k = CodeIndex(code);
  prometheus::Counter* c = joins_[k].load(std::memory_order_acquire);
  if (c == nullptr) {
    c = &joins_family_->Add({{"outcome", OutcomeLabel(k)}});
    joins_[k].store(c, std::memory_order_release);
  }
  c->Increment();
}

void Metrics::SetUpstreamConnected(bool connected) {
  if (upstream_connected_ != nullptr) upstream_connected_->Set(connected ? 1 : 0);
}

void Metrics::SetLimits(const MetricsLimits& limits) {
  const prometheus::Labels constant = {{"role", role_}};
  auto gauge = [&](const char* name, const char* help, int64_t value) {
    prometheus::BuildGauge().Name(name).Help(help).Labels(constant).Register(*registry_)
        .Add({}).Set(double(value));
  };
  gauge("hsbn_max_jobs", "--max-jobs.", limits.max_jobs);
  gauge("hsbn_max_open_rounds", "--max-open-rounds (per job).", limits.max_open_rounds);
  gauge("hsbn_max_channels", "--max-channels.", limits.max_channels);
  gauge("hsbn_max_world_size", "--max-world-size.", limits.max_world_size);
  gauge("hsbn_memory_budget_bytes", "--memory-budget-bytes (all jobs together).",
        limits.memory_budget_bytes);
  gauge("hsbn_max_queued_bytes", "--max-queued-bytes (per stream).", limits.max_queued_bytes);
  gauge("hsbn_max_unbound_bytes", "--max-unbound-bytes (per stream, before any Attach).",
        limits.max_unbound_bytes);
}

void Metrics::SetStateSource(std::function<v1::StatusResponse()> source) {
  state_->SetSource(std::move(source));
}

absl::StatusOr<std::string> Metrics::Serve(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-listen=", address, " is not HOST:PORT (e.g. 0.0.0.0:9464; port 0 picks one)"));
  }
  try {
    // civetweb serves each connection on one of num_threads threads until it is done, and
    // waits up to request_timeout_ms for a request (30 s by default): with one thread, a single
    // idle connection held back every scrape. Several threads and a short timeout bound that.
    exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", std::to_string(kServeThreads),
        "request_timeout_ms", std::to_string(kServeRequestTimeoutMs)});
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen=", address,
                                               ": cannot listen (", e.what(), ")"));
  }
  // The state collector first: it releases the labels of jobs that are gone (and removes their
  // counters from registry_), so that the same scrape no longer shows them.
  exposer_->RegisterCollectable(state_);
  exposer_->RegisterCollectable(registry_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    exposer_.reset();
    return absl::UnavailableError(absl::StrCat("--metrics-listen=", address,
                                               ": no port was bound"));
  }
  return absl::StrCat(address.substr(0, colon), ":", ports[0]);
}

std::string Metrics::Text() {
  std::vector<prometheus::MetricFamily> families = state_->Collect();  // first, as in Serve
  for (auto& f : registry_->Collect()) families.push_back(std::move(f));
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

void Metrics::StopServing() {
  exposer_.reset();
  state_->SetSource(nullptr);
}

}  // namespace hsbn::server

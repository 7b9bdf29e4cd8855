#include "metrics.h"

#include <exception>

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

namespace hsbn::server {

namespace {

const char* ScopeLabel(int scope) {
  switch (scope) {
    case v1::SCOPE_NODE: return "node";
    case v1::SCOPE_GLOBAL: return "global";
    case v1::SCOPE_SHADOW: return "shadow";
    default: return "unknown";
  }
}

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

}  // namespace

// Builds the state gauges at scrape time from a StatusResponse snapshot.
class Metrics::StateCollector final : public prometheus::Collectable {
 public:
  explicit StateCollector(std::string role) : role_(std::move(role)) {}

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
        "over channels and shadow rounds, per job, layer (op) and node.");
    prometheus::MetricFamily shift_max = family(
        "hsbn_shadow_mean_shift_max", "Shadow scope: the largest per-channel mean shift seen.");
    prometheus::MetricFamily ratio = family(
        "hsbn_shadow_var_ratio", "Shadow scope: (var_node + eps) / (var_global + eps), averaged.");
    prometheus::MetricFamily log_ratio = family(
        "hsbn_shadow_log_var_ratio_abs", "Shadow scope: mean of |log var_ratio|.");
    prometheus::MetricFamily shadow_rounds =
        family("hsbn_shadow_rounds", "Shadow rounds behind the divergence averages.");
    add(jobs, double(status.jobs_size()), {});
    for (const v1::JobStatus& j : status.jobs()) {
      add(open, double(j.open_rounds()), {{"job_id", j.job_id()}});
      int connected = 0;
      for (const auto& m : j.members()) connected += m.connected() ? 1 : 0;
      add(members, double(connected), {{"job_id", j.job_id()}});
      add(expected, double(j.group_size()), {{"job_id", j.job_id()}});
      for (const v1::Divergence& d : j.divergence()) {
        std::vector<prometheus::ClientMetric::Label> l = {
            {"job_id", j.job_id()}, {"op", std::to_string(d.op())},
            {"node", std::to_string(d.node())}};
        add(shift, d.mean_shift_avg(), l);
        add(shift_max, d.mean_shift_max(), l);
        add(ratio, d.var_ratio_avg(), l);
        add(log_ratio, d.log_var_ratio_abs_avg(), l);
        add(shadow_rounds, double(d.rounds()), l);
      }
    }
    std::vector<prometheus::MetricFamily> out;
    for (auto* f : {&jobs, &open, &members, &expected, &shift, &shift_max, &ratio, &log_ratio,
                    &shadow_rounds}) {
      if (!f->metric.empty()) out.push_back(std::move(*f));
    }
    return out;
  }

 private:
  const std::string role_;
  mutable std::mutex mu_;
  std::function<v1::StatusResponse()> source_;
};

Metrics::Metrics(const std::string& role, bool has_upstream)
    : role_(role),
      registry_(std::make_shared<prometheus::Registry>()),
      state_(std::make_shared<StateCollector>(role)) {
  const prometheus::Labels constant = {{"role", role}};
  rounds_family_ = &prometheus::BuildCounter()
                        .Name("hsbn_rounds_total")
                        .Help("Rounds finished here, by scope, phase and outcome (ok, or the "
                              "gRPC status code name in lower case).")
                        .Labels(constant)
                        .Register(*registry_);
  timeouts_family_ = &prometheus::BuildCounter()
                          .Name("hsbn_round_timeouts_total")
                          .Help("Rounds that timed out waiting for this member (\"rank N\" at a "
                                "sidecar, \"node N\" at the root, \"upstream\" when the parent "
                                "did not answer).")
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
    for (int p = 1; p < kPhases; ++p) {
      latency_[s][p] =
          &latency.Add({{"scope", ScopeLabel(s)}, {"phase", PhaseLabel(p)}}, LatencyBuckets());
      RoundCounter(s, p, 0);  // ok rounds exist from the start, at 0
    }
  }
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
  const int s = Clamp(int(scope), kScopes), p = Clamp(int(phase), kPhases);
  RoundCounter(s, p, CodeIndex(code)).Increment();
  if (code == absl::StatusCode::kOk && seconds >= 0 && latency_[s][p] != nullptr) {
    latency_[s][p]->Observe(seconds);
  }
}

void Metrics::RoundTimedOut(const std::string& job_id, const std::string& member) {
  prometheus::Counter* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(timeouts_mu_);
    auto key = std::make_pair(job_id, member);
    auto it = timeouts_.find(key);
    if (it == timeouts_.end() && timeouts_.size() >= kMaxTimeoutSeries) {
      key = {"_other", "_other"};
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

void Metrics::SetLimits(int64_t max_jobs, int64_t max_open_rounds, int64_t max_channels) {
  const prometheus::Labels constant = {{"role", role_}};
  prometheus::BuildGauge().Name("hsbn_max_jobs").Help("--max-jobs.").Labels(constant)
      .Register(*registry_).Add({}).Set(double(max_jobs));
  prometheus::BuildGauge().Name("hsbn_max_open_rounds").Help("--max-open-rounds (per job).")
      .Labels(constant).Register(*registry_).Add({}).Set(double(max_open_rounds));
  prometheus::BuildGauge().Name("hsbn_max_channels").Help("--max-channels.").Labels(constant)
      .Register(*registry_).Add({}).Set(double(max_channels));
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
    exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen=", address,
                                               ": cannot listen (", e.what(), ")"));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(state_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    exposer_.reset();
    return absl::UnavailableError(absl::StrCat("--metrics-listen=", address,
                                               ": no port was bound"));
  }
  return absl::StrCat(address.substr(0, colon), ":", ports[0]);
}

void Metrics::StopServing() {
  exposer_.reset();
  state_->SetSource(nullptr);
}

}  // namespace hsbn::server

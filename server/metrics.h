// server/metrics.h — the aggregator's Prometheus metrics (--metrics-listen).
//
// Two kinds of metrics:
//  - event counters and histograms (rounds by scope, phase and outcome, round latency, bytes,
//    joins, timeouts and whom they waited for, refusals, non-finite values), updated on the hot
//    path through handles that are created once and cached, so recording a round allocates no
//    label set;
//  - state gauges (jobs, members, open rounds, shadow divergence, limits, memory), computed
//    only when /metrics is scraped, from the same snapshot as the Status RPC: nothing on the hot
//    path.
//
// Every series carries the constant label `role` (node or root). Per-job series use the label
// `job_id` (not `job`, which Prometheus reserves for the scrape job).
//
// Label values are bounded, whatever clients send:
//  - job_id: at most `max_job_labels` jobs (--metrics-max-jobs) have a label of their own at a
//    time, given in the order the metrics first see them; every other job counts under
//    job_id="_other" (state gauges are summed there; shadow divergence of such jobs is left
//    out). A job's label is released, and its per-job counters removed, at the first scrape
//    after the job is gone.
//  - member: one word without spaces: "rank3" (at a sidecar), "node1" (at the root),
//    "upstream" (the parent did not answer). See MemberLabel.
//  - reason (hsbn_refused_total): the fixed set kRefusedReasons.
//
// The HTTP endpoint serves with several threads and a read timeout, so idle connections to the
// port cannot hold back a scrape (kServeThreads, kServeRequestTimeoutMs).
//
// Thread safety: all methods are thread-safe.
#ifndef HSBN_SERVER_METRICS_H_
#define HSBN_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hsbn/v1/hsbn.pb.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace hsbn::server {

// The limits exported as gauges (hsbn_max_jobs, hsbn_memory_budget_bytes, ...), so that alerts
// can compare against them. Filled from AggregatorOptions by main.
struct MetricsLimits {
  int64_t max_jobs = 0;
  int64_t max_open_rounds = 0;
  int64_t max_channels = 0;
  int64_t max_world_size = 0;
  int64_t memory_budget_bytes = 0;
  int64_t max_queued_bytes = 0;
  int64_t max_unbound_bytes = 0;
};

// The `member` label for a member name as Job writes it ("rank 3", "node 1", "upstream"):
// spaces dropped ("rank3", "node1"), any byte other than [A-Za-z0-9_.-] replaced by '_', at
// most 32 bytes.
std::string MemberLabel(const std::string& member);

class Metrics {
 public:
  enum class Link { kMembers = 0, kUpstream = 1 };  // the peers below, the parent above

  // Default of --metrics-max-jobs.
  static constexpr size_t kDefaultMaxJobLabels = 64;

  // `role`: "node" or "root"; `has_upstream`: a sidecar with --upstream (it gets the upstream
  // byte counters and hsbn_upstream_connected); `max_job_labels` (>= 1): jobs with a job_id
  // label of their own at a time (--metrics-max-jobs), the others count as "_other".
  Metrics(const std::string& role, bool has_upstream,
          size_t max_job_labels = kDefaultMaxJobLabels);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // A round finished here with `code` (OK: its result was sent). `seconds` is the time from
  // its first contribution until then; negative when the round never opened here.
  void RoundFinished(v1::Scope scope, v1::Phase phase, absl::StatusCode code, double seconds);
  // `n` rounds finished with `code` elsewhere (the shared-memory node path: the workers reduce
  // them and the sidecar harvests their counts), without latencies.
  void RoundsFinished(v1::Scope scope, v1::Phase phase, absl::StatusCode code, int64_t n);
  // A round of `job_id` timed out waiting for `member` ("rank 3", "node 1", "upstream"; the
  // label is MemberLabel(member)).
  void RoundTimedOut(const std::string& job_id, const std::string& member);
  // `values` non-finite values (NaN, +-Inf) seen in a round of `phase` (in contributions or
  // results; the caller says which it counts). hsbn_nonfinite_values_total{phase}.
  void NonFinite(v1::Phase phase, int64_t values);
  // A request refused because of `reason`, one of kRefusedReasons (anything else counts as
  // "other"). hsbn_refused_total{reason}.
  void Refused(const char* reason);
  // Bytes of the memory budget in use now (hsbn_memory_used_bytes).
  void SetMemoryUsed(int64_t bytes);
  // One protocol message (of `bytes` serialized bytes) received or sent on `link`.
  void Received(Link link, size_t bytes);
  void Sent(Link link, size_t bytes);
  void JoinAnswered(absl::StatusCode code);
  void SetUpstreamConnected(bool connected);

  // Limits, exported as gauges so that alerts can compare against them. Call once.
  void SetLimits(const MetricsLimits& limits);
  // Where the state gauges come from (called once per scrape).
  void SetStateSource(std::function<v1::StatusResponse()> source);

  // Starts the HTTP endpoint (/metrics) on host:port (port 0: a free one). Returns the bound
  // "host:port".
  absl::StatusOr<std::string> Serve(const std::string& address);
  // Stops the HTTP endpoint (before the state source goes away).
  void StopServing();
  // The /metrics body, as a scrape would return it now (for tests).
  std::string Text();

  // hsbn_refused_total's reasons: memory_budget (the process-wide --memory-budget-bytes),
  // queue_bytes (--max-queued-bytes of one stream), write_deadline (--write-deadline-ms),
  // world_size (--max-world-size), unbound_bytes (--max-unbound-bytes before any Attach),
  // attach_timeout (--attach-timeout-ms), job_id (a job id too long or not printable),
  // count_overflow (counts whose sum overflows int64), strict_nonfinite (a job's strict mode
  // refused NaN/Inf), other (any reason not in this list).
  static constexpr std::array<const char*, 10> kRefusedReasons = {
      "memory_budget", "queue_bytes", "write_deadline", "world_size", "unbound_bytes",
      "attach_timeout", "job_id", "count_overflow", "strict_nonfinite", "other"};
  // The HTTP endpoint's worker threads (civetweb's num_threads): this many connections are
  // served at once, so fewer idle ones cannot hold back a scrape.
  static constexpr int kServeThreads = 8;
  // How long a connection may take to send its request (civetweb's request_timeout_ms) before
  // it is closed and its thread freed.
  static constexpr int kServeRequestTimeoutMs = 5000;
  // Most shadow divergence series (job, op, node) exported per scrape.
  static constexpr size_t kMaxDivergenceSeries = 4096;  // lagged trip series share the cap

  // Most (job, member) timeout series kept; beyond it, timeouts count under
  // job_id="_other", member="_other".
  static constexpr size_t kMaxTimeoutSeries = 1000;

 private:
  class StateCollector;
  static constexpr int kScopes = 8;   // unspecified, node, global, shadow, group, -, renorm, lagged
  static constexpr int kPhases = 3;   // unspecified, forward, backward
  static constexpr int kCodes = 17;   // gRPC codes 0..16

  prometheus::Counter& RoundCounter(int scope, int phase, int code);
  // The job_id label of `job_id`: its own while fewer than max_job_labels_ jobs hold one, else
  // "_other". REQUIRES: labels_mu_ held.
  const std::string& JobLabelLocked(const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(labels_mu_);
  // Called at each scrape with the jobs that exist now: assigns their labels (in order) and
  // releases those of jobs that are gone, removing their counters. Returns each job's label.
  std::vector<std::string> LabelJobs(const std::vector<std::string>& present);

  const std::string role_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* rounds_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* timeouts_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* joins_family_ = nullptr;
  std::atomic<prometheus::Counter*> rounds_[kScopes][kPhases][kCodes] = {};
  std::atomic<prometheus::Counter*> joins_[kCodes] = {};
  prometheus::Histogram* latency_[kScopes][kPhases] = {};
  prometheus::Counter* received_[2] = {};
  prometheus::Counter* sent_[2] = {};
  prometheus::Counter* received_messages_[2] = {};
  prometheus::Counter* sent_messages_[2] = {};
  prometheus::Gauge* upstream_connected_ = nullptr;  // with an upstream only

  prometheus::Counter* nonfinite_[kPhases] = {};
  prometheus::Counter* refused_[kRefusedReasons.size()] = {};
  prometheus::Gauge* memory_used_ = nullptr;

  const size_t max_job_labels_;
  absl::Mutex labels_mu_;
  // Jobs with a job_id label of their own.
  std::set<std::string> labelled_jobs_ ABSL_GUARDED_BY(labels_mu_);
  // (job label, member label) -> its series of hsbn_round_timeouts_total.
  std::map<std::pair<std::string, std::string>, prometheus::Counter*> timeouts_
      ABSL_GUARDED_BY(labels_mu_);

  std::shared_ptr<StateCollector> state_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_METRICS_H_

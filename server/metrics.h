// server/metrics.h — the aggregator's Prometheus metrics (--metrics-listen).
//
// Two kinds of metrics:
//  - event counters and histograms (rounds by scope, phase and outcome, round latency, bytes,
//    joins, timeouts and whom they waited for), updated on the hot path through handles that
//    are created once and cached, so recording a round allocates no label set;
//  - state gauges (jobs, members, open rounds, shadow divergence, limits), computed only when
//    /metrics is scraped, from the same snapshot as the Status RPC: nothing on the hot path.
//
// Every series carries the constant label `role` (node or root). Per-job series use the label
// `job_id` (not `job`, which Prometheus reserves for the scrape job).
//
// Thread safety: all methods are thread-safe.
#ifndef HSBN_SERVER_METRICS_H_
#define HSBN_SERVER_METRICS_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

class Metrics {
 public:
  enum class Link { kMembers = 0, kUpstream = 1 };  // the peers below, the parent above

  // `role`: "node" or "root"; `has_upstream`: a sidecar with --upstream (it gets the upstream
  // byte counters and hsbn_upstream_connected).
  Metrics(const std::string& role, bool has_upstream);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // A round finished here with `code` (OK: its result was sent). `seconds` is the time from
  // its first contribution until then; negative when the round never opened here.
  void RoundFinished(v1::Scope scope, v1::Phase phase, absl::StatusCode code, double seconds);
  // A round of `job_id` timed out waiting for `member` ("rank 3", "node 1", "upstream").
  void RoundTimedOut(const std::string& job_id, const std::string& member);
  // One protocol message (of `bytes` serialized bytes) received or sent on `link`.
  void Received(Link link, size_t bytes);
  void Sent(Link link, size_t bytes);
  void JoinAnswered(absl::StatusCode code);
  void SetUpstreamConnected(bool connected);

  // Limits, exported as gauges so that alerts can compare against them.
  void SetLimits(int64_t max_jobs, int64_t max_open_rounds, int64_t max_channels);
  // Where the state gauges come from (called once per scrape).
  void SetStateSource(std::function<v1::StatusResponse()> source);

  // Starts the HTTP endpoint (/metrics) on host:port (port 0: a free one). Returns the bound
  // "host:port".
  absl::StatusOr<std::string> Serve(const std::string& address);
  // Stops the HTTP endpoint (before the state source goes away).
  void StopServing();

  // Most (job, member) timeout series kept; beyond it, timeouts count under
  // job_id="_other", member="_other".
  static constexpr size_t kMaxTimeoutSeries = 1000;

 private:
  class StateCollector;
  static constexpr int kScopes = 4;   // unspecified, node, global, shadow
  static constexpr int kPhases = 3;   // unspecified, forward, backward
  static constexpr int kCodes = 17;   // gRPC codes 0..16

  prometheus::Counter& RoundCounter(int scope, int phase, int code);

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

  std::mutex timeouts_mu_;
  std::map<std::pair<std::string, std::string>, prometheus::Counter*> timeouts_;

  std::shared_ptr<StateCollector> state_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_METRICS_H_

// server/aggregator.h — the hsbn aggregation service (one process, node or root role).
//
// An Aggregator serves the hsbn.v1.Aggregator gRPC service with the async (completion-queue)
// API, driven by event threads of its own (one by default, --event-threads): each drains its
// own completion queue and runs every event inline (a small call-state object per RPC, one tag
// per operation); a call's events all come back to the queue it was accepted on. The sidecar's
// stream to its root completes on the first queue, so no gRPC callback-API thread exists in
// the process. Jobs and sessions live in a transport-independent Registry (registry.h): jobs
// are created by their first Join and dropped when every member has gone or none is attached
// for --attach-timeout-ms. Rounds travel through transports (transport.h), which this class
// tells of each event of the job lifecycle through one interface, naming none: the member
// streams (stream_transport.h: the gRPC calls, every role) and, at a sidecar, the
// shared-memory node path (shm_transport.h). The upstream link reaches this class only
// through UpstreamListener. Rounds are reduced on the event thread when the last contribution
// arrives (or on the deadline thread when they expire); results go out through each stream's
// outbox without blocking, from whichever thread has them.
//
// In the node role (a sidecar) workers join it; rounds whose scope reaches above the node are
// forwarded to the parent (--upstream) over one persistent stream shared by all jobs. In the
// group role the sidecars of one group of nodes per job join it; group rounds complete there,
// wider ones are merged and forwarded to the root (--upstream). In the root role sidecars (or
// group aggregators) join it, one member per node (group).
//
// Thread safety: all public methods are thread-safe.
#ifndef HSBN_SERVER_AGGREGATOR_H_
#define HSBN_SERVER_AGGREGATOR_H_

#include <atomic>
#include <memory>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/completion_queue.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "event.h"
#include "job.h"
#include "log.h"
#include "metrics.h"
#include "parent_link.h"
#include "poll_window.h"
#include "registry.h"
#include "stream_transport.h"
#include "stream_writer.h"
#include "tokens.h"
#include "transport.h"

namespace hsbn::server {

struct AggregatorOptions {
  enum class Role { kNode, kGroup, kRoot };
  Role role = Role::kNode;
  std::string id = "hsbn-aggregator";
  std::string upstream;  // parent address (node: optional, single-node jobs only without it;
                         // group: required)
  JobLimits limits;
  int32_t max_jobs = 256;
  std::chrono::milliseconds tick{10};  // deadline check period
  // --upstream-ca/--upstream-cert/--upstream-key/--upstream-tls-name: TLS to the parent when
  // upstream_ca_pem is set; a client certificate when upstream_cert_pem is set too.
  std::string upstream_ca_pem, upstream_cert_pem, upstream_key_pem, upstream_tls_name;
  std::shared_ptr<TokenStore> tokens;  // --token-file; null: Join needs no token
  std::shared_ptr<Metrics> metrics;    // --metrics-listen; null: no metrics
  // Resource bounds (docs/DEPLOY.md, "Limits"); exceeding one answers RESOURCE_EXHAUSTED to the
  // offender only.
  int32_t max_world_size = 16384;                  // --max-world-size: WORLD_SIZE at Join
  int64_t memory_budget_bytes = int64_t(1) << 30;  // --memory-budget-bytes: all jobs' round data
  int64_t max_queued_bytes = int64_t(64) << 20;    // --max-queued-bytes: unsent bytes per stream
  std::chrono::milliseconds write_deadline{10000};  // --write-deadline-ms: one write's longest wait
  std::chrono::milliseconds attach_timeout{60000};  // --attach-timeout-ms: joined, never attached
  int64_t max_unbound_bytes = int64_t(1) << 20;    // --max-unbound-bytes: sent before any Attach
  std::string divergence_dir;  // --divergence-dir: where a finished job's shadow record goes
  // Node role: the shared-memory node path (shm_transport.h). --shm=off disables it; the socket
  // where workers fetch segments is derived from --listen by main.
  bool shm = true;
  std::string shm_socket;
  mode_t socket_mode = 0660;
  int32_t shm_ring = 16;                           // --shm-ring
  int32_t shm_max_channels = 8192;                 // --shm-max-channels
  std::chrono::milliseconds shm_wait{30000};       // --shm-wait-ms
  // --poll-us: after forwarding a partial whose answer the node's ranks wait for (global and
  // group scope), the first event thread polls its queue for the parent's answer, for at most
  // this long (poll_window.h), instead of sleeping. 0: it sleeps (a wake-up per answer).
  int64_t poll_us = 0;
  // --lagged-hold-ms: the node role holds a job's lagged partials until their pass ends, then
  // sends them as one batch, at most this long after the first (pass_batcher.h). 0: each
  // partial leaves at once.
  std::chrono::milliseconds lagged_hold{50};
};

// "node", "group" or "root": the role's name in --role, Status and metrics.
const char* RoleName(AggregatorOptions::Role role);

class Aggregator final : public UpstreamListener, public TransportHost {
 public:
  explicit Aggregator(AggregatorOptions options);
  ~Aggregator() override;

  // Register with the grpc::ServerBuilder.
  grpc::Service* service() { return &service_; }
  // After ServerBuilder::BuildAndStart: `cqs` are the builder's AddCompletionQueue()s, one per
  // event thread (--event-threads). Starts the parent link (on the first queue), the deadline
  // thread and one event thread per queue, and requests the first calls on every queue.
  void Start(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs);

  // Fails every open round with UNAVAILABLE and stops the deadline thread and the parent link.
  // Call before shutting the gRPC server down, so the failures reach the clients.
  void Shutdown(const std::string& why);
  // Call after the gRPC server's Shutdown: shuts the completion queues down; the event threads
  // drain them (deleting every call state) and exit; returns when they have.
  void StopEvents();
  // Starts one gRPC operation by calling `start()`, unless the completion queues are being shut
  // down: then starts nothing and returns false. Any thread. A queue is never shut down while an
  // operation is being started on it (starting one on a shut-down queue aborts in gRPC).
  template <typename F>
  bool StartOp(F&& start) {
    std::shared_lock<std::shared_mutex> lock(gate_);
    if (draining_) return false;
    start();
    return true;
  }
  bool draining() {
    std::shared_lock<std::shared_mutex> lock(gate_);
    return draining_;
  }
  v1::Aggregator::AsyncService* async_service() { return &service_; }
  ParentLink* parent() { return parent_.get(); }
  Registry& registry() { return registry_; }
  const WriterLimits& writer_limits() const { return writer_limits_; }

  // UpstreamListener (called by the parent link).
  void OnParentResult(const std::string& job_id, const v1::Result& result) override;
  void OnParentLost(const absl::Status& status) override;
  bool NodeDown(const std::string& job_id, std::string* message) override;

  // The unary methods, run on the event thread.
  grpc::Status Join(const v1::JoinRequest& req, v1::JoinResponse* resp);
  grpc::Status Leave(const v1::LeaveRequest& req);
  // The Status RPC: what `req` may see (Registry::StatusJobs), or why not.
  grpc::Status AnswerStatus(const v1::StatusRequest& req, v1::StatusResponse* resp);
  // Every job (or the one named), unfiltered: for this process's own metrics.
  void FillStatus(const std::string& job_id, v1::StatusResponse* resp);

  // Used by the streams and (TransportHost) every transport.
  void Execute(Actions& actions, const std::string& job_id) override;
  void StreamClosed(const std::vector<SessionId>& sessions);
  // A worker's Abort frame: its session is gone, for `reason` (docs/PROTOCOL.md, "Abort").
  // A worker of `job_id` waits for round `key`'s late result: a held partial of it leaves.
  void LateWanted(const std::string& job_id, const RoundKey& key) {
    if (parent_) parent_->Wanted(job_id, key);
  }
  void MemberAborted(const Registry::SessionRef& ref, const SessionId& session,
                     const std::string& reason);
  // Counts a refusal for lack of a resource (Metrics::Refused reasons).
  void Refused(const char* reason);
  // Logs invalid input from a client, escaped and rate-limited.
  void LogInvalid(const std::string& what);
  Metrics* metrics() const { return options_.metrics.get(); }
  const AggregatorOptions& options() const { return options_; }

 private:
  void TickLoop();
  // The transports of this role, in the order every event reaches them.
  void StartTransports();
  // A job the Registry dropped: its record saved, every transport and the parent told.
  void Dropped(const Registry::Dropped& d);
  void EventLoop(grpc::ServerCompletionQueue* cq, size_t index);
  // --poll-us: after a forward that waits for an answer, the first event thread polls until
  // poll_until_ns_ (steady clock; 0: it sleeps), the window learned by poll_ (null: no poll).
  void ArmPoll();
  std::unique_ptr<PollWindow> poll_;
  std::atomic<int64_t> poll_until_ns_{0};

  const AggregatorOptions options_;
  const Clock::time_point started_;
  Registry registry_;
  WriterLimits writer_limits_;
  std::unique_ptr<ParentLink> parent_;
  // Every event of the job lifecycle reaches each, in this order; set by Start, then fixed.
  std::vector<std::unique_ptr<Transport>> transports_;
  StreamTransport* streams_ = nullptr;  // the member streams, one of transports_
  // "shm", "grpc: <why>" or "pending": how the node's rounds of `job_id` travel (Status).
  std::string NodeTransport(const std::string& job_id) const;

  absl::Mutex tick_mu_;
  bool stopping_ ABSL_GUARDED_BY(tick_mu_) = false;
  std::thread ticker_;

  v1::Aggregator::AsyncService service_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs_;
  std::shared_mutex gate_;  // StartOp holds it shared; StopEvents sets draining_ exclusively
  bool draining_ = false;
  std::vector<std::thread> events_;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_AGGREGATOR_H_

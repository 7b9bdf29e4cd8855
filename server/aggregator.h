// server/aggregator.h — the hsbn aggregation service (one process, node or root role).
//
// An Aggregator serves the hsbn.v1.Aggregator gRPC service with the callback API: one reactor
// per Exchange stream, no thread of its own per stream. Jobs are created by their first Join
// and dropped when every member has gone. Rounds are reduced on the gRPC thread that delivers
// the last contribution; results go out through each stream's outbox without blocking.
//
// In the node role (a sidecar) workers join it; rounds whose scope reaches above the node are
// forwarded to the parent (--upstream) over one persistent stream shared by all jobs. In the
// root role sidecars join it, one member per node.
//
// Thread safety: all public methods are thread-safe.
#ifndef HSBN_SERVER_AGGREGATOR_H_
#define HSBN_SERVER_AGGREGATOR_H_

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "job.h"
#include "log.h"
#include "metrics.h"
#include "tokens.h"

namespace hsbn::server {

class ParentLink;

struct AggregatorOptions {
  enum class Role { kNode, kRoot };
  Role role = Role::kNode;
  std::string id = "hsbn-aggregator";
  std::string upstream;  // parent address; node role only; empty: single-node jobs only
  JobLimits limits;
  int32_t max_jobs = 256;
  std::chrono::milliseconds tick{10};  // deadline check period
  // --upstream-ca/--upstream-cert/--upstream-key/--upstream-tls-name: TLS to the parent when
  // upstream_ca_pem is set; a client certificate when upstream_cert_pem is set too.
  std::string upstream_ca_pem, upstream_cert_pem, upstream_key_pem, upstream_tls_name;
  std::shared_ptr<TokenStore> tokens;  // --token-file; null: Join needs no token
  std::shared_ptr<Metrics> metrics;    // --metrics-listen; null: no metrics
};

class Aggregator final : public v1::Aggregator::CallbackService {
 public:
  explicit Aggregator(AggregatorOptions options);
  ~Aggregator() override;

  // Fails every open round with UNAVAILABLE and stops the deadline thread and the parent link.
  // Call before shutting the gRPC server down, so the failures reach the clients.
  void Shutdown(const std::string& why);

  // Called by the parent link.
  void OnParentResult(const std::string& job_id, const v1::Result& result);
  void OnParentLost(const absl::Status& status);

  // Callback-service methods.
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerBidiReactor<v1::ClientFrame, v1::ServerFrame>* Exchange(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest* req,
                                  v1::LeaveResponse* resp) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* ctx, const v1::StatusRequest* req,
                                   v1::StatusResponse* resp) override;

  // Used by the stream reactor.
  struct SessionRef {
    std::shared_ptr<Job> job;
    int32_t index = -1;
  };
  bool FindSession(uint64_t session, SessionRef* out);
  void Execute(Actions& actions, const std::string& job_id);
  void StreamClosed(const std::vector<uint64_t>& sessions, bool graceful);
  // This aggregator's status (every job when job_id is empty), as the Status RPC answers it.
  void FillStatus(const std::string& job_id, v1::StatusResponse* resp);
  Metrics* metrics() const { return options_.metrics.get(); }
  const AggregatorOptions& options() const { return options_; }

 private:
  absl::Status DoJoin(const v1::JoinRequest& req, v1::JoinResponse* resp);
  void TickLoop();

  const AggregatorOptions options_;
  const Clock::time_point started_;
  std::unique_ptr<ParentLink> parent_;

  std::mutex mu_;  // guards jobs_, sessions_, rng_
  std::map<std::string, std::shared_ptr<Job>> jobs_;
  std::map<uint64_t, SessionRef> sessions_;
  std::mt19937_64 rng_;

  std::mutex tick_mu_;
  std::condition_variable tick_cv_;
  bool stopping_ = false;
  std::thread ticker_;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_AGGREGATOR_H_

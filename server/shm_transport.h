// server/shm_transport.h — the sidecar's shared-memory node path: a second transport of the
// Registry's jobs, beside the member streams.
//
// Workers still Join and keep their Exchange stream (the control plane and their liveness
// signal). A worker that offered shared memory at Join then connects to this transport's Unix
// socket and presents its session (and the job's token when tokens are on): the Registry says
// which job and local rank the session is, so only a process that joined a job can obtain that
// job's segment. Once every local rank of the job on this node has offered and presented its
// session, the transport creates the job's segment (shm_segment.h: a sealed memfd charged to the
// MemoryBudget) and passes it, with the job's doorbell eventfd, to every rank over SCM_RIGHTS.
// If any rank declines, or has not presented its session within --shm-wait-ms, or the segment
// cannot be made, every rank is told "grpc: <why>": a node's rounds never mix transports.
//
// Node rounds then run among the workers alone. Global and shadow partials arrive on the
// doorbell; the transport's thread hands them to the aggregator (TransportHost::Execute), which
// forwards them to the root through the parent link as for streamed rounds; the root's answers come back
// through ParentResult and are written into the slots. A worker whose stream breaks is marked
// gone in the segment (MemberGone), which fails the others' open rounds at once.
//
// Thread safety: all public methods are thread-safe. One thread of its own runs the socket,
// the hand-offs and the doorbells; the other methods run on the caller's thread.
#ifndef HSBN_SERVER_SHM_TRANSPORT_H_
#define HSBN_SERVER_SHM_TRANSPORT_H_

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "hsbn/v1/hsbn.pb.h"
#include "job.h"
#include "metrics.h"
#include "registry.h"
#include "shm_segment.h"
#include "transport.h"

namespace hsbn::server {

struct ShmOptions {
  std::string socket;                 // a path, or "@name" (abstract)
  mode_t socket_mode = 0660;
  int32_t ring = 16;                  // --shm-ring
  int32_t max_channels = 8192;        // --shm-max-channels
  std::chrono::milliseconds wait{30000};  // --shm-wait-ms
  bool has_parent = false;
  std::chrono::milliseconds round_timeout{30000};
  Metrics* metrics = nullptr;         // optional: where the segments' round counters go
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(ShmOptions options, Registry* registry, TransportHost* host);
  ~ShmTransport() override;

  // Binds the socket and starts the thread.
  absl::Status Start();
  const std::string& socket() const { return options_.socket; }

  // Transport (transport.h), as this transport reads each event:
  // Shutdown: invalidates every segment (open rounds fail UNAVAILABLE with the status's
  // message, the segment's text: at most shm::kTextBytes - 1 bytes of it) and stops the thread.
  void Shutdown(const absl::Status& closing) override;
  // CheckJoin: a worker's Join is refused (FAILED_PRECONDITION) when the job's node already
  // uses shared memory and this worker does not offer it (its rounds could not meet the
  // others'), unless it starts a new run of the job (a higher incarnation than the Registry's).
  absl::Status CheckJoin(const v1::JoinRequest& req) override;
  // Joined: fills a worker's shm fields (the socket, or "grpc: <why>").
  void Joined(const v1::JoinRequest& req, int32_t index, v1::JoinResponse* resp) override;
  void Refused(const std::string& job_id, const absl::Status& refusal) override;
  // MemberGone: marks the rank gone in the segment, which fails the others' open rounds.
  void MemberGone(const std::string& job_id, int32_t index, bool left,
                  const std::string& aborted) override;
  // JobDropped: the job's segment is invalidated, and open rounds in it fail with `why`.
  void JobDropped(const std::string& job_id, const std::string& why) override;
  // ParentResult: written into the round's slots when this transport forwarded the round.
  bool ParentResult(const std::string& job_id, const v1::Result& result) override;
  void ParentLost(const absl::Status& status) override;
  // Describe: "shm", "grpc: <why>", "pending", or "" for a job this transport does not know.
  std::string Describe(const std::string& job_id) const override;
  // AddCounts: the rounds answered through the job's segment.
  void AddCounts(const std::string& job_id, v1::JobStatus* status) const override;
  // HarvestMetrics: what the segments counted (rounds by scope, phase and code; non-finite
  // values). Runs on every tick of this transport's thread and when a segment is released too.
  void HarvestMetrics() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class Decision { kPending, kShm, kGrpc };
  struct Forwarded {
    int64_t channels = 0;
    Clock::time_point at;
  };
  struct NodeJob {
    std::string id;
    int32_t ranks = 0;
    Decision decision = Decision::kPending;
    std::string reason;               // kGrpc: why
    std::vector<int> offer;           // per local rank: 0 not joined, 1 offered, 2 declined
    std::vector<int> waiting;         // hand-off connection waiting for the answer, or -1
    Clock::time_point deadline;
    std::shared_ptr<shm::Segment> segment;
    int doorbell = -1;                // eventfd
    int64_t charged = 0;
    std::map<std::tuple<uint32_t, uint64_t, int32_t>, Forwarded> forwarded;
    // The segment's metric counters as last harvested (rounds, then non-finite values).
    std::vector<uint64_t> harvested;
  };
  struct HandoffConn {
    int fd = -1;
    Clock::time_point opened;
    bool answered = false;
  };

  void Loop();
  void Accept() ABSL_LOCKS_EXCLUDED(mu_);
  void Hello(int fd) ABSL_LOCKS_EXCLUDED(mu_);
  void Doorbell(const std::string& job_id, int fd) ABSL_LOCKS_EXCLUDED(mu_);
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);
  // Decides when every rank offered and presented its session (or one declined, or time ran
  // out), answering the waiting connections.
  void MaybeDecideLocked(NodeJob& job, Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DecideGrpcLocked(NodeJob& job, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendShmLocked(NodeJob& job, int fd, int32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseConnLocked(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HarvestLocked(NodeJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(NodeJob& job, const std::string& why = "the job ended at the sidecar")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  NodeJob& JobLocked(const std::string& job_id, int32_t ranks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ShmOptions options_;
  Registry* const registry_;
  TransportHost* const host_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that stops the loop
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, NodeJob> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<int, HandoffConn> conns_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> doorbells_ ABSL_GUARDED_BY(mu_);  // eventfd -> job id
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_SHM_TRANSPORT_H_

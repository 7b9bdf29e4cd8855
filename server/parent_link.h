// server/parent_link.h — a sidecar's one persistent stream to its parent (root) aggregator.
//
// Forward() and Abort() never block. When the stream is up and the job already joined at the
// parent, the frame goes straight to the stream's write queue from the calling thread; otherwise
// it queues for a connect thread, which connects (lazily, and again after a failure), joins
// each job at the parent once (blocking unary calls, off the hot path), and then hands the frame
// to the stream. The stream (Conn) is a gRPC async-API call on the aggregator's first
// completion queue, so its completions run on that queue's event thread: one write in flight at
// a time, and whatever queued meanwhile goes out as one FrameBatch message when the root accepts
// batches, so many rounds in flight cost one message, not one each. Results (single or
// batched) are handed to the Aggregator from the event thread when a read completes. A node
// whose worker crashed is reported to the root (NodeState). When the stream breaks, the
// Aggregator is told at once so that every
// round waiting on the parent fails with UNAVAILABLE instead of at its deadline; the next
// forward reconnects. gRPC keepalive pings the root every 10 s when the link is idle, so a
// half-open link (the root's machine vanished) is noticed within about 15 s.
//
// Thread safety: all public methods are thread-safe.
#ifndef HSBN_SERVER_PARENT_LINK_H_
#define HSBN_SERVER_PARENT_LINK_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "grpcpp/security/credentials.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "job.h"
#include "metrics.h"
#include "session.h"
#include "stream_writer.h"

namespace hsbn::server {

// What the upstream link needs from the aggregator that owns it, and nothing more.
class UpstreamListener {
 public:
  virtual ~UpstreamListener() = default;
  // The parent's answer (or failure) for a round forwarded for `job_id`.
  virtual void OnParentResult(const std::string& job_id, const v1::Result& result) = 0;
  // The stream to the parent broke: every round waiting for it must fail with `status`.
  virtual void OnParentLost(const absl::Status& status) = 0;
  // Whether this node is down in `job_id` (a worker gone), and why.
  virtual bool NodeDown(const std::string& job_id, std::string* message) = 0;
};

class ParentLink {
 public:
  struct Options {
    std::string address;
    std::string id;
    // Insecure, or TLS (grpc::SslCredentials); `tls_name`, when not empty, overrides the name
    // the parent's certificate must carry (default: the host in `address`).
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    bool tls = false;
    std::string tls_name;
    WriterLimits writer;        // bounds of the stream's write queue
    Metrics* metrics = nullptr;  // may be null
  };
  // `cq`: the aggregator's completion queue, drained by its event thread; it must outlive
  // Shutdown(). `listener` must outlive this link.
  ParentLink(UpstreamListener* listener, Options options, grpc::CompletionQueue* cq);
  ~ParentLink();

  // `token`: the job's token at this aggregator, presented when joining the job at the parent.
  void Forward(const std::string& job_id, const JobLayout& layout,
               std::shared_ptr<const std::string> token, const Actions::Forward& f);
  void Abort(const std::string& job_id, const JobLayout& layout,
             std::shared_ptr<const std::string> token, const Actions::Abort& a);
  // This node is down in the job (a worker crashed) or back: tell the parent, if it holds the
  // node's session in the job (never connects or joins just for this).
  void NodeState(const std::string& job_id, const Actions::NodeState& state);
  // The job was dropped here: leave it at the parent too, so the parent can drop it.
  void Leave(const std::string& job_id);
  // Asks the parent for its status; `done` runs on the event thread (at once, on the calling
  // thread, when the link is shutting down).
  void Status(const v1::StatusRequest& request,
              std::function<void(const grpc::Status&, const v1::StatusResponse&)> done);
  void Shutdown();
  // Ends the stream if its write has waited past the write deadline (the root stopped reading).
  void CheckStalled(std::chrono::steady_clock::time_point now);
  const std::string& address() const { return address_; }

 private:
  struct Item {
    std::string job_id;
    JobLayout layout;
    std::shared_ptr<const std::string> token;
    v1::ClientFrame frame;
    RoundKey key;
    bool wants_answer = false;  // a global round: its failure to send must fail the round
    bool leave = false;         // not a frame: leave job_id at the parent
  };
  class Conn;
  class StatusCall;

  static Item MakeItem(const std::string& job_id, const JobLayout& layout,
                       std::shared_ptr<const std::string> token, const RoundKey& key);
  void Enqueue(Item item);
  void Unpublish();
  void WriterLoop();
  absl::Status Send(Item& item);
  void FailItem(const Item& item, const absl::Status& status);
  // Called by Conn's reactions.
  void Deliver(const v1::Result& result);
  void ConnDone(const grpc::Status& status);
  void StatusDone(StatusCall* call);

  UpstreamListener* const listener_;
  const std::string address_;
  const std::string id_;
  const bool tls_;
  const WriterLimits writer_limits_;
  Metrics* const metrics_;
  grpc::CompletionQueue* const cq_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Aggregator::Stub> stub_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::mutex jobs_mu_;  // guards job_of_session_ (read on the event thread when results arrive)
  absl::flat_hash_map<SessionId, std::string> job_of_session_;
  std::shared_ptr<Conn> conn_;  // owned by the writer thread
  int live_conns_ = 0;          // under mu_: streams and Status calls not finished yet
  std::set<StatusCall*> status_calls_;  // under mu_: cancelled by Shutdown
  // The writer thread publishes an established stream and the jobs joined on it (under mu_),
  // so that Forward/Abort can write at once from the calling thread when nothing is queued,
  // without a hop to the writer thread.
  std::shared_ptr<Conn> published_;
  std::map<std::string, SessionId> published_sessions_;
  // Writer thread only: the last session each job had at the parent, sent as
  // previous_session when joining again on a new stream (the parent may not have noticed
  // that the old stream is gone, and would refuse a second live session for the node).
  std::map<std::string, SessionId> last_session_;
  absl::Status last_connect_error_;                  // writer thread only
  std::chrono::steady_clock::time_point retry_after_;  // writer thread only
  std::thread writer_;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_PARENT_LINK_H_

// server/parent_link.h — a sidecar's one persistent stream to its parent (root) aggregator.
//
// Forward() and Abort() never block. When the stream is up and the job already joined at the
// parent, the frame goes straight to the stream's write queue from the calling thread; otherwise
// it queues for a connect thread, which connects (lazily, and again after a failure) and joins
// each job at the parent once. A Join at the parent is an async unary call: a job whose Join
// is in flight parks its own frames until it completes, and every other job's frames go on. A
// job that ends here leaves the parent with a Leave frame on the stream, after its partials. The stream (ParentStream) is a gRPC async-API call on the aggregator's first
// completion queue, so its completions run on that queue's event thread: writes go through a
// bounded StreamWriter (one in flight, batches when the root accepts them). Results (single or
// batched) reach the aggregator through UpstreamListener from the event thread. A node whose
// worker crashed is reported to the root (NodeState). When the stream breaks, the listener is
// told at once so that every round waiting on the parent fails with UNAVAILABLE instead of at
// its deadline; the next forward reconnects. gRPC keepalive pings the root every 10 s when the
// link is idle, so a half-open link (the root's machine vanished) is noticed within about 15 s.
//
// Thread safety: all public methods are thread-safe.
#ifndef HSBN_SERVER_PARENT_LINK_H_
#define HSBN_SERVER_PARENT_LINK_H_

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <variant>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/credentials.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "job.h"
#include "metrics.h"
#include "pass_batcher.h"
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
    std::string self = "this node's sidecar";  // this aggregator, in errors
    // --lagged-hold-ms: a job's lagged partials wait for the end of their pass and leave
    // together, at most this long after the first (pass_batcher.h); 0: each leaves at once.
    std::chrono::milliseconds lagged_hold{0};
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
  // Layer names of the job, for the parent's Status (joins the job at the parent if need be,
  // in order with its partials).
  void LayerNames(const std::string& job_id, const JobLayout& layout,
                  std::shared_ptr<const std::string> token,
                  const std::vector<v1::LayerName>& names);
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
  // Sends the lagged partials held since `lagged_hold` or longer (the aggregator's tick).
  void FlushHeld(std::chrono::steady_clock::time_point now) ABSL_LOCKS_EXCLUDED(hold_mu_);
  // A worker of the job waits for round `key`'s late result (v1::LateWanted): the job's held
  // partials leave now if that round's is among them; if it has not come yet, it will not be
  // held when it comes.
  void Wanted(const std::string& job_id, const RoundKey& key) ABSL_LOCKS_EXCLUDED(hold_mu_);
  const std::string& address() const { return address_; }

 private:
  // One entry of the writer's queue, for job_id: a frame for the job's session at the parent,
  // a Leave of the job, or the completion of the job's Join (acted on by the writer thread only,
  // in order with the job's frames).
  struct Frame {
    JobLayout layout;
    std::shared_ptr<const std::string> token;
    v1::ClientFrame frame;
    RoundKey key;
    bool contribution = false;  // a partial: its failure to send is reported (FailItem)
    bool wants_answer = false;  // ... to the listener, failing its round (not shadow)
  };
  struct LeaveItem {};
  struct JoinDoneItem {
    grpc::Status status;
    v1::JoinResponse response;
    std::shared_ptr<void> joined_on;  // the stream it was made on
  };
  struct Item {
    std::string job_id;
    std::variant<Frame, LeaveItem, JoinDoneItem> what;
  };
  class ParentStream;
  template <typename Req, typename Resp>
  class UnaryCall;

  static Item MakeItem(const std::string& job_id, const JobLayout& layout,
                       std::shared_ptr<const std::string> token, const RoundKey& key);
  // The frame of a Frame item, null for the others.
  static void SetSession(v1::ClientFrame* frame, const SessionId& session);
  static v1::ClientFrame* FrameOf(Item& item) {
    Frame* f = std::get_if<Frame>(&item.what);
    return f ? &f->frame : nullptr;
  }
  void Enqueue(Item item) ABSL_LOCKS_EXCLUDED(mu_);
  // The stream `item` may be written on from the calling thread (a frame, nothing queued for
  // the writer thread, the stream up, its job joined there), and the job's session on it; null
  // when it must go through the writer thread.
  std::shared_ptr<ParentStream> FastPathLocked(Item& item, SessionId* session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every frame of a job enters here: with --lagged-hold-ms its lagged partials are held
  // (pass_batcher.h), and what leaves goes out in order through one drainer at a time. `pass`:
  // 0 for a forward partial, 1 for a backward one, -1 for any other frame.
  void Submit(Item item, bool lagged, uint32_t op, int pass) ABSL_LOCKS_EXCLUDED(hold_mu_);
  // Moves a job's held frames to the outbox. hold_mu_ held.
  void ReleaseHeldLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hold_mu_);
  // Sends the outbox in order, unless another thread is already doing so (it sends ours too).
  void Drain() ABSL_LOCKS_EXCLUDED(hold_mu_);
  // Enqueue for several items, in order: on the fast path one write (a batch frame).
  void EnqueueAll(std::deque<Item> items) ABSL_LOCKS_EXCLUDED(mu_);
  void Unpublish() ABSL_LOCKS_EXCLUDED(mu_);
  void WriterLoop() ABSL_LOCKS_EXCLUDED(mu_);
  bool WriterHasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }
  // Writer thread: sends `item` (or parks it until its job's Join at the parent completes).
  absl::Status Send(Item& item);
  // Send's steps: a job's Leave (after its Join and frames when that Join is in flight; never
  // connecting just to leave); the stream to the parent, reconnected when it broke (failing at
  // once for 2 s after a failed connect, and after a short wait when the parent said it stops).
  void SendLeave(Item& item);
  absl::Status EnsureConnected();
  void StartJoin(const std::string& job_id, const Frame& first);
  void Joined(const std::string& job_id, const JoinDoneItem& done);
  void SendJoined(Item& item, const SessionId& session);
  // Writer thread: every parked item fails with `status` (the stream they waited for is gone).
  void FailParked(const absl::Status& status);
  void FailItem(const Item& item, const absl::Status& status);
  // Starts an async unary call on cq_, counted in live_conns_; `done` runs on the event thread.
  // False (nothing started, `done` not called) once the link is stopping.
  template <typename Req, typename Resp>
  bool StartUnary(
      std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> (v1::Aggregator::Stub::*prepare)(
          grpc::ClientContext*, const Req&, grpc::CompletionQueue*),
      const Req& req, std::chrono::milliseconds timeout,
      std::function<void(const grpc::Status&, const Resp&)> done) ABSL_LOCKS_EXCLUDED(mu_);
  void UnaryDone(void* call) ABSL_LOCKS_EXCLUDED(mu_);
  // Called by ParentStream's reactions.
  void Deliver(const v1::Result& result) ABSL_LOCKS_EXCLUDED(jobs_mu_);
  void ConnDone(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  // The parent, in errors and logs: "root", or "group aggregator" once a Join's answer said so.
  std::string Parent() const ABSL_LOCKS_EXCLUDED(name_mu_) {
    absl::MutexLock lock(&name_mu_);
    return parent_;
  }
  std::string ParentLong() const {
    std::string p = Parent();
    return p == "root" ? "root aggregator" : p;
  }

  UpstreamListener* const listener_;
  const std::string self_;
  mutable absl::Mutex name_mu_;
  std::string parent_ ABSL_GUARDED_BY(name_mu_) = "root";
  const std::string address_;
  const std::string id_;
  const bool tls_;
  const WriterLimits writer_limits_;
  Metrics* const metrics_;
  grpc::CompletionQueue* const cq_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Aggregator::Stub> stub_;

  mutable absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int live_conns_ ABSL_GUARDED_BY(mu_) = 0;  // streams and unary calls not finished yet
  // Unary calls in flight, cancelled by Shutdown.
  std::map<void*, std::function<void()>> unary_calls_ ABSL_GUARDED_BY(mu_);
  // The writer thread publishes an established stream and the jobs joined on it, so that
  // Forward/Abort can write at once from the calling thread when nothing is queued, without a
  // hop to the writer thread.
  std::shared_ptr<ParentStream> published_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, SessionId> published_sessions_ ABSL_GUARDED_BY(mu_);
  absl::Mutex jobs_mu_;  // read on the event thread when results arrive
  absl::flat_hash_map<SessionId, std::string> job_of_session_ ABSL_GUARDED_BY(jobs_mu_);
  // Writer thread only.
  std::shared_ptr<ParentStream> conn_;
  // Jobs whose Join at the parent is in flight on conn_, and the items waiting for it: a slow
  // Join delays its own job's frames only, never another job's.
  std::map<std::string, std::deque<Item>> parked_;
  // The last session each job had at the parent, sent as previous_session when joining again
  // on a new stream (the parent may not have noticed that the old stream is gone, and would
  // refuse a second live session for the node).
  std::map<std::string, SessionId> last_session_;
  absl::Status last_connect_error_;
  // Set when the parent ended the stream because it is stopping (reason SHUTTING_DOWN): later
  // forwards that find no parent fail at once with its words; cleared by a new connection.
  absl::Status parent_stopped_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point retry_after_;
  std::thread writer_;

  // --lagged-hold-ms (pass_batcher.h). Never held together with mu_.
  struct Held {
    PassBatcher batcher;
    std::vector<Item> items;
    int64_t bytes = 0;
    // Rounds a worker waits for that had not come here yet (at most kMaxWanted, oldest first).
    std::deque<RoundKey> wanted;
  };
  const std::chrono::milliseconds lagged_hold_;
  absl::Mutex hold_mu_;
  std::map<std::string, Held> held_ ABSL_GUARDED_BY(hold_mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(hold_mu_) = 0;  // over all jobs
  std::deque<Item> outbox_ ABSL_GUARDED_BY(hold_mu_);
  bool draining_ ABSL_GUARDED_BY(hold_mu_) = false;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_PARENT_LINK_H_

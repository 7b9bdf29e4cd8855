// server/parent_link.h — a sidecar's one persistent stream to its parent (root) aggregator.
//
// Forward() and Abort() queue a frame and return at once; a writer thread connects (lazily,
// and again after a failure), joins each job at the parent once, and writes the frames in
// order. A reader thread hands the parent's results back to the Aggregator. When the stream
// breaks, the Aggregator is told at once so that every round waiting on the parent fails with
// UNAVAILABLE instead of at its deadline; the next forward reconnects.
//
// Thread safety: all public methods are thread-safe.
#ifndef HSBN_SERVER_PARENT_LINK_H_
#define HSBN_SERVER_PARENT_LINK_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "grpcpp/security/credentials.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "job.h"

namespace hsbn::server {

class Aggregator;

class ParentLink {
 public:
  // `credentials`: insecure, or TLS (grpc::SslCredentials); `tls_name`, when not empty,
  // overrides the name the parent's certificate must carry (default: the host in `address`).
  ParentLink(Aggregator* aggregator, std::string address, std::string id,
             std::shared_ptr<grpc::ChannelCredentials> credentials, bool tls,
             const std::string& tls_name);
  ~ParentLink();

  // `token`: the job's token at this aggregator, presented when joining the job at the parent.
  void Forward(const std::string& job_id, const JobLayout& layout,
               std::shared_ptr<const std::string> token, const Actions::Forward& f);
  void Abort(const std::string& job_id, const JobLayout& layout,
             std::shared_ptr<const std::string> token, const Actions::Abort& a);
  // The job was dropped here: leave it at the parent too, so the parent can drop it.
  void Leave(const std::string& job_id);
  // Asks the parent for its status; `done` runs on a gRPC thread.
  void Status(const v1::StatusRequest& request,
              std::function<void(const grpc::Status&, const v1::StatusResponse&)> done);
  void Shutdown();
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
  struct Conn {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream;
    std::mutex write_mu;
    std::atomic<bool> broken{false};
    std::thread reader;
    std::map<std::string, uint64_t> session_of_job;
  };

  void Enqueue(Item item);
  void Unpublish();
  void WriterLoop();
  void ReaderLoop(Conn* conn);
  absl::Status Send(Item& item);
  bool Write(Conn* conn, const v1::ClientFrame& frame);
  void FailItem(const Item& item, const absl::Status& status);

  Aggregator* const aggregator_;
  const std::string address_;
  const std::string id_;
  const bool tls_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Aggregator::Stub> stub_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::mutex jobs_mu_;  // guards job_of_session_ (read by the reader thread)
  std::map<uint64_t, std::string> job_of_session_;
  std::shared_ptr<Conn> conn_;  // owned by the writer thread
  // The writer thread publishes an established stream and the jobs joined on it (under mu_),
  // so that Forward/Abort can write at once from the calling thread when nothing is queued,
  // without a hop to the writer thread.
  std::shared_ptr<Conn> published_;
  std::map<std::string, uint64_t> published_sessions_;
  // Writer thread only: the last session each job had at the parent, sent as
  // previous_session_id when joining again on a new stream (the parent may not have noticed
  // that the old stream is gone, and would refuse a second live session for the node).
  std::map<std::string, uint64_t> last_session_;
  absl::Status last_connect_error_;                  // writer thread only
  std::chrono::steady_clock::time_point retry_after_;  // writer thread only
  std::thread writer_;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_PARENT_LINK_H_

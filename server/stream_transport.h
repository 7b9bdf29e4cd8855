// server/stream_transport.h — the member streams: the gRPC calls an aggregator serves
// (Exchange, Join, Leave, Status), and the transport of rounds over Exchange streams.
//
// Each call is a small state object driven by the aggregator's event threads (one tag per
// operation; a call's events come back to the queue it was requested on) that deletes itself
// when its last operation is back. What an Exchange stream's frames may do is MemberStream's
// policy (member_stream.h); results go out through the stream's bounded outbox
// (stream_writer.h) without blocking, from whichever thread has them. The unary calls hand
// their request to the Aggregator and answer what it returns.
//
// As a Transport (transport.h) the streams need little: rounds on them live in the Job, which
// answers each member's sink itself. They watch every stream for a write stalled past
// --write-deadline-ms (Tick), end every stream with the shutdown's status (so that a member
// between rounds reads the reason in its stream's final status, not a bare CANCELLED), and,
// at a sidecar whose node rounds have no other transport, say why (Describe, Joined).
//
// Thread safety: all public methods are thread-safe.
#ifndef HSBN_SERVER_STREAM_TRANSPORT_H_
#define HSBN_SERVER_STREAM_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/completion_queue.h"
#include "job.h"
#include "transport.h"

namespace hsbn::server {

class Aggregator;

// A member stream, as the write-deadline timer sees it.
class WatchedStream {
 public:
  virtual ~WatchedStream() = default;
  // Ends the stream if a write has waited past the write deadline; true if it did.
  virtual bool CancelIfStalled(Clock::time_point now) = 0;
  // Ends the stream with `status` once the write in flight (if any) completed.
  virtual void End(const absl::Status& status) = 0;
};

class StreamTransport final : public Transport {
 public:
  // `note`: how a sidecar's node rounds travel when no other transport carries them
  // ("grpc: <why>"); empty otherwise.
  StreamTransport(Aggregator* aggregator, std::string note);

  // Requests the first call of each method on `cq`; each call requests the next when it
  // arrives, so one request per method is always outstanding on every queue while serving.
  void RequestCalls(grpc::ServerCompletionQueue* cq);
  // Watches a member stream for writes stalled past the write deadline.
  void Watch(std::weak_ptr<WatchedStream> stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Transport.
  void Shutdown(const absl::Status& closing) override ABSL_LOCKS_EXCLUDED(mu_);
  void Joined(const v1::JoinRequest& req, int32_t index, v1::JoinResponse* resp) override;
  std::string Describe(const std::string& job_id) const override;
  void Tick(Clock::time_point now) override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The streams still alive (the dead are forgotten here).
  std::vector<std::shared_ptr<WatchedStream>> Live() ABSL_LOCKS_EXCLUDED(mu_);

  Aggregator* const aggregator_;
  const std::string note_;
  absl::Mutex mu_;
  std::vector<std::weak_ptr<WatchedStream>> watched_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_STREAM_TRANSPORT_H_

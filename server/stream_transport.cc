#include "stream_transport.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "aggregator.h"
#include "log.h"
#include "member_stream.h"
#include "metrics.h"
#include "parent_link.h"
#include "stream_writer.h"
#include "wire.h"

namespace hsbn::server {

namespace {

struct ResultTraits {
  using Item = v1::Result;
  using Frame = v1::ServerFrame;
  static size_t Bytes(const v1::Result& r) {
    return r.data().size() + r.message().size() + sizeof(v1::Result);
  }
  static void SetOne(v1::ServerFrame* frame, v1::Result&& r) {
    *frame->mutable_result() = std::move(r);
  }
  static void AddToBatch(v1::ServerFrame* frame, v1::Result&& r) {
    *frame->mutable_batch()->add_results() = std::move(r);
  }
};

// The write side of one Exchange stream: a bounded StreamWriter of results (one write in
// flight; batches for a peer that accepts them). Results are queued from any thread and Send
// never blocks on the network. The stream ends with a graceful Finish once the client
// half-closed (or the stream broke) and no write is in flight, or early with the status of
// Terminate() or of an overflow (RESOURCE_EXHAUSTED: a reader too slow for --max-queued-bytes,
// or the memory budget). Jobs may hold the outbox after the stream is gone; Send then does
// nothing.
class Outbox final : public MemberSink, public WatchedStream, public StreamWriter<ResultTraits> {
 public:
  Outbox(grpc::ServerAsyncReaderWriter<v1::ServerFrame, v1::ClientFrame>* stream,
         grpc::ServerContext* ctx, EventTag* write_tag, EventTag* finish_tag,
         Aggregator* aggregator, WriterLimits limits)
      : StreamWriter(std::move(limits)),
        stream_(stream),
        ctx_(ctx),
        write_tag_(write_tag),
        finish_tag_(finish_tag),
        aggregator_(aggregator),
        metrics_(aggregator->metrics()) {}

  void Send(v1::Result result) override { Push(std::move(result)); }
  void EnableBatches() override { StreamWriter::EnableBatches(); }

  // The client half-closed or the stream broke (event thread).
  void ReadDone() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    read_done_ = true;
    if (!writing() && !finishing_) FinishLocked();
  }

  // Ends the stream early with `status`, after the write in flight (if any).
  void Terminate(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (end_status_.ok()) end_status_ = status;
    set_closed();
    if (!writing() && !finishing_) FinishLocked();
  }

  // A write stalled past the write deadline: the peer does not read. Cancels the call (the
  // write cannot complete, so no status can be sent); its read then fails, which reports its
  // members gone.
  bool CancelIfStalled(Clock::time_point now) override {
    if (!Stalled(now)) return false;
    ctx_->TryCancel();
    return true;
  }
  void End(const absl::Status& status) override { Terminate(status); }

 protected:
  bool StartWriteLocked(const v1::ServerFrame& frame) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (metrics_) metrics_->Sent(Metrics::Link::kMembers, frame.ByteSizeLong());
    ++ops();  // counted here, not in the lambda: the lock analysis does not see into it
    if (aggregator_->StartOp([&] { stream_->Write(frame, write_tag_); })) return true;
    --ops();
    return false;
  }

  void OverflowLocked(Overflow which) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool queue = which == Overflow::kQueue;
    aggregator_->Refused(queue ? "queue_bytes" : "memory_budget");
    if (end_status_.ok()) {
      end_status_ = absl::ResourceExhaustedError(
          queue
              ? absl::StrCat("this stream's reader fell more than --max-queued-bytes=",
                             limits().max_queued_bytes, " bytes of results behind; the "
                             "aggregator dropped it (read results as they come)")
              : std::string("the aggregator's memory budget (--memory-budget-bytes) is "
                            "exhausted; this stream's queued results were dropped"));
      end_status_ = wire::WithReason(
          end_status_, queue ? v1::REASON_QUEUE_BYTES : v1::REASON_MEMORY_BUDGET);
    }
    if (!writing() && !finishing_) FinishLocked();
  }

  void IdleLocked() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if ((read_done_ || !end_status_.ok()) && !finishing_) FinishLocked();
  }

 private:
  void FinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finishing_ = true;
    const grpc::Status status = wire::ToGrpc(end_status_);
    ++ops();
    // Nothing starts once the queues are shutting down.
    if (!aggregator_->StartOp([&] { stream_->Finish(status, finish_tag_); })) --ops();
  }

  grpc::ServerAsyncReaderWriter<v1::ServerFrame, v1::ClientFrame>* const stream_;
  grpc::ServerContext* const ctx_;
  EventTag* const write_tag_;
  EventTag* const finish_tag_;
  Aggregator* const aggregator_;
  Metrics* const metrics_;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
};

// What a member stream's policy (MemberStream) asks of the aggregator.
class StreamHost final : public MemberStreamHost {
 public:
  explicit StreamHost(Aggregator* aggregator) : aggregator_(aggregator) {}
  Registry& registry() override { return aggregator_->registry(); }
  void Execute(const std::shared_ptr<Job>& job, Actions& actions) override {
    aggregator_->Execute(actions, job->id());
  }
  void LogInvalid(const std::string& what) override { aggregator_->LogInvalid(what); }
  void Refused(const char* reason) override { aggregator_->Refused(reason); }
  void Leave(const SessionId& session) override {
    v1::LeaveRequest req;
    req.set_session(session.Bytes());
    aggregator_->Leave(req);
  }
  void Aborted(const Registry::SessionRef& ref, const SessionId& session,
               const std::string& reason) override {
    aggregator_->MemberAborted(ref, session, reason);
  }
  void LateWanted(const std::string& job_id, const RoundKey& key) override {
    aggregator_->LateWanted(job_id, key);
  }

 private:
  Aggregator* const aggregator_;
};

// One Exchange stream: requested, then one read outstanding at a time until the client
// half-closes or the stream breaks, writes through the outbox, a Finish, and the done
// notification. Its events run on the event thread; it deletes itself when the last of its
// operations has come back (Outbox::ReleaseOp). What each frame read may do is the
// MemberStream's policy (member_stream.h).
class ExchangeCall final {
 public:
  // Requests the next Exchange call on `cq` (one request is always outstanding on each queue
  // while serving; a call's events all come back on the queue it was requested on).
  static void Request(Aggregator* aggregator, StreamTransport* streams,
                      grpc::ServerCompletionQueue* cq) {
    auto* call = new ExchangeCall(aggregator, streams, cq);
    call->ctx_.AsyncNotifyWhenDone(&call->done_tag_);
    if (!aggregator->StartOp([&] {
          aggregator->async_service()->RequestExchange(&call->ctx_, &call->stream_, cq, cq,
                                                       &call->request_tag_);
        })) {
      delete call;  // never requested: no tag of it will come back
    }
  }

 private:
  ExchangeCall(Aggregator* aggregator, StreamTransport* streams, grpc::ServerCompletionQueue* cq)
      : aggregator_(aggregator),
        streams_(streams),
        cq_(cq),
        metrics_(aggregator->metrics()),
        outbox_(std::make_shared<Outbox>(&stream_, &ctx_, &write_tag_, &finish_tag_, aggregator,
                                         aggregator->writer_limits())),
        host_(aggregator),
        policy_(&host_, outbox_, aggregator->options().max_unbound_bytes) {}

  void OnRequest(bool ok) {
    if (!ok) {  // the server is shutting down; the call never started (no done notification)
      delete this;
      return;
    }
    Request(aggregator_, streams_, cq_);
    outbox_->AddOp();  // the done notification
    streams_->Watch(outbox_);
    StartRead();
  }

  // Starts the next read (not when the queues are shutting down).
  void StartRead() {
    outbox_->AddOp();
    if (!aggregator_->StartOp([&] { stream_.Read(&in_, &read_tag_); })) {
      outbox_->ReleaseOp();  // never the last: the caller holds an operation of this call
    }
  }

  void OnRead(bool ok) {
    if (!ok) {
      aggregator_->StreamClosed(policy_.sessions());
      outbox_->ReadDone();
      Release();
      return;
    }
    if (metrics_) metrics_->Received(Metrics::Link::kMembers, in_.ByteSizeLong());
    if (absl::Status s = policy_.Read(in_); !s.ok()) {
      outbox_->Terminate(s);
      Release();
      return;  // no more reads: the Finish ends the call
    }
    StartRead();
    Release();
  }

  void OnWrite(bool ok) {
    outbox_->WriteDone(ok);
    Release();
  }
  void OnFinish(bool) { Release(); }
  void OnDone(bool) { Release(); }

  void Release() {
    if (outbox_->ReleaseOp()) delete this;
  }

  Aggregator* const aggregator_;
  StreamTransport* const streams_;
  grpc::ServerCompletionQueue* const cq_;
  Metrics* const metrics_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<v1::ServerFrame, v1::ClientFrame> stream_{&ctx_};
  MemberTag<ExchangeCall> request_tag_{this, &ExchangeCall::OnRequest};
  MemberTag<ExchangeCall> read_tag_{this, &ExchangeCall::OnRead};
  MemberTag<ExchangeCall> write_tag_{this, &ExchangeCall::OnWrite};
  MemberTag<ExchangeCall> finish_tag_{this, &ExchangeCall::OnFinish};
  MemberTag<ExchangeCall> done_tag_{this, &ExchangeCall::OnDone};
  std::shared_ptr<Outbox> outbox_;
  v1::ClientFrame in_;
  StreamHost host_;
  MemberStream policy_;  // event thread only
};

// One unary call: requested; when it arrives the next one is requested and `Handle` runs on
// the event thread, which (then or later, from the event thread) calls Finish; the finish's
// completion deletes the call.
template <typename Req, typename Resp>
class UnaryCall final {
 public:
  using RequestFn = void (v1::Aggregator::AsyncService::*)(
      grpc::ServerContext*, Req*, grpc::ServerAsyncResponseWriter<Resp>*, grpc::CompletionQueue*,
      grpc::ServerCompletionQueue*, void*);
  using HandleFn = void (*)(Aggregator*, UnaryCall*);

  static void Request(Aggregator* aggregator, grpc::ServerCompletionQueue* cq, RequestFn request,
                      HandleFn handle) {
    auto* call = new UnaryCall(aggregator, cq, request, handle);
    if (!aggregator->StartOp([&] {
          (aggregator->async_service()->*request)(&call->ctx_, &call->req, &call->writer_, cq,
                                                   cq, &call->request_tag_);
        })) {
      delete call;
    }
  }

  void Finish(const grpc::Status& status) {
    if (!aggregator_->StartOp([&] { writer_.Finish(resp, status, &finish_tag_); })) delete this;
  }

  Req req;
  Resp resp;

 private:
  UnaryCall(Aggregator* aggregator, grpc::ServerCompletionQueue* cq, RequestFn request,
            HandleFn handle)
      : aggregator_(aggregator), cq_(cq), request_(request), handle_(handle) {}

  void OnRequest(bool ok) {
    if (!ok || aggregator_->draining()) {
      delete this;
      return;
    }
    Request(aggregator_, cq_, request_, handle_);
    handle_(aggregator_, this);  // may delete this
  }
  void OnFinish(bool) { delete this; }

  Aggregator* const aggregator_;
  grpc::ServerCompletionQueue* const cq_;
  const RequestFn request_;
  const HandleFn handle_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncResponseWriter<Resp> writer_{&ctx_};
  MemberTag<UnaryCall> request_tag_{this, &UnaryCall::OnRequest};
  MemberTag<UnaryCall> finish_tag_{this, &UnaryCall::OnFinish};
};

using JoinCall = UnaryCall<v1::JoinRequest, v1::JoinResponse>;
using LeaveCall = UnaryCall<v1::LeaveRequest, v1::LeaveResponse>;
using StatusCall = UnaryCall<v1::StatusRequest, v1::StatusResponse>;

void HandleJoin(Aggregator* aggregator, JoinCall* call) {
  call->Finish(aggregator->Join(call->req, &call->resp));
}

void HandleLeave(Aggregator* aggregator, LeaveCall* call) {
  call->Finish(aggregator->Leave(call->req));
}

void HandleStatus(Aggregator* aggregator, StatusCall* call) {
  if (grpc::Status s = aggregator->AnswerStatus(call->req, &call->resp); !s.ok()) {
    call->Finish(s);
    return;
  }
  if (call->req.include_upstream() && aggregator->parent()) {
    // Answered when the parent's reply arrives (on the event thread).
    aggregator->parent()->Status(
        call->req, [call](const grpc::Status& s, const v1::StatusResponse& up) {
          if (s.ok()) {
            *call->resp.mutable_upstream() = up;
          } else {
            call->resp.set_upstream_error(s.error_message());
          }
          call->Finish(grpc::Status::OK);
        });
    return;
  }
  call->Finish(grpc::Status::OK);
}

}  // namespace

StreamTransport::StreamTransport(Aggregator* aggregator, std::string note)
    : aggregator_(aggregator), note_(std::move(note)) {}

void StreamTransport::RequestCalls(grpc::ServerCompletionQueue* cq) {
  ExchangeCall::Request(aggregator_, this, cq);
  JoinCall::Request(aggregator_, cq, &v1::Aggregator::AsyncService::RequestJoin, &HandleJoin);
  LeaveCall::Request(aggregator_, cq, &v1::Aggregator::AsyncService::RequestLeave,
                     &HandleLeave);
  StatusCall::Request(aggregator_, cq, &v1::Aggregator::AsyncService::RequestStatus,
                      &HandleStatus);
}

void StreamTransport::Watch(std::weak_ptr<WatchedStream> stream) {
  absl::MutexLock lock(&mu_);
  watched_.push_back(std::move(stream));
}

std::vector<std::shared_ptr<WatchedStream>> StreamTransport::Live() {
  std::vector<std::shared_ptr<WatchedStream>> live;
  absl::MutexLock lock(&mu_);
  live.reserve(watched_.size());
  for (auto it = watched_.begin(); it != watched_.end();) {
    if (auto s = it->lock()) {
      live.push_back(std::move(s));
      ++it;
    } else {
      it = watched_.erase(it);
    }
  }
  return live;
}

void StreamTransport::Shutdown(const absl::Status& closing) {
  for (auto& s : Live()) s->End(closing);
}

void StreamTransport::Tick(Clock::time_point now) {
  for (auto& s : Live()) {
    if (s->CancelIfStalled(now)) {
      aggregator_->Refused("write_deadline");
      Log(LogLevel::kWarn, absl::StrCat("a stream's write waited longer than --write-deadline-ms=",
                                        aggregator_->options().write_deadline.count(),
                                        " (its reader stopped reading); the stream was dropped"));
    }
  }
}

void StreamTransport::Joined(const v1::JoinRequest&, int32_t, v1::JoinResponse* resp) {
  if (!note_.empty()) resp->set_shm_note(note_);
}

std::string StreamTransport::Describe(const std::string&) const { return note_; }

}  // namespace hsbn::server

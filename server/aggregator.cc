#include "aggregator.h"

#include <pthread.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <deque>
#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/security/credentials.h"
#include "member_stream.h"
#include "parent_link.h"
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
  static void Request(Aggregator* aggregator, grpc::ServerCompletionQueue* cq) {
    auto* call = new ExchangeCall(aggregator, cq);
    call->ctx_.AsyncNotifyWhenDone(&call->done_tag_);
    if (!aggregator->StartOp([&] {
          aggregator->async_service()->RequestExchange(&call->ctx_, &call->stream_, cq, cq,
                                                       &call->request_tag_);
        })) {
      delete call;  // never requested: no tag of it will come back
    }
  }

 private:
  ExchangeCall(Aggregator* aggregator, grpc::ServerCompletionQueue* cq)
      : aggregator_(aggregator),
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
    Request(aggregator_, cq_);
    outbox_->AddOp();  // the done notification
    aggregator_->WatchStream(outbox_);
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

void RequestCalls(Aggregator* aggregator, grpc::ServerCompletionQueue* cq) {
  ExchangeCall::Request(aggregator, cq);
  JoinCall::Request(aggregator, cq, &v1::Aggregator::AsyncService::RequestJoin, &HandleJoin);
  LeaveCall::Request(aggregator, cq, &v1::Aggregator::AsyncService::RequestLeave, &HandleLeave);
  StatusCall::Request(aggregator, cq, &v1::Aggregator::AsyncService::RequestStatus,
                      &HandleStatus);
}

}  // namespace


namespace {
RegistryOptions MakeRegistryOptions(const AggregatorOptions& o, bool has_parent) {
  RegistryOptions r;
  r.id = o.id;
  r.joins = o.role == AggregatorOptions::Role::kNode ? v1::MEMBER_KIND_WORKER
                                                      : v1::MEMBER_KIND_AGGREGATOR;
  r.group_tier = o.role == AggregatorOptions::Role::kGroup;
  r.max_jobs = o.max_jobs;
  r.max_world_size = o.max_world_size;
  r.attach_timeout = o.attach_timeout;
  r.memory_budget_bytes = o.memory_budget_bytes;
  r.limits = o.limits;
  r.limits.has_parent = has_parent;
  r.tokens = o.tokens;
  return r;
}
}  // namespace

Aggregator::Aggregator(AggregatorOptions options)
    : options_(std::move(options)),
      started_(Clock::now()),
      registry_(MakeRegistryOptions(
          options_, options_.role != AggregatorOptions::Role::kRoot && !options_.upstream.empty())) {
  writer_limits_.max_queued_bytes = options_.max_queued_bytes;
  writer_limits_.write_deadline = options_.write_deadline;
  writer_limits_.budget = registry_.budget();
}

void Aggregator::Start(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs) {
  cqs_ = std::move(cqs);
  if (options_.role != AggregatorOptions::Role::kRoot && !options_.upstream.empty()) {
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    const bool tls = !options_.upstream_ca_pem.empty();
    if (tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options_.upstream_ca_pem;
      ssl.pem_cert_chain = options_.upstream_cert_pem;
      ssl.pem_private_key = options_.upstream_key_pem;
      credentials = grpc::SslCredentials(ssl);
    } else {
      credentials = grpc::InsecureChannelCredentials();
    }
    ParentLink::Options link;
    link.address = options_.upstream;
    link.id = options_.id;
    link.credentials = std::move(credentials);
    link.tls = tls;
    link.tls_name = options_.upstream_tls_name;
    link.writer = writer_limits_;
    link.metrics = options_.metrics.get();
    if (options_.role == AggregatorOptions::Role::kGroup) {
      link.self = absl::StrCat("group aggregator ", options_.id);
    }
    parent_ = std::make_unique<ParentLink>(this, std::move(link), cqs_[0].get());
  }
  if (options_.role == AggregatorOptions::Role::kNode && options_.shm &&
      !options_.shm_socket.empty()) {
    ShmOptions shm;
    shm.socket = options_.shm_socket;
    shm.socket_mode = options_.socket_mode;
    shm.ring = options_.shm_ring;
    shm.max_channels = std::min(options_.shm_max_channels, options_.limits.max_channels);
    shm.wait = options_.shm_wait;
    shm.has_parent = parent_ != nullptr;
    shm.round_timeout = options_.limits.round_timeout;
    shm.metrics = options_.metrics.get();
    shm_ = std::make_unique<ShmTransport>(std::move(shm), &registry_, this);
    if (absl::Status s = shm_->Start(); !s.ok()) {
      Log(LogLevel::kWarn, absl::StrCat("shared-memory node path off: ", s.message(),
                                        "; node rounds use the gRPC stream"));
      shm_.reset();
    }
  }
  ticker_ = std::thread([this] { TickLoop(); });
  for (size_t i = 0; i < cqs_.size(); ++i) {
    grpc::ServerCompletionQueue* cq = cqs_[i].get();
    RequestCalls(this, cq);
    events_.emplace_back([this, cq, i] { EventLoop(cq, i); });
  }
}

Aggregator::~Aggregator() {
  Shutdown("the aggregator is being destroyed");
  StopEvents();
}

void Aggregator::EventLoop(grpc::ServerCompletionQueue* cq, size_t index) {
  const std::string name = index == 0 ? "hsbn-events" : absl::StrCat("hsbn-events-", index);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) static_cast<EventTag*>(tag)->OnEvent(ok);
}

void Aggregator::StopEvents() {
  if (events_.empty()) return;
  // From here on StartOp starts nothing, on any thread: then no queue can be shut down under
  // an operation being started (an event thread may start one on another thread's queue, when
  // a round completes and its results go to every member's stream).
  {
    std::unique_lock<std::shared_mutex> lock(gate_);
    draining_ = true;
  }
  for (auto& cq : cqs_) cq->Shutdown();
  for (auto& t : events_) t.join();
  events_.clear();
}

void Aggregator::Shutdown(const std::string& why) {
  {
    absl::MutexLock lock(&tick_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (ticker_.joinable()) ticker_.join();
  // One status for every rank, whichever path its round takes (stream, shared memory, a Join).
  const absl::Status closing = wire::WithReason(absl::UnavailableError(absl::StrCat(
      options_.role == AggregatorOptions::Role::kNode    ? "sidecar "
      : options_.role == AggregatorOptions::Role::kGroup ? "group aggregator "
                                                         : "aggregator ",
      options_.id,
      " is shutting down (", why, "): the training step in flight is lost on every rank. "
      "Restart the job from its last checkpoint (torchrun --max-restarts does it)")),
      v1::REASON_SHUTTING_DOWN);
  // Nothing is admitted any more before rounds fail: a rank whose round fails cannot join this
  // process again, so all ranks of a node meet at the next process on this address.
  std::vector<std::shared_ptr<Job>> jobs = registry_.Close(closing);
  if (shm_) shm_->Shutdown(std::string(closing.message()));
  for (auto& job : jobs) {
    Actions actions;
    job->FailAll(closing, &actions);
    actions.forwards.clear();
    actions.aborts.clear();
    Execute(actions, job->id());
  }
  // Every stream ends with the same status, so a member that was between rounds reads the
  // reason (and the words) in its stream's final status, not a bare CANCELLED.
  std::vector<std::shared_ptr<WatchedStream>> streams;
  {
    absl::MutexLock lock(&watch_mu_);
    for (auto& weak : watched_) {
      if (auto s = weak.lock()) streams.push_back(std::move(s));
    }
  }
  for (auto& s : streams) s->End(closing);
  if (parent_) parent_->Shutdown();
}

void Aggregator::WatchStream(std::weak_ptr<WatchedStream> stream) {
  absl::MutexLock lock(&watch_mu_);
  watched_.push_back(std::move(stream));
}

void Aggregator::CheckStreams(Clock::time_point now) {
  std::vector<std::shared_ptr<WatchedStream>> live;
  {
    absl::MutexLock lock(&watch_mu_);
    live.reserve(watched_.size());
    for (auto it = watched_.begin(); it != watched_.end();) {
      if (auto s = it->lock()) {
        live.push_back(std::move(s));
        ++it;
      } else {
        it = watched_.erase(it);
      }
    }
  }
  for (auto& s : live) {
    if (s->CancelIfStalled(now)) {
      Refused("write_deadline");
      Log(LogLevel::kWarn, absl::StrCat("a stream's write waited longer than --write-deadline-ms=",
                                        options_.write_deadline.count(),
                                        " (its reader stopped reading); the stream was dropped"));
    }
  }
  if (parent_) parent_->CheckStalled(now);
}

void Aggregator::TickLoop() {
  pthread_setname_np(pthread_self(), "hsbn-tick");  // top -H, perf, gdb
  Clock::time_point next_check = Clock::now();
  absl::MutexLock lock(&tick_mu_);
  while (!stopping_) {
    tick_mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::FromChrono(options_.tick));
    if (stopping_) break;
    tick_mu_.Unlock();
    const Clock::time_point now = Clock::now();
    for (const Registry::Dropped& d : registry_.Sweep(now)) {
      if (d.expired) Refused("attach_timeout");
      Log(LogLevel::kInfo,
          absl::StrCat("job '", d.job->id(), "' dropped: ",
                       d.expired ? "no member attached a stream within --attach-timeout-ms"
                                 : "every member left or lost its stream"));
      if (!options_.divergence_dir.empty()) SaveDivergence(*d.job);
      if (shm_) shm_->DropJob(d.job->id());
      // The root holds the job while this node is a member of it: leave, so it can drop it too.
      if (parent_) parent_->Leave(d.job->id());
    }
    for (auto& job : registry_.Jobs()) {
      Actions actions;
      job->Expire(now, &actions);
      if (!actions.empty() || !actions.log.empty() || !actions.outcomes.empty()) {
        Execute(actions, job->id());
      }
    }
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(100);
      CheckStreams(now);
      LogFlushSuppressed();
      if (Metrics* m = options_.metrics.get()) m->SetMemoryUsed(registry_.budget()->used());
    }
    tick_mu_.Lock();
  }
}

namespace {
// A job id as a file name: [A-Za-z0-9._-] kept, every other byte as %XX, and a leading '.'
// escaped too, so no id can name a path outside the directory or a hidden file.
std::string FileNameOf(const std::string& job_id) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (size_t i = 0; i < job_id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(job_id[i]);
    if (std::isalnum(c) || c == '_' || c == '-' || (c == '.' && i > 0)) {
      out.push_back(char(c));
    } else {
      out += '%';
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}
}  // namespace

void Aggregator::SaveDivergence(const Job& job) {
  v1::JobStatus status;
  job.FillStatus(&status);
  if (status.divergence_size() == 0) return;
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  if (!google::protobuf::util::MessageToJsonString(status, &json, print).ok()) return;
  const std::string path =
      absl::StrCat(options_.divergence_dir, "/", FileNameOf(job.id()), ".divergence.json");
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << json << "\n";
    if (!out) {
      Log(LogLevel::kWarn, absl::StrCat("cannot write ", tmp, " (--divergence-dir)"));
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    Log(LogLevel::kWarn, absl::StrCat("cannot rename ", tmp, " to ", path));
    return;
  }
  Log(LogLevel::kInfo, absl::StrCat("job '", job.id(), "': shadow divergence record written to ",
                                    path));
}

void Aggregator::LogInvalid(const std::string& what) {
  LogLimited(LogLevel::kWarn, LogKind::kInvalidFrame,
             absl::StrCat("invalid input: ", LogSafe(what, 512)));
}

void Aggregator::Refused(const char* reason) {
  if (Metrics* m = options_.metrics.get()) m->Refused(reason);
}

const char* RoleName(AggregatorOptions::Role role) {
  switch (role) {
    case AggregatorOptions::Role::kNode: return "node";
    case AggregatorOptions::Role::kGroup: return "group";
    case AggregatorOptions::Role::kRoot: return "root";
  }
  return "node";
}

void Aggregator::Execute(Actions& actions, const std::string& job_id) {
  for (const std::string& line : actions.log) Log(LogLevel::kInfo, line);
  for (const std::string& line : actions.round_failures) {
    LogLimited(LogLevel::kInfo, LogKind::kRoundFailed, LogSafe(line, 1024));
  }
  for (const char* reason : actions.refused) Refused(reason);
  // Metrics first: whoever receives a result below must find its round already counted.
  if (Metrics* m = options_.metrics.get()) {
    if (actions.nonfinite[0] > 0) m->NonFinite(v1::PHASE_FORWARD, actions.nonfinite[0]);
    if (actions.nonfinite[1] > 0) m->NonFinite(v1::PHASE_BACKWARD, actions.nonfinite[1]);
    const Clock::time_point now = Clock::now();
    for (const auto& o : actions.outcomes) {
      m->RoundFinished(o.scope, o.phase, o.code,
                       o.opened == Clock::time_point{}
                           ? -1.0
                           : std::chrono::duration<double>(now - o.opened).count());
    }
    for (const auto& member : actions.timed_out) m->RoundTimedOut(job_id, member);
  }
  // Partials go up before results go down: a shadow partial is then queued to the root before
  // its workers can start their next round, so the root sees a node's rounds in the order the
  // node ran them (auto scope's decision round relies on it; docs/PROTOCOL.md).
  if (!actions.forwards.empty() || !actions.aborts.empty() || !actions.names.empty()) {
    std::shared_ptr<Job> job = registry_.FindJob(job_id);
    if (job && parent_) {
      std::shared_ptr<const std::string> token = job->token();
      for (const auto& f : actions.forwards) parent_->Forward(job_id, job->layout(), token, f);
      for (const auto& a : actions.aborts) parent_->Abort(job_id, job->layout(), token, a);
      if (!actions.names.empty()) parent_->LayerNames(job_id, job->layout(), token, actions.names);
    }
  }
  for (auto& d : actions.deliveries) {
    for (auto& [session, sink] : d.to) {
      v1::Result r = *d.result;  // the one copy per member: the outbox keeps it
      r.set_session(session.Bytes());
      sink->Send(std::move(r));
    }
  }
  if (parent_) {
    for (const auto& n : actions.node_states) parent_->NodeState(job_id, n);
  }
}

void Aggregator::StreamClosed(const std::vector<SessionId>& sessions) {
  for (const SessionId& session : sessions) {
    Registry::SessionRef ref;
    if (!registry_.Find(session, &ref)) continue;
    Actions actions;
    ref.job->MemberGone(ref.index, session, /*left=*/false, Clock::now(), &actions);
    if (shm_) shm_->MemberGone(ref.job->id(), ref.index, /*left=*/false);
    Execute(actions, ref.job->id());
  }
}

void Aggregator::MemberAborted(const Registry::SessionRef& ref, const SessionId& session,
                               const std::string& reason) {
  Actions actions;
  ref.job->MemberGone(ref.index, session, /*left=*/false, Clock::now(), &actions, reason);
  if (shm_) shm_->MemberGone(ref.job->id(), ref.index, /*left=*/false, reason);
  Execute(actions, ref.job->id());
}

void Aggregator::OnParentResult(const std::string& job_id, const v1::Result& result) {
  if (shm_ && shm_->ParentResult(job_id, result)) return;
  std::shared_ptr<Job> job = registry_.FindJob(job_id);
  if (!job) return;
  Actions actions;
  job->ParentResult(result, &actions);
  Execute(actions, job_id);
}

bool Aggregator::NodeDown(const std::string& job_id, std::string* message) {
  std::shared_ptr<Job> job = registry_.FindJob(job_id);
  return job && job->NodeDown(message);
}

void Aggregator::OnParentLost(const absl::Status& status) {
  if (shm_) shm_->ParentLost(status);
  for (auto& job : registry_.Jobs()) {
    Actions actions;
    job->ParentLost(status, &actions);
    Execute(actions, job->id());
  }
}

grpc::Status Aggregator::Join(const v1::JoinRequest& req, v1::JoinResponse* resp) {
  Actions actions;
  if (shm_ && req.kind() == v1::MEMBER_KIND_WORKER) {
    if (absl::Status s = shm_->CheckJoin(req); !s.ok()) return wire::ToGrpc(s);
  }
  absl::StatusOr<Registry::Joined> joined = registry_.Join(req, &actions);
  if (Metrics* m = options_.metrics.get()) m->JoinAnswered(joined.status().code());
  if (!joined.ok()) {
    const absl::Status& s = joined.status();
    Execute(actions, req.job_id());  // a layout refusal fails the job's rounds (Job::Refused)
    if (shm_) {
      std::shared_ptr<Job> job = registry_.FindJob(req.job_id());
      if (job && !job->refusal().ok()) shm_->Refuse(req.job_id(), job->refusal());
    }
    switch (wire::ReasonOf(s)) {
      case v1::REASON_MAX_WORLD_SIZE: Refused("world_size"); break;
      case v1::REASON_MAX_JOBS: Refused("max_jobs"); break;
      case v1::REASON_JOB_ID: Refused("job_id"); break;
      default: break;
    }
    LogLimited(LogLevel::kWarn,
               s.code() == absl::StatusCode::kUnauthenticated ? LogKind::kUnauthenticated
                                                              : LogKind::kJoinRefused,
               absl::StrCat("Join refused: ", LogSafe(s.ToString(), 1024)));
    return wire::ToGrpc(joined.status());
  }
  Execute(actions, joined->job->id());
  // The root holds the old run with this node's session in it: leave it, like a dropped job;
  // the new run's first forward joins the root again, with the new incarnation.
  if (joined->replaced && parent_) parent_->Leave(joined->replaced->id());
  if (joined->replaced && shm_) {
    shm_->DropJob(joined->replaced->id(),
                  absl::StrCat("job '", joined->replaced->id(), "' was restarted: run ",
                               req.incarnation(), " joined, so this round of run ",
                               joined->replaced->layout().incarnation, " can never complete"));
  }
  Log(LogLevel::kDebug, absl::StrCat("job '", req.job_id(), "': ",
                                     joined->job->MemberName(joined->index), " joined"));
  resp->set_session(joined->session.Bytes());
  resp->set_protocol_version(v1::PROTOCOL_VERSION_2);
  resp->set_num_nodes(joined->num_nodes);
  resp->set_max_channels(options_.limits.max_channels);
  resp->set_round_timeout_ms(options_.limits.round_timeout.count());
  resp->set_aggregator_id(options_.id);
  resp->set_accepts_batches(true);
  resp->set_role(RoleName(options_.role));
  if (shm_ && req.kind() == v1::MEMBER_KIND_WORKER) {
    shm_->Joined(req, joined->index, resp);
  } else if (options_.role == AggregatorOptions::Role::kNode) {
    resp->set_shm_note(options_.shm ? "grpc: the sidecar's shared-memory socket is not available"
                                    : "grpc: the sidecar runs with --shm=off");
  }
  return grpc::Status::OK;
}

std::string Aggregator::NodeTransport(const std::string& job_id) const {
  if (options_.role != AggregatorOptions::Role::kNode) return "";
  if (!shm_) {
    return options_.shm ? "grpc: the sidecar's shared-memory socket is not available"
                        : "grpc: the sidecar runs with --shm=off";
  }
  return shm_->Describe(job_id);
}

void Aggregator::ShmToParent(const std::string& job_id, const shm::QueueEntry& item) {
  std::shared_ptr<Job> job = registry_.FindJob(job_id);
  if (!job || !parent_) return;
  const RoundKey key{item.key.op, item.key.seq, v1::Phase(item.key.phase)};
  std::shared_ptr<const std::string> token = job->token();
  if (item.kind == shm::kPartial) {
    // A renorm or lagged round's node answer is in the segment already; its global result
    // comes back through the job, to every worker's stream.
    if (item.scope == v1::SCOPE_RENORM || item.scope == v1::SCOPE_LAGGED) {
      job->ExpectLate(key, uint32_t(item.channels), Clock::now());
    }
    auto data = std::make_shared<std::string>();
    wire::PackPayload(item.data.data(), item.data.data() + item.channels, item.channels,
                      data.get());
    parent_->Forward(job_id, job->layout(), token,
                     Actions::Forward{key, v1::Scope(item.scope), uint32_t(item.channels),
                                      item.count, std::move(data), /*decide=*/nullptr});
  } else {
    parent_->Abort(job_id, job->layout(), token,
                   Actions::Abort{key, wire::StatusFromCode(item.code, item.message,
                                                           static_cast<v1::Reason>(item.reason))});
  }
}

grpc::Status Aggregator::Leave(const v1::LeaveRequest& req) {
  SessionId session;
  if (!SessionId::FromBytes(req.session(), &session)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "Leave: session must be 16 bytes");
  }
  Actions actions;
  std::string job_id;
  Registry::SessionRef ref;
  const bool known = shm_ && registry_.Find(session, &ref);
  if (absl::Status s = registry_.Leave(session, &actions, &job_id); !s.ok()) {
    return wire::ToGrpc(s);
  }
  if (known) shm_->MemberGone(job_id, ref.index, /*left=*/true);
  Execute(actions, job_id);
  return grpc::Status::OK;
}

grpc::Status Aggregator::AnswerStatus(const v1::StatusRequest& req, v1::StatusResponse* resp) {
  absl::StatusOr<std::vector<std::shared_ptr<Job>>> jobs = registry_.StatusJobs(req);
  if (!jobs.ok()) return wire::ToGrpc(jobs.status());
  resp->set_aggregator_id(options_.id);
  resp->set_role(RoleName(options_.role));
  resp->set_uptime_s(std::chrono::duration<double>(Clock::now() - started_).count());
  for (auto& job : *jobs) {
    v1::JobStatus* js = resp->add_jobs();
    job->FillStatus(js);
    js->set_node_transport(NodeTransport(job->id()));
    if (shm_) shm_->AddCounts(job->id(), js);
  }
  return grpc::Status::OK;
}

void Aggregator::FillStatus(const std::string& job_id, v1::StatusResponse* resp) {
  // A scrape (main.cc's state source) counts every round a worker was answered through shared
  // memory.
  if (shm_) shm_->HarvestMetrics();
  resp->set_aggregator_id(options_.id);
  resp->set_role(RoleName(options_.role));
  resp->set_uptime_s(std::chrono::duration<double>(Clock::now() - started_).count());
  for (auto& job : registry_.Jobs()) {
    if (job_id.empty() || job->id() == job_id) {
      v1::JobStatus* js = resp->add_jobs();
      job->FillStatus(js);
      js->set_node_transport(NodeTransport(job->id()));
      if (shm_) shm_->AddCounts(job->id(), js);
    }
  }
}

}  // namespace hsbn::server

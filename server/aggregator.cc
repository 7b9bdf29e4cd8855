#include "aggregator.h"

#include <pthread.h>

#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "parent_link.h"
#include "wire.h"

namespace hsbn::server {

namespace {

// The write side of one Exchange stream. Results for its members are queued here from any
// thread; one write is in flight at a time. Send never blocks on the network. On a stream whose
// peer accepts batches (a sidecar), whatever queued while a write was in flight goes out as one
// ResultBatch frame; workers get one Result per frame.
//
// The outbox also counts the stream's operations in flight (the done notification, the read,
// the write, the finish), under its mutex: a write may be started from any thread (the async
// API runs nothing inline, so it is started under the lock), and the stream's state may be
// deleted only once every operation has come back. When the count reaches zero the outbox is
// closed: Jobs may still hold it and call Send, which then does nothing.
class Outbox final : public ResultSink {
 public:
  Outbox(grpc::ServerAsyncReaderWriter<v1::ServerFrame, v1::ClientFrame>* stream,
         EventTag* write_tag, EventTag* finish_tag, Aggregator* aggregator)
      : stream_(stream),
        write_tag_(write_tag),
        finish_tag_(finish_tag),
        aggregator_(aggregator),
        metrics_(aggregator->metrics()) {}

  void EnableBatches() { batches_.store(true, std::memory_order_relaxed); }

  void Send(v1::Result result) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_ || closed_) return;
    pending_.push_back(std::move(result));
    if (writing_) return;
    writing_ = true;
    StartWriteLocked();
  }

  // The write started last has completed (event thread).
  void WriteDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok) {
      broken_ = true;
      pending_.clear();
    }
    if (pending_.empty() || finishing_ || !StartWriteLocked()) {
      writing_ = false;
      if (read_done_ && !finishing_) FinishLocked();
    }
  }

  // The client half-closed or the stream broke (event thread).
  void ReadDone() {
    std::lock_guard<std::mutex> lock(mu_);
    read_done_ = true;
    if (!writing_ && !finishing_) FinishLocked();
  }

  void AddOp() {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_;
  }
  // An operation came back; true when it was the last one: the stream's state may go.
  bool ReleaseOp() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--ops_ > 0) return false;
    closed_ = true;
    pending_.clear();
    return true;
  }

 private:
  // Most bytes of results put in one batch frame (a single larger result still goes alone).
  static constexpr size_t kMaxBatchBytes = 4 << 20;

  // Starts a write of what is pending; false (pending dropped, writing_ cleared) when the
  // queues are shutting down.
  bool StartWriteLocked() {
    if (aggregator_->StartOp([&] {
          ++ops_;
          stream_->Write(*TakeLocked(), write_tag_);
        })) {
      return true;
    }
    pending_.clear();
    writing_ = false;
    return false;
  }

  void FinishLocked() {
    finishing_ = true;
    aggregator_->StartOp([&] {  // nothing starts once the queues are shutting down
      ++ops_;
      stream_->Finish(grpc::Status::OK, finish_tag_);
    });
  }

  // Moves the next frame's worth of pending results into current_.
  v1::ServerFrame* TakeLocked() {
    current_.Clear();
    if (pending_.size() == 1 || !batches_.load(std::memory_order_relaxed)) {
      *current_.mutable_result() = std::move(pending_.front());
      pending_.pop_front();
    } else {
      v1::ResultBatch* batch = current_.mutable_batch();
      size_t bytes = 0;
      while (!pending_.empty() &&
             (batch->results_size() == 0 ||
              bytes + pending_.front().data().size() <= kMaxBatchBytes)) {
        bytes += pending_.front().data().size();
        *batch->add_results() = std::move(pending_.front());
        pending_.pop_front();
      }
    }
    if (metrics_) metrics_->Sent(Metrics::Link::kMembers, current_.ByteSizeLong());
    return &current_;
  }

  grpc::ServerAsyncReaderWriter<v1::ServerFrame, v1::ClientFrame>* const stream_;
  EventTag* const write_tag_;
  EventTag* const finish_tag_;
  Aggregator* const aggregator_;
  Metrics* const metrics_;
  std::atomic<bool> batches_{false};
  std::mutex mu_;
  std::deque<v1::Result> pending_;
  v1::ServerFrame current_;
  int ops_ = 0;
  bool writing_ = false;
  bool read_done_ = false;
  bool finishing_ = false;
  bool broken_ = false;
  bool closed_ = false;
};

// One Exchange stream: requested, then one read outstanding at a time until the client
// half-closes or the stream breaks, writes through the outbox, a graceful Finish, and the done
// notification. Its events run on the event thread; it deletes itself when the last of its
// operations has come back (Outbox::ReleaseOp).
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
        outbox_(std::make_shared<Outbox>(&stream_, &write_tag_, &finish_tag_, aggregator)) {}

  void OnRequest(bool ok) {
    if (!ok) {  // the server is shutting down; the call never started (no done notification)
      delete this;
      return;
    }
    Request(aggregator_, cq_);
    outbox_->AddOp();  // the done notification
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
      aggregator_->StreamClosed(sessions_, /*graceful=*/false);
      outbox_->ReadDone();
      Release();
      return;
    }
    if (metrics_) metrics_->Received(Metrics::Link::kMembers, in_.ByteSizeLong());
    if (in_.has_batch()) {
      for (const v1::ClientFrame& frame : in_.batch().frames()) Handle(frame);
    } else {
      Handle(in_);
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

  void Handle(const v1::ClientFrame& frame) {
    switch (frame.frame_case()) {
      case v1::ClientFrame::kAttach:
        if (frame.attach().accepts_batches()) outbox_->EnableBatches();
        for (uint64_t s : frame.attach().session_ids()) Bind(s);
        break;
      case v1::ClientFrame::kContribution:
        HandleContribution(frame.contribution());
        break;
      case v1::ClientFrame::kAbort:
        HandleAbort(frame.abort());
        break;
      case v1::ClientFrame::kNodeState:
        HandleNodeState(frame.node_state());
        break;
      default:  // an empty frame, or a batch nested in a batch: nothing to do
        break;
    }
  }

  bool Bind(uint64_t session) {
    Aggregator::SessionRef ref;
    if (!aggregator_->FindSession(session, &ref)) return false;
    if (!ref.job->Attach(ref.index, session, outbox_).ok()) return false;
    for (auto& [s, r] : bound_) {
      if (s == session) {
        r = ref;
        return true;
      }
    }
    sessions_.push_back(session);
    bound_.emplace_back(session, ref);
    return true;
  }

  void SendError(const v1::Contribution& c, const absl::Status& status) {
    v1::Result r;
    r.set_session_id(c.session_id());
    r.set_op(c.op());
    r.set_seq(c.seq());
    r.set_phase(c.phase());
    r.set_code(int(status.code()));
    r.set_message(std::string(status.message()));
    outbox_->Send(std::move(r));
  }

  void HandleContribution(const v1::Contribution& c) {
    // The sessions bound to this stream are cached here: no aggregator-wide lock per round.
    const Aggregator::SessionRef* ref = nullptr;
    for (const auto& [s, r] : bound_) {
      if (s == c.session_id()) ref = &r;
    }
    if (ref == nullptr) {
      Aggregator::SessionRef found;
      if (!aggregator_->FindSession(c.session_id(), &found)) {
        SendError(c, absl::NotFoundError(
                         "unknown session: the aggregator restarted or the job was dropped; the "
                         "client must Join again (hsbn clients do this by themselves)"));
        return;
      }
      if (!Bind(c.session_id())) {
        SendError(c, absl::NotFoundError(kStaleSession));
        return;
      }
      ref = &bound_.back().second;
    }
    Actions actions;
    if (!ref->job->Contribute(ref->index, c.session_id(), c, Clock::now(), &actions)) {
      SendError(c, absl::NotFoundError(kStaleSession));
      return;
    }
    aggregator_->Execute(actions, ref->job->id());
  }

  static constexpr const char* kStaleSession =
      "this session was replaced by a newer Join of the same rank, or it left the job; this "
      "connection is stale";

  void HandleAbort(const v1::Abort& a) {
    Aggregator::SessionRef ref;
    if (!aggregator_->FindSession(a.session_id(), &ref)) return;
    Actions actions;
    ref.job->ChildAbort(ref.index, a, &actions);
    aggregator_->Execute(actions, ref.job->id());
  }

  void HandleNodeState(const v1::NodeState& state) {
    Aggregator::SessionRef ref;
    if (!aggregator_->FindSession(state.session_id(), &ref)) return;
    if (ref.job->layout().member_kind != v1::MEMBER_KIND_AGGREGATOR) return;  // from a worker?
    Actions actions;
    ref.job->ChildState(ref.index, state, &actions);
    aggregator_->Execute(actions, ref.job->id());
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
  // Event thread only.
  std::vector<uint64_t> sessions_;
  std::vector<std::pair<uint64_t, Aggregator::SessionRef>> bound_;
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
  aggregator->FillStatus(call->req.job_id(), &call->resp);
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

Aggregator::Aggregator(AggregatorOptions options)
    : options_(std::move(options)), started_(Clock::now()), rng_(std::random_device{}()) {}

void Aggregator::Start(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs) {
  cqs_ = std::move(cqs);
  if (options_.role == AggregatorOptions::Role::kNode && !options_.upstream.empty()) {
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
    parent_ = std::make_unique<ParentLink>(this, options_.upstream, options_.id,
                                           std::move(credentials), tls,
                                           options_.upstream_tls_name, cqs_[0].get());
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
    std::lock_guard<std::mutex> lock(tick_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  tick_cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) {
    Actions actions;
    job->FailAll(absl::UnavailableError(absl::StrCat(
                     "aggregator ", options_.id, " is shutting down (", why,
                     "); rounds in flight failed. Clients reconnect when it is back")),
                 &actions);
    actions.forwards.clear();
    actions.aborts.clear();
    Execute(actions, job->id());
  }
  if (parent_) parent_->Shutdown();
}

void Aggregator::TickLoop() {
  std::unique_lock<std::mutex> lock(tick_mu_);
  while (!stopping_) {
    tick_cv_.wait_for(lock, options_.tick);
    if (stopping_) break;
    lock.unlock();
    std::vector<std::shared_ptr<Job>> jobs;
    std::vector<std::string> dropped;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto it = jobs_.begin(); it != jobs_.end();) {
        if (it->second->Abandoned()) {
          Log(LogLevel::kInfo, absl::StrCat("job '", it->first, "' dropped: all members are gone"));
          dropped.push_back(it->first);
          for (auto s = sessions_.begin(); s != sessions_.end();) {
            s = s->second.job == it->second ? sessions_.erase(s) : std::next(s);
          }
          it = jobs_.erase(it);
        } else {
          jobs.push_back(it->second);
          ++it;
        }
      }
    }
    // The root holds the job while this node is a member of it: leave, so it can drop it too.
    if (parent_) {
      for (const std::string& id : dropped) parent_->Leave(id);
    }
    const Clock::time_point now = Clock::now();
    for (auto& job : jobs) {
      Actions actions;
      job->Expire(now, &actions);
      if (!actions.empty() || !actions.log.empty() || !actions.outcomes.empty()) {
        Execute(actions, job->id());
      }
    }
    lock.lock();
  }
}

bool Aggregator::FindSession(uint64_t session, SessionRef* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return false;
  *out = it->second;
  return true;
}

void Aggregator::Execute(Actions& actions, const std::string& job_id) {
  for (const std::string& line : actions.log) Log(LogLevel::kInfo, line);
  // Metrics first: whoever receives a result below must find its round already counted.
  if (Metrics* m = options_.metrics.get()) {
    const Clock::time_point now = Clock::now();
    for (const auto& o : actions.outcomes) {
      m->RoundFinished(o.scope, o.phase, o.code,
                       o.opened == Clock::time_point{}
                           ? -1.0
                           : std::chrono::duration<double>(now - o.opened).count());
    }
    for (const auto& member : actions.timed_out) m->RoundTimedOut(job_id, member);
  }
  for (auto& d : actions.deliveries) {
    for (auto& [session, sink] : d.to) {
      v1::Result r = *d.result;  // the one copy per member: the outbox keeps it
      r.set_session_id(session);
      sink->Send(std::move(r));
    }
  }
  if (!actions.forwards.empty() || !actions.aborts.empty()) {
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(job_id);
      if (it != jobs_.end()) job = it->second;
    }
    if (job && parent_) {
      std::shared_ptr<const std::string> token = job->token();
      for (const auto& f : actions.forwards) parent_->Forward(job_id, job->layout(), token, f);
      for (const auto& a : actions.aborts) parent_->Abort(job_id, job->layout(), token, a);
    }
  }
  if (parent_) {
    for (const auto& n : actions.node_states) parent_->NodeState(job_id, n);
  }
}

void Aggregator::StreamClosed(const std::vector<uint64_t>& sessions, bool graceful) {
  for (uint64_t session : sessions) {
    SessionRef ref;
    if (!FindSession(session, &ref)) continue;
    Actions actions;
    ref.job->MemberGone(ref.index, session, /*left=*/false, &actions);
    Execute(actions, ref.job->id());
  }
}

void Aggregator::OnParentResult(const std::string& job_id, const v1::Result& result) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    job = it->second;
  }
  Actions actions;
  job->ParentResult(result, &actions);
  Execute(actions, job_id);
}

bool Aggregator::NodeDown(const std::string& job_id, std::string* message) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return false;
    job = it->second;
  }
  return job->NodeDown(message);
}

void Aggregator::OnParentLost(const absl::Status& status) {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) {
    Actions actions;
    job->ParentLost(status, &actions);
    Execute(actions, job->id());
  }
}

absl::Status Aggregator::DoJoin(const v1::JoinRequest& req, v1::JoinResponse* resp) {
  const bool is_root = options_.role == AggregatorOptions::Role::kRoot;
  const bool worker = req.kind() == v1::MEMBER_KIND_WORKER;
  if (req.protocol_version() != v1::PROTOCOL_VERSION_1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", req.protocol_version(),
        " is not spoken by this aggregator (it speaks 1); use matching hsbn versions"));
  }
  if (req.kind() != v1::MEMBER_KIND_WORKER && req.kind() != v1::MEMBER_KIND_AGGREGATOR) {
    return absl::InvalidArgumentError("Join: field 'kind' must be worker or aggregator");
  }
  if (is_root && worker) {
    return absl::FailedPreconditionError(absl::StrCat(
        "aggregator ", options_.id, " is a root; workers join their node's sidecar "
        "(--role=node), not the root. Check HSBN_ADDRESS"));
  }
  if (!is_root && !worker) {
    return absl::FailedPreconditionError(absl::StrCat(
        "aggregator ", options_.id, " is a node sidecar; only a root (--role=root) accepts "
        "other aggregators. Check the sidecar's --upstream"));
  }
  const std::string who = worker ? absl::StrCat("rank ", req.rank())
                                 : absl::StrCat("the sidecar of node ", req.node_rank());
  auto bad = [&](const std::string& field, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(who, " of job '", req.job_id(), "': ", field,
                                                   " ", what));
  };
  if (req.job_id().empty()) return bad("job_id", "is empty: set HSBN_JOB_ID");
  if (req.job_id().size() > 256) return bad("job_id", "is longer than 256 bytes");
  // Before anything touches the job: a refused Join creates no job and replaces no member.
  if (options_.tokens) {
    if (absl::Status s = options_.tokens->Check(req.job_id(), req.token(), who); !s.ok()) {
      return s;
    }
  }
  if (req.world_size() <= 0) return bad("world_size (WORLD_SIZE)", "must be positive");
  if (req.local_world_size() <= 0 || req.world_size() % req.local_world_size() != 0) {
    return bad("local_world_size (LOCAL_WORLD_SIZE)",
               absl::StrCat("is ", req.local_world_size(), "; it must be positive and divide "
                            "WORLD_SIZE=", req.world_size(), " (hsbn needs as many workers on "
                            "every node)"));
  }
  const int32_t num_nodes = req.world_size() / req.local_world_size();
  if (req.node_rank() < 0 || req.node_rank() >= num_nodes) {
    return bad("node_rank (GROUP_RANK)", absl::StrCat("is ", req.node_rank(), "; the job has ",
                                                      num_nodes, " nodes"));
  }
  if (worker) {
    if (req.rank() < 0 || req.rank() >= req.world_size()) {
      return bad("rank (RANK)", absl::StrCat("is ", req.rank(), "; it must be in [0, WORLD_SIZE=",
                                             req.world_size(), ")"));
    }
    if (req.local_rank() < 0 || req.local_rank() >= req.local_world_size()) {
      return bad("local_rank (LOCAL_RANK)",
                 absl::StrCat("is ", req.local_rank(), "; it must be in [0, LOCAL_WORLD_SIZE=",
                              req.local_world_size(), ")"));
    }
    if (req.rank() != req.node_rank() * req.local_world_size() + req.local_rank()) {
      return bad("rank (RANK)",
                 absl::StrCat("is ", req.rank(), " but GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK = ",
                              req.node_rank() * req.local_world_size() + req.local_rank(),
                              "; hsbn expects torchrun's rank layout"));
    }
  }
  JobLayout layout;
  layout.member_kind = req.kind();
  layout.world_size = req.world_size();
  layout.local_world_size = req.local_world_size();
  layout.num_nodes = num_nodes;
  layout.node_rank = worker ? req.node_rank() : -1;
  const int32_t index = worker ? req.local_rank() : req.node_rank();

  std::shared_ptr<Job> job;
  uint64_t session;
  Actions actions;
  {
    // One critical section from finding (or creating) the job to registering the member, so
    // the deadline thread can never see a new job without members and drop it.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(req.job_id());
    if (it == jobs_.end()) {
      if (int32_t(jobs_.size()) >= options_.max_jobs) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "aggregator ", options_.id, " already serves ", jobs_.size(),
            " jobs, its limit (--max-jobs); job '", req.job_id(), "' was refused"));
      }
      JobLimits limits = options_.limits;
      limits.has_parent = parent_ != nullptr;
      job = std::make_shared<Job>(req.job_id(), layout, limits);
    } else {
      job = it->second;
      if (absl::Status s = job->CheckLayout(layout, who); !s.ok()) return s;
    }
    do {
      session = rng_();
    } while (session == 0 || sessions_.count(session));
    if (absl::Status s = job->AddMember(index, session, req.previous_session_id(), &actions);
        !s.ok()) {
      return s;
    }
    if (it == jobs_.end()) {
      jobs_.emplace(req.job_id(), job);
      Log(LogLevel::kInfo, absl::StrCat("job '", req.job_id(), "' created: ", layout.world_size,
                                        " workers on ", num_nodes, " node(s)"));
    }
    if (auto prev = sessions_.find(req.previous_session_id());
        prev != sessions_.end() && prev->second.job == job && prev->second.index == index) {
      sessions_.erase(prev);
    }
    sessions_[session] = SessionRef{job, index};
  }
  if (!req.token().empty()) job->SetToken(req.token());
  Execute(actions, job->id());
  Log(LogLevel::kDebug, absl::StrCat("job '", req.job_id(), "': ", job->MemberName(index),
                                     " joined"));
  resp->set_session_id(session);
  resp->set_protocol_version(v1::PROTOCOL_VERSION_1);
  resp->set_num_nodes(num_nodes);
  resp->set_max_channels(options_.limits.max_channels);
  resp->set_round_timeout_ms(options_.limits.round_timeout.count());
  resp->set_aggregator_id(options_.id);
  resp->set_accepts_batches(true);
  return absl::OkStatus();
}

grpc::Status Aggregator::Join(const v1::JoinRequest& req, v1::JoinResponse* resp) {
  absl::Status s = DoJoin(req, resp);
  if (!s.ok()) Log(LogLevel::kWarn, absl::StrCat("Join refused: ", s.ToString()));
  if (Metrics* m = options_.metrics.get()) m->JoinAnswered(s.code());
  return wire::ToGrpc(s);
}

grpc::Status Aggregator::Leave(const v1::LeaveRequest& req) {
  SessionRef ref;
  if (!FindSession(req.session_id(), &ref)) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown session");
  }
  Actions actions;
  ref.job->MemberGone(ref.index, req.session_id(), /*left=*/true, &actions);
  Execute(actions, ref.job->id());
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(req.session_id());
  }
  return grpc::Status::OK;
}

void Aggregator::FillStatus(const std::string& job_id, v1::StatusResponse* resp) {
  resp->set_aggregator_id(options_.id);
  resp->set_role(options_.role == AggregatorOptions::Role::kRoot ? "root" : "node");
  resp->set_uptime_s(std::chrono::duration<double>(Clock::now() - started_).count());
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, job] : jobs_) {
      if (job_id.empty() || id == job_id) jobs.push_back(job);
    }
  }
  for (auto& job : jobs) job->FillStatus(resp->add_jobs());
}

}  // namespace hsbn::server

#include "parent_link.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "aggregator.h"
#include "event.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "log.h"
#include "wire.h"

namespace hsbn::server {

namespace {
constexpr auto kConnectTimeout = std::chrono::seconds(5);
// Most bytes of frames put in one FrameBatch (a single larger frame still goes alone).
constexpr size_t kMaxBatchBytes = 4 << 20;
}  // namespace

// One Exchange stream to the parent, on gRPC's async API, on the aggregator's completion queue:
// its completions run on the event thread. Send() queues a frame and starts a write when none
// is in flight (from any thread: the async API runs nothing inline, so the write starts under
// the lock); a write's completion sends whatever queued meanwhile, as one FrameBatch when the
// parent accepts batches. Until the call has started, the start counts as the write in flight.
// When the read fails (the stream broke, or was cancelled) and no write is in flight, Finish
// collects the status and its completion tells the link (ConnDone). Every operation in flight
// (start, read, write, finish) is counted; the Conn holds itself (self_) until the count is
// zero, after which nothing refers to it from gRPC. Send() refuses frames once it is broken.
class ParentLink::Conn final {
 public:
  explicit Conn(ParentLink* link) : link_(link) {}

  void Start(const std::shared_ptr<Conn>& self, v1::Aggregator::Stub* stub,
             grpc::CompletionQueue* cq) {
    std::lock_guard<std::mutex> lock(mu_);
    self_ = self;
    writing_ = true;  // nothing is written before the call has started
    ops_ = 1;
    stream_ = stub->PrepareAsyncExchange(&context_, cq);
    stream_->StartCall(&start_tag_);
  }

  // The parent's JoinResponse said it accepts batches.
  void EnableBatches() { batches_.store(true, std::memory_order_relaxed); }

  // False when the stream is broken: the frame was not queued.
  bool Send(v1::ClientFrame frame) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return false;
    pending_.push_back(std::move(frame));
    if (writing_) return true;
    writing_ = true;
    StartWriteLocked();
    return true;
  }

  bool broken() {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  void Cancel() { context_.TryCancel(); }

  // Waits (at most `timeout`) until ConnDone has told the link that this stream is gone, so
  // that its failure report cannot fail rounds already sent on the next stream.
  void WaitDone(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait_for(lock, timeout, [this] { return done_; });
  }

  // Writer (connect) thread only.
  std::map<std::string, uint64_t> session_of_job;

 private:
  void OnStart(bool ok) {
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ok) {
        // The call never started: no read; Finish reports why.
        broken_ = true;
        read_failed_ = true;
        pending_.clear();
        writing_ = false;
        MaybeFinishLocked();
      } else {
        ++ops_;
        stream_->Read(&in_, &read_tag_);
        if (broken_) {
          // Cancelled before it started: the read fails, then Finish.
          writing_ = false;
          pending_.clear();
          cancel = true;
        } else if (!pending_.empty()) {
          StartWriteLocked();
        } else {
          writing_ = false;
        }
      }
    }
    if (cancel) context_.TryCancel();
    Release();
  }

  void OnRead(bool ok) {
    if (!ok) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = true;
        read_failed_ = true;
        MaybeFinishLocked();
      }
      Release();
      return;
    }
    Metrics* metrics = link_->aggregator_->metrics();
    if (metrics) metrics->Received(Metrics::Link::kUpstream, in_.ByteSizeLong());
    if (in_.has_result()) {
      link_->Deliver(in_.result());
    } else if (in_.has_batch()) {
      for (const v1::Result& r : in_.batch().results()) link_->Deliver(r);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++ops_;
      stream_->Read(&in_, &read_tag_);
    }
    Release();
  }

  void OnWrite(bool ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ok) broken_ = true;
      if (broken_) {
        pending_.clear();  // the rounds behind them fail through ConnDone -> OnParentLost
        writing_ = false;
        MaybeFinishLocked();
      } else if (!pending_.empty()) {
        StartWriteLocked();
      } else {
        writing_ = false;
      }
    }
    if (!ok) context_.TryCancel();  // so that the read fails too
    Release();
  }

  void OnFinish(bool) {
    link_->ConnDone(status_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      done_cv_.notify_all();
    }
    Release();
  }

  // Drops one operation; the last one releases the Conn's hold on itself (may delete it).
  void Release() {
    std::shared_ptr<Conn> self;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--ops_ == 0) self = std::move(self_);
    }
  }

  // Finish once no more messages come (the read failed) and no write is in flight.
  void MaybeFinishLocked() {
    if (!read_failed_ || writing_ || finishing_) return;
    finishing_ = true;
    ++ops_;
    stream_->Finish(&status_, &finish_tag_);
  }

  void StartWriteLocked() {
    ++ops_;
    stream_->Write(*TakeLocked(), &write_tag_);
  }

  v1::ClientFrame* TakeLocked() {
    if (pending_.size() == 1 || !batches_.load(std::memory_order_relaxed)) {
      current_ = std::move(pending_.front());
      pending_.pop_front();
    } else {
      current_.Clear();
      v1::FrameBatch* batch = current_.mutable_batch();
      size_t bytes = 0;
      while (!pending_.empty()) {
        const size_t size = pending_.front().contribution().data().size();
        if (batch->frames_size() > 0 && bytes + size > kMaxBatchBytes) break;
        bytes += size;
        *batch->add_frames() = std::move(pending_.front());
        pending_.pop_front();
      }
    }
    if (Metrics* m = link_->aggregator_->metrics()) {
      m->Sent(Metrics::Link::kUpstream, current_.ByteSizeLong());
    }
    return &current_;
  }

  ParentLink* const link_;
  std::shared_ptr<Conn> self_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream_;
  MemberTag<Conn> start_tag_{this, &Conn::OnStart};
  MemberTag<Conn> read_tag_{this, &Conn::OnRead};
  MemberTag<Conn> write_tag_{this, &Conn::OnWrite};
  MemberTag<Conn> finish_tag_{this, &Conn::OnFinish};
  v1::ServerFrame in_;
  grpc::Status status_;
  std::atomic<bool> batches_{false};
  std::mutex mu_;
  std::deque<v1::ClientFrame> pending_;
  v1::ClientFrame current_;
  int ops_ = 0;  // operations in flight
  bool writing_ = false;
  bool broken_ = false;
  bool read_failed_ = false;
  bool finishing_ = false;
  bool done_ = false;
  std::condition_variable done_cv_;
};

// ParentLink::Status as an async unary call on the event thread's queue.
class ParentLink::StatusCall final {
 public:
  StatusCall(ParentLink* link,
             std::function<void(const grpc::Status&, const v1::StatusResponse&)> done)
      : link_(link), done_(std::move(done)) {}

  grpc::ClientContext ctx;
  v1::StatusResponse resp;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::StatusResponse>> rpc;
  MemberTag<StatusCall> tag{this, &StatusCall::OnDone};

 private:
  void OnDone(bool) {
    done_(status, resp);
    link_->StatusDone(this);  // deletes this
  }

  ParentLink* const link_;
  std::function<void(const grpc::Status&, const v1::StatusResponse&)> done_;
};

ParentLink::ParentLink(Aggregator* aggregator, std::string address, std::string id,
                       std::shared_ptr<grpc::ChannelCredentials> credentials, bool tls,
                       const std::string& tls_name, grpc::CompletionQueue* cq)
    : aggregator_(aggregator),
      address_(std::move(address)),
      id_(std::move(id)),
      tls_(tls),
      cq_(cq) {
  grpc::ChannelArguments args;
  if (!tls_name.empty()) args.SetSslTargetNameOverride(tls_name);
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Ping an idle link every 10 s and give up on it after 5 s without an answer: a root whose
  // machine vanished (no RST) is noticed without waiting for a write to fail. The root allows
  // pings this often (main.cc sets its minimum ping interval).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // keep pinging an idle stream
  channel_ = grpc::CreateCustomChannel(address_, std::move(credentials), args);
  stub_ = v1::Aggregator::NewStub(channel_);
  writer_ = std::thread([this] { WriterLoop(); });
}

ParentLink::~ParentLink() { Shutdown(); }

void ParentLink::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  // A stream's and a Status call's completions call into this object and the aggregator until
  // they finish; the event thread runs them.
  std::unique_lock<std::mutex> lock(mu_);
  for (StatusCall* call : status_calls_) call->ctx.TryCancel();
  cv_.wait(lock, [this] { return live_conns_ == 0; });
}

void ParentLink::Enqueue(Item item) {
  std::shared_ptr<Conn> conn;
  uint64_t session = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    if (!item.leave && queue_.empty() && published_ && !published_->broken()) {
      auto it = published_sessions_.find(item.job_id);
      if (it != published_sessions_.end()) {
        conn = published_;
        session = it->second;
      }
    }
    if (!conn) {
      queue_.push_back(std::move(item));
      cv_.notify_one();
      return;
    }
  }
  // Fast path: the stream is up and the job joined at the parent; queue on the stream from this
  // thread (never blocks).
  if (item.frame.has_contribution()) item.frame.mutable_contribution()->set_session_id(session);
  if (item.frame.has_abort()) item.frame.mutable_abort()->set_session_id(session);
  if (item.frame.has_node_state()) item.frame.mutable_node_state()->set_session_id(session);
  if (!conn->Send(std::move(item.frame))) {
    FailItem(item, absl::UnavailableError(absl::StrCat("the stream to the root ", address_,
                                                       " broke")));
  }
}

void ParentLink::Unpublish() {
  std::lock_guard<std::mutex> lock(mu_);
  published_.reset();
  published_sessions_.clear();
}

ParentLink::Item ParentLink::MakeItem(const std::string& job_id, const JobLayout& layout,
                                     std::shared_ptr<const std::string> token,
                                     const RoundKey& key) {
  Item item;
  item.job_id = job_id;
  item.layout = layout;
  item.token = std::move(token);
  item.key = key;
  return item;
}

void ParentLink::Forward(const std::string& job_id, const JobLayout& layout,
                         std::shared_ptr<const std::string> token, const Actions::Forward& f) {
  Item item = MakeItem(job_id, layout, std::move(token), f.key);
  item.wants_answer = f.scope == v1::SCOPE_GLOBAL;
  v1::Contribution* c = item.frame.mutable_contribution();
  c->set_op(f.key.op);
  c->set_seq(f.key.seq);
  c->set_phase(f.key.phase);
  c->set_scope(f.scope);
  c->set_channels(f.channels);
  c->set_count(f.count);
  c->set_data(*f.data);
  Enqueue(std::move(item));
}

void ParentLink::Abort(const std::string& job_id, const JobLayout& layout,
                       std::shared_ptr<const std::string> token, const Actions::Abort& a) {
  Item item = MakeItem(job_id, layout, std::move(token), a.key);
  v1::Abort* ab = item.frame.mutable_abort();
  ab->set_op(a.key.op);
  ab->set_seq(a.key.seq);
  ab->set_phase(a.key.phase);
  ab->set_code(int(a.status.code()));
  ab->set_message(std::string(a.status.message()));
  Enqueue(std::move(item));
}

void ParentLink::NodeState(const std::string& job_id, const Actions::NodeState& state) {
  Item item;
  item.job_id = job_id;
  v1::NodeState* ns = item.frame.mutable_node_state();
  ns->set_healthy(state.healthy);
  ns->set_message(state.message);
  Enqueue(std::move(item));
}

void ParentLink::Status(const v1::StatusRequest& request,
                        std::function<void(const grpc::Status&, const v1::StatusResponse&)> done) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    lock.unlock();
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the sidecar is shutting down"),
         v1::StatusResponse());
    return;
  }
  // Started under mu_: Shutdown (which sets stopping_ first) then waits for it, so the queue
  // is never shut down under a call started here.
  auto* call = new StatusCall(this, std::move(done));
  v1::StatusRequest req = request;
  req.set_include_upstream(false);
  call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  status_calls_.insert(call);
  ++live_conns_;
  call->rpc = stub_->PrepareAsyncStatus(&call->ctx, req, cq_);
  call->rpc->StartCall();
  call->rpc->Finish(&call->resp, &call->status, &call->tag);
}

void ParentLink::StatusDone(StatusCall* call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    status_calls_.erase(call);
    --live_conns_;
    cv_.notify_all();
  }
  delete call;
}

void ParentLink::FailItem(const Item& item, const absl::Status& status) {
  if (!item.frame.has_contribution()) return;  // an abort that could not be sent: nothing waits
  if (!item.wants_answer) {
    Log(LogLevel::kWarn, absl::StrCat("shadow partial for job '", item.job_id, "' round ",
                                      Describe(item.key), " not sent to the root: ",
                                      status.ToString()));
    return;
  }
  v1::Result r;
  r.set_op(item.key.op);
  r.set_seq(item.key.seq);
  r.set_phase(item.key.phase);
  r.set_code(int(status.code()));
  r.set_message(std::string(status.message()));
  aggregator_->OnParentResult(item.job_id, r);
}

void ParentLink::Leave(const std::string& job_id) {
  Item item;
  item.job_id = job_id;
  item.leave = true;
  Enqueue(std::move(item));
}

absl::Status ParentLink::Send(Item& item) {
  if (item.leave) {  // never connects just to leave
    uint64_t session = 0;
    if (conn_ && !conn_->broken()) {
      auto it = conn_->session_of_job.find(item.job_id);
      if (it != conn_->session_of_job.end()) {
        session = it->second;
        conn_->session_of_job.erase(it);
      }
    }
    last_session_.erase(item.job_id);
    {
      std::lock_guard<std::mutex> lock(mu_);
      published_sessions_.erase(item.job_id);
    }
    if (session != 0) {
      {
        std::lock_guard<std::mutex> lock(jobs_mu_);
        job_of_session_.erase(session);
      }
      v1::LeaveRequest req;
      req.set_session_id(session);
      v1::LeaveResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      grpc::Status s = stub_->Leave(&ctx, req, &resp);
      if (!s.ok()) {
        Log(LogLevel::kDebug, absl::StrCat("leaving job '", item.job_id, "' at the root: ",
                                           s.error_message()));
      }
    }
    return absl::OkStatus();
  }
  if (item.frame.has_node_state()) {
    // Only news for a root that holds this node's session in the job: never connects or joins
    // just to say it (a root that never saw the job has no round waiting for this node).
    if (!conn_ || conn_->broken()) return absl::OkStatus();
    auto it = conn_->session_of_job.find(item.job_id);
    if (it == conn_->session_of_job.end()) return absl::OkStatus();
    item.frame.mutable_node_state()->set_session_id(it->second);
    conn_->Send(std::move(item.frame));
    return absl::OkStatus();
  }
  if (conn_ && conn_->broken()) {
    Unpublish();
    conn_->WaitDone(std::chrono::seconds(10));
    conn_.reset();
  }
  if (!conn_) {
    // After a failed connect, forwards fail at once for 2 s instead of each waiting out
    // the connect timeout behind the previous one.
    if (!last_connect_error_.ok() && std::chrono::steady_clock::now() < retry_after_) {
      return last_connect_error_;
    }
    if (!channel_->WaitForConnected(std::chrono::system_clock::now() + kConnectTimeout)) {
      retry_after_ = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      return last_connect_error_ = absl::UnavailableError(absl::StrCat(
          "the root aggregator at ", address_, " did not answer within 5 s; is it running, and "
          "is --upstream right?",
          tls_ ? " This sidecar uses TLS: check that --upstream-ca signed the root's "
                 "certificate, that the certificate names the host in --upstream (or "
                 "--upstream-tls-name), and, if the root has --tls-client-ca, that this sidecar "
                 "has --upstream-cert and --upstream-key signed by that CA"
               : " If the root uses TLS (--tls-cert), give this sidecar --upstream-ca"));
    }
    last_connect_error_ = absl::OkStatus();
    auto conn = std::make_shared<Conn>(this);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++live_conns_;
    }
    conn->Start(conn, stub_.get(), cq_);
    conn_ = std::move(conn);
    Log(LogLevel::kInfo, absl::StrCat("connected to the root aggregator at ", address_,
                                      tls_ ? " (TLS)" : ""));
    if (Metrics* m = aggregator_->metrics()) m->SetUpstreamConnected(true);
  }
  uint64_t session = 0;
  v1::ClientFrame resend_down;
  auto found = conn_->session_of_job.find(item.job_id);
  if (found == conn_->session_of_job.end()) {
    v1::JoinRequest req;
    req.set_protocol_version(v1::PROTOCOL_VERSION_1);
    req.set_job_id(item.job_id);
    req.set_kind(v1::MEMBER_KIND_AGGREGATOR);
    req.set_world_size(item.layout.world_size);
    req.set_local_world_size(item.layout.local_world_size);
    req.set_node_rank(item.layout.node_rank);
    req.set_rank(-1);
    req.set_local_rank(-1);
    if (auto last = last_session_.find(item.job_id); last != last_session_.end()) {
      req.set_previous_session_id(last->second);
    }
    if (item.token) req.set_token(*item.token);
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kConnectTimeout);
    grpc::Status s = stub_->Join(&ctx, req, &resp);
    if (!s.ok()) {
      return absl::Status(wire::FromGrpc(s).code(),
                          absl::StrCat("joining job '", item.job_id, "' at the root ", address_,
                                       " failed: ", s.error_message()));
    }
    session = resp.session_id();
    if (resp.accepts_batches()) conn_->EnableBatches();
    conn_->session_of_job[item.job_id] = session;
    last_session_[item.job_id] = session;
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      job_of_session_[session] = item.job_id;
    }
    v1::ClientFrame attach;
    attach.mutable_attach()->add_session_ids(session);
    attach.mutable_attach()->set_accepts_batches(true);
    if (!conn_->Send(std::move(attach))) {
      return absl::UnavailableError(absl::StrCat("the stream to the root ", address_, " broke"));
    }
    // A parent that holds a new session for this node knows nothing of its lost workers: say
    // it again, after this item (whose round completed here before).
    if (std::string why; aggregator_->NodeDown(item.job_id, &why)) {
      resend_down.mutable_node_state()->set_session_id(session);
      resend_down.mutable_node_state()->set_healthy(false);
      resend_down.mutable_node_state()->set_message(why);
    }
  } else {
    session = found->second;
  }
  if (item.frame.has_contribution()) item.frame.mutable_contribution()->set_session_id(session);
  if (item.frame.has_abort()) item.frame.mutable_abort()->set_session_id(session);
  if (!conn_->Send(std::move(item.frame))) {
    return absl::UnavailableError(absl::StrCat("the stream to the root ", address_, " broke"));
  }
  if (resend_down.has_node_state()) conn_->Send(std::move(resend_down));
  {
    std::lock_guard<std::mutex> lock(mu_);
    published_ = conn_;
    published_sessions_[item.job_id] = session;
  }
  return absl::OkStatus();
}

void ParentLink::WriterLoop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) break;
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status s = Send(item);
    if (!s.ok()) FailItem(item, s);
  }
  // Drain: whatever is left fails.
  std::deque<Item> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queue_);
  }
  for (const Item& item : left) {
    FailItem(item, absl::UnavailableError("the sidecar is shutting down"));
  }
  Unpublish();
  if (conn_) {
    conn_->Cancel();
    conn_.reset();
  }
}

void ParentLink::Deliver(const v1::Result& result) {
  std::string job_id;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    auto it = job_of_session_.find(result.session_id());
    if (it == job_of_session_.end()) return;
    job_id = it->second;
  }
  aggregator_->OnParentResult(job_id, result);
}

void ParentLink::ConnDone(const grpc::Status& status) {
  if (Metrics* m = aggregator_->metrics()) m->SetUpstreamConnected(false);
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping = stopping_;
  }
  if (!stopping) {
    Log(LogLevel::kWarn, absl::StrCat("lost the stream to the root aggregator at ", address_, ": ",
                                      status.error_message()));
    aggregator_->OnParentLost(absl::UnavailableError(absl::StrCat(
        "this node's sidecar lost its link to the root aggregator at ", address_, " (",
        status.error_message(), "); global rounds in flight failed, later rounds reconnect")));
  }
  std::lock_guard<std::mutex> lock(mu_);
  --live_conns_;
  cv_.notify_all();
}

}  // namespace hsbn::server

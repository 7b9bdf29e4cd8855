#include "parent_link.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "event.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "log.h"
#include "wire.h"

namespace hsbn::server {

namespace {
constexpr auto kConnectTimeout = std::chrono::seconds(5);
constexpr auto kStoppedParentWait = std::chrono::milliseconds(500);
// --lagged-hold-ms: at most this many partials of a job are held at once, and this many rounds
// remembered as waited for before their partial came.
constexpr size_t kMaxHeldPerJob = 256;
constexpr size_t kMaxWanted = 64;

bool SameRound(const RoundKey& a, const RoundKey& b) {
  return a.op == b.op && a.seq == b.seq && a.phase == b.phase;
}
}  // namespace

struct FrameTraits {
  using Item = v1::ClientFrame;
  using Frame = v1::ClientFrame;
  // An upper bound of the frame's serialized size (the payload plus at most 96 bytes of
  // fields), so that a batch stays within the root's message limit however small its frames.
  static size_t Bytes(const v1::ClientFrame& f) { return f.contribution().data().size() + 96; }
  static void SetOne(v1::ClientFrame* frame, v1::ClientFrame&& f) { *frame = std::move(f); }
  static void AddToBatch(v1::ClientFrame* frame, v1::ClientFrame&& f) {
    *frame->mutable_batch()->add_frames() = std::move(f);
  }
};

// One Exchange stream to the parent, on gRPC's async API, on the aggregator's completion queue:
// its completions run on the event thread. Writes go through a bounded StreamWriter (one in
// flight, batches when the parent accepts them, --max-queued-bytes and the memory budget);
// until the call has started the writer is held. When the read fails (the stream broke, or
// was cancelled) and no write is in flight, Finish collects the status and its completion
// tells the link (ConnDone). The ParentStream holds itself (self_) until its last operation is back.
// Send() refuses frames once it is broken; an overflow breaks it (the rounds behind it fail
// through ConnDone -> OnParentLost).
class ParentLink::ParentStream final : public StreamWriter<FrameTraits> {
 public:
  explicit ParentStream(ParentLink* link)
      : StreamWriter(link->writer_limits_, /*held=*/true), link_(link) {}

  void Start(const std::shared_ptr<ParentStream>& self, v1::Aggregator::Stub* stub,
             grpc::CompletionQueue* cq) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    self_ = self;
    ops() = 1;
    stream_ = stub->PrepareAsyncExchange(&context_, cq);
    stream_->StartCall(&start_tag_);
  }

  // False when the stream is broken: the frame was not queued.
  bool Send(v1::ClientFrame frame) { return Push(std::move(frame)); }
  // Several frames in one write when the parent reads batches; false as Send (none queued).
  bool SendAll(std::vector<v1::ClientFrame> frames) { return PushAll(std::move(frames)); }

  bool broken() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return closed();
  }
  void Cancel() { context_.TryCancel(); }

  // Waits (at most `timeout`) until ConnDone has told the link that this stream is gone, so
  // that its failure report cannot fail rounds already sent on the next stream.
  void WaitDone(std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&done_), absl::FromChrono(timeout));
  }

  // Writer (connect) thread only.
  std::map<std::string, SessionId> session_of_job;

 protected:
  bool StartWriteLocked(const v1::ClientFrame& frame) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (link_->metrics_) link_->metrics_->Sent(Metrics::Link::kUpstream, frame.ByteSizeLong());
    ++ops();
    stream_->Write(frame, &write_tag_);
    return true;
  }
  void OverflowLocked(Overflow which) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Log(LogLevel::kWarn, absl::StrCat("the stream to the ", link_->Parent(), " ", link_->address_, " has more "
                                      "than ", which == Overflow::kQueue
                                          ? "--max-queued-bytes unsent"
                                          : "the memory budget's worth of unsent bytes",
                                      "; dropping it (global rounds in flight fail)"));
    context_.TryCancel();  // the read fails, then Finish, then ConnDone
  }
  void IdleLocked() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { MaybeFinishLocked(); }

 private:
  void OnStart(bool ok) {
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {
        // The call never started: no read; Finish reports why.
        set_closed();
        read_failed_ = true;
        MaybeFinishLocked();
      } else {
        ++ops();
        stream_->Read(&in_, &read_tag_);
        if (closed()) {
          cancel = true;  // cancelled before it started: the read fails, then Finish
        } else {
          UnholdLocked();
        }
      }
    }
    if (cancel) context_.TryCancel();
    Release();
  }

  void OnRead(bool ok) {
    if (!ok) {
      {
        absl::MutexLock lock(&mu_);
        set_closed();
        read_failed_ = true;
        MaybeFinishLocked();
      }
      Release();
      return;
    }
    if (link_->metrics_) link_->metrics_->Received(Metrics::Link::kUpstream, in_.ByteSizeLong());
    if (in_.has_result()) {
      link_->Deliver(in_.result());
    } else if (in_.has_batch()) {
      for (const v1::Result& r : in_.batch().results()) link_->Deliver(r);
    }
    {
      absl::MutexLock lock(&mu_);
      ++ops();
      stream_->Read(&in_, &read_tag_);
    }
    Release();
  }

  void OnWrite(bool ok) {
    WriteDone(ok);
    if (!ok) context_.TryCancel();  // so that the read fails too
    Release();
  }

  void OnFinish(bool) {
    link_->ConnDone(status_);
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    Release();
  }

  // Drops one operation; the last one releases the ParentStream's hold on itself (may delete it).
  void Release() {
    std::shared_ptr<ParentStream> self;
    if (ReleaseOp()) {
      absl::MutexLock lock(&mu_);
      self = std::move(self_);
    }
  }

  // Finish once no more messages come (the read failed) and no write is in flight.
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!read_failed_ || writing() || finishing_) return;
    finishing_ = true;
    ++ops();
    stream_->Finish(&status_, &finish_tag_);
  }

  ParentLink* const link_;
  std::shared_ptr<ParentStream> self_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream_;
  MemberTag<ParentStream> start_tag_{this, &ParentStream::OnStart};
  MemberTag<ParentStream> read_tag_{this, &ParentStream::OnRead};
  MemberTag<ParentStream> write_tag_{this, &ParentStream::OnWrite};
  MemberTag<ParentStream> finish_tag_{this, &ParentStream::OnFinish};
  v1::ServerFrame in_;
  grpc::Status status_;
  bool read_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

// One async unary call to the parent (Join, Leave, Status) on cq_; its completion runs `done`
// on the event thread, then tells the link (UnaryDone), which deletes it.
template <typename Req, typename Resp>
class ParentLink::UnaryCall final {
 public:
  UnaryCall(ParentLink* link, std::function<void(const grpc::Status&, const Resp&)> done)
      : link_(link), done_(std::move(done)) {}

  grpc::ClientContext ctx;
  Resp resp;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> rpc;
  MemberTag<UnaryCall> tag{this, &UnaryCall::OnDone};

 private:
  void OnDone(bool) {
    done_(status, resp);
    link_->UnaryDone(this);
    delete this;
  }

  ParentLink* const link_;
  std::function<void(const grpc::Status&, const Resp&)> done_;
};

ParentLink::ParentLink(UpstreamListener* listener, Options options, grpc::CompletionQueue* cq)
    : listener_(listener),
      self_(options.self),
      address_(std::move(options.address)),
      id_(std::move(options.id)),
      tls_(options.tls),
      writer_limits_(options.writer),
      metrics_(options.metrics),
      cq_(cq),
      lagged_hold_(options.lagged_hold) {
  grpc::ChannelArguments args;
  if (!options.tls_name.empty()) args.SetSslTargetNameOverride(options.tls_name);
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
  channel_ = grpc::CreateCustomChannel(address_, std::move(options.credentials), args);
  stub_ = v1::Aggregator::NewStub(channel_);
  writer_ = std::thread([this] { WriterLoop(); });
}

ParentLink::~ParentLink() { Shutdown(); }

void ParentLink::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (writer_.joinable()) writer_.join();
  // A stream's and a unary call's completions call into this object and the listener until
  // they finish; the event thread runs them.
  absl::MutexLock lock(&mu_);
  for (auto& [call, cancel] : unary_calls_) cancel();
  mu_.Await(absl::Condition(
      +[](int* live) { return *live == 0; }, &live_conns_));
}

template <typename Req, typename Resp>
bool ParentLink::StartUnary(
    std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> (v1::Aggregator::Stub::*prepare)(
        grpc::ClientContext*, const Req&, grpc::CompletionQueue*),
    const Req& req, std::chrono::milliseconds timeout,
    std::function<void(const grpc::Status&, const Resp&)> done) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  // Started under mu_: Shutdown (which sets stopping_ first) then waits for it, so the queue
  // is never shut down under a call started here.
  auto* call = new UnaryCall<Req, Resp>(this, std::move(done));
  call->ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  unary_calls_[call] = [call] { call->ctx.TryCancel(); };
  ++live_conns_;
  call->rpc = (stub_.get()->*prepare)(&call->ctx, req, cq_);
  call->rpc->StartCall();
  call->rpc->Finish(&call->resp, &call->status, &call->tag);
  return true;
}

void ParentLink::UnaryDone(void* call) {
  absl::MutexLock lock(&mu_);
  unary_calls_.erase(call);
  --live_conns_;
}

void ParentLink::CheckStalled(std::chrono::steady_clock::time_point now) {
  std::shared_ptr<ParentStream> conn;
  {
    absl::MutexLock lock(&mu_);
    conn = published_;
  }
  if (conn && conn->Stalled(now)) {
    Log(LogLevel::kWarn, absl::StrCat("a write to the ", Parent(), " ", address_, " waited longer than "
                                      "--write-deadline-ms; dropping the stream"));
    conn->Cancel();
  }
}

void ParentLink::Enqueue(Item item) {
  std::shared_ptr<ParentStream> conn;
  SessionId session;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    conn = FastPathLocked(item, &session);
    if (!conn) {
      queue_.push_back(std::move(item));
      return;
    }
  }
  // Fast path: the stream is up and the job joined at the parent; queue on the stream from this
  // thread (never blocks).
  v1::ClientFrame* frame = FrameOf(item);
  SetSession(frame, session);
  if (!conn->Send(std::move(*frame))) {
    FailItem(item, absl::UnavailableError(absl::StrCat("the stream to the ", Parent(), " ", address_,
                                                       " broke")));
  }
}

std::shared_ptr<ParentLink::ParentStream> ParentLink::FastPathLocked(Item& item,
                                                                     SessionId* session) {
  if (FrameOf(item) == nullptr || !queue_.empty() || !published_ || published_->broken()) {
    return nullptr;
  }
  auto it = published_sessions_.find(item.job_id);
  if (it == published_sessions_.end()) return nullptr;
  *session = it->second;
  return published_;
}

void ParentLink::Unpublish() {
  absl::MutexLock lock(&mu_);
  published_.reset();
  published_sessions_.clear();
}

ParentLink::Item ParentLink::MakeItem(const std::string& job_id, const JobLayout& layout,
                                     std::shared_ptr<const std::string> token,
                                     const RoundKey& key) {
  Frame f;
  f.layout = layout;
  f.token = std::move(token);
  f.key = key;
  return Item{job_id, std::move(f)};
}

void ParentLink::SetSession(v1::ClientFrame* frame, const SessionId& session) {
  if (frame->has_contribution()) frame->mutable_contribution()->set_session(session.Bytes());
  if (frame->has_abort()) frame->mutable_abort()->set_session(session.Bytes());
  if (frame->has_node_state()) frame->mutable_node_state()->set_session(session.Bytes());
  if (frame->has_layer_names()) frame->mutable_layer_names()->set_session(session.Bytes());
}

void ParentLink::Forward(const std::string& job_id, const JobLayout& layout,
                         std::shared_ptr<const std::string> token, const Actions::Forward& f) {
  Item item = MakeItem(job_id, layout, std::move(token), f.key);
  Frame& frame = std::get<Frame>(item.what);
  // A renorm or lagged partial wants its answer too: the root's global result goes to every
  // worker; and so does a group aggregator's shadow partial (the global statistics, for its
  // record).
  frame.contribution = true;
  frame.wants_answer = f.scope != v1::SCOPE_SHADOW || !layout.workers();
  v1::Contribution* c = frame.frame.mutable_contribution();
  c->set_op(f.key.op);
  c->set_seq(f.key.seq);
  c->set_phase(f.key.phase);
  c->set_scope(f.scope);
  c->set_channels(f.channels);
  c->set_count(f.count);
  c->set_data(*f.data);
  if (f.decide) *c->mutable_decide() = *f.decide;
  const int pass = f.key.phase == v1::PHASE_FORWARD ? 0 : f.key.phase == v1::PHASE_BACKWARD ? 1 : -1;
  Submit(std::move(item), f.scope == v1::SCOPE_LAGGED, f.key.op, pass);
}

void ParentLink::Abort(const std::string& job_id, const JobLayout& layout,
                       std::shared_ptr<const std::string> token, const Actions::Abort& a) {
  Item item = MakeItem(job_id, layout, std::move(token), a.key);
  v1::Abort* ab = std::get<Frame>(item.what).frame.mutable_abort();
  ab->set_op(a.key.op);
  ab->set_seq(a.key.seq);
  ab->set_phase(a.key.phase);
  ab->set_code(int(a.status.code()));
  ab->set_message(std::string(a.status.message()));
  ab->set_reason(wire::ReasonOf(a.status));
  Submit(std::move(item), false, 0, -1);
}

void ParentLink::LayerNames(const std::string& job_id, const JobLayout& layout,
                            std::shared_ptr<const std::string> token,
                            const std::vector<v1::LayerName>& names) {
  Item item = MakeItem(job_id, layout, std::move(token), RoundKey{});
  v1::LayerNames* n = std::get<Frame>(item.what).frame.mutable_layer_names();
  for (const v1::LayerName& name : names) *n->add_layers() = name;
  Submit(std::move(item), false, 0, -1);
}

void ParentLink::NodeState(const std::string& job_id, const Actions::NodeState& state) {
  Item item{job_id, Frame{}};
  v1::NodeState* ns = std::get<Frame>(item.what).frame.mutable_node_state();
  ns->set_healthy(state.healthy);
  ns->set_message(state.message);
  Submit(std::move(item), false, 0, -1);
}

void ParentLink::Status(const v1::StatusRequest& request,
                        std::function<void(const grpc::Status&, const v1::StatusResponse&)> done) {
  // The parent asks its own parent in turn (a group aggregator, the root): the whole tree.
  v1::StatusRequest req = request;
  if (!StartUnary<v1::StatusRequest, v1::StatusResponse>(
          &v1::Aggregator::Stub::PrepareAsyncStatus, req, std::chrono::seconds(2), done)) {
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the sidecar is shutting down"),
         v1::StatusResponse());
  }
}

void ParentLink::FailItem(const Item& item, const absl::Status& status) {
  const Frame* f = std::get_if<Frame>(&item.what);
  // Only contributions wait for an answer (aborts, node states and leaves do not); the frame
  // itself may have been moved out already.
  if (f == nullptr || !f->contribution) return;
  if (!f->wants_answer) {
    Log(LogLevel::kWarn, absl::StrCat("shadow partial for job '", item.job_id, "' round ",
                                      Describe(f->key), " not sent to the ", Parent(), ": ",
                                      status.ToString()));
    return;
  }
  listener_->OnParentResult(item.job_id,
                            wire::ErrorResult(f->key.op, f->key.seq, f->key.phase, status));
}

void ParentLink::FailParked(const absl::Status& status) {
  std::map<std::string, std::deque<Item>> parked;
  parked.swap(parked_);
  for (auto& [job, items] : parked) {
    for (const Item& item : items) FailItem(item, status);
  }
}

void ParentLink::Leave(const std::string& job_id) {
  Submit(Item{job_id, LeaveItem{}}, false, 0, -1);
  if (lagged_hold_.count() > 0) {
    absl::MutexLock lock(&hold_mu_);
    // Its held frames left before the Leave (Submit); a new run of the job may hold some now.
    if (auto it = held_.find(job_id); it != held_.end() && it->second.items.empty()) {
      held_.erase(it);
    }
  }
}

void ParentLink::Submit(Item item, bool lagged, uint32_t op, int pass) {
  if (lagged_hold_.count() <= 0) {
    Enqueue(std::move(item));
    return;
  }
  {
    absl::MutexLock lock(&hold_mu_);
    auto it = held_.find(item.job_id);
    if (it == held_.end() && !lagged) {
      outbox_.push_back(std::move(item));  // nothing of this job held: it leaves in order
    } else {
      if (it == held_.end()) it = held_.try_emplace(item.job_id).first;
      Held& h = it->second;
      const std::string job_id = item.job_id;
      PassBatcher::Step step = h.batcher.Next(lagged, op, pass, std::chrono::steady_clock::now());
      if (step.hold) {
        // A worker already waits for this round's result: it leaves now, with the held ones.
        const RoundKey& key = std::get<Frame>(item.what).key;
        auto w = std::find_if(h.wanted.begin(), h.wanted.end(),
                              [&](const RoundKey& k) { return SameRound(k, key); });
        if (w != h.wanted.end()) {
          h.wanted.erase(w);
          step.flush_after = true;
        }
      }
      if (step.flush_before) ReleaseHeldLocked(job_id);
      if (step.hold) {
        const Frame* f = std::get_if<Frame>(&item.what);
        const int64_t bytes = f ? int64_t(FrameTraits::Bytes(f->frame)) : 0;
        h.bytes += bytes;
        held_bytes_ += bytes;
        h.items.push_back(std::move(item));
        // A pass longer than half a batch frame leaves in several; all jobs together hold at
        // most one batch frame's bytes (and one partial).
        if (step.flush_after || h.bytes >= int64_t(writer_limits_.max_batch_bytes) / 2 ||
            held_bytes_ >= int64_t(writer_limits_.max_batch_bytes) ||
            h.items.size() >= kMaxHeldPerJob) {
          ReleaseHeldLocked(job_id);
          h.batcher.Flushed();
        }
      } else {
        outbox_.push_back(std::move(item));
      }
    }
    if (draining_) return;  // the thread draining sends ours too, in order
    draining_ = true;
  }
  Drain();
}

void ParentLink::Wanted(const std::string& job_id, const RoundKey& key) {
  if (lagged_hold_.count() <= 0) return;
  {
    absl::MutexLock lock(&hold_mu_);
    Held& h = held_[job_id];  // (the job's frames are bound to this worker's session)
    const bool held = std::any_of(h.items.begin(), h.items.end(), [&](const Item& item) {
      const Frame* f = std::get_if<Frame>(&item.what);
      return f != nullptr && SameRound(f->key, key);
    });
    if (!held) {
      // Not come yet (the worker's wait can overtake the node's partial on its way here), or
      // sent already: remembered, so that it is not held when it comes.
      if (std::none_of(h.wanted.begin(), h.wanted.end(),
                       [&](const RoundKey& k) { return SameRound(k, key); })) {
        if (h.wanted.size() >= kMaxWanted) h.wanted.pop_front();
        h.wanted.push_back(key);
      }
      return;
    }
    ReleaseHeldLocked(job_id);
    h.batcher.Flushed();
    if (draining_) return;
    draining_ = true;
  }
  Drain();
}

void ParentLink::ReleaseHeldLocked(const std::string& job_id) {
  auto it = held_.find(job_id);
  if (it == held_.end()) return;
  Held& h = it->second;
  held_bytes_ -= h.bytes;
  for (Item& item : h.items) outbox_.push_back(std::move(item));
  h.items.clear();
  h.bytes = 0;
}

void ParentLink::Drain() {
  for (;;) {
    std::deque<Item> items;
    {
      absl::MutexLock lock(&hold_mu_);
      if (outbox_.empty()) {
        draining_ = false;
        return;
      }
      items.swap(outbox_);
    }
    EnqueueAll(std::move(items));
  }
}

void ParentLink::FlushHeld(std::chrono::steady_clock::time_point now) {
  if (lagged_hold_.count() <= 0) return;
  {
    absl::MutexLock lock(&hold_mu_);
    bool any = false;
    for (auto& [job_id, h] : held_) {
      if (!h.batcher.Due(now, lagged_hold_)) continue;
      ReleaseHeldLocked(job_id);
      h.batcher.Flushed();
      any = true;
    }
    if (!any || draining_) return;
    draining_ = true;
  }
  Drain();
}

void ParentLink::EnqueueAll(std::deque<Item> items) {
  while (!items.empty()) {
    // The longest run of frames that can take the fast path together: one write, one batch.
    std::shared_ptr<ParentStream> conn;
    std::vector<v1::ClientFrame> frames;
    std::vector<Item> sent;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      SessionId session;
      while (!items.empty()) {
        std::shared_ptr<ParentStream> fast = FastPathLocked(items.front(), &session);
        if (!fast) break;
        conn = std::move(fast);
        SetSession(FrameOf(items.front()), session);
        sent.push_back(std::move(items.front()));
        items.pop_front();
      }
    }
    if (sent.empty()) {  // the rest goes through the writer thread, in order
      Enqueue(std::move(items.front()));
      items.pop_front();
      continue;
    }
    frames.reserve(sent.size());
    for (Item& item : sent) frames.push_back(std::move(*FrameOf(item)));
    if (!conn->SendAll(std::move(frames))) {
      for (const Item& item : sent) {
        FailItem(item, absl::UnavailableError(absl::StrCat("the stream to the ", Parent(), " ",
                                                           address_, " broke")));
      }
    }
  }
}

void ParentLink::StartJoin(const std::string& job_id, const Frame& item) {
  v1::JoinRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_2);
  req.set_job_id(job_id);
  req.set_kind(v1::MEMBER_KIND_AGGREGATOR);
  req.set_world_size(item.layout.world_size);
  req.set_local_world_size(item.layout.local_world_size);
  // A sidecar joins as its node; a group aggregator as its group, named by its first node.
  req.set_node_rank(item.layout.first_node());
  req.set_member_nodes(item.layout.workers() ? 1 : item.layout.covered_nodes());
  req.set_rank(-1);
  req.set_local_rank(-1);
  req.set_strict_finite(item.layout.strict_finite);
  req.set_group_nodes(item.layout.group_nodes);
  req.set_incarnation(item.layout.incarnation);
  if (auto last = last_session_.find(job_id); last != last_session_.end()) {
    req.set_previous_session(last->second.Bytes());
  }
  if (item.token) req.set_token(*item.token);
  std::shared_ptr<void> on = conn_;
  StartUnary<v1::JoinRequest, v1::JoinResponse>(
      &v1::Aggregator::Stub::PrepareAsyncJoin, req,
      std::chrono::duration_cast<std::chrono::milliseconds>(kConnectTimeout),
      [this, on, job_id](const grpc::Status& s, const v1::JoinResponse& resp) {
        // To the writer thread, in order with the job's frames.
        Enqueue(Item{job_id, JoinDoneItem{s, resp, on}});
      });
}

void ParentLink::Joined(const std::string& job_id, const JoinDoneItem& done) {
  auto parked = parked_.find(job_id);
  if (parked == parked_.end() || done.joined_on != std::static_pointer_cast<void>(conn_)) {
    return;  // its stream is gone: the parked items failed with it
  }
  std::deque<Item> items = std::move(parked->second);
  parked_.erase(parked);
  absl::Status status;
  SessionId session;
  if (!done.status.ok()) {
    status = wire::WithMessage(wire::FromGrpc(done.status),
                               absl::StrCat("joining job '", job_id, "' at the ", Parent(), " ", address_,
                                            " failed: ", done.status.error_message()));
  } else if (!SessionId::FromBytes(done.response.session(), &session)) {
    status = absl::InternalError(absl::StrCat("the ", Parent(), " ", address_, " answered Join for job '",
                                              job_id, "' without a valid session; check "
                                              "that it runs the same hsbn version"));
  }
  if (status.ok() && done.response.role() == "group") {
    absl::MutexLock lock(&name_mu_);
    parent_ = "group aggregator";
  }
  if (!status.ok()) {
    for (const Item& item : items) FailItem(item, status);
    return;
  }
  if (done.response.accepts_batches()) conn_->EnableBatches();
  conn_->session_of_job[job_id] = session;
  last_session_[job_id] = session;
  {
    absl::MutexLock lock(&jobs_mu_);
    job_of_session_[session] = job_id;
  }
  v1::ClientFrame attach;
  attach.mutable_attach()->add_sessions(session.Bytes());
  attach.mutable_attach()->set_accepts_batches(true);
  // The first parked item is the frame whose forward started the Join.
  if (const Frame* first = items.empty() ? nullptr : std::get_if<Frame>(&items.front().what);
      first != nullptr && first->token) {
    attach.mutable_attach()->set_token(*first->token);
  }
  if (!conn_->Send(std::move(attach))) {
    for (const Item& item : items) {
      FailItem(item, absl::UnavailableError(absl::StrCat("the stream to the ", Parent(), " ", address_,
                                                         " broke")));
    }
    return;
  }
  bool left = false;
  for (size_t i = 0; i < items.size(); ++i) {
    if (std::holds_alternative<LeaveItem>(items[i].what)) {  // the job ended while it joined
      Send(items[i]).IgnoreError();  // a leave never fails
      left = true;
      continue;
    }
    SendJoined(items[i], session);
    // A parent that holds a new session for this node knows nothing of its lost workers: say
    // it again, after the first item (whose round completed here before).
    if (i == 0) {
      if (std::string why; listener_->NodeDown(job_id, &why)) {
        v1::ClientFrame down;
        down.mutable_node_state()->set_session(session.Bytes());
        down.mutable_node_state()->set_healthy(false);
        down.mutable_node_state()->set_message(why);
        conn_->Send(std::move(down));
      }
    }
  }
  if (left) return;
  absl::MutexLock lock(&mu_);
  published_ = conn_;
  published_sessions_[job_id] = session;
}

void ParentLink::SendJoined(Item& item, const SessionId& session) {
  v1::ClientFrame* frame = FrameOf(item);
  if (frame == nullptr) return;
  SetSession(frame, session);
  if (!conn_->Send(std::move(*frame))) {
    FailItem(item, absl::UnavailableError(absl::StrCat("the stream to the ", Parent(), " ", address_,
                                                       " broke")));
  }
}

absl::Status ParentLink::Send(Item& item) {
  if (const JoinDoneItem* done = std::get_if<JoinDoneItem>(&item.what)) {
    Joined(item.job_id, *done);
    return absl::OkStatus();
  }
  if (std::holds_alternative<LeaveItem>(item.what)) {  // never connects just to leave, nor waits
    SendLeave(item);
    return absl::OkStatus();
  }
  Frame& f = std::get<Frame>(item.what);
  if (f.frame.has_node_state() && !parked_.count(item.job_id)) {
    // Only news for a root that holds this node's session in the job: never connects or joins
    // just to say it (a root that never saw the job has no round waiting for this node).
    if (!conn_ || conn_->broken()) return absl::OkStatus();
    auto it = conn_->session_of_job.find(item.job_id);
    if (it == conn_->session_of_job.end()) return absl::OkStatus();
    f.frame.mutable_node_state()->set_session(it->second.Bytes());
    conn_->Send(std::move(f.frame));
    return absl::OkStatus();
  }
  if (absl::Status s = EnsureConnected(); !s.ok()) return s;
  if (auto p = parked_.find(item.job_id); p != parked_.end()) {
    p->second.push_back(std::move(item));  // behind its job's Join in flight
    return absl::OkStatus();
  }
  auto found = conn_->session_of_job.find(item.job_id);
  if (found == conn_->session_of_job.end()) {
    StartJoin(item.job_id, f);
    parked_[item.job_id].push_back(std::move(item));
    return absl::OkStatus();
  }
  SendJoined(item, found->second);
  return absl::OkStatus();
}

void ParentLink::SendLeave(Item& item) {
  if (auto p = parked_.find(item.job_id); p != parked_.end()) {
    p->second.push_back(std::move(item));  // after its Join, in order with its frames
    return;
  }
  SessionId session;
  if (conn_ && !conn_->broken()) {
    auto it = conn_->session_of_job.find(item.job_id);
    if (it != conn_->session_of_job.end()) {
      session = it->second;
      conn_->session_of_job.erase(it);
    }
  }
  last_session_.erase(item.job_id);
  {
    absl::MutexLock lock(&mu_);
    published_sessions_.erase(item.job_id);
  }
  if (!session.empty()) {
    {
      absl::MutexLock lock(&jobs_mu_);
      job_of_session_.erase(session);
    }
    // On the stream, after the job's partials: the root reduces every one it was sent.
    v1::ClientFrame leave;
    leave.mutable_leave()->set_session(session.Bytes());
    conn_->Send(std::move(leave));
  }
}

absl::Status ParentLink::EnsureConnected() {
  if (conn_ && conn_->broken()) {
    Unpublish();
    FailParked(absl::UnavailableError(absl::StrCat("the stream to the ", Parent(), " ", address_,
                                                   " broke")));
    conn_->WaitDone(std::chrono::seconds(10));
    conn_.reset();
  }
  if (!conn_) {
    // After a failed connect, forwards fail at once for 2 s instead of each waiting out
    // the connect timeout behind the previous one.
    if (!last_connect_error_.ok() && std::chrono::steady_clock::now() < retry_after_) {
      return last_connect_error_;
    }
    absl::Status stopped;
    {
      absl::MutexLock lock(&mu_);
      stopped = parent_stopped_;
    }
    // A parent that said it stops gets a short wait (a restart may be under way), not the
    // connect timeout: its own words name the failure.
    if (!stopped.ok() &&
        !channel_->WaitForConnected(std::chrono::system_clock::now() + kStoppedParentWait)) {
      retry_after_ = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      return last_connect_error_ = stopped;
    }
    if (!channel_->WaitForConnected(std::chrono::system_clock::now() + kConnectTimeout)) {
      retry_after_ = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      return last_connect_error_ = absl::UnavailableError(absl::StrCat(
          "the ", ParentLong(), " at ", address_, " did not answer within 5 s; is it running, and "
          "is --upstream right?",
          tls_ ? absl::StrCat(" This aggregator uses TLS: check that --upstream-ca signed the ",
                              Parent(), "'s certificate, that the certificate names the host in "
                              "--upstream (or --upstream-tls-name), and, if the ", Parent(),
                              " has --tls-client-ca, that this aggregator has --upstream-cert "
                              "and --upstream-key signed by that CA")
               : absl::StrCat(" If the ", Parent(), " uses TLS (--tls-cert), give this "
                              "aggregator --upstream-ca")));
    }
    last_connect_error_ = absl::OkStatus();
    auto conn = std::make_shared<ParentStream>(this);
    {
      absl::MutexLock lock(&mu_);
      ++live_conns_;
      parent_stopped_ = absl::OkStatus();
    }
    conn->Start(conn, stub_.get(), cq_);
    conn_ = std::move(conn);
    Log(LogLevel::kInfo, absl::StrCat("connected to the ", ParentLong(), " at ", address_,
                                      tls_ ? " (TLS)" : ""));
    if (metrics_) metrics_->SetUpstreamConnected(true);
  }
  return absl::OkStatus();
}

void ParentLink::WriterLoop() {
  pthread_setname_np(pthread_self(), "hsbn-uplink");  // top -H, perf, gdb
  for (;;) {
    std::optional<Item> next;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &ParentLink::WriterHasWork));
      if (stopping_) break;
      next.emplace(std::move(queue_.front()));
      queue_.pop_front();
    }
    Item& item = *next;
    absl::Status s = Send(item);
    if (!s.ok()) FailItem(item, s);
  }
  // Drain: whatever is left fails.
  std::deque<Item> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(queue_);
  }
  const absl::Status down = absl::UnavailableError("the sidecar is shutting down");
  for (const Item& item : left) FailItem(item, down);
  FailParked(down);
  Unpublish();
  if (conn_) {
    conn_->Cancel();
    conn_.reset();
  }
}

void ParentLink::Deliver(const v1::Result& result) {
  std::string job_id;
  SessionId session;
  if (!SessionId::FromBytes(result.session(), &session)) return;
  {
    absl::MutexLock lock(&jobs_mu_);
    auto it = job_of_session_.find(session);
    if (it == job_of_session_.end()) return;
    job_id = it->second;
  }
  listener_->OnParentResult(job_id, result);
}

void ParentLink::ConnDone(const grpc::Status& status) {
  if (metrics_) metrics_->SetUpstreamConnected(false);
  bool stopping;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
  }
  if (!stopping) {
    Log(LogLevel::kWarn, absl::StrCat("lost the stream to the ", ParentLong(), " at ", address_, ": ",
                                      status.error_message()));
    // A parent that stops politely says so in the stream's status: its reason travels on.
    const v1::Reason reason = wire::ReasonOf(wire::FromGrpc(status));
    listener_->OnParentLost(wire::WithReason(
        absl::UnavailableError(absl::StrCat(
            self_, " lost its link to the ", ParentLong(), " at ", address_, " (",
            status.error_message(), "); global rounds in flight failed, later rounds reconnect")),
        reason));
    if (reason == v1::REASON_SHUTTING_DOWN) {
      absl::MutexLock lock(&mu_);
      parent_stopped_ = wire::WithReason(
          absl::UnavailableError(absl::StrCat(
              "the ", ParentLong(), " at ", address_, " stopped (", status.error_message(),
              ") and no new one answers there yet")),
          reason);
    }
  }
  absl::MutexLock lock(&mu_);
  --live_conns_;
}

}  // namespace hsbn::server

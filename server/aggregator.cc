#include "aggregator.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpc/support/time.h"
#include "divergence.h"
#include "grpcpp/security/credentials.h"
#include "parent_link.h"
#include "shm_transport.h"
#include "wire.h"

namespace hsbn::server {

namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
  // Only an aggregator with a parent waits for answers.
  if (options_.poll_us > 0 && options_.role != AggregatorOptions::Role::kRoot &&
      !options_.upstream.empty()) {
    poll_ = std::make_unique<PollWindow>(options_.poll_us * 1000);
  }
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
    // Sidecars only: a group aggregator's partials leave as its sidecars' batches complete its
    // rounds (batched by its writer), and no worker could tell it that it waits (LateWanted).
    if (options_.role == AggregatorOptions::Role::kNode) link.lagged_hold = options_.lagged_hold;
    if (options_.role == AggregatorOptions::Role::kGroup) {
      link.self = absl::StrCat("group aggregator ", options_.id);
    }
    parent_ = std::make_unique<ParentLink>(this, std::move(link), cqs_[0].get());
  }
  StartTransports();
  ticker_ = std::thread([this] { TickLoop(); });
  for (size_t i = 0; i < cqs_.size(); ++i) {
    grpc::ServerCompletionQueue* cq = cqs_[i].get();
    streams_->RequestCalls(cq);
    events_.emplace_back([this, cq, i] { EventLoop(cq, i); });
  }
}

void Aggregator::StartTransports() {
  // Node role: the shared-memory node path first (it answers the Join's transport question
  // and takes the parent's answers to the rounds it forwarded), else the streams say why not.
  std::string note;
  if (options_.role == AggregatorOptions::Role::kNode) {
    note = options_.shm ? "grpc: the sidecar's shared-memory socket is not available"
                        : "grpc: the sidecar runs with --shm=off";
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
    auto transport = std::make_unique<ShmTransport>(std::move(shm), &registry_, this);
    if (absl::Status s = transport->Start(); s.ok()) {
      transports_.push_back(std::move(transport));
      note.clear();
    } else {
      Log(LogLevel::kWarn, absl::StrCat("shared-memory node path off: ", s.message(),
                                        "; node rounds use the gRPC stream"));
    }
  }
  auto streams = std::make_unique<StreamTransport>(this, std::move(note));
  streams_ = streams.get();
  transports_.push_back(std::move(streams));
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
  const bool polls = index == 0 && poll_ != nullptr;
  for (;;) {
    if (polls && poll_until_ns_.load(std::memory_order_relaxed) > NowNs()) {
      // A non-blocking look at the queue (gRPC polls its sockets once with a zero timeout),
      // then the core goes to whoever else wants it.
      switch (cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC))) {
        case grpc::CompletionQueue::GOT_EVENT:
          static_cast<EventTag*>(tag)->OnEvent(ok);
          continue;
        case grpc::CompletionQueue::TIMEOUT:
          sched_yield();
          continue;
        case grpc::CompletionQueue::SHUTDOWN:
          return;
      }
    }
    if (!cq->Next(&tag, &ok)) return;
    static_cast<EventTag*>(tag)->OnEvent(ok);
  }
}

void Aggregator::ArmPoll() {
  if (poll_ == nullptr) return;
  const int64_t until = poll_->Forwarded(NowNs());
  int64_t seen = poll_until_ns_.load(std::memory_order_relaxed);
  while (seen < until &&
         !poll_until_ns_.compare_exchange_weak(seen, until, std::memory_order_relaxed)) {
  }
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
  for (auto& job : jobs) {
    Actions actions;
    job->FailAll(closing, &actions);
    actions.forwards.clear();
    actions.aborts.clear();
    Execute(actions, job->id());
  }
  // After the jobs' failures were queued: the streams end with the same status, after them.
  for (auto& t : transports_) t->Shutdown(closing);
  if (parent_) parent_->Shutdown();
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
    if (parent_) parent_->FlushHeld(now);
    for (const Registry::Dropped& d : registry_.Sweep(now)) Dropped(d);
    for (auto& job : registry_.Jobs()) {
      Actions actions;
      job->Expire(now, &actions);
      if (!actions.empty() || !actions.log.empty() || !actions.outcomes.empty()) {
        Execute(actions, job->id());
      }
    }
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(100);
      for (auto& t : transports_) t->Tick(now);
      if (parent_) parent_->CheckStalled(now);
      LogFlushSuppressed();
      if (Metrics* m = options_.metrics.get()) m->SetMemoryUsed(registry_.budget()->used());
    }
    tick_mu_.Lock();
  }
}

void Aggregator::Dropped(const Registry::Dropped& d) {
  if (d.expired) Refused("attach_timeout");
  Log(LogLevel::kInfo,
      absl::StrCat("job '", d.job->id(), "' dropped: ",
                   d.expired ? "no member attached a stream within --attach-timeout-ms"
                             : "every member left or lost its stream"));
  if (!options_.divergence_dir.empty()) {
    absl::StatusOr<std::string> saved = SaveDivergence(*d.job, options_.divergence_dir);
    if (!saved.ok()) {
      Log(LogLevel::kWarn, std::string(saved.status().message()));
    } else if (!saved->empty()) {
      Log(LogLevel::kInfo, absl::StrCat("job '", d.job->id(),
                                        "': shadow divergence record written to ", *saved));
    }
  }
  for (auto& t : transports_) t->JobDropped(d.job->id(), "the job ended at the sidecar");
  // The root holds the job while this node is a member of it: leave, so it can drop it too.
  if (parent_) parent_->Leave(d.job->id());
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
      for (const auto& f : actions.forwards) {
        // Armed before the write starts: the write's completion wakes the event thread, which
        // must then find the window open and stay up for the answer.
        if (f.scope == v1::SCOPE_GLOBAL || f.scope == v1::SCOPE_GROUP) ArmPoll();
        parent_->Forward(job_id, job->layout(), token, f);
      }
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
    for (auto& t : transports_) t->MemberGone(ref.job->id(), ref.index, /*left=*/false, "");
    Execute(actions, ref.job->id());
  }
}

void Aggregator::MemberAborted(const Registry::SessionRef& ref, const SessionId& session,
                               const std::string& reason) {
  Actions actions;
  ref.job->MemberGone(ref.index, session, /*left=*/false, Clock::now(), &actions, reason);
  for (auto& t : transports_) t->MemberGone(ref.job->id(), ref.index, /*left=*/false, reason);
  Execute(actions, ref.job->id());
}

void Aggregator::OnParentResult(const std::string& job_id, const v1::Result& result) {
  // The answer polled for is here: sleep again (another round in flight re-arms on its next
  // forward only; the window bounds CPU, it promises nothing).
  if (poll_ != nullptr) {
    poll_->Answered(NowNs());
    poll_until_ns_.store(0, std::memory_order_relaxed);
  }
  for (auto& t : transports_) {
    if (t->ParentResult(job_id, result)) return;
  }
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
  poll_until_ns_.store(0, std::memory_order_relaxed);  // no answer is coming
  for (auto& t : transports_) t->ParentLost(status);
  for (auto& job : registry_.Jobs()) {
    Actions actions;
    job->ParentLost(status, &actions);
    Execute(actions, job->id());
  }
}

grpc::Status Aggregator::Join(const v1::JoinRequest& req, v1::JoinResponse* resp) {
  Actions actions;
  for (auto& t : transports_) {
    if (absl::Status s = t->CheckJoin(req); !s.ok()) return wire::ToGrpc(s);
  }
  absl::StatusOr<Registry::Joined> joined = registry_.Join(req, &actions);
  if (Metrics* m = options_.metrics.get()) m->JoinAnswered(joined.status().code());
  if (!joined.ok()) {
    const absl::Status& s = joined.status();
    Execute(actions, req.job_id());  // a layout refusal fails the job's rounds (Job::Refused)
    if (std::shared_ptr<Job> job = registry_.FindJob(req.job_id());
        job && !job->refusal().ok()) {
      for (auto& t : transports_) t->Refused(req.job_id(), job->refusal());
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
  if (joined->replaced) {
    const std::string why = absl::StrCat(
        "job '", joined->replaced->id(), "' was restarted: run ", req.incarnation(),
        " joined, so this round of run ", joined->replaced->layout().incarnation,
        " can never complete");
    for (auto& t : transports_) t->JobDropped(joined->replaced->id(), why);
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
  for (auto& t : transports_) t->Joined(req, joined->index, resp);
  return grpc::Status::OK;
}

std::string Aggregator::NodeTransport(const std::string& job_id) const {
  for (const auto& t : transports_) {
    if (std::string note = t->Describe(job_id); !note.empty()) return note;
  }
  return "";
}

grpc::Status Aggregator::Leave(const v1::LeaveRequest& req) {
  SessionId session;
  if (!SessionId::FromBytes(req.session(), &session)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "Leave: session must be 16 bytes");
  }
  Actions actions;
  std::string job_id;
  Registry::SessionRef ref;
  const bool known = registry_.Find(session, &ref);
  if (absl::Status s = registry_.Leave(session, &actions, &job_id); !s.ok()) {
    return wire::ToGrpc(s);
  }
  if (known) {
    for (auto& t : transports_) t->MemberGone(job_id, ref.index, /*left=*/true, "");
  }
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
    for (auto& t : transports_) t->AddCounts(job->id(), js);
  }
  return grpc::Status::OK;
}

void Aggregator::FillStatus(const std::string& job_id, v1::StatusResponse* resp) {
  // A scrape (main.cc's state source) counts every round a worker was answered through shared
  // memory.
  for (auto& t : transports_) t->HarvestMetrics();
  resp->set_aggregator_id(options_.id);
  resp->set_role(RoleName(options_.role));
  resp->set_uptime_s(std::chrono::duration<double>(Clock::now() - started_).count());
  for (auto& job : registry_.Jobs()) {
    if (job_id.empty() || job->id() == job_id) {
      v1::JobStatus* js = resp->add_jobs();
      job->FillStatus(js);
      js->set_node_transport(NodeTransport(job->id()));
      for (auto& t : transports_) t->AddCounts(job->id(), js);
    }
  }
}

}  // namespace hsbn::server

#include "parent_link.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "aggregator.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "log.h"
#include "wire.h"

namespace hsbn::server {

namespace {
constexpr auto kConnectTimeout = std::chrono::seconds(5);
}

ParentLink::ParentLink(Aggregator* aggregator, std::string address, std::string id,
                       std::shared_ptr<grpc::ChannelCredentials> credentials, bool tls,
                       const std::string& tls_name)
    : aggregator_(aggregator), address_(std::move(address)), id_(std::move(id)), tls_(tls) {
  grpc::ChannelArguments args;
  if (!tls_name.empty()) args.SetSslTargetNameOverride(tls_name);
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
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
}

void ParentLink::Enqueue(Item item) {
  std::shared_ptr<Conn> conn;
  uint64_t session = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    if (!item.leave && queue_.empty() && published_ && !published_->broken) {
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
  // Fast path: the stream is up and the job joined at the parent; write from this thread.
  if (item.frame.has_contribution()) item.frame.mutable_contribution()->set_session_id(session);
  if (item.frame.has_abort()) item.frame.mutable_abort()->set_session_id(session);
  if (!Write(conn.get(), item.frame)) {
    FailItem(item, absl::UnavailableError(absl::StrCat("the stream to the root ", address_,
                                                       " broke")));
  }
}

void ParentLink::Unpublish() {
  std::lock_guard<std::mutex> lock(mu_);
  published_.reset();
  published_sessions_.clear();
}

void ParentLink::Forward(const std::string& job_id, const JobLayout& layout,
                         std::shared_ptr<const std::string> token, const Actions::Forward& f) {
  Item item;
  item.job_id = job_id;
  item.layout = layout;
  item.token = std::move(token);
  item.key = f.key;
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
  Item item;
  item.job_id = job_id;
  item.layout = layout;
  item.token = std::move(token);
  item.key = a.key;
  v1::Abort* ab = item.frame.mutable_abort();
  ab->set_op(a.key.op);
  ab->set_seq(a.key.seq);
  ab->set_phase(a.key.phase);
  ab->set_code(int(a.status.code()));
  ab->set_message(std::string(a.status.message()));
  Enqueue(std::move(item));
}

void ParentLink::Status(const v1::StatusRequest& request,
                        std::function<void(const grpc::Status&, const v1::StatusResponse&)> done) {
  struct Call {
    grpc::ClientContext ctx;
    v1::StatusRequest req;
    v1::StatusResponse resp;
  };
  auto call = std::make_shared<Call>();
  call->req = request;
  call->req.set_include_upstream(false);
  call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  stub_->async()->Status(&call->ctx, &call->req, &call->resp,
                         [call, done = std::move(done)](grpc::Status s) { done(s, call->resp); });
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
    if (conn_ && !conn_->broken) {
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
  if (conn_ && conn_->broken) {
    Unpublish();
    if (conn_->reader.joinable()) conn_->reader.join();
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
    auto conn = std::make_shared<Conn>();
    conn->stream = stub_->Exchange(&conn->context);
    if (!conn->stream) return absl::UnavailableError("could not open a stream to the root");
    Conn* raw = conn.get();
    conn_ = std::move(conn);
    conn_->reader = std::thread([this, raw] { ReaderLoop(raw); });
    Log(LogLevel::kInfo, absl::StrCat("connected to the root aggregator at ", address_,
                                      tls_ ? " (TLS)" : ""));
    if (Metrics* m = aggregator_->metrics()) m->SetUpstreamConnected(true);
  }
  uint64_t session = 0;
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
    conn_->session_of_job[item.job_id] = session;
    last_session_[item.job_id] = session;
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      job_of_session_[session] = item.job_id;
    }
    v1::ClientFrame attach;
    attach.mutable_attach()->add_session_ids(session);
    if (!Write(conn_.get(), attach)) {
      return absl::UnavailableError(absl::StrCat("the stream to the root ", address_, " broke"));
    }
  } else {
    session = found->second;
  }
  if (item.frame.has_contribution()) item.frame.mutable_contribution()->set_session_id(session);
  if (item.frame.has_abort()) item.frame.mutable_abort()->set_session_id(session);
  if (!Write(conn_.get(), item.frame)) {
    return absl::UnavailableError(absl::StrCat("the stream to the root ", address_, " broke"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    published_ = conn_;
    published_sessions_[item.job_id] = session;
  }
  return absl::OkStatus();
}

bool ParentLink::Write(Conn* conn, const v1::ClientFrame& frame) {
  // Counted before the write: the answer may reach the workers before Write returns.
  if (Metrics* m = aggregator_->metrics()) m->Sent(Metrics::Link::kUpstream, frame.ByteSizeLong());
  std::lock_guard<std::mutex> lock(conn->write_mu);
  if (conn->broken || !conn->stream->Write(frame)) {
    conn->broken = true;
    return false;
  }
  return true;
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
    conn_->context.TryCancel();
    if (conn_->reader.joinable()) conn_->reader.join();
    conn_.reset();
  }
}

void ParentLink::ReaderLoop(Conn* conn) {
  v1::ServerFrame frame;
  Metrics* metrics = aggregator_->metrics();
  while (conn->stream->Read(&frame)) {
    if (metrics) metrics->Received(Metrics::Link::kUpstream, frame.ByteSizeLong());
    if (!frame.has_result()) continue;
    std::string job_id;
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      auto it = job_of_session_.find(frame.result().session_id());
      if (it == job_of_session_.end()) continue;
      job_id = it->second;
    }
    aggregator_->OnParentResult(job_id, frame.result());
  }
  conn->broken = true;
  if (metrics) metrics->SetUpstreamConnected(false);
  grpc::Status status;
  {
    std::lock_guard<std::mutex> lock(conn->write_mu);
    status = conn->stream->Finish();
  }
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
}

}  // namespace hsbn::server

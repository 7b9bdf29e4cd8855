#include "hsbn/client.h"

#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "wire.h"

namespace hsbn {

const char* ScopeName(Scope scope) { return wire::ScopeName(v1::Scope(int(scope))); }

absl::StatusOr<Scope> ParseScope(const std::string& name) {
  v1::Scope s = wire::ParseScope(name);
  if (s == v1::SCOPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("scope '", name, "' is not one of node, global, shadow"));
  }
  return Scope(int(s));
}

namespace {

absl::Status EnvInt(const char* name, bool required, int64_t* out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        name, " is not set. Launch the trainer with torchrun, or set RANK, WORLD_SIZE, "
              "LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK yourself"));
  }
  if (!absl::SimpleAtoi(v, out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "' is not an integer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ClientOptions> ClientOptions::FromEnv() {
  ClientOptions o;
  int64_t v = 0;
  const std::pair<const char*, int32_t*> fields[] = {{"RANK", &o.rank},
                                                      {"WORLD_SIZE", &o.world_size},
                                                      {"LOCAL_RANK", &o.local_rank},
                                                      {"LOCAL_WORLD_SIZE", &o.local_world_size},
                                                      {"GROUP_RANK", &o.node_rank}};
  for (auto& [name, field] : fields) {
    if (absl::Status s = EnvInt(name, true, &v); !s.ok()) return s;
    *field = int32_t(v);
  }
  const char* job = std::getenv("HSBN_JOB_ID");
  if (job == nullptr || *job == '\0') job = std::getenv("TORCHELASTIC_RUN_ID");
  if (job == nullptr || *job == '\0') {
    return absl::InvalidArgumentError(
        "HSBN_JOB_ID is not set (nor torchrun's TORCHELASTIC_RUN_ID): give every process of the "
        "job the same HSBN_JOB_ID, unique among the jobs sharing a sidecar");
  }
  o.job_id = job;
  if (const char* a = std::getenv("HSBN_ADDRESS"); a != nullptr && *a != '\0') o.address = a;
  v = 0;
  if (absl::Status s = EnvInt("HSBN_ROUND_TIMEOUT_MS", false, &v); !s.ok()) return s;
  o.round_timeout = std::chrono::milliseconds(v);
  v = 10000;
  if (absl::Status s = EnvInt("HSBN_CONNECT_TIMEOUT_MS", false, &v); !s.ok()) return s;
  o.connect_timeout = std::chrono::milliseconds(v);
  if (const char* t = std::getenv("HSBN_TOKEN"); t != nullptr && *t != '\0') {
    o.token = t;
  } else if (const char* f = std::getenv("HSBN_TOKEN_FILE"); f != nullptr && *f != '\0') {
    std::ifstream in(f);
    if (!in) {
      return absl::InvalidArgumentError(absl::StrCat("HSBN_TOKEN_FILE=", f, " cannot be read"));
    }
    std::stringstream ss;
    ss << in.rdbuf();
    o.token = std::string(absl::StripAsciiWhitespace(ss.str()));
  }
  if (absl::Status s = o.Validate(); !s.ok()) return s;
  return o;
}

absl::Status ClientOptions::Validate() const {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (job_id.empty()) return bad("job_id (HSBN_JOB_ID) is empty");
  if (address.empty()) return bad("address (HSBN_ADDRESS) is empty");
  if (world_size <= 0) return bad(absl::StrCat("WORLD_SIZE=", world_size, " must be positive"));
  if (rank < 0 || rank >= world_size) {
    return bad(absl::StrCat("RANK=", rank, " is outside [0, WORLD_SIZE=", world_size, ")"));
  }
  if (local_world_size <= 0 || world_size % local_world_size != 0) {
    return bad(absl::StrCat("LOCAL_WORLD_SIZE=", local_world_size,
                            " must be positive and divide WORLD_SIZE=", world_size,
                            " (hsbn needs the same number of workers on every node)"));
  }
  if (local_rank < 0 || local_rank >= local_world_size) {
    return bad(absl::StrCat("LOCAL_RANK=", local_rank, " is outside [0, LOCAL_WORLD_SIZE=",
                            local_world_size, ")"));
  }
  const int32_t nodes = world_size / local_world_size;
  if (node_rank < 0 || node_rank >= nodes) {
    return bad(absl::StrCat("GROUP_RANK=", node_rank, " is outside [0, ", nodes,
                            ") (WORLD_SIZE / LOCAL_WORLD_SIZE nodes)"));
  }
  if (rank != node_rank * local_world_size + local_rank) {
    return bad(absl::StrCat("RANK=", rank, " but GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK=",
                            node_rank * local_world_size + local_rank,
                            "; hsbn expects torchrun's rank layout"));
  }
  return absl::OkStatus();
}

class PendingRound {
 public:
  uint32_t op = 0;
  uint64_t seq = 0;
  Phase phase = Phase::kForward;
  int64_t channels = 0;
  uint64_t generation = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
  int64_t count = 0;
  std::string data;
};

namespace {
using Key = std::tuple<uint32_t, uint64_t, int>;
}

class Client::Impl {
 public:
  explicit Impl(ClientOptions options) : options_(std::move(options)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel_ = grpc::CreateCustomChannel(options_.address, grpc::InsecureChannelCredentials(),
                                         args);
    stub_ = v1::Aggregator::NewStub(channel_);
  }

  ~Impl() {
    std::shared_ptr<Conn> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn = conn_;
      conn_.reset();
    }
    if (session_ != 0) {
      v1::LeaveRequest req;
      req.set_session_id(session_);
      v1::LeaveResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      stub_->Leave(&ctx, req, &resp);  // best effort
    }
    if (conn) {
      {
        std::lock_guard<std::mutex> lock(conn->write_mu);
        if (!conn->broken) conn->stream->WritesDone();
      }
      conn->context.TryCancel();
      if (conn->reader.joinable()) conn->reader.join();
    }
  }

  absl::Status Connect() {
    std::lock_guard<std::mutex> lock(mu_);
    return ConnectLocked();
  }

  absl::StatusOr<std::shared_ptr<PendingRound>> Start(Phase phase, uint32_t op, uint64_t seq,
                                                      Scope scope, int64_t channels,
                                                      int64_t count, const double* a,
                                                      const double* b) {
    const std::string round = wire::RoundName(op, seq, v1::Phase(int(phase)));
    if (phase != Phase::kForward && phase != Phase::kBackward) {
      return absl::InvalidArgumentError("phase must be forward or backward");
    }
    if (scope != Scope::kNode && scope != Scope::kGlobal && scope != Scope::kShadow) {
      return absl::InvalidArgumentError("scope must be node, global or shadow");
    }
    if (channels <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("round ", round, ": channels=", channels,
                                                     " must be at least 1"));
    }
    if (a == nullptr || b == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("round ", round, ": null statistics array"));
    }
    // Large enough to hold the payload; gRPC refuses bigger messages.
    if (wire::PayloadBytes(channels) > (60 << 20)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "round ", round, ": ", channels, " channels do not fit in one message"));
    }
    auto pending = std::make_shared<PendingRound>();
    pending->op = op;
    pending->seq = seq;
    pending->phase = phase;
    pending->channels = channels;
    v1::ClientFrame frame;
    v1::Contribution* c = frame.mutable_contribution();
    c->set_op(op);
    c->set_seq(seq);
    c->set_phase(v1::Phase(int(phase)));
    c->set_scope(v1::Scope(int(scope)));
    c->set_channels(uint32_t(channels));
    c->set_count(count);
    wire::PackPayload(a, b, channels, c->mutable_data());

    std::shared_ptr<Conn> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!conn_ || conn_->broken) {
        if (absl::Status s = ConnectLocked(); !s.ok()) return s;
      }
      conn = conn_;
      c->set_session_id(session_);
    }
    pending->generation = conn->generation;
    const Key key{op, seq, int(phase)};
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (!pending_.emplace(key, pending).second) {
        return absl::AlreadyExistsError(absl::StrCat(
            "round ", round, " is already in flight on this client; each (op, seq, phase) is "
            "one round"));
      }
    }
    bool ok;
    {
      std::lock_guard<std::mutex> lock(conn->write_mu);
      ok = !conn->broken && conn->stream->Write(frame);
    }
    if (!ok) {
      conn->broken = true;
      std::lock_guard<std::mutex> lock(pending_mu_);
      pending_.erase(key);
      return absl::UnavailableError(absl::StrCat(
          "round ", round, ": the stream to the hsbn sidecar at ", options_.address,
          " broke while sending; the next call reconnects"));
    }
    return pending;
  }

  absl::Status Wait(PendingRound& p, int64_t* out_count, double* out_a, double* out_b) {
    std::chrono::milliseconds timeout = options_.round_timeout;
    if (timeout.count() <= 0) timeout = aggregator_timeout_ + std::chrono::seconds(5);
    std::unique_lock<std::mutex> lock(p.mu);
    if (!p.cv.wait_for(lock, timeout, [&] { return p.done; })) {
      lock.unlock();
      {
        std::lock_guard<std::mutex> g(pending_mu_);
        auto it = pending_.find(Key{p.op, p.seq, int(p.phase)});
        if (it != pending_.end() && it->second.get() == &p) pending_.erase(it);
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "round ", wire::RoundName(p.op, p.seq, v1::Phase(int(p.phase))), ": no answer from the "
          "hsbn sidecar at ", options_.address, " within ", timeout.count(), " ms"));
    }
    if (!p.status.ok()) return p.status;
    if (int64_t(p.data.size()) != wire::PayloadBytes(p.channels)) {
      return absl::InternalError("the sidecar answered with a payload of the wrong size");
    }
    if (out_count) *out_count = p.count;
    std::vector<double> a(p.channels), b(p.channels);
    wire::UnpackPayload(p.data, p.channels, a.data(), b.data());
    if (out_a) std::copy(a.begin(), a.end(), out_a);
    if (out_b) std::copy(b.begin(), b.end(), out_b);
    return absl::OkStatus();
  }

  absl::StatusOr<v1::StatusResponse> Status(bool include_upstream) {
    v1::StatusRequest req;
    req.set_include_upstream(include_upstream);
    v1::StatusResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status s = stub_->Status(&ctx, req, &resp);
    if (!s.ok()) return wire::FromGrpc(s);
    return resp;
  }

  const ClientOptions options_;
  int32_t num_nodes_ = 0;
  int32_t max_channels_ = 0;
  std::chrono::milliseconds aggregator_timeout_{30000};

 private:
  struct Conn {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream;
    std::mutex write_mu;
    std::atomic<bool> broken{false};
    std::thread reader;
    uint64_t generation = 0;
  };

  absl::Status ConnectLocked() {
    if (conn_) {  // a broken stream: its reader has failed the rounds in flight
      conn_->context.TryCancel();
      if (conn_->reader.joinable()) conn_->reader.join();
      conn_.reset();
    }
    const auto deadline = std::chrono::system_clock::now() + options_.connect_timeout;
    if (!channel_->WaitForConnected(deadline)) {
      std::string hint;
      if (options_.address.rfind("unix:", 0) == 0) {
        struct stat st;
        const std::string path = options_.address.substr(5);
        if (stat(path.c_str(), &st) != 0) hint = absl::StrCat(" (", path, " does not exist)");
      }
      return absl::UnavailableError(absl::StrCat(
          "no hsbn sidecar answered at ", options_.address, hint, " within ",
          options_.connect_timeout.count(), " ms. Start one (hsbn-aggregator --role=node "
          "--listen=", options_.address, ") or set HSBN_ADDRESS to the sidecar's address"));
    }
    v1::JoinRequest req;
    req.set_protocol_version(v1::PROTOCOL_VERSION_1);
    req.set_job_id(options_.job_id);
    req.set_kind(v1::MEMBER_KIND_WORKER);
    req.set_rank(options_.rank);
    req.set_world_size(options_.world_size);
    req.set_local_rank(options_.local_rank);
    req.set_local_world_size(options_.local_world_size);
    req.set_node_rank(options_.node_rank);
    req.set_previous_session_id(session_);
    req.set_token(options_.token);
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline + std::chrono::seconds(5));
    grpc::Status s = stub_->Join(&ctx, req, &resp);
    if (!s.ok()) {
      absl::Status st = wire::FromGrpc(s);
      return absl::Status(st.code(), absl::StrCat("joining job '", options_.job_id, "' at ",
                                                  options_.address, " failed: ", st.message()));
    }
    session_ = resp.session_id();
    num_nodes_ = resp.num_nodes();
    max_channels_ = resp.max_channels();
    aggregator_timeout_ = std::chrono::milliseconds(resp.round_timeout_ms());
    auto conn = std::make_shared<Conn>();
    conn->generation = ++generation_;
    conn->stream = stub_->Exchange(&conn->context);
    v1::ClientFrame attach;
    attach.mutable_attach()->add_session_ids(session_);
    if (!conn->stream->Write(attach)) {
      conn->context.TryCancel();
      conn->stream->Finish();
      return absl::UnavailableError(absl::StrCat("the hsbn sidecar at ", options_.address,
                                                 " closed the stream at once"));
    }
    Conn* raw = conn.get();
    conn->reader = std::thread([this, raw] { ReadLoop(raw); });
    conn_ = std::move(conn);
    return absl::OkStatus();
  }

  void ReadLoop(Conn* conn) {
    v1::ServerFrame frame;
    while (conn->stream->Read(&frame)) {
      if (!frame.has_result()) continue;
      v1::Result* r = frame.mutable_result();
      std::shared_ptr<PendingRound> p;
      {
        std::lock_guard<std::mutex> lock(pending_mu_);
        auto it = pending_.find(Key{r->op(), r->seq(), int(r->phase())});
        if (it == pending_.end()) continue;  // a round we gave up on, or a repeat
        p = it->second;
        pending_.erase(it);
      }
      std::lock_guard<std::mutex> lock(p->mu);
      p->status = wire::StatusFromCode(r->code(), r->message());
      p->count = r->count();
      p->data = std::move(*r->mutable_data());
      p->done = true;
      p->cv.notify_all();
    }
    conn->broken = true;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(conn->write_mu);
      status = conn->stream->Finish();
    }
    const absl::Status lost = absl::UnavailableError(absl::StrCat(
        "the stream to the hsbn sidecar at ", options_.address, " broke (",
        status.error_message().empty() ? "closed" : status.error_message(),
        "); rounds in flight were lost. The next call reconnects"));
    std::vector<std::shared_ptr<PendingRound>> failed;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second->generation == conn->generation) {
          failed.push_back(it->second);
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& p : failed) {
      std::lock_guard<std::mutex> lock(p->mu);
      p->status = lost;
      p->done = true;
      p->cv.notify_all();
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Aggregator::Stub> stub_;
  std::mutex mu_;  // connection state
  std::shared_ptr<Conn> conn_;
  uint64_t session_ = 0;
  uint64_t generation_ = 0;
  std::mutex pending_mu_;
  std::map<Key, std::shared_ptr<PendingRound>> pending_;
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Connect(); !s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Start(Phase phase, uint32_t op,
                                                            uint64_t seq, Scope scope,
                                                            int64_t channels, int64_t count,
                                                            const double* a, const double* b) {
  return impl_->Start(phase, op, seq, scope, channels, count, a, b);
}

absl::Status Client::Wait(PendingRound& round, int64_t* out_count, double* out_a,
                          double* out_b) {
  return impl_->Wait(round, out_count, out_a, out_b);
}

absl::Status Client::Forward(uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                             int64_t count, const double* mean, const double* m2,
                             int64_t* out_count, double* out_mean, double* out_m2) {
  auto p = Start(Phase::kForward, op, seq, scope, channels, count, mean, m2);
  if (!p.ok()) return p.status();
  return Wait(**p, out_count, out_mean, out_m2);
}

absl::Status Client::Backward(uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                              int64_t count, const double* sum_dy, const double* sum_dy_xmu,
                              int64_t* out_count, double* out_sum_dy, double* out_sum_dy_xmu) {
  auto p = Start(Phase::kBackward, op, seq, scope, channels, count, sum_dy, sum_dy_xmu);
  if (!p.ok()) return p.status();
  return Wait(**p, out_count, out_sum_dy, out_sum_dy_xmu);
}

absl::StatusOr<v1::StatusResponse> Client::Status(bool include_upstream) {
  return impl_->Status(include_upstream);
}

absl::StatusOr<std::string> Client::StatusJson(bool include_upstream) {
  auto s = impl_->Status(include_upstream);
  if (!s.ok()) return s.status();
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  auto st = google::protobuf::util::MessageToJsonString(*s, &json, opts);
  if (!st.ok()) return absl::InternalError(std::string(st.message()));
  return json;
}

const ClientOptions& Client::options() const { return impl_->options_; }
int32_t Client::num_nodes() const { return impl_->num_nodes_; }
int32_t Client::max_channels() const { return impl_->max_channels_; }
std::chrono::milliseconds Client::aggregator_round_timeout() const {
  return impl_->aggregator_timeout_;
}

}  // namespace hsbn

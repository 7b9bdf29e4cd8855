// Joining the job at the sidecar and attaching the stream (the node's shared memory is offered
// and opened by shm_rounds.cc), the polite stop of a sidecar, and the Status RPC.
#include "client_impl.h"

namespace hsbn {

absl::Status Client::Impl::StoppingLocked() {
  if (absl::Status s = ShmStoppingLocked(); !s.ok()) return s;
  if (conn_ != nullptr && conn_->broken) {
    absl::MutexLock lock(&rounds_mu_);
    // A broken stream's final status is on its way (or here): read it, briefly, so that a
    // polite stop is named by the sidecar's own status instead of being guessed at.
    if (!conn_->finished && !conn_->polling) {
      conn_->polling = true;
      const std::shared_ptr<RoundStream> conn = conn_;
      Poll(conn, Clock::now() + kFinishWait, [&] { return conn->finished; });
      conn->polling = false;
      HandOff(*conn);
    }
    if (!conn_->finished) return absl::OkStatus();
    absl::Status s = wire::FromGrpc(conn_->final_status);
    if (wire::ReasonOf(s) == v1::REASON_SHUTTING_DOWN) return s;
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::ConnectLocked() {
  // A broken stream is dropped here; rounds still in flight on it keep it alive until their
  // waits have seen them fail (or their results, read before the break).
  conn_.reset();
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
  v1::JoinResponse resp;
  if (absl::Status s = JoinLocked(deadline, &resp); !s.ok()) return s;
  session_ = resp.session();
  num_nodes_ = resp.num_nodes();
  max_channels_ = resp.max_channels();
  aggregator_timeout_ms_ = resp.round_timeout_ms();
  if (absl::Status s = AttachLocked(deadline); !s.ok()) return s;
  // The node's transport, offered at the join (decided by the sidecar; awaited at the first
  // round): false when this worker must join again without the offer.
  if (!ChooseNodeTransportLocked(resp)) return ConnectLocked();
  return absl::OkStatus();
}

absl::Status Client::Impl::JoinLocked(std::chrono::system_clock::time_point deadline,
                                      v1::JoinResponse* resp) {
  v1::JoinRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_2);
  req.set_job_id(options_.job_id);
  req.set_kind(v1::MEMBER_KIND_WORKER);
  req.set_rank(options_.rank);
  req.set_world_size(options_.world_size);
  req.set_local_rank(options_.local_rank);
  req.set_local_world_size(options_.local_world_size);
  req.set_node_rank(options_.node_rank);
  req.set_previous_session(session_);
  req.set_token(options_.token);
  req.set_strict_finite(options_.strict_finite);
  req.set_group_nodes(options_.group_nodes);
  req.set_incarnation(options_.incarnation);
  req.set_shm_offer(OfferShm());
  grpc::Status s;
  Debug(absl::StrCat("joining job '", options_.job_id, "' at ", options_.address, " as rank ",
                     options_.rank, " of ", options_.world_size, " (node ", options_.node_rank,
                     ", local rank ", options_.local_rank, " of ", options_.local_world_size,
                     ", run ", options_.incarnation, ", shared memory ",
                     req.shm_offer() ? "offered" : "not offered", ")"));
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline + std::chrono::seconds(5));
    ctx.set_wait_for_ready(true);
    s = stub_->Join(&ctx, req, resp);
    // A sidecar that is stopping refuses Joins (UNAVAILABLE: no other refusal has that code)
    // and cancels the calls it will not answer: once its connection is gone, join the next
    // process on the address, as a new connection would.
    const auto code = s.error_code();
    if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::CANCELLED) break;
    // Said in words: the refusal names the stopping process and what to do.
    if (wire::ReasonOf(wire::FromGrpc(s)) == v1::REASON_SHUTTING_DOWN) break;
    if (channel_->GetState(false) == GRPC_CHANNEL_READY &&
        !channel_->WaitForStateChange(GRPC_CHANNEL_READY, deadline)) {
      break;
    }
    if (!channel_->WaitForConnected(deadline)) break;
  }
  if (!s.ok()) {
    absl::Status st = wire::FromGrpc(s);
    Debug(absl::StrCat("join refused: ", st.ToString()));
    return wire::WithMessage(st, absl::StrCat("joining job '", options_.job_id, "' at ",
                                              options_.address, " failed: ", st.message()));
  }
  Debug(absl::StrCat("joined: ", resp->num_nodes(), " node(s), aggregator '",
                     wire::Printable(resp->aggregator_id(), 128), "', round timeout ",
                     resp->round_timeout_ms(), " ms, max channels ", resp->max_channels(),
                     resp->shm_socket().empty()
                         ? std::string(", no shared memory: ") +
                               wire::Printable(resp->shm_note().empty() ? "none offered"
                                                                        : resp->shm_note(),
                                               256)
                         : ", shared memory offered"));
  if (resp->session().size() != 16) {
    return absl::InternalError(absl::StrCat(
        "the hsbn sidecar at ", options_.address, " answered Join without a valid session; "
        "check that it runs the same hsbn version as this client"));
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::AttachLocked(std::chrono::system_clock::time_point deadline) {
  auto conn = std::make_shared<RoundStream>();
  conn->generation = ++generation_;
  // Not shared yet: start the call, then send the attach frame, synchronously on its queue
  // (StartCall uses the write slot: the attach Write waits for it).
  conn->stream = stub_->AsyncExchange(&conn->context, &conn->cq, TagOf(kStartCall));
  const auto op_deadline = deadline + std::chrono::seconds(5);
  auto await = [&](Tag want) {
    void* tag = nullptr;
    bool ok = false;
    return conn->cq.AsyncNext(&tag, &ok, op_deadline) == grpc::CompletionQueue::GOT_EVENT &&
           ok && tag == TagOf(want);
  };
  bool attached = await(kStartCall);
  if (attached) {
    v1::ClientFrame attach;
    attach.mutable_attach()->add_sessions(session_);
    attach.mutable_attach()->set_token(options_.token);
    counters_.Sent(int64_t(attach.ByteSizeLong()));
    conn->stream->Write(attach, TagOf(kWrite));
    attached = await(kWrite);
  }
  if (!attached) {
    return absl::UnavailableError(absl::StrCat("the hsbn sidecar at ", options_.address,
                                               " closed the stream at once"));
  }
  conn_ = std::move(conn);
  return absl::OkStatus();
}

void Client::Impl::ForgetStoppedSidecar(uint64_t generation) {
  absl::MutexLock lock(&mu_);
  if (conn_ != nullptr && conn_->generation == generation) {
    shm_.reset();
    conn_.reset();
  }
}

absl::StatusOr<v1::StatusResponse> Client::Impl::Status(bool include_upstream) {
  // This client's own job, with its token: with tokens on that is all Status will show.
  v1::StatusRequest req;
  req.set_include_upstream(include_upstream);
  req.set_job_id(options_.job_id);
  req.set_token(options_.token);
  v1::StatusResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Status s = stub_->Status(&ctx, req, &resp);
  if (!s.ok()) return wire::FromGrpc(s);
  return resp;
}

}  // namespace hsbn

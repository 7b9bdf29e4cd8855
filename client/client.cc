#include "hsbn/client.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "auto_scope.h"
#include "round_stats.h"
#include "env.h"
#include "hsbn/status.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "result.h"
#include "shm_channel.h"
#include "wire.h"

namespace hsbn {

// How results reach the caller (leader/follower, no reader thread).
//
// A connection is one gRPC bidi stream driven through the async API on its own completion
// queue. Nobody reads it in the background: a thread that needs an event from the stream (a
// Wait whose round is not done yet, or a Start that must wait for the previous write to finish)
// takes the connection's *poller role* if it is free, posts a Read if none is posted, and calls
// AsyncNext on the completion queue itself. It dispatches every event it gets: its own result
// ends its wait; other rounds' results complete their PendingRound and wake that waiter (one
// notify). When its own round is done it gives the role back and wakes one other waiter of that
// connection, who then polls in its turn. Waiters that do not hold the role sleep on their
// round's condition variable until their round is done or the role is handed to them. In the
// common case (one thread, one round at a time) the caller reads its own answer: no thread hop.
// All of this state (pending_, every PendingRound's fields, every RoundStream's poll state) is
// guarded by one mutex, rounds_mu_; it is never held while polling.
//
// Timeouts. The poller polls with its own round's deadline (AsyncNext takes one; a blocking
// sync Read could not), so a poller never stays past its deadline: it gives the role back,
// returns DEADLINE_EXCEEDED, and the Read it posted stays posted for the next poller, so no
// result is lost. A follower's deadline passing while someone else polls makes it return
// DEADLINE_EXCEEDED at once; the poller keeps polling for its own round. A round that timed
// out is forgotten (removed from pending_); its late result is dropped.
//
// Broken streams. A failed Read (or Write) marks the connection broken; its poller then posts
// Finish, and when Finish completes every round still in flight on that connection fails with
// UNAVAILABLE. Start reconnects (joining again with previous_session) when it finds the
// current connection broken. Since nobody polls while nobody waits, a break is noticed at the
// next Start or Wait, not when it happens. When no other thread polls, Start first handles the
// events already ready without blocking (a closed stream among them: replaced before sending),
// then, like a sync Write, sees its write complete; a failed write (the stream was dead before
// the contribution left) marks the stream broken and sends the contribution again, once, on a
// new stream. A
// contribution written on a stream that breaks afterwards (or whose write completes in another
// thread's poll) fails with UNAVAILABLE at its Wait. A broken connection lives on (it may still
// deliver results read before the break) until its last round is done; its destructor cancels
// the call and drains its completion queue.
struct RoundStream {
  ~RoundStream() {
    context.TryCancel();
    cq.Shutdown();
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
    }
  }

  grpc::ClientContext context;  // declared first: the stream lives in the call's arena
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream;
  uint64_t generation = 0;
  std::atomic<bool> broken{false};  // no new rounds on this stream; set under rounds_mu_

  // Guarded by Client::Impl::rounds_mu_.
  v1::ServerFrame in;         // the posted Read's buffer
  bool polling = false;       // a thread holds the poller role
  bool read_posted = false;
  bool read_failed = false;
  bool write_in_flight = false;
  bool write_failed = false;  // the last write's outcome
  bool finish_posted = false;
  bool finished = false;      // Finish completed; every round of this stream has failed
  int waiters = 0;            // threads sleeping in Wait or Start on this connection
  grpc::Status final_status;  // Finish's
  absl::CondVar write_cv;  // Starts waiting for the write slot
  // Client::Abort: the Abort frame to write once the write slot is free (the poller writes it),
  // and the alarm that wakes a poller blocked in AsyncNext.
  std::unique_ptr<v1::ClientFrame> abort_frame;
  bool woken = false;
  grpc::Alarm wake;
};

class PendingRound {
 public:
  uint32_t op = 0;
  uint64_t seq = 0;
  Phase phase = Phase::kForward;
  Scope scope = Scope::kNode;  // the scope sent (what auto scope chose)
  bool decide = false;         // auto scope's decision round
  int64_t channels = 0;
  std::shared_ptr<RoundStream> conn;  // the stream it was sent on (gRPC rounds)
  uint64_t generation = 0;  // the connection (RoundStream::generation) it started on
  // Shared-memory rounds: the channel and the slot it was posted in (conn is null).
  std::shared_ptr<client_internal::ShmChannel> shm;
  client_internal::ShmRound shm_round;
  bool shm_waited = false;  // a shared-memory round already waited for: its outcome
  absl::Status shm_status;
  // Started before the node's transport was decided: the inputs, sent at Wait.
  std::vector<double> deferred;
  int64_t deferred_count = 0;
  bool counted = false;  // in the client's stats already; touched only by its waiter
  // Sliced waits (Client::WaitFor), touched only by its waiter: the wait's deadline and when
  // it began, fixed by the first slice; a deferred round's real round once started.
  bool wait_started = false;
  std::chrono::steady_clock::time_point wait_deadline;
  std::chrono::steady_clock::time_point blocked_since;
  std::shared_ptr<PendingRound> restarted;
  // Guarded by Client::Impl::rounds_mu_ until done; after that, read only by its waiter.
  absl::CondVar cv;
  bool waiting = false;
  bool done = false;
  client_internal::Answer answer;
};

namespace {
using Key = std::tuple<uint32_t, uint64_t, int>;

enum Tag : intptr_t { kStartCall = 1, kRead, kWrite, kFinish, kWake };
void* TagOf(Tag t) { return reinterpret_cast<void*>(t); }

// A steady-clock deadline as absl::Time, for absl::CondVar's waits.
absl::Time AbslTime(std::chrono::steady_clock::time_point t) {
  return absl::Now() + absl::FromChrono(t - std::chrono::steady_clock::now());
}

std::chrono::system_clock::time_point ToSystem(std::chrono::steady_clock::time_point t) {
  const auto now = std::chrono::steady_clock::now();
  if (t <= now) return std::chrono::system_clock::now();
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - now);
}
}  // namespace

class Client::Impl {
 public:

  using Clock = std::chrono::steady_clock;
  // How long a round's Start waits for the node's transport before leaving it to its Wait.
  static constexpr std::chrono::milliseconds kDecisionWait{500};
  // How long a broken stream's final status is waited for before reconnecting.
  static constexpr std::chrono::milliseconds kFinishWait{1000};

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
    std::shared_ptr<RoundStream> conn;
    {
      absl::MutexLock lock(&mu_);
      conn = std::move(conn_);
    }
    if (!session_.empty()) {
      v1::LeaveRequest req;
      req.set_session(session_);
      v1::LeaveResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      stub_->Leave(&ctx, req, &resp);  // best effort
    }
    // The stream is cancelled and drained when its last reference goes (rounds not waited for
    // through the C ABI may hold it a little longer).
    if (conn) conn->context.TryCancel();
  }

  absl::Status Connect() {
    absl::MutexLock lock(&mu_);
    return ConnectLocked();
  }

  absl::StatusOr<std::shared_ptr<PendingRound>> Start(Phase phase, uint32_t op, uint64_t seq,
                                                      Scope scope, int64_t channels,
                                                      int64_t count, const double* a,
                                                      const double* b) {
    // The round's name is only built for an error message.
    auto round = [&] { return wire::RoundName(op, seq, v1::Phase(int(phase))); };
    if (absl::Status s = Aborted(); !s.ok()) return s;
    if (phase != Phase::kForward && phase != Phase::kBackward) {
      return absl::InvalidArgumentError("phase must be forward or backward");
    }
    if (scope != Scope::kNode && scope != Scope::kGlobal && scope != Scope::kShadow &&
        scope != Scope::kGroup && scope != Scope::kAuto && scope != Scope::kRenorm &&
        scope != Scope::kLagged) {
      return absl::InvalidArgumentError(
          "scope must be node, global, shadow, group, auto, renorm or lagged");
    }
    if (scope == Scope::kGroup && options_.group_nodes <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "round ", round(), ": group scope, but this client joined without a group size; set "
          "HSBN_GROUP_NODES (ClientOptions::group_nodes) on every process of the job"));
    }
    if (channels <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("round ", round(), ": channels=", channels,
                                                     " must be at least 1"));
    }
    if (a == nullptr || b == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("round ", round(), ": null statistics array"));
    }
    // Large enough to hold the payload; gRPC refuses bigger messages.
    if (wire::PayloadBytes(channels) > (60 << 20)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "round ", round(), ": ", channels, " channels do not fit in one message"));
    }
    bool decide = false;
    v1::AutoDecide request;
    // Group and auto-scope rounds take the stream even where the node has shared memory: the
    // segment carries neither a group nor a decision, and an auto layer's shadow partials must
    // reach the root ahead of its decision round, which one path keeps in order. Every rank
    // of a layer asks for the same scope, so a round still never mixes transports.
    const bool stream_only = scope == Scope::kAuto || scope == Scope::kGroup;
    if (scope == Scope::kAuto) {
      if (absl::Status s = auto_.Resolve(op, seq, phase, &scope, &decide, &request); !s.ok()) {
        return s;
      }
    }
    // What the wire says: a renorm layer's backward round is a node round (its sums are the
    // node's); the round is still counted under renorm.
    const Scope wire_scope =
        scope == Scope::kRenorm && phase == Phase::kBackward ? Scope::kNode : scope;
    // The stream's message, built only for a round that takes the stream (packing the payload
    // was most of a shared-memory round's cost).
    v1::ClientFrame frame;
    auto build_frame = [&](const std::string& session) {
      v1::Contribution* c = frame.mutable_contribution();
      if (c->data().empty()) {
        c->set_op(op);
        c->set_seq(seq);
        c->set_phase(v1::Phase(int(phase)));
        c->set_scope(v1::Scope(int(wire_scope)));
        if (decide) *c->mutable_decide() = request;
        c->set_channels(uint32_t(channels));
        c->set_count(count);
        wire::PackPayload(a, b, channels, c->mutable_data());
      }
      c->set_session(session);
    };
    const Key key{op, seq, int(phase)};
    const auto deadline = Clock::now() + RoundTimeout();
    if ((scope == Scope::kRenorm && phase == Phase::kForward) || scope == Scope::kLagged) {
      absl::MutexLock lock(&rounds_mu_);
      ExpectLate(key, scope);
    }
    // The round's record, whichever transport carries it.
    auto make_pending = [&](const RoundStream& via) {
      auto pending = std::make_shared<PendingRound>();
      pending->op = op;
      pending->seq = seq;
      pending->phase = phase;
      pending->scope = scope;
      pending->channels = channels;
      pending->generation = via.generation;
      return pending;
    };

    // Twice at most: when the stream turns out broken before the contribution left (the
    // previous write failed, or ours did), it is sent again once on a new stream.
    for (int attempt = 0;; ++attempt) {
      std::shared_ptr<RoundStream> conn;
      std::shared_ptr<client_internal::ShmChannel> shm;
      std::string session;
      {
        absl::MutexLock lock(&mu_);
        // A sidecar that stopped politely said so: this call fails with its words, and the
        // next one rejoins (the process that follows it on the address, if any).
        if (absl::Status stopping = StoppingLocked(); !stopping.ok()) {
          Debug(absl::StrCat("the sidecar is stopping: ", stopping.message()));
          conn_.reset();
          shm_.reset();
          return stopping;
        }
        // A sidecar that closed the shared-memory socket is gone (restarted): rejoin, as for a
        // broken stream, which nobody reads while rounds travel through shared memory.
        if (!conn_ || conn_->broken || (shm_ && !shm_->AliveRecently())) {
          if (conn_) {
            Debug(conn_->broken ? "reconnecting: the stream to the sidecar broke"
                                : "reconnecting: the sidecar's shared-memory segment is gone");
          }
          if (absl::Status s = ConnectLocked(); !s.ok()) return s;
        }
        conn = conn_;
        shm = shm_;
        session = session_;
      }
      if (shm != nullptr && !stream_only) {
        if (!shm->decided()) {
          // The sidecar answers once every local rank of the job presented its session. Wait
          // briefly: when the other ranks are not there yet (they may be started by this very
          // thread, as tests do), the round is sent at its Wait instead.
          absl::Status s = shm->Await(std::min(deadline, Clock::now() + kDecisionWait));
          if (s.code() == absl::StatusCode::kDeadlineExceeded) {
            auto pending = make_pending(*conn);
            pending->shm = std::move(shm);
            pending->deferred_count = count;
            pending->deferred.assign(a, a + channels);
            pending->deferred.insert(pending->deferred.end(), b, b + channels);
            return pending;
          }
          if (!s.ok()) return s;
          absl::MutexLock lock(&mu_);
          SetTransport(shm->note());
          if (!shm->mapped() && shm_ == shm) shm_.reset();
        }
        // Every rank chooses by the channel count alone, so a round never mixes transports;
        // one wider than the aggregator allows goes into the segment to fail there for all.
        if (shm->mapped() && (channels <= shm->max_channels() ||
                              (max_channels_ > 0 && channels > max_channels_))) {
          auto r = shm->Start(shm::Key{op, seq, int32_t(phase)}, int32_t(wire_scope), channels, count,
                              a, b, deadline);
          if (!r.ok()) return r.status();
          counters_.Sent(wire::PayloadBytes(std::min<int64_t>(channels, shm->max_channels())));
          auto pending = make_pending(*conn);
          pending->shm = std::move(shm);
          pending->shm_round = *r;
          // Late global results come on the stream, which shared-memory rounds never read:
          // take what has arrived, so that they cannot pile up at the sidecar (a stream more
          // than --max-queued-bytes behind is ended) while nobody asks for them (a warm-up).
          if (scope == Scope::kRenorm || scope == Scope::kLagged) DrainStream(conn);
          return pending;
        }
      }
      build_frame(session);
      auto pending = make_pending(*conn);
      pending->decide = decide;
      pending->conn = conn;
      absl::ReleasableMutexLock lk(&rounds_mu_);
      // Nobody polls: handle what is ready without blocking (results read meanwhile, and a
      // stream closed meanwhile, which is replaced before sending). gRPC's poller handles one
      // ready socket per pass, hence more than one pass. A sidecar stopped between rounds must
      // be seen here, before our write: writing to its closed socket draws a reset that
      // discards its final status (the words and reason SHUTTING_DOWN) unread. With 2 passes
      // that happened in 1 of 75 runs of test_failures' between-rounds test under load (the
      // round failed "broke (Broken pipe)", reason unspecified); with 4, in none of 75.
      if (!conn->polling) {
        conn->polling = true;
        for (int pass = 0; pass < 4 && !conn->broken; ++pass) {
          Poll(conn, Clock::now(), [] { return false; });
        }
        conn->polling = false;
        HandOff(*conn);
        if (conn->broken) {
          if (attempt == 0) continue;
          return Broken(round());
        }
      }
      if (!pending_.emplace(key, pending).second) {
        return absl::AlreadyExistsError(absl::StrCat(
            "round ", round(), " is already in flight on this client; each (op, seq, phase) is "
            "one round"));
      }
      // An Abort between this call's first check and here failed the rounds in pending_
      // before ours was in it (it sets the flag before taking rounds_mu_, so it shows now);
      // sent anyway, ours would wait for an answer the sidecar never gives an aborted rank.
      if (absl::Status s = Aborted(); !s.ok()) {
        Forget(*pending);
        return s;
      }
      // One write in flight per stream: wait for the previous one to complete.
      if (absl::Status s = AwaitWriteSlot(conn, deadline, [&] { return "round " + round(); });
          !s.ok()) {
        Forget(*pending);
        return s;
      }
      if (conn->broken) {  // our contribution was not sent
        Forget(*pending);
        if (attempt == 0) continue;
        return Broken(round());
      }
      conn->write_in_flight = true;
      conn->write_failed = false;
      counters_.Sent(int64_t(frame.ByteSizeLong()));
      conn->stream->Write(frame, TagOf(kWrite));  // serialised here: frame may go
      // Like a sync Write, see it complete when nobody else polls (usually it already has: the
      // transport writes inline). A failed write means the stream was dead before the
      // contribution left: send it again on a new stream. When another thread polls, return
      // at once; that thread sees the completion, and a failure fails the round at its Wait.
      if (conn->polling) return pending;
      AwaitWrite(conn, deadline);
      if (!conn->write_in_flight && conn->write_failed) {
        Forget(*pending);
        if (attempt == 0) continue;
        return Broken(round());
      }
      return pending;  // a write still in flight at the deadline fails the round at its Wait
    }
  }

  // A blocking round (Forward, Backward): Start and Wait, blocked time counted from the call.
  absl::Status Blocking(Phase phase, uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                        int64_t count, const double* a, const double* b, int64_t* out_count,
                        double* out_a, double* out_b) {
    const auto since = Clock::now();
    auto p = Start(phase, op, seq, scope, channels, count, a, b);
    if (!p.ok()) {
      counters_.Record(scope, phase, false, true, Clock::now() - since);
      return p.status();
    }
    return Wait(**p, out_count, out_a, out_b, since);
  }

  // Wait, counted in the stats: the caller has been blocked since `blocked_since`.
  absl::Status Wait(PendingRound& p, int64_t* out_count, double* out_a, double* out_b,
                    Clock::time_point blocked_since) {
    absl::Status s = WaitResult(p, out_count, out_a, out_b);
    return Waited(p, s, blocked_since);
  }

  // One slice of a wait: returns at `slice_end` with *done = false if the round is still
  // open (it stays waitable), else as Wait with *done = true.
  absl::Status WaitFor(PendingRound& p, Clock::time_point slice_end, bool* done,
                       int64_t* out_count, double* out_a, double* out_b) {
    const bool first = !p.wait_started;
    if (first) p.blocked_since = Clock::now();
    bool pending = false;
    absl::Status s = WaitResult(p, out_count, out_a, out_b, slice_end, &pending);
    *done = !pending;
    if (pending) return absl::OkStatus();
    return Waited(p, s, p.blocked_since);
  }

  // The client's abort (Client::Abort): every round in flight and every later one fails with
  // ABORTED and `reason`; the sidecar is told, so the job's other ranks fail at once too.
  void Abort(const std::string& reason) {
    const std::string why = reason.empty() ? std::string("no reason given")
                                           : wire::Printable(reason, 512);
    const absl::Status status = wire::WithReason(
        absl::AbortedError(absl::StrCat("rank ", options_.rank, " of job '", options_.job_id,
                                        "' was aborted (", why,
                                        "); its rounds fail, and the job's other ranks are told")),
        v1::REASON_CLIENT_ABORTED);
    {
      absl::MutexLock lock(&abort_mu_);
      if (!aborted_.ok()) return;  // the first abort's reason stands
      aborted_ = status;
    }
    aborted_flag_.store(true, std::memory_order_release);
    Debug(absl::StrCat("aborting: ", why));
    std::shared_ptr<RoundStream> conn;
    std::shared_ptr<client_internal::ShmChannel> shm;
    std::string session;
    {
      absl::MutexLock lock(&mu_);
      conn = conn_;
      shm = shm_;
      session = session_;
    }
    if (shm) shm->Abort(status);
    if (!conn) return;
    absl::MutexLock lk(&rounds_mu_);
    for (auto it = pending_.begin(); it != pending_.end(); it = pending_.erase(it)) {
      PendingRound& p = *it->second;
      p.answer.status = status;
      p.done = true;
      if (p.waiting) p.cv.Signal();
    }
    conn->write_cv.SignalAll();
    if (late_waiters_ > 0) late_cv_.SignalAll();  // GlobalStats waits end too
    if (conn->broken) return;  // the sidecar already reports this rank as disconnected
    conn->abort_frame = std::make_unique<v1::ClientFrame>();
    v1::Abort* frame = conn->abort_frame->mutable_abort();
    frame->set_session(session);
    frame->set_code(int(absl::StatusCode::kAborted));
    frame->set_message(why);
    if (conn->polling) {
      // The poller writes the frame when the slot is free; wake it from AsyncNext.
      if (!conn->woken) {
        conn->woken = true;
        conn->wake.Set(&conn->cq, gpr_now(GPR_CLOCK_MONOTONIC), TagOf(kWake));
      }
      return;
    }
    // Nobody polls: see the frame out (a bounded wait, as a sync Write would).
    conn->polling = true;
    FlushAbortFrame(*conn);
    Poll(conn, Clock::now() + kAbortFlush, [&] {
      return (conn->abort_frame == nullptr && !conn->write_in_flight) || conn->broken;
    });
    conn->polling = false;
    HandOff(*conn);
  }

  absl::Status Aborted() const {
    if (!aborted_flag_.load(std::memory_order_acquire)) return absl::OkStatus();
    absl::MutexLock lock(&abort_mu_);
    return aborted_;
  }

  // A wait's end, counted in the stats.
  absl::Status Waited(PendingRound& p, absl::Status s, Clock::time_point blocked_since) {
    if (p.decide) s = auto_.Take(p.op, p.seq, p.answer, s);
    const Clock::duration blocked = Clock::now() - blocked_since;
    if (options_.debug && blocked > options_.debug_slow) {
      Debug(absl::StrCat(
          "round ", wire::RoundName(p.op, p.seq, v1::Phase(int(p.phase))), " (", ScopeName(p.scope),
          ") waited ", std::chrono::duration_cast<std::chrono::milliseconds>(blocked).count(),
          " ms: ", s.ok() ? std::string("ok") : absl::StatusCodeToString(s.code())));
    }
    counters_.Record(p.scope, p.phase, s.ok(), !p.counted, blocked);
    p.counted = true;
    if (wire::ReasonOf(s) == v1::REASON_SHUTTING_DOWN) ForgetStoppedSidecar(p.generation);
    return s;
  }

  // A round of connection `generation` failed because its sidecar is stopping, which its
  // caller now knows: while that is still the connection, the next call rejoins instead of
  // naming the stop again.
  void ForgetStoppedSidecar(uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (conn_ != nullptr && conn_->generation == generation) {
      shm_.reset();
      conn_.reset();
    }
  }

  // Waits for p until its deadline (fixed by the wait's first slice), or until `slice_end`
  // when `pending` is given: then *pending = true says the round is still open.
  absl::Status WaitResult(PendingRound& p, int64_t* out_count, double* out_a, double* out_b,
                          Clock::time_point slice_end = Clock::time_point::max(),
                          bool* pending = nullptr) {
    if (!p.wait_started) {
      p.wait_started = true;
      p.wait_deadline = Clock::now() + RoundTimeout();
    }
    absl::Status s;
    if (((p.scope == Scope::kRenorm && p.phase == Phase::kForward) ||
         p.scope == Scope::kLagged) &&
        num_nodes_.load() == 1) {
      // A job of one node: the node's statistics are the job's, kept as the round's global
      // ones here (the sidecar sends none).
      std::vector<double> a(size_t(p.channels)), b(size_t(p.channels));
      int64_t count = 0;
      s = WaitUntil(p, p.wait_deadline, &count, a.data(), b.data(), slice_end, pending);
      if (s.ok() && (pending == nullptr || !*pending)) {
        v1::Result own;
        own.set_op(p.op);
        own.set_seq(p.seq);
        own.set_phase(v1::Phase(int(p.phase)));
        own.set_channels(uint32_t(p.channels));
        own.set_count(count);
        wire::PackPayload(a.data(), b.data(), p.channels, own.mutable_data());
        {
          absl::MutexLock lock(&rounds_mu_);
          late_expected_.erase(Key{p.op, p.seq, int(p.phase)});
          KeepLate(&own, p.scope);
        }
        if (out_count != nullptr) *out_count = count;
        if (out_a != nullptr) std::copy(a.begin(), a.end(), out_a);
        if (out_b != nullptr) std::copy(b.begin(), b.end(), out_b);
      }
    } else {
      s = WaitUntil(p, p.wait_deadline, out_count, out_a, out_b, slice_end, pending);
    }
    if (pending == nullptr || !*pending) p.wait_started = false;
    return s;
  }

  absl::Status WaitUntil(PendingRound& p, Clock::time_point deadline, int64_t* out_count,
                         double* out_a, double* out_b, Clock::time_point slice_end,
                         bool* pending) {
    // A slice that ends before the deadline may return "still open".
    auto slice_over = [&] { return pending != nullptr && Clock::now() >= slice_end; };
    if (p.restarted) {  // a deferred round, started by an earlier slice
      absl::Status s = WaitResult(*p.restarted, out_count, out_a, out_b, slice_end, pending);
      if (pending != nullptr && *pending) return s;
      p.restarted.reset();
      p.shm_waited = true;
      p.shm_status = s;
      return s;
    }
    if (p.shm_waited) {
      // Waited for before: its answer was taken then (a failed round fails again).
      return p.shm_status.ok() ? absl::FailedPreconditionError("this round was already waited for")
                               : p.shm_status;
    }
    if (p.shm && !p.deferred.empty()) {
      // Started before the node's transport was decided: decide, then start it for real.
      std::shared_ptr<client_internal::ShmChannel> shm = p.shm;
      absl::Status s;
      for (;;) {  // in short slices, so that an abort ends it
        s = shm->Await(std::min({deadline, slice_end, Clock::now() + kAbortCheck}));
        if (s.code() != absl::StatusCode::kDeadlineExceeded || Clock::now() >= deadline) break;
        if (absl::Status a = Aborted(); !a.ok()) {
          s = a;
          break;
        }
        if (slice_over()) {
          *pending = true;
          return absl::OkStatus();
        }
      }
      p.shm.reset();
      if (!s.ok()) {
        p.shm_waited = true;
        p.shm_status = s;
        return s;
      }
      {
        absl::MutexLock lock(&mu_);
        SetTransport(shm->note());
        if (!shm->mapped() && shm_ == shm) shm_.reset();
      }
      std::vector<double> in = std::move(p.deferred);
      const int64_t ch = p.channels;
      auto q = Start(p.phase, p.op, p.seq, p.scope, ch, p.deferred_count, in.data(),
                     in.data() + ch);
      if (!q.ok()) {
        p.shm_waited = true;
        p.shm_status = q.status();
        return q.status();
      }
      p.restarted = *std::move(q);
      return WaitUntil(p, deadline, out_count, out_a, out_b, slice_end, pending);
    }
    if (p.shm) {
      absl::Status s = p.shm->Wait(p.shm_round, deadline, RoundTimeout(), out_count, out_a,
                                   out_b, slice_end, pending);
      if (pending != nullptr && *pending) return s;
      if (s.ok()) {
        counters_.Received(wire::PayloadBytes(p.channels));
      }
      if (s.code() == absl::StatusCode::kDeadlineExceeded && p.shm->Posted(p.shm_round)) {
        return s;  // the caller's own timeout: as on the stream, it may wait again
      }
      p.shm.reset();
      p.shm_waited = true;
      p.shm_status = s;
      return s;
    }
    if (!p.conn) return absl::FailedPreconditionError("this round was never sent");
    {
      absl::ReleasableMutexLock lk(&rounds_mu_);
      RoundStream& conn = *p.conn;
      while (!p.done) {
        if (Clock::now() < deadline && slice_over()) {
          if (!conn.polling) HandOff(conn);
          *pending = true;
          return absl::OkStatus();
        }
        if (Clock::now() >= deadline) {
          Forget(p);
          if (!conn.polling) HandOff(conn);
          lk.Release();
          return absl::DeadlineExceededError(absl::StrCat(
              "round ", wire::RoundName(p.op, p.seq, v1::Phase(int(p.phase))),
              ": no answer from the hsbn sidecar at ", options_.address, " within ",
              RoundTimeout().count(), " ms"));
        }
        const auto until = std::min(deadline, slice_end);
        if (!conn.polling) {
          conn.polling = true;
          Poll(p.conn, until, [&] { return p.done; });
          conn.polling = false;
          HandOff(conn);
        } else {
          p.waiting = true;
          ++conn.waiters;
          p.cv.WaitWithDeadline(&rounds_mu_, AbslTime(until));
          --conn.waiters;
          p.waiting = false;
        }
      }
      if (!conn.polling) HandOff(conn);  // a hand-off meant for us may have raced our result
    }
    // Done: nobody else touches p now. A round that failed after this client aborted failed
    // because of the abort (its Abort frame may have reached the sidecar before the round's
    // contribution, which the sidecar then no longer knows): the caller gets the abort.
    if (!p.answer.status.ok()) {
      if (absl::Status aborted = Aborted(); !aborted.ok()) return aborted;
    }
    return client_internal::DeliverAnswer(p.answer, p.channels, out_count, out_a, out_b);
  }

  absl::StatusOr<v1::StatusResponse> Status(bool include_upstream) {
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

  const ClientOptions options_;
  client_internal::AutoScopes auto_{options_.auto_policy, options_.group_nodes};
  client_internal::RoundCounters counters_;
  ClientStats Stats() const {
    return counters_.Snapshot(late_dropped_.load(std::memory_order_relaxed));
  }
  // Written on (re)connect under mu_, read without it by rounds and info calls.
  std::atomic<int32_t> num_nodes_{0};
  std::atomic<int32_t> max_channels_{0};
  std::atomic<int64_t> aggregator_timeout_ms_{30000};

  // GlobalStats, whole (slice_end max, done null) or in slices: a slice that ends first sets
  // *done = false and writes nothing; the wait goes on at the next call, against the deadline
  // its first slice set. Counted in the stats once, when it ends.
  // `phase`: forward, the job's statistics (renorm, lagged); backward, the job's sums (lagged).
  absl::Status GlobalStats(Phase phase, uint32_t op, uint64_t seq, int64_t channels,
                           int64_t* out_count, double* out_mean, double* out_m2,
                           Clock::time_point slice_end = Clock::time_point::max(),
                           bool* done = nullptr) {
    GlobalWait wait;
    bool pending = false;
    absl::Status s = WaitGlobal(phase, op, seq, channels, out_count, out_mean, out_m2, slice_end,
                                &pending, &wait);
    if (done != nullptr) *done = !pending;
    if (pending) return absl::OkStatus();
    counters_.RecordGlobal(s.ok(), wait.waited, Clock::now() - wait.since);
    return s;
  }

  // A wait for a round's global statistics, across the slices of a sliced wait.
  struct GlobalWait {
    Clock::time_point since, deadline;
    bool waited = false;  // the result was not there at the first look
  };

  absl::Status WaitGlobal(Phase phase, uint32_t op, uint64_t seq, int64_t channels,
                          int64_t* out_count, double* out_mean, double* out_m2,
                          Clock::time_point slice_end, bool* pending, GlobalWait* wait) {
    const Key key{op, seq, int(phase)};
    Scope scope = phase == Phase::kForward ? Scope::kRenorm : Scope::kLagged;
    {
      absl::MutexLock lock(&rounds_mu_);
      if (auto it = late_.find(key); it != late_.end()) {
        scope = it->second.scope;
      } else if (auto e = late_expected_.find(key); e != late_expected_.end()) {
        scope = e->second;
      }
    }
    auto what = [&] {
      return absl::StrCat("the global ", phase == Phase::kForward ? "statistics" : "sums",
                          " of ", ScopeName(scope), " round op ", op, ", seq ", seq);
    };
    if (channels <= 0 || out_count == nullptr || out_mean == nullptr || out_m2 == nullptr) {
      *wait = GlobalWait{Clock::now(), Clock::now()};
      return absl::InvalidArgumentError(absl::StrCat(
          what(), ": channels must be at least 1 and the outputs not null"));
    }
    std::shared_ptr<RoundStream> conn;
    {
      absl::MutexLock lock(&mu_);
      conn = conn_;
    }
    absl::MutexLock lock(&rounds_mu_);
    const auto emplaced = global_waits_.try_emplace(key);
    const auto entry = emplaced.first;
    const bool first = emplaced.second;
    if (first) {
      entry->second.since = Clock::now();
      entry->second.deadline = entry->second.since + RoundTimeout();
    }
    // Ends the wait (not a slice): its record goes to the caller.
    auto end = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
      *wait = entry->second;
      global_waits_.erase(entry);
      return s;
    };
    const Clock::time_point deadline = entry->second.deadline;
    for (int pass = 0;; ++pass) {
      if (auto it = late_.find(key); it != late_.end()) {
        const Late& late = it->second;
        if (!late.status.ok()) {
          return end(wire::WithMessage(late.status,
                                       absl::StrCat(what(), ": ", late.status.message())));
        }
        if (late.channels != channels) {
          return end(absl::InvalidArgumentError(absl::StrCat(
              what(), " have ", late.channels, " channels; the caller asked for ", channels)));
        }
        *out_count = late.count;
        wire::UnpackPayload(late.data, channels, out_mean, out_m2);
        return end(absl::OkStatus());
      }
      if (absl::Status aborted = Aborted(); !aborted.ok()) return end(aborted);
      if (conn == nullptr || conn->broken) {
        const std::string why =
            conn != nullptr && conn->finished ? conn->final_status.error_message() : "";
        return end(absl::UnavailableError(absl::StrCat(
            what(), " did not arrive: the stream to the hsbn sidecar at ", options_.address,
            " broke (", why.empty() ? "the sidecar restarted or stopped, or ended the stream"
                                    : why,
            "). The next call reconnects; the round's global statistics are lost")));
      }
      if (pass > 0 || !first) entry->second.waited = true;
      const Clock::time_point now = Clock::now();
      if (now >= deadline && pass > 0) {
        return end(absl::DeadlineExceededError(absl::StrCat(
            what(), " did not arrive within ", RoundTimeout().count(), " ms: the job's root "
            "aggregator (the sidecar's --upstream) did not answer, or this round was never "
            "started with ", ScopeName(scope), " scope on every rank")));
      }
      if (now >= slice_end && pass > 0) {
        *pending = true;
        return absl::OkStatus();
      }
      const Clock::time_point until = std::min(deadline, slice_end);
      if (!conn->polling) {
        conn->polling = true;
        // The first pass only handles what is ready (twice: see GlobalStatsReady): a result
        // already in the socket counts as no wait.
        for (int ready = 0; ready < (pass == 0 ? 2 : 1); ++ready) {
          Poll(conn, pass == 0 ? now : until, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
            return late_.count(key) > 0 || conn->broken ||
                   aborted_flag_.load(std::memory_order_acquire);
          });
        }
        conn->polling = false;
        HandOff(*conn);
      } else if (pass > 0) {
        ++late_waiters_;
        ++conn->waiters;
        late_cv_.WaitWithDeadline(&rounds_mu_, AbslTime(until));
        --conn->waiters;
        --late_waiters_;
      }
    }
  }

  absl::Status NameLayers(const std::vector<std::pair<uint32_t, std::string>>& names) {
    if (names.empty()) return absl::OkStatus();
    v1::ClientFrame frame;
    for (const auto& [op, name] : names) {
      v1::LayerName* n = frame.mutable_layer_names()->add_layers();
      n->set_op(op);
      n->set_name(name);
    }
    return SendFrame(&frame, "layer names");
  }

  // Writes a frame that is not a round on the stream (its session set here), waiting for the
  // write slot as Start does; a write that fails shows as a broken stream at the next call.
  absl::Status SendFrame(v1::ClientFrame* frame, const char* what) {
    std::shared_ptr<RoundStream> conn;
    {
      absl::MutexLock lock(&mu_);
      if (!conn_ || conn_->broken) {
        if (absl::Status s = ConnectLocked(); !s.ok()) return s;
      }
      conn = conn_;
      if (frame->has_layer_names()) frame->mutable_layer_names()->set_session(session_);
    }
    const auto deadline = Clock::now() + RoundTimeout();
    absl::MutexLock lock(&rounds_mu_);
    if (absl::Status s = AwaitWriteSlot(conn, deadline, [&] { return std::string(what); });
        !s.ok()) {
      return s;
    }
    if (conn->broken) {
      return absl::UnavailableError(absl::StrCat("could not send ", what, ": the stream to the "
                                                 "hsbn sidecar at ", options_.address,
                                                 " broke; the next call reconnects"));
    }
    conn->write_in_flight = true;
    conn->write_failed = false;
    counters_.Sent(int64_t(frame->ByteSizeLong()));
    conn->stream->Write(*frame, TagOf(kWrite));
    if (!conn->polling) AwaitWrite(conn, deadline);
    return absl::OkStatus();
  }

  // Waits until conn's write slot is free or the stream broke (OK), polling it if nobody else
  // does; the client's abort, or DEADLINE_EXCEEDED naming what() at `deadline`.
  template <typename What>
  absl::Status AwaitWriteSlot(const std::shared_ptr<RoundStream>& conn,
                              Clock::time_point deadline, What what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    while (conn->write_in_flight && !conn->broken) {
      if (absl::Status s = Aborted(); !s.ok()) return s;
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            what(), ": could not send to the hsbn sidecar at ", options_.address, " within ",
            RoundTimeout().count(), " ms"));
      }
      if (!conn->polling) {
        conn->polling = true;
        Poll(conn, deadline, [&] { return !conn->write_in_flight || conn->broken; });
        conn->polling = false;
        HandOff(*conn);
      } else {
        ++conn->waiters;
        conn->write_cv.WaitWithDeadline(&rounds_mu_, AbslTime(deadline));
        --conn->waiters;
      }
    }
    return absl::OkStatus();
  }

  // Like a sync Write: sees the write just started complete (or the deadline pass), taking the
  // poller role, which nobody holds.
  void AwaitWrite(const std::shared_ptr<RoundStream>& conn, Clock::time_point deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    conn->polling = true;
    Poll(conn, deadline, [&] { return !conn->write_in_flight; });
    conn->polling = false;
    HandOff(*conn);
  }

  // Handles the stream's ready events without blocking, unless another thread polls it.
  void DrainStream(const std::shared_ptr<RoundStream>& conn) {
    absl::MutexLock lock(&rounds_mu_);
    if (conn == nullptr || conn->polling || conn->broken) return;
    conn->polling = true;
    for (int pass = 0; pass < 2 && !conn->broken; ++pass) {
      Poll(conn, Clock::now(), [] { return false; });
    }
    conn->polling = false;
    HandOff(*conn);
  }

  bool GlobalStatsReady(Phase phase, uint32_t op, uint64_t seq) {
    std::shared_ptr<RoundStream> conn;
    {
      absl::MutexLock lock(&mu_);
      conn = conn_;
    }
    const Key key{op, seq, int(phase)};
    absl::MutexLock lock(&rounds_mu_);
    if (late_.count(key) > 0) return true;
    if (conn != nullptr && !conn->polling && !conn->broken) {
      conn->polling = true;
      // Two passes, as in Start: bytes already in the socket may take one pass to be read and
      // another to complete the Read.
      for (int pass = 0; pass < 2 && late_.count(key) == 0 && !conn->broken; ++pass) {
        Poll(conn, Clock::now(),
             [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) { return late_.count(key) > 0; });
      }
      conn->polling = false;
      HandOff(*conn);
    }
    return late_.count(key) > 0;
  }

 private:
  // Auto scope's state of one op. An epoch is a decision: `scope` applies to the op's rounds
  // after seq `decided_at` (all of them for a restored decision, decided_at = -1), except the
  // re-check samples and decision rounds of its policy.
  // How often a wait that cannot be woken (the transport decision) looks for an abort.
  static constexpr std::chrono::milliseconds kAbortCheck{200};
  // How long a poller stays to see Abort's frame out (as a sync Write would, bounded).
  static constexpr std::chrono::milliseconds kAbortFlush{1000};
  mutable absl::Mutex abort_mu_;  // a leaf lock
  absl::Status aborted_ ABSL_GUARDED_BY(abort_mu_);  // Abort's status; OK: not aborted
  std::atomic<bool> aborted_flag_{false};            // !aborted_.ok(), read without the lock

  std::chrono::milliseconds RoundTimeout() const {
    return client_internal::RoundWait(options_.round_timeout, aggregator_timeout_ms_.load());
  }

  absl::Status Broken(const std::string& round) const {
    return absl::UnavailableError(absl::StrCat(
        "round ", round, ": the stream to the hsbn sidecar at ", options_.address,
        " broke while sending; the next call reconnects"));
  }

  // Removes a round from pending_ (if it is still there). rounds_mu_ held.
  void Forget(PendingRound& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    auto it = pending_.find(Key{p.op, p.seq, int(p.phase)});
    if (it != pending_.end() && it->second.get() == &p) pending_.erase(it);
  }

  // After the poller role was given back: wake one thread that may take it. rounds_mu_ held.
  void HandOff(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    if (conn.waiters == 0) return;
    conn.write_cv.SignalAll();  // Starts waiting for the write slot (rare)
    if (late_waiters_ > 0) late_cv_.SignalAll();  // GlobalStats waiters may poll in turn
    for (auto& [key, r] : pending_) {
      if (r->conn.get() == &conn && r->waiting && !r->done) {
        r->cv.Signal();
        return;
      }
    }
  }

  // The poller's loop: rounds_mu_ held on entry and exit, released while in AsyncNext. Handles
  // events until `stop()` or `deadline` (a deadline in the past handles what is ready and
  // returns). The caller holds conn's poller role.
  template <typename Stop>
  void Poll(const std::shared_ptr<RoundStream>& conn, Clock::time_point deadline, Stop stop)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    auto sys_deadline = ToSystem(deadline);
    bool now_only = deadline <= Clock::now();
    // A poller leaving with Abort's frame unwritten would strand it: it stays to write it,
    // past its deadline too (then only for that frame, bounded as Abort's own wait). Stranded,
    // the frame never reaches the sidecar, and the job's other ranks wait for this one.
    bool stranded = false;
    while (!stop() || (conn->abort_frame != nullptr && !conn->broken)) {
      if (stranded && (conn->abort_frame == nullptr || conn->broken)) return;
      if (!conn->read_posted && !conn->read_failed) {
        conn->read_posted = true;
        conn->stream->Read(&conn->in, TagOf(kRead));
      }
      void* tag = nullptr;
      bool ok = false;
      rounds_mu_.Unlock();
      // A deadline already passed is given as "infinitely past": gRPC rounds deadlines up to
      // the next millisecond, so "now" would block up to 1 ms in epoll_wait.
      const auto got = now_only ? conn->cq.AsyncNext(&tag, &ok, gpr_inf_past(GPR_CLOCK_MONOTONIC))
                                : conn->cq.AsyncNext(&tag, &ok, sys_deadline);
      rounds_mu_.Lock();
      if (got != grpc::CompletionQueue::GOT_EVENT) {  // TIMEOUT (SHUTDOWN: never here)
        if (stranded || conn->abort_frame == nullptr || conn->broken) return;
        stranded = true;
        now_only = false;
        sys_deadline = ToSystem(Clock::now() + kAbortFlush);
        FlushAbortFrame(*conn);
        continue;
      }
      switch (static_cast<Tag>(reinterpret_cast<intptr_t>(tag))) {
        case kRead:
          conn->read_posted = false;
          if (ok) {
            counters_.Received(int64_t(conn->in.ByteSizeLong()));
            Dispatch(*conn);
          } else {
            conn->read_failed = true;
            conn->broken = true;
            if (!conn->finish_posted) {
              conn->finish_posted = true;
              conn->stream->Finish(&conn->final_status, TagOf(kFinish));
            }
          }
          break;
        case kWrite:
          conn->write_in_flight = false;
          conn->write_failed = !ok;
          if (!ok) conn->broken = true;  // the Read fails too, and then Finish is posted
          if (conn->waiters > 0) conn->write_cv.SignalAll();
          break;
        case kFinish:
          conn->finished = true;
          FailRounds(*conn);
          break;
        case kStartCall:
        case kWake:
          break;
      }
      FlushAbortFrame(*conn);
    }
  }

  // Writes Abort's frame if the write slot is free. rounds_mu_ held.
  void FlushAbortFrame(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    if (!conn.abort_frame || conn.write_in_flight || conn.broken) return;
    conn.write_in_flight = true;
    conn.write_failed = false;
    conn.stream->Write(*conn.abort_frame, TagOf(kWrite));  // serialised here
    conn.abort_frame.reset();
  }

  // A result read from conn: complete its round. rounds_mu_ held.
  void Dispatch(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    if (!conn.in.has_result()) return;
    v1::Result* r = conn.in.mutable_result();
    if (r->late()) {
      auto expected = late_expected_.find(Key{r->op(), r->seq(), int(r->phase())});
      if (expected == late_expected_.end()) {
        // Not a round this client started with renorm or lagged scope (or its result came
        // already): kept, it could shadow the real one.
        late_dropped_.fetch_add(1, std::memory_order_relaxed);
        Debug(absl::StrCat("dropped a late result for round ",
                           wire::RoundName(r->op(), r->seq(), r->phase()),
                           ", which this client did not start with renorm or lagged scope"));
        return;
      }
      const Scope scope = expected->second;
      late_expected_.erase(expected);
      KeepLate(r, scope);
      return;
    }
    auto it = pending_.find(Key{r->op(), r->seq(), int(r->phase())});
    // A round we gave up on, a repeat, or a key reused on a newer stream: drop it.
    if (it == pending_.end() || it->second->conn.get() != &conn) return;
    PendingRound& p = *it->second;
    p.answer = client_internal::TakeAnswer(r);
    p.done = true;
    if (p.waiting) p.cv.Signal();
    pending_.erase(it);  // p stays alive: its waiter holds it
  }

  // A renorm or lagged round's global result (or failure), pushed by the sidecar: kept for
  // GlobalStats, the oldest dropped past kLateKept results or kLateBytes. rounds_mu_ held.
  static constexpr size_t kLateKept = 4096;
  static constexpr int64_t kLateBytes = 64 << 20;
  // A renorm or lagged round this client started: its late result will be kept. At most
  // kLateKept rounds are expected at once (the oldest is forgotten).
  void ExpectLate(const Key& key, Scope scope) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    if (!late_expected_.emplace(key, scope).second) return;
    late_expected_order_.push_back(key);
    while (late_expected_order_.size() > kLateKept ||
           (!late_expected_order_.empty() && !late_expected_.count(late_expected_order_.front()))) {
      late_expected_.erase(late_expected_order_.front());
      late_expected_order_.pop_front();
    }
  }
  void KeepLate(v1::Result* r, Scope scope) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    const Key key{r->op(), r->seq(), int(r->phase())};
    Late late;
    late.scope = scope;
    if (r->code() != 0) {
      late.status = wire::StatusFromCode(r->code(), r->message(), r->reason());
    } else if (r->channels() < 1 ||
               int64_t(r->data().size()) != wire::PayloadBytes(r->channels()) || r->count() < 0) {
      late.status = absl::InternalError(absl::StrCat(
          "the sidecar sent a malformed global result (", r->channels(), " channels, ",
          r->data().size(), " bytes); check that it runs the same hsbn version"));
    } else {
      late.count = r->count();
      late.channels = r->channels();
      late.data = std::move(*r->mutable_data());
    }
    late_bytes_ += int64_t(late.data.size());
    if (auto it = late_.find(key); it != late_.end()) {  // a repeat: the newer one counts
      late_bytes_ -= int64_t(it->second.data.size());
      it->second = std::move(late);
    } else {
      late_.emplace(key, std::move(late));
      late_order_.push_back(key);
    }
    while (!late_order_.empty() && (late_.size() > kLateKept || late_bytes_ > kLateBytes)) {
      auto old = late_.find(late_order_.front());
      if (old != late_.end()) {
        late_bytes_ -= int64_t(old->second.data.size());
        late_.erase(old);
      }
      late_order_.pop_front();
    }
    if (late_waiters_ > 0) late_cv_.SignalAll();
  }

  // conn's stream is finished: every round still in flight on it fails. rounds_mu_ held.
  void FailRounds(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_) {
    const std::string why = conn.final_status.error_message();
    // The sidecar's reason (a polite stop says SHUTTING_DOWN) travels with the failure.
    const absl::Status lost = wire::WithReason(
        absl::UnavailableError(absl::StrCat(
            "the stream to the hsbn sidecar at ", options_.address, " broke (",
            why.empty() ? "closed" : why, "); rounds in flight were lost. The next call "
            "reconnects")),
        wire::ReasonOf(wire::FromGrpc(conn.final_status)));
    for (auto it = pending_.begin(); it != pending_.end();) {
      PendingRound& p = *it->second;
      if (p.conn.get() != &conn) {
        ++it;
        continue;
      }
      p.answer.status = lost;
      p.done = true;
      if (p.waiting) p.cv.Signal();
      it = pending_.erase(it);
    }
  }

  // Non-OK (reason SHUTTING_DOWN) when the sidecar invalidated its segment, or ended the
  // stream, because it is stopping.
  absl::Status StoppingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shm_ != nullptr) {
      if (absl::Status s = shm_->Stopping(); !s.ok()) return s;
    }
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

  absl::Status ConnectLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
    v1::JoinResponse resp;
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
      s = stub_->Join(&ctx, req, &resp);
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
    Debug(absl::StrCat("joined: ", resp.num_nodes(), " node(s), aggregator '",
                       wire::Printable(resp.aggregator_id(), 128), "', round timeout ",
                       resp.round_timeout_ms(), " ms, max channels ", resp.max_channels(),
                       resp.shm_socket().empty()
                           ? std::string(", no shared memory: ") +
                                 wire::Printable(resp.shm_note().empty() ? "none offered"
                                                                         : resp.shm_note(),
                                                 256)
                           : ", shared memory offered"));
    if (resp.session().size() != 16) {
      return absl::InternalError(absl::StrCat(
          "the hsbn sidecar at ", options_.address, " answered Join without a valid session; "
          "check that it runs the same hsbn version as this client"));
    }
    session_ = resp.session();
    num_nodes_ = resp.num_nodes();
    max_channels_ = resp.max_channels();
    aggregator_timeout_ms_ = resp.round_timeout_ms();
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
    // The node's transport: shared memory if the sidecar offers it and every local rank takes
    // it (decided by the sidecar; awaited at the first round).
    shm_.reset();
    if (!OfferShm()) {
      SetTransport(shm_unreachable_.empty()
                       ? std::string("grpc: HSBN_TRANSPORT=grpc")
                       : absl::StrCat("grpc: this worker cannot reach the sidecar's "
                                      "shared-memory socket: ", shm_unreachable_));
    } else if (resp.shm_socket().empty()) {
      SetTransport(resp.shm_note().empty()
                       ? std::string("grpc: the sidecar does not offer shared memory")
                       : wire::Printable(resp.shm_note(), 512));
    } else {
      client_internal::ShmConfig config;
      config.socket = resp.shm_socket();
      config.session = session_;
      config.token = options_.token;
      config.job_id = options_.job_id;
      config.local_rank = options_.local_rank;
      config.local_world_size = options_.local_world_size;
      config.node_rank = options_.node_rank;
      config.num_nodes = resp.num_nodes();
      config.strict_finite = options_.strict_finite;
      config.max_channels = resp.max_channels();
      config.round_timeout = std::chrono::milliseconds(
          std::clamp<int64_t>(resp.round_timeout_ms(), 1, client_internal::kMaxWaitMs));
      auto opened = client_internal::ShmChannel::Open(std::move(config));
      if (opened.ok()) {
        shm_ = std::move(*opened);
        SetTransport("pending");
      } else if (shm_unreachable_.empty()) {
        // Another host or container: tell the sidecar now, by joining again without the
        // offer, so that the node takes the stream at once instead of after --shm-wait-ms.
        shm_unreachable_ = std::string(opened.status().message());
        return ConnectLocked();
      }
    }
    return absl::OkStatus();
  }

  bool OfferShm() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!shm_unreachable_.empty()) return false;
    return options_.transport != "grpc";
  }

  void SetTransport(const std::string& t) {
    if (counters_.SetTransport(t) && t != "pending") {
      Debug(absl::StrCat("node rounds travel by ", t));
    }
  }

  // HSBN_DEBUG=INFO: one line on stderr, prefixed with the rank (one write: lines of several
  // threads or processes do not interleave).
  void Debug(const std::string& what) const {
    if (!options_.debug) return;
    const std::string line = absl::StrCat("hsbn[rank ", options_.rank, "] ", what, "\n");
    fwrite(line.data(), 1, line.size(), stderr);
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Aggregator::Stub> stub_;
  absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(rounds_mu_);  // connection state; never taken while
                                                     // rounds_mu_ is held
  std::shared_ptr<RoundStream> conn_ ABSL_GUARDED_BY(mu_);
  // null: rounds use the stream
  std::shared_ptr<client_internal::ShmChannel> shm_ ABSL_GUARDED_BY(mu_);
  // Why the sidecar's shared-memory socket could not be used; then this worker offers it no more.
  std::string shm_unreachable_ ABSL_GUARDED_BY(mu_);
  std::string session_ ABSL_GUARDED_BY(mu_);  // the 16-byte secret from Join; empty before
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  // pending_, and (documented on them, not expressible as annotations across classes) the
  // PendingRounds' and the Conns' poll state.
  absl::Mutex rounds_mu_;
  std::map<Key, std::shared_ptr<PendingRound>> pending_ ABSL_GUARDED_BY(rounds_mu_);
  // Renorm and lagged rounds' global results by (op, seq, phase), in arrival order (KeepLate).
  struct Late {
    Scope scope = Scope::kRenorm;  // what the round was started with
    absl::Status status;
    int64_t count = 0;
    int64_t channels = 0;
    std::string data;  // packed payload
  };
  std::map<Key, Late> late_ ABSL_GUARDED_BY(rounds_mu_);
  std::deque<Key> late_order_ ABSL_GUARDED_BY(rounds_mu_);
  // Rounds started with renorm (forward) or lagged scope whose late result has not come.
  std::map<Key, Scope> late_expected_ ABSL_GUARDED_BY(rounds_mu_);
  std::deque<Key> late_expected_order_ ABSL_GUARDED_BY(rounds_mu_);
  std::atomic<int64_t> late_dropped_{0};  // late results for rounds not in late_expected_
  int64_t late_bytes_ ABSL_GUARDED_BY(rounds_mu_) = 0;
  int late_waiters_ ABSL_GUARDED_BY(rounds_mu_) = 0;
  std::map<Key, GlobalWait> global_waits_ ABSL_GUARDED_BY(rounds_mu_);
  absl::CondVar late_cv_;  // a late result arrived, or the poller role is free

};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& given) {
  ClientOptions options = given;
  if (options.transport.empty()) {
    absl::StatusOr<std::string> t = env::Resolve(env::Source::Process(), "HSBN_TRANSPORT");
    if (!t.ok()) return t.status();
    options.transport = *t;
  }
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Connect(); !s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<std::shared_ptr<PendingRound>> Client::Start(Phase phase, uint32_t op,
                                                            uint64_t seq, Scope scope,
                                                            int64_t channels, int64_t count,
                                                            const double* a, const double* b) {
  auto p = impl_->Start(phase, op, seq, scope, channels, count, a, b);
  // Start's own time is not blocked time (see RoundStats); a failed Start is a failed round.
  if (!p.ok()) impl_->counters_.Record(scope, phase, false, true, Impl::Clock::duration::zero());
  return p;
}

absl::Status Client::Wait(PendingRound& round, int64_t* out_count, double* out_a,
                          double* out_b) {
  return impl_->Wait(round, out_count, out_a, out_b, Impl::Clock::now());
}

absl::Status Client::Forward(uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                             int64_t count, const double* mean, const double* m2,
                             int64_t* out_count, double* out_mean, double* out_m2) {
  return impl_->Blocking(Phase::kForward, op, seq, scope, channels, count, mean, m2, out_count,
                         out_mean, out_m2);
}

absl::Status Client::Backward(uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                              int64_t count, const double* sum_dy, const double* sum_dy_xmu,
                              int64_t* out_count, double* out_sum_dy, double* out_sum_dy_xmu) {
  return impl_->Blocking(Phase::kBackward, op, seq, scope, channels, count, sum_dy, sum_dy_xmu,
                         out_count, out_sum_dy, out_sum_dy_xmu);
}

absl::Status Client::WaitFor(PendingRound& round, std::chrono::milliseconds slice, bool* done,
                             int64_t* out_count, double* out_a, double* out_b) {
  return impl_->WaitFor(round, Impl::Clock::now() + slice, done, out_count, out_a, out_b);
}

void Client::Abort(const std::string& reason) { impl_->Abort(reason); }

ClientStats Client::Stats() const {
  return impl_->Stats();
}

absl::Status Client::GlobalStats(uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
                                 double* out_mean, double* out_m2) {
  return impl_->GlobalStats(Phase::kForward, op, seq, channels, out_count, out_mean, out_m2);
}
absl::Status Client::GlobalStatsFor(uint32_t op, uint64_t seq, int64_t channels,
                                    std::chrono::milliseconds slice, bool* done,
                                    int64_t* out_count, double* out_mean, double* out_m2) {
  return impl_->GlobalStats(Phase::kForward, op, seq, channels, out_count, out_mean, out_m2,
                            Impl::Clock::now() + slice, done);
}

absl::Status Client::NameLayers(const std::vector<std::pair<uint32_t, std::string>>& names) {
  return impl_->NameLayers(names);
}
bool Client::GlobalStatsReady(uint32_t op, uint64_t seq) {
  return impl_->GlobalStatsReady(Phase::kForward, op, seq);
}

absl::Status Client::GlobalSums(uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
                                double* out_sum_dy, double* out_sum_dy_xmu) {
  return impl_->GlobalStats(Phase::kBackward, op, seq, channels, out_count, out_sum_dy,
                            out_sum_dy_xmu);
}
absl::Status Client::GlobalSumsFor(uint32_t op, uint64_t seq, int64_t channels,
                                   std::chrono::milliseconds slice, bool* done,
                                   int64_t* out_count, double* out_sum_dy,
                                   double* out_sum_dy_xmu) {
  return impl_->GlobalStats(Phase::kBackward, op, seq, channels, out_count, out_sum_dy,
                            out_sum_dy_xmu, Impl::Clock::now() + slice, done);
}
bool Client::GlobalSumsReady(uint32_t op, uint64_t seq) {
  return impl_->GlobalStatsReady(Phase::kBackward, op, seq);
}

absl::Status Client::SetAutoPolicy(uint32_t op, const AutoPolicy& policy) {
  return impl_->auto_.SetPolicy(op, policy);
}
AutoDecision Client::AutoDecisionOf(uint32_t op) const { return impl_->auto_.DecisionOf(op); }
absl::Status Client::SetAutoDecision(uint32_t op, Scope scope) {
  return impl_->auto_.SetDecision(op, scope);
}
void Client::ResetStats() { impl_->counters_.Reset(); }

absl::StatusOr<v1::StatusResponse> Client::Status(bool include_upstream) {
  return impl_->Status(include_upstream);
}

absl::StatusOr<std::string> Client::StatusJson(bool include_upstream) {
  auto s = impl_->Status(include_upstream);
  if (!s.ok()) return s.status();
  return StatusToJson(*s);
}

const ClientOptions& Client::options() const { return impl_->options_; }
int32_t Client::num_nodes() const { return impl_->num_nodes_; }
int32_t Client::max_channels() const { return impl_->max_channels_; }
std::chrono::milliseconds Client::aggregator_round_timeout() const {
  return std::chrono::milliseconds(impl_->aggregator_timeout_ms_.load());
}

}  // namespace hsbn

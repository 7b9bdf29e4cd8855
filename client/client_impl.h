// client/client_impl.h — Client::Impl, the worker's end of hsbn (private to client/).
//
// Client::Impl wires what a client is made of: its options (options.cc), the two transports of
// its rounds — the stream to the sidecar (this header's RoundStream and PendingRound; the
// stream's events and rounds in stream.cc) and the node's shared-memory segment (shm_channel.h;
// its rounds in shm_rounds.cc) — auto
// scope's decisions (auto_scope.h), its counters (round_stats.h), the connection to the
// sidecar (connect.cc) and the late global results of renorm and lagged rounds
// (late_results.cc). Starting and waiting for a round, and Abort, are client.cc's.
#ifndef HSBN_CLIENT_CLIENT_IMPL_H_
#define HSBN_CLIENT_CLIENT_IMPL_H_

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
  // How its answer is waited for, set by the transport that started it (stream.cc,
  // shm_rounds.cc): Client::Impl's WaitOnStream, WaitOnShm or WaitDeferred.
  absl::Status (Client::Impl::*wait)(PendingRound&, std::chrono::steady_clock::time_point,
                                     int64_t*, double*, double*,
                                     std::chrono::steady_clock::time_point, bool*) = nullptr;
  bool waited = false;  // a round already waited for to its end (not on the stream): outcome
  absl::Status outcome;
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

namespace client_internal {
using Key = std::tuple<uint32_t, uint64_t, int>;

enum Tag : intptr_t { kStartCall = 1, kRead, kWrite, kFinish, kWake };
inline void* TagOf(Tag t) { return reinterpret_cast<void*>(t); }

// A steady-clock deadline as absl::Time, for absl::CondVar's waits.
inline absl::Time AbslTime(std::chrono::steady_clock::time_point t) {
  return absl::Now() + absl::FromChrono(t - std::chrono::steady_clock::now());
}

inline std::chrono::system_clock::time_point ToSystem(std::chrono::steady_clock::time_point t) {
  const auto now = std::chrono::steady_clock::now();
  if (t <= now) return std::chrono::system_clock::now();
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - now);
}
}  // namespace client_internal

using client_internal::AbslTime;
using client_internal::Key;
using client_internal::kFinish;
using client_internal::kRead;
using client_internal::kStartCall;
using client_internal::kWake;
using client_internal::kWrite;
using client_internal::Tag;
using client_internal::TagOf;
using client_internal::ToSystem;

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

  absl::Status Connect();

  // Starts a round (Client::Start): checked, its scope resolved (auto), then through the
  // node's segment where the node uses shared memory, else (or for group and auto scope) on
  // the stream; sent again once on a new stream when the stream was dead before it left.
  absl::StatusOr<std::shared_ptr<PendingRound>> Start(Phase phase, uint32_t op, uint64_t seq,
                                                      Scope scope, int64_t channels,
                                                      int64_t count, const double* a,
                                                      const double* b);
  // One round as Start has it: the caller's arguments, the scope auto scope chose and the one
  // the wire carries, and the round's deadline.
  struct RoundRequest {
    Phase phase;
    uint32_t op;
    uint64_t seq;
    Scope scope;       // what the caller asked for, or what auto scope chose
    Scope wire_scope;  // what the contribution says (a renorm backward is a node round)
    int64_t channels;
    int64_t count;
    const double* a;
    const double* b;
    bool decide = false;       // auto scope's decision round: `decision` goes with it
    v1::AutoDecide decision;
    Clock::time_point deadline;
  };
  // Start's checks of its arguments (INVALID_ARGUMENT, FAILED_PRECONDITION for group scope
  // without groups, RESOURCE_EXHAUSTED for a payload larger than a message).
  absl::Status CheckRound(Phase phase, uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                          const double* a, const double* b) const;
  // The connection a round goes out on: joined again when the stream broke or the sidecar's
  // segment is gone; the sidecar's words when it stopped politely.
  absl::Status CurrentConnection(std::shared_ptr<RoundStream>* conn,
                                 std::shared_ptr<client_internal::ShmChannel>* shm,
                                 std::string* session) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<PendingRound> NewPending(const RoundRequest& r, const RoundStream& via) const;
  // The round through the node's segment: *taken = false when it takes the stream instead
  // (the node decided for the stream, or the round is wider than the segment's slots); a
  // round started before the node decided is deferred to its Wait.
  absl::StatusOr<std::shared_ptr<PendingRound>> StartOnShm(
      const RoundRequest& r, const std::shared_ptr<RoundStream>& conn,
      std::shared_ptr<client_internal::ShmChannel> shm, bool* taken) ABSL_LOCKS_EXCLUDED(mu_);
  // The round's contribution on the stream: *retry = true (with UNAVAILABLE) when the stream
  // was found dead before the contribution left, so that it may go once more on a new one.
  absl::StatusOr<std::shared_ptr<PendingRound>> SendOnStream(
      const RoundRequest& r, const std::shared_ptr<RoundStream>& conn, const std::string& session,
      bool* retry) ABSL_LOCKS_EXCLUDED(rounds_mu_);

  // A blocking round (Forward, Backward): Start and Wait, blocked time counted from the call.
  absl::Status Blocking(Phase phase, uint32_t op, uint64_t seq, Scope scope, int64_t channels,
                        int64_t count, const double* a, const double* b, int64_t* out_count,
                        double* out_a, double* out_b);

  // Wait, counted in the stats: the caller has been blocked since `blocked_since`.
  absl::Status Wait(PendingRound& p, int64_t* out_count, double* out_a, double* out_b,
                    Clock::time_point blocked_since);

  // One slice of a wait: returns at `slice_end` with *done = false if the round is still
  // open (it stays waitable), else as Wait with *done = true.
  absl::Status WaitFor(PendingRound& p, Clock::time_point slice_end, bool* done,
                       int64_t* out_count, double* out_a, double* out_b);

  // The client's abort (Client::Abort): every round in flight and every later one fails with
  // ABORTED and `reason`; the sidecar is told, so the job's other ranks fail at once too.
  void Abort(const std::string& reason);

  absl::Status Aborted() const;

  // A wait's end, counted in the stats.
  absl::Status Waited(PendingRound& p, absl::Status s, Clock::time_point blocked_since);

  // A round of connection `generation` failed because its sidecar is stopping, which its
  // caller now knows: while that is still the connection, the next call rejoins instead of
  // naming the stop again.
  void ForgetStoppedSidecar(uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits for p until its deadline (fixed by the wait's first slice), or until `slice_end`
  // when `pending` is given: then *pending = true says the round is still open.
  absl::Status WaitResult(PendingRound& p, int64_t* out_count, double* out_a, double* out_b,
                          Clock::time_point slice_end = Clock::time_point::max(),
                          bool* pending = nullptr);

  absl::Status WaitUntil(PendingRound& p, Clock::time_point deadline, int64_t* out_count,
                         double* out_a, double* out_b, Clock::time_point slice_end,
                         bool* pending);
  // WaitUntil's three ways (PendingRound::wait), by how the round travels: started before the
  // node decided its transport (decide, then start it for real), through the segment, or on
  // the stream.
  absl::Status WaitDeferred(PendingRound& p, Clock::time_point deadline, int64_t* out_count,
                            double* out_a, double* out_b, Clock::time_point slice_end,
                            bool* pending);
  absl::Status WaitOnShm(PendingRound& p, Clock::time_point deadline, int64_t* out_count,
                         double* out_a, double* out_b, Clock::time_point slice_end,
                         bool* pending);
  absl::Status WaitOnStream(PendingRound& p, Clock::time_point deadline, int64_t* out_count,
                            double* out_a, double* out_b, Clock::time_point slice_end,
                            bool* pending);

  // The node's shared-memory transport's part of the connection (shm_rounds.cc): choosing it
  // from the join's answer (false: join again without offering it), a segment whose sidecar
  // is gone, a sidecar that stopped politely, and Abort.
  bool ChooseNodeTransportLocked(const v1::JoinResponse& resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ShmGoneLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ShmStoppingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortShm(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // Abort on the stream (stream.cc): rounds in flight fail, and the Abort frame goes out.
  void AbortStream(const absl::Status& status, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mu_, rounds_mu_);

  absl::StatusOr<v1::StatusResponse> Status(bool include_upstream);

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
                           bool* done = nullptr);

  // A wait for a round's global statistics, across the slices of a sliced wait.
  struct GlobalWait {
    Clock::time_point since, deadline;
    bool waited = false;  // the result was not there at the first look
  };

  // The scope a late result's round was started with (for messages): what the result or its
  // expectation says, else renorm for a forward and lagged for a backward.
  Scope LateScopeOf(const Key& key) ABSL_LOCKS_EXCLUDED(rounds_mu_);
  absl::Status WaitGlobal(Phase phase, uint32_t op, uint64_t seq, int64_t channels,
                          int64_t* out_count, double* out_mean, double* out_m2,
                          Clock::time_point slice_end, bool* pending, GlobalWait* wait);

  absl::Status NameLayers(const std::vector<std::pair<uint32_t, std::string>>& names);
  absl::Status ReportLaggedTrip(uint32_t op, uint64_t seq, double drift, int64_t exact_calls);

  // Writes a frame that is not a round on the stream (its session set here), waiting for the
  // write slot as Start does; a write that fails shows as a broken stream at the next call.
  // A broken stream is replaced first, unless `reconnect` is false (then UNAVAILABLE).
  absl::Status SendFrame(v1::ClientFrame* frame, const char* what, bool reconnect = true);

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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

  // Handles the stream's ready events without blocking, unless another thread polls it.
  void DrainStream(const std::shared_ptr<RoundStream>& conn);

  bool GlobalStatsReady(Phase phase, uint32_t op, uint64_t seq);

  // The first slice of a wait for a late result that is not here: tells the sidecar
  // (v1::LateWanted), which may hold the round's partial until its pass ends (docs/PROTOCOL.md,
  // "Lagged scope", item 10). Nothing when the result is here or was never expected.
  void WantLate(Phase phase, uint32_t op, uint64_t seq) ABSL_LOCKS_EXCLUDED(mu_, rounds_mu_);

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

  absl::Status Broken(const std::string& round) const;

  // Removes a round from pending_ (if it is still there). rounds_mu_ held.
  void Forget(PendingRound& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

  // After the poller role was given back: wake one thread that may take it. rounds_mu_ held.
  void HandOff(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

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
  void FlushAbortFrame(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

  // A result read from conn: complete its round. rounds_mu_ held.
  void Dispatch(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

  // A renorm or lagged round's global result (or failure), pushed by the sidecar: kept for
  // GlobalStats, the oldest dropped past kLateKept results or kLateBytes. rounds_mu_ held.
  static constexpr size_t kLateKept = 4096;
  static constexpr int64_t kLateBytes = 64 << 20;
  // A renorm or lagged round this client started: its late result will be kept. At most
  // kLateKept rounds are expected at once (the oldest is forgotten).
  void ExpectLate(const Key& key, Scope scope) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);
  void KeepLate(v1::Result* r, Scope scope) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

  // conn's stream is finished: every round still in flight on it fails. rounds_mu_ held.
  void FailRounds(RoundStream& conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rounds_mu_);

  // Non-OK (reason SHUTTING_DOWN) when the sidecar invalidated its segment, or ended the
  // stream, because it is stopping.
  absl::Status StoppingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status ConnectLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ConnectLocked's steps: Join (again, naming the previous session) until the sidecar answers
  // or refuses in words; the Exchange stream started and attached (conn_); the node's
  // shared-memory channel opened (shm_), or why not.
  absl::Status JoinLocked(std::chrono::system_clock::time_point deadline,
                          v1::JoinResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AttachLocked(std::chrono::system_clock::time_point deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OpenShmLocked(const v1::JoinResponse& resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool OfferShm() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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

}  // namespace hsbn

#endif  // HSBN_CLIENT_CLIENT_IMPL_H_

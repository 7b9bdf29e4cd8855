// client/shm_channel.h — a worker's end of the shared-memory node path (round/shm_segment.h).
//
// After Join, a worker whose sidecar offered shared memory opens a ShmChannel: it connects to
// the sidecar's hand-off socket and presents its session (and token). The sidecar answers once
// every local rank of the job has done so: "shm" with the job's segment and doorbell
// descriptors, or "grpc: <why>". The connection then stays open: its end tells the worker that
// the sidecar is gone (a restart invalidates the segment).
//
// Rounds: Start posts the contribution into a free slot of this rank's ring and, if every
// local rank has posted the round, reduces it (the last arriver reduces; the sidecar is not on
// the critical path of node rounds). Wait spins briefly (adaptively), then sleeps on the slot's
// futex in short slices, checking between them that the sidecar lives, that no rank the round
// waits for is gone, and the deadline.
//
// Thread safety: all methods are thread-safe; each started round is waited for by one thread.
#ifndef HSBN_CLIENT_SHM_CHANNEL_H_
#define HSBN_CLIENT_SHM_CHANNEL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "shm_segment.h"

namespace hsbn::client_internal {

struct ShmConfig {
  std::string socket;      // JoinResponse.shm_socket: a path, or "@name"
  std::string session;     // 16 bytes
  std::string token;
  std::string job_id;
  int32_t local_rank = 0;
  int32_t local_world_size = 1;
  int32_t node_rank = 0;
  int32_t num_nodes = 1;
  bool strict_finite = false;
  std::chrono::milliseconds round_timeout{30000};  // the aggregator's
  int64_t max_channels = 0;                        // the aggregator's --max-channels
};

// One round posted into the segment.
struct ShmRound {
  shm::Key key;
  int32_t scope = 0;
  int64_t channels = 0;
  int32_t slot = -1;
  uint32_t posted = 0;
  std::chrono::steady_clock::time_point started;
};

class ShmChannel {
 public:
  using Clock = std::chrono::steady_clock;
  // Connects to the hand-off socket and presents the session. UNAVAILABLE if it cannot.
  static absl::StatusOr<std::shared_ptr<ShmChannel>> Open(ShmConfig config);
  ~ShmChannel();

  // Waits until `deadline` for the sidecar's answer. OK: decided (mapped() tells which way,
  // note() why); DEADLINE_EXCEEDED: no answer yet; other errors: the hand-off failed.
  absl::Status Await(Clock::time_point deadline);
  bool decided() const { return decided_.load(std::memory_order_acquire); }
  bool mapped() const { return segment_ != nullptr; }
  const std::string& note() const { return note_; }  // valid once decided
  int32_t max_channels() const { return segment_ ? segment_->geometry().max_channels : 0; }
  // False once the sidecar closed the hand-off connection or invalidated the segment.
  bool Alive() const;
  // Alive() for the per-round check: the segment's dead word (set by a sidecar that shuts down)
  // every time, the connection (a sidecar killed outright) at most every kAlivePoll, since a
  // poll() is most of a round's cost. A round posted meanwhile into a dead sidecar's segment
  // fails at its Wait, which checks Alive() before it sleeps.
  bool AliveRecently() const;
  // Non-OK (UNAVAILABLE, reason SHUTTING_DOWN, the sidecar's own words) once the sidecar
  // invalidated the segment because it is stopping; OK otherwise, also after other
  // invalidations (a dropped or replaced job), which the next call rejoins past.
  absl::Status Stopping() const;
  static constexpr std::chrono::milliseconds kAlivePoll{20};
  // True while the round's contribution is still posted (its caller's own timeout passed: it
  // may be waited for again).
  bool Posted(const ShmRound& round) const {
    return segment_ && segment_->State(config_.local_rank, round.slot) == round.posted;
  }
  // The mapped segment (null before the answer or on the stream): for tests that play a
  // hostile worker of the same job.
  shm::Segment* segment() const { return segment_.get(); }
  int doorbell() const { return doorbell_; }

  // Posts a round (REQUIRES: mapped(), channels <= max_channels()). Reduces it when this rank
  // is the last to post. Waits for a free slot until `deadline` when the ring is full.
  absl::StatusOr<ShmRound> Start(const shm::Key& key, int32_t scope, int64_t channels,
                                 int64_t count, const double* a, const double* b,
                                 Clock::time_point deadline);
  // Waits for the round's answer until `client_deadline` (the caller's round timeout); fails
  // with DEADLINE_EXCEEDED naming the missing ranks at the aggregator's round timeout.
  // With `pending`: returns OK at `slice_end` with *pending = true while the round is still
  // open (it stays posted; wait again).
  absl::Status Wait(const ShmRound& round, Clock::time_point client_deadline,
                    std::chrono::milliseconds client_timeout, int64_t* out_count, double* out_a,
                    double* out_b, Clock::time_point slice_end = Clock::time_point::max(),
                    bool* pending = nullptr);
  // The client aborted: waits end with `status` (their slots withdrawn), woken at once; later
  // rounds are refused by the client. The sidecar marks this rank aborted for the others.
  void Abort(const absl::Status& status);
  absl::Status AbortStatus();  // OK until Abort

 private:
  explicit ShmChannel(ShmConfig config) : config_(std::move(config)) {}
  shm::ReduceOptions Reduce() const;
  // Takes the answers of DONE slots of this rank into stash_ (frees their slots). mu_ held.
  void HarvestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Deliver(const absl::Status& s, int64_t count, const std::vector<double>& data,
                       int64_t channels, int64_t* out_count, double* out_a, double* out_b);
  // Wait's steps. TakeAnswer takes a round's answer once its slot is no longer posted (from
  // the stash or the slot): kAgain when the slot changed under it, kLost (with *status) when
  // the answer is gone. Abandon records a wait given up at the caller's own timeout.
  enum class Taken { kTaken, kAgain, kLost };
  Taken TakeAnswer(const ShmRound& round, absl::Status* status, int64_t* count,
                   std::vector<double>* data);
  absl::Status Abandon(const ShmRound& round, Clock::time_point aggregator_deadline,
                       std::chrono::milliseconds client_timeout);
  absl::Status SidecarGone(const shm::Key& key) const;
  absl::Status TimedOut(const shm::Key& key, std::chrono::milliseconds aggregator_wait) const;

  const ShmConfig config_;
  int sock_ = -1;
  int doorbell_ = -1;
  std::atomic<bool> decided_{false};
  std::string note_;
  std::unique_ptr<shm::Segment> segment_;
  // One thread awaits the sidecar's answer at a time. What it sets up (segment_, note_,
  // doorbell_, the spin bounds) is published by decided_ (release/acquire), not by this lock:
  // rounds read it only once decided() is true, and nothing writes it after that.
  absl::Mutex await_mu_;

  struct Stashed {
    uint32_t posted;
    absl::Status status;
    int64_t count = 0;
    std::vector<double> data;
  };
  absl::Mutex mu_;  // the ring's slot ownership, stash_ and abandoned_
  absl::CondVar never_;  // no one signals it: a timed wait on it is a sleep that releases mu_
  std::vector<bool> busy_ ABSL_GUARDED_BY(mu_);  // slots owned by a round not yet waited for
  std::map<uint64_t, Stashed> stash_ ABSL_GUARDED_BY(mu_);  // by RoundId(slot, posted)
  struct Abandoned {
    uint32_t posted;
    Clock::time_point deadline;  // the aggregator's: withdrawn then if still unanswered
  };
  // Slots whose caller gave up (its own timeout).
  std::map<int32_t, Abandoned> abandoned_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<int64_t> polled_at_ns_{0};  // AliveRecently: the last poll (steady ns)
  mutable std::atomic<bool> gone_{false};         // a poll found the connection closed
  std::atomic<bool> aborted_flag_{false};
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);  // set once, with aborted_flag_
  std::atomic<int64_t> spin_ns_{20000};    // adaptive spin before sleeping
  int64_t max_spin_ns_ = 50000;
};

}  // namespace hsbn::client_internal

#endif  // HSBN_CLIENT_SHM_CHANNEL_H_

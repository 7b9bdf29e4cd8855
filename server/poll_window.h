// server/poll_window.h — how long a sidecar's event thread polls for its parent's answer
// (--poll-us), learned from how long answers take.
//
// After forwarding a partial whose answer the node's ranks wait for, the event thread may poll
// its completion queue instead of sleeping, so the answer finds it awake (a thread wake-up
// fewer on the round's critical path). Polling costs CPU, so the window follows the answers:
// an exponential average (weight 1/8) of the time from a forward to the next answer, the
// window twice that, capped at --poll-us, and no poll at all while the average exceeds the
// cap (a slow link or parent: the answer would come after any window, so none is spent).
// Until the first answer the window is the cap. Times are nanoseconds of one steady clock.
//
// Thread safety: all methods are thread-safe.
#ifndef HSBN_SERVER_POLL_WINDOW_H_
#define HSBN_SERVER_POLL_WINDOW_H_

#include <algorithm>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace hsbn::server {

class PollWindow {
 public:
  // `cap_ns` > 0: the longest poll (--poll-us).
  explicit PollWindow(int64_t cap_ns) : cap_ns_(cap_ns) {}

  // A forward at `now`: the time to poll until, or 0 for no poll.
  int64_t Forwarded(int64_t now) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    last_forward_ = now;
    if (avg_ns_ < 0) return now + cap_ns_;
    if (avg_ns_ > cap_ns_) return 0;
    return now + std::min(cap_ns_, 2 * avg_ns_);
  }

  // An answer at `now`: one sample of the time since the last forward.
  void Answered(int64_t now) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (last_forward_ < 0 || now < last_forward_) return;
    const int64_t sample = now - last_forward_;
    avg_ns_ = avg_ns_ < 0 ? sample : avg_ns_ + (sample - avg_ns_) / 8;
    last_forward_ = -1;  // later answers of the same forward are not samples
  }

  // The current average (-1 before the first answer); for tests and logs.
  int64_t average_ns() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return avg_ns_;
  }

 private:
  const int64_t cap_ns_;
  absl::Mutex mu_;
  int64_t last_forward_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t avg_ns_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_POLL_WINDOW_H_

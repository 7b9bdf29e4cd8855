// server/stream_writer.h — the write side of one gRPC stream, bounded.
//
// One StreamWriter serves each member stream (results to a worker or a sidecar) and the
// sidecar's upstream link (partials to the root). Frames are queued from any thread; one write
// is in flight at a time; whatever queued while it was in flight goes out as one batch frame
// when the peer accepts batches. The writer also counts the stream's gRPC operations in flight,
// so that its owner knows when nothing of gRPC refers to it any more.
//
// Bounds: the bytes queued and not yet written are capped (--max-queued-bytes) and charged to
// the process's MemoryBudget; a Push past either bound refuses the frame, drops what is queued
// and calls Overflow() once, which must end the stream. A write in flight longer than the
// write deadline (--write-deadline-ms) makes Stalled() true; the owner's timer then ends the
// stream. A peer that does not read costs at most the cap, never the neighbours.
//
// Traits: `Item` (what is queued), `Frame` (what one write sends), `size_t Bytes(const Item&)`
// (an upper bound of its serialized size), `void SetOne(Frame*, Item&&)` (a frame of one item)
// and `void AddToBatch(Frame*, Item&&)` (one more item in the frame's batch).
//
// Thread safety: all public methods are thread-safe. The hooks (StartWriteLocked, Overflow
// Locked, IdleLocked) run with the writer's mutex held and must not block.
#ifndef HSBN_SERVER_STREAM_WRITER_H_
#define HSBN_SERVER_STREAM_WRITER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "session.h"

namespace hsbn::server {

struct WriterLimits {
  int64_t max_queued_bytes = int64_t(64) << 20;
  std::chrono::steady_clock::duration write_deadline = std::chrono::seconds(10);
  std::shared_ptr<MemoryBudget> budget;  // null: none
  size_t max_batch_bytes = 4 << 20;      // most bytes put in one batch frame
};

// Which bound refused a frame.
enum class Overflow { kQueue, kBudget };

template <typename Traits>
class StreamWriter {
 public:
  using Item = typename Traits::Item;
  using Frame = typename Traits::Frame;
  using Clock = std::chrono::steady_clock;

  explicit StreamWriter(WriterLimits limits) : limits_(std::move(limits)) {}
  virtual ~StreamWriter() {
    absl::MutexLock lock(&mu_);
    DropPendingLocked();
  }
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  // The peer reads batch frames from now on.
  void EnableBatches() { batches_.store(true, std::memory_order_relaxed); }

  // Queues `item` and starts a write if none is in flight. False when the writer is closed or
  // the item was refused for a bound (then the stream is being ended).
  bool Push(Item item) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (closed_ || !AdmitLocked(int64_t(Traits::Bytes(item)), pending_.empty())) return false;
    pending_.push_back(std::move(item));
    if (!writing_ && !held_) StartNextLocked();
    return true;
  }

  // Queues every item in order and starts one write if none is in flight: with batches, the
  // items leave together in one frame (as many as max_batch_bytes allows). False as Push (then
  // none of them is queued).
  bool PushAll(std::vector<Item> items) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    int64_t bytes = 0;
    for (const Item& item : items) bytes += int64_t(Traits::Bytes(item));
    if (closed_ || !AdmitLocked(bytes, pending_.empty() && items.size() == 1)) return false;
    for (Item& item : items) pending_.push_back(std::move(item));
    if (!writing_ && !held_ && !pending_.empty()) StartNextLocked();
    return true;
  }

  // The write started last completed; `ok` false: the stream broke (nothing more is written).
  void WriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      closed_ = true;
      DropPendingLocked();
    }
    if (!closed_ && !pending_.empty()) {
      StartNextLocked();
    } else {
      IdleLocked();
    }
  }

  // A write has been in flight for longer than the write deadline.
  bool Stalled(Clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return writing_ && now - write_started_ > limits_.write_deadline;
  }

  // Refuses every later Push and drops what is queued (not the write in flight).
  void Close() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    DropPendingLocked();
  }

  // Operation counting: AddOp when a gRPC operation of the stream starts, ReleaseOp when it
  // comes back; true when that was the last one (then the writer is closed).
  void AddOp() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ++ops_;
  }
  bool ReleaseOp() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (--ops_ > 0) return false;
    closed_ = true;
    DropPendingLocked();
    return true;
  }

  int64_t queued_bytes() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queued_bytes_;
  }

 protected:
  // Starts the gRPC write of `frame` (which stays valid until WriteDone); counts its operation
  // with ++ops(). False when it could not start (the transport is shutting down).
  virtual bool StartWriteLocked(const Frame& frame) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // A bound refused a frame (`which`: the queue's --max-queued-bytes, or the memory budget):
  // end the stream.
  virtual void OverflowLocked(Overflow which) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // No write in flight and none to start.
  virtual void IdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {}

  // While held (from construction when `held` is true), frames queue but no write starts; for
  // a client stream whose call has not started yet.
  explicit StreamWriter(WriterLimits limits, bool held) : limits_(std::move(limits)), held_(held) {}
  void UnholdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    held_ = false;
    if (!writing_ && !closed_ && !pending_.empty()) StartNextLocked();
  }

  int& ops() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ops_; }
  bool writing() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writing_; }
  bool closed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_; }
  void set_closed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    closed_ = true;
    DropPendingLocked();
  }
  const WriterLimits& limits() const { return limits_; }

  absl::Mutex mu_;

 private:
  void StartNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    current_ = Frame();
    // One item alone, or as many as fit in max_batch_bytes (at least one) when the peer
    // reads batches: whatever queued while the last write was in flight goes in one message.
    int64_t bytes = 0;
    if (pending_.size() == 1 || !batches_.load(std::memory_order_relaxed)) {
      bytes = int64_t(Traits::Bytes(pending_.front()));
      Traits::SetOne(&current_, std::move(pending_.front()));
      pending_.pop_front();
    } else {
      while (!pending_.empty()) {
        const int64_t size = int64_t(Traits::Bytes(pending_.front()));
        if (bytes > 0 && bytes + size > int64_t(limits_.max_batch_bytes)) break;
        bytes += size;
        Traits::AddToBatch(&current_, std::move(pending_.front()));
        pending_.pop_front();
      }
    }
    // The bytes leave the queue now; the frame being written is the transport's.
    queued_bytes_ -= bytes;
    if (limits_.budget) limits_.budget->Release(bytes);
    writing_ = true;
    write_started_ = Clock::now();
    if (!StartWriteLocked(current_)) {
      writing_ = false;
      closed_ = true;
      DropPendingLocked();
    }
  }

  // Queues `bytes` more, or refuses them for a bound: then the writer closes, drops what is
  // queued and reports the overflow. `alone`: they are one item with nothing else queued,
  // which may exceed the cap (a single large frame is still written).
  bool AdmitLocked(int64_t bytes, bool alone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool over_cap = queued_bytes_ + bytes > limits_.max_queued_bytes && !alone;
    if (over_cap || (limits_.budget && !limits_.budget->TryCharge(bytes))) {
      closed_ = true;
      DropPendingLocked();
      OverflowLocked(over_cap ? Overflow::kQueue : Overflow::kBudget);
      return false;
    }
    queued_bytes_ += bytes;
    return true;
  }

  void DropPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (limits_.budget) limits_.budget->Release(queued_bytes_);
    queued_bytes_ = 0;
    pending_.clear();
  }

  const WriterLimits limits_;
  std::atomic<bool> batches_{false};
  std::deque<Item> pending_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  Frame current_ ABSL_GUARDED_BY(mu_);
  int ops_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  Clock::time_point write_started_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_STREAM_WRITER_H_

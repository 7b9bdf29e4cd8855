// server/session.h — session secrets and the process-wide memory budget.
//
// A SessionId is the 128-bit secret an aggregator hands a member at Join. It is drawn from the
// operating system's cryptographic source (getrandom), travels as 16 bytes in the protocol's
// `session` fields, and is never logged or shown in Status: whoever holds it can speak for the
// member, so it is compared, hashed and copied, never printed.
//
// A MemoryBudget counts the bytes of round data, kept results and queued frames held across
// every job of the process (--memory-budget-bytes). Charges that would pass the budget are
// refused; the caller answers RESOURCE_EXHAUSTED to whoever asked for the bytes.
//
// Thread safety: SessionId is a value; MemoryBudget is thread-safe (atomics).
#ifndef HSBN_SERVER_SESSION_H_
#define HSBN_SERVER_SESSION_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace hsbn::server {

struct SessionId {
  uint64_t hi = 0, lo = 0;

  // 16 bytes from getrandom(2); never all zero. Aborts the process if the OS has no entropy
  // source (a session that could be guessed is worse than no aggregator).
  static SessionId Random();
  // False unless `bytes` holds exactly 16 bytes that are not all zero.
  static bool FromBytes(absl::string_view bytes, SessionId* out);
  std::string Bytes() const;
  bool empty() const { return hi == 0 && lo == 0; }
  bool operator==(const SessionId& o) const { return hi == o.hi && lo == o.lo; }
  bool operator!=(const SessionId& o) const { return !(*this == o); }
  template <typename H>
  friend H AbslHashValue(H h, const SessionId& s) {
    return H::combine(std::move(h), s.hi, s.lo);
  }
};

class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}
  // Adds `bytes` unless the total would pass the limit; false (nothing added) then.
  bool TryCharge(int64_t bytes) { return TryChargeWithin(bytes, limit_); }
  // The same against a lower `cap`: for memory that must leave room for more urgent uses.
  bool TryChargeWithin(int64_t bytes, int64_t cap);
  // Adds `bytes` even past the limit (memory already held that must be accounted for).
  void Charge(int64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_SESSION_H_

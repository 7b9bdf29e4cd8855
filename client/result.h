// client/result.h — what the client takes from a Result its aggregator sent.
//
// A Result is untrusted input: a buggy or hostile aggregator may set any field. Apart from
// matching a result to its pending round by (op, seq, phase) (client.cc), these functions are
// all the client does with one, so they can be tested without a stream
// (tests/fuzz/fuzz_client_results.cc).
//
// Thread safety: pure functions.
#ifndef HSBN_CLIENT_RESULT_H_
#define HSBN_CLIENT_RESULT_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "hsbn/v1/hsbn.pb.h"

namespace hsbn::client_internal {

// A round's answer, kept until its waiter takes it.
struct Answer {
  absl::Status status;
  int64_t count = 0;
  std::string data;  // [a | b]: 2 * channels doubles, when the answer is OK
  bool has_decision = false;  // Result.decision (auto scope's decision round)
  v1::AutoDecision decision;
};

// The answer `r` carries; its payload is moved out of `r`.
Answer TakeAnswer(v1::Result* r);

// Hands the answer of a `channels`-channel round to its caller: the answer's error if it
// failed; INTERNAL when its payload is not 2 * channels doubles; else OK, with the count and
// both arrays written (any output may be null).
absl::Status DeliverAnswer(const Answer& answer, int64_t channels, int64_t* out_count,
                           double* out_a, double* out_b);

// The longest wait the client computes a deadline for (about 24.8 days): time points are int64
// nanoseconds, and a larger wait from a caller or an aggregator must not overflow them.
constexpr int64_t kMaxWaitMs = 2147483647;

// How long a round waits for its answer: `configured` (ClientOptions::round_timeout) when
// positive, else `aggregator_ms` (the aggregator's round timeout from its JoinResponse,
// untrusted) + 5 s; each taken within [0, kMaxWaitMs].
std::chrono::milliseconds RoundWait(std::chrono::milliseconds configured, int64_t aggregator_ms);

}  // namespace hsbn::client_internal

#endif  // HSBN_CLIENT_RESULT_H_

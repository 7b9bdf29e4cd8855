#include "result.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "wire.h"

namespace hsbn::client_internal {

Answer TakeAnswer(v1::Result* r) {
  Answer a;
  a.status = wire::StatusFromCode(r->code(), r->message(), r->reason());
  a.count = r->count();
  a.data.swap(*r->mutable_data());
  if (r->has_decision()) {
    a.has_decision = true;
    a.decision = r->decision();
  }
  return a;
}

absl::Status DeliverAnswer(const Answer& answer, int64_t channels, int64_t* out_count,
                           double* out_a, double* out_b) {
  if (!answer.status.ok()) return answer.status;
  if (int64_t(answer.data.size()) != wire::PayloadBytes(channels)) {
    return absl::InternalError("the sidecar answered with a payload of the wrong size");
  }
  if (out_count) *out_count = answer.count;
  const size_t half = size_t(channels) * sizeof(double);
  // Straight into the caller's arrays (the inputs were copied by Start, so they may alias).
  if (out_a) std::memcpy(out_a, answer.data.data(), half);
  if (out_b) std::memcpy(out_b, answer.data.data() + half, half);
  return absl::OkStatus();
}

std::chrono::milliseconds RoundWait(std::chrono::milliseconds configured, int64_t aggregator_ms) {
  if (configured.count() > 0) {
    return std::chrono::milliseconds(std::min<int64_t>(configured.count(), kMaxWaitMs));
  }
  const int64_t aggregator = std::max<int64_t>(0, std::min(aggregator_ms, kMaxWaitMs));
  return std::chrono::milliseconds(aggregator) + std::chrono::seconds(5);
}

}  // namespace hsbn::client_internal

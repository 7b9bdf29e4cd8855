#include "wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace hsbn::wire {

static_assert(sizeof(double) == 8, "hsbn's payloads are IEEE-754 binary64");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "hsbn's wire payloads are little-endian; add byte swapping for this host"
#endif

void PackPayload(const double* a, const double* b, int64_t channels, std::string* out) {
  const size_t half = size_t(channels) * sizeof(double);
  out->resize(2 * half);
  if (half == 0) return;
  std::memcpy(out->data(), a, half);
  std::memcpy(out->data() + half, b, half);
}

void UnpackPayload(const std::string& data, int64_t channels, double* a, double* b) {
  const size_t half = size_t(channels) * sizeof(double);
  if (half == 0) return;
  std::memcpy(a, data.data(), half);
  std::memcpy(b, data.data() + half, half);
}

absl::Status StatusFromCode(int code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > 16) code = int(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

absl::Status FromGrpc(const grpc::Status& status) {
  return StatusFromCode(int(status.error_code()), status.error_message());
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

const char* PhaseName(v1::Phase phase) {
  switch (phase) {
    case v1::PHASE_FORWARD: return "forward";
    case v1::PHASE_BACKWARD: return "backward";
    default: return "unknown-phase";
  }
}

const char* ScopeName(v1::Scope scope) {
  switch (scope) {
    case v1::SCOPE_NODE: return "node";
    case v1::SCOPE_GLOBAL: return "global";
    case v1::SCOPE_SHADOW: return "shadow";
    default: return "unknown-scope";
  }
}

v1::Scope ParseScope(const std::string& name) {
  if (name == "node") return v1::SCOPE_NODE;
  if (name == "global") return v1::SCOPE_GLOBAL;
  if (name == "shadow") return v1::SCOPE_SHADOW;
  return v1::SCOPE_UNSPECIFIED;
}

std::string RoundName(uint32_t op, uint64_t seq, v1::Phase phase) {
  return absl::StrCat("op ", op, ", seq ", seq, ", ", PhaseName(phase));
}

}  // namespace hsbn::wire

#include "wire.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/cord.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
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

absl::Status StatusFromCode(int code, const std::string& message, v1::Reason reason) {
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > 16) code = int(absl::StatusCode::kUnknown);
  return WithReason(absl::Status(static_cast<absl::StatusCode>(code), message), reason);
}

absl::Status WithReason(absl::Status status, v1::Reason reason) {
  if (status.ok() || reason == v1::REASON_UNSPECIFIED || !v1::Reason_IsValid(reason)) {
    return status;
  }
  v1::ErrorDetail detail;
  detail.set_reason(reason);
  status.SetPayload(kReasonUrl, absl::Cord(detail.SerializeAsString()));
  return status;
}

v1::Reason ReasonOf(const absl::Status& status) {
  auto payload = status.GetPayload(kReasonUrl);
  v1::ErrorDetail detail;
  if (!payload || !detail.ParseFromString(std::string(*payload))) return v1::REASON_UNSPECIFIED;
  return v1::Reason_IsValid(detail.reason()) ? detail.reason() : v1::REASON_UNSPECIFIED;
}

absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  absl::Status out(status.code(), message);
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

const char* ReasonName(v1::Reason reason) {
  if (!v1::Reason_IsValid(reason) || reason == v1::REASON_UNSPECIFIED) return "UNSPECIFIED";
  // The enum's names without their "REASON_" prefix.
  return v1::Reason_Name(reason).c_str() + 7;
}

absl::Status FromGrpc(const grpc::Status& status) {
  v1::Reason reason = v1::REASON_UNSPECIFIED;
  v1::RpcStatus details;
  if (!status.error_details().empty() && details.ParseFromString(status.error_details())) {
    for (const v1::AnyDetail& any : details.details()) {
      v1::ErrorDetail detail;
      if (any.type_url() == kReasonUrl && detail.ParseFromString(any.value())) {
        reason = detail.reason();
      }
    }
  }
  return StatusFromCode(int(status.error_code()), status.error_message(), reason);
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const v1::Reason reason = ReasonOf(status);
  if (reason == v1::REASON_UNSPECIFIED) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                        std::string(status.message()));
  }
  v1::RpcStatus details;
  details.set_code(int(status.code()));
  details.set_message(std::string(status.message()));
  v1::AnyDetail* any = details.add_details();
  any->set_type_url(kReasonUrl);
  v1::ErrorDetail detail;
  detail.set_reason(reason);
  any->set_value(detail.SerializeAsString());
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()),
                      details.SerializeAsString());
}

const char* PhaseName(v1::Phase phase) {
  switch (phase) {
    case v1::PHASE_FORWARD: return "forward";
    case v1::PHASE_BACKWARD: return "backward";
    default: return "unknown-phase";
  }
}

static_assert([] {
  for (int i = 0; i < kScopeCount; ++i) {
    if (kScopes[i].api != i + 1) return false;
    if (kScopes[i].late_backward && !kScopes[i].late) return false;
  }
  return true;
}(), "kScopes: rows in API order from 1; late_backward implies late");

const ScopeEntry* ScopeByApi(int api) {
  return api >= 1 && api <= kScopeCount ? &kScopes[api - 1] : nullptr;
}

const ScopeEntry* ScopeByName(absl::string_view name) {
  for (const ScopeEntry& e : kScopes) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

std::string ScopeNames() {
  std::string out;
  for (const ScopeEntry& e : kScopes) absl::StrAppend(&out, out.empty() ? "" : ", ", e.name);
  return out;
}

const char* ScopeName(v1::Scope scope, const char* unknown) {
  if (scope == v1::SCOPE_UNSPECIFIED) return unknown;
  for (const ScopeEntry& e : kScopes) {
    if (e.scope == scope) return e.name;
  }
  return unknown;
}

v1::Scope ParseScope(const std::string& name) {
  const ScopeEntry* e = ScopeByName(name);
  return e == nullptr ? v1::SCOPE_UNSPECIFIED : e->scope;
}

std::string RoundName(uint32_t op, uint64_t seq, v1::Phase phase) {
  return absl::StrCat("op ", op, ", seq ", seq, ", ", PhaseName(phase));
}

v1::Result ErrorResult(uint32_t op, uint64_t seq, v1::Phase phase, const absl::Status& status) {
  v1::Result r;
  r.set_op(op);
  r.set_seq(seq);
  r.set_phase(phase);
  r.set_code(int(status.code()));
  r.set_message(std::string(status.message()));
  r.set_reason(ReasonOf(status));
  return r;
}

absl::Status CheckWorkerLayout(int64_t rank, int64_t world_size, int64_t local_rank,
                               int64_t local_world_size, int64_t node_rank,
                               int64_t max_world_size, int64_t group_nodes) {
  auto bad = [](const std::string& what) {
    return WithReason(absl::InvalidArgumentError(what), v1::REASON_LAYOUT);
  };
  if (world_size <= 0) return bad(absl::StrCat("WORLD_SIZE=", world_size, " must be positive"));
  if (max_world_size > 0 && world_size > max_world_size) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "WORLD_SIZE=", world_size,
                          " is more than this aggregator serves (--max-world-size=",
                          max_world_size, ")")),
                      v1::REASON_MAX_WORLD_SIZE);
  }
  if (rank < 0 || rank >= world_size) {
    return bad(absl::StrCat("RANK=", rank, " is outside [0, WORLD_SIZE=", world_size, ")"));
  }
  if (local_world_size <= 0 || world_size % local_world_size != 0) {
    return bad(absl::StrCat("LOCAL_WORLD_SIZE=", local_world_size,
                            " must be positive and divide WORLD_SIZE=", world_size,
                            " (hsbn needs the same number of workers on every node)"));
  }
  if (local_rank < 0 || local_rank >= local_world_size) {
    return bad(absl::StrCat("LOCAL_RANK=", local_rank, " is outside [0, LOCAL_WORLD_SIZE=",
                            local_world_size, ")"));
  }
  const int64_t nodes = world_size / local_world_size;
  if (node_rank < 0 || node_rank >= nodes) {
    return bad(absl::StrCat("GROUP_RANK=", node_rank, " is outside [0, ", nodes,
                            ") (WORLD_SIZE / LOCAL_WORLD_SIZE nodes)"));
  }
  if (rank != node_rank * local_world_size + local_rank) {
    return bad(absl::StrCat("RANK=", rank, " but GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK=",
                            node_rank * local_world_size + local_rank,
                            "; hsbn expects torchrun's rank layout"));
  }
  return CheckGroupNodes(group_nodes, nodes);
}

absl::Status CheckGroupNodes(int64_t group_nodes, int64_t num_nodes) {
  if (group_nodes == 0) return absl::OkStatus();
  if (group_nodes < 0 || num_nodes <= 0 || num_nodes % group_nodes != 0) {
    return WithReason(absl::InvalidArgumentError(absl::StrCat(
                          "HSBN_GROUP_NODES=", group_nodes, " does not divide the job's ",
                          num_nodes, " nodes (WORLD_SIZE / LOCAL_WORLD_SIZE); group scope needs "
                          "groups of equal size: choose a positive divisor of ", num_nodes,
                          ", or 0 for no groups")),
                      v1::REASON_GROUP_NODES);
  }
  return absl::OkStatus();
}

std::string Printable(absl::string_view text, size_t max) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(std::min(text.size(), max) + 8);
  for (size_t i = 0; i < text.size(); ++i) {
    if (i >= max) {
      out += "...";
      break;
    }
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(char(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

}  // namespace hsbn::wire

namespace hsbn::wire {

std::string AddressError(absl::string_view label, absl::string_view address, bool unix_ok,
                         int min_port) {
  const std::string given = absl::StrCat(label, "=", Printable(address, 128));
  const std::string forms = unix_ok ? "HOST:PORT or unix:/path/to.sock" : "HOST:PORT";
  if (absl::StartsWith(address, "unix:")) {
    if (!unix_ok) return absl::StrCat(given, " is a Unix socket; ", label, " takes HOST:PORT");
    const absl::string_view path = address.substr(5);
    if (path.empty()) return absl::StrCat(given, " names no socket: write unix:/path/to.sock");
    if (path.size() >= sizeof(sockaddr_un::sun_path)) {
      return absl::StrCat(given, ": a Unix socket path has at most ",
                          sizeof(sockaddr_un::sun_path) - 1, " bytes; choose a shorter one");
    }
    return "";
  }
  if (unix_ok && (address.find('/') != absl::string_view::npos || absl::EndsWith(address, ".sock"))) {
    return absl::StrCat(given, " is a path: a Unix socket is written ", label, "=unix:",
                        Printable(address, 128));
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::StrCat(given, " has no port: write ", forms, " (e.g. 0.0.0.0:7070)");
  }
  const absl::string_view host = address.substr(0, colon), port = address.substr(colon + 1);
  bool host_ok = !host.empty();
  if (host_ok && host.front() == '[') {
    host_ok = host.size() > 2 && host.back() == ']' &&
              host.find_first_not_of("0123456789abcdefABCDEF:.", 1) == host.size() - 1;
  } else if (host_ok) {
    if (host.find(':') != absl::string_view::npos) {
      return absl::StrCat(given, ": an IPv6 address goes in brackets, as in [::1]:7070");
    }
    host_ok = host.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                     "0123456789-._") == absl::string_view::npos;
  }
  if (!host_ok) {
    return absl::StrCat(given, " has no valid host before the port: write ", forms,
                        " (0.0.0.0 listens on every interface)");
  }
  int n = -1;
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(port, &n) || n < min_port || n > 65535) {
    return absl::StrCat(given, ": the port must be a number from ", min_port, " to 65535",
                        min_port == 0 ? " (0 picks a free port)" : "");
  }
  return "";
}

}  // namespace hsbn::wire

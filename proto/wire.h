// hsbn/wire.h — small helpers around the generated protocol, shared by server and client.
//
// Payload packing (statistics travel as raw little-endian doubles in `bytes` fields, which
// avoids per-element protobuf work), status conversion between gRPC and absl, and the words
// used to name rounds, phases and scopes in messages a user reads.
//
// Thread safety: pure functions.
#ifndef HSBN_WIRE_H_
#define HSBN_WIRE_H_

#include <cstdint>
#include <iterator>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "hsbn/v1/hsbn.pb.h"

namespace hsbn::wire {

// Bytes of one payload: two arrays of `channels` doubles.
inline int64_t PayloadBytes(int64_t channels) { return channels * 2 * int64_t(sizeof(double)); }

// Writes [a | b] into *out (resized). a and b hold `channels` doubles each.
void PackPayload(const double* a, const double* b, int64_t channels, std::string* out);
// Reads [a | b] from data, which must hold PayloadBytes(channels) bytes.
void UnpackPayload(const std::string& data, int64_t channels, double* a, double* b);

// A status's Reason travels as an absl payload (kReasonUrl) within a process, as the status
// details of an RPC (v1::RpcStatus) and as Result.reason in a round's answer.
absl::Status FromGrpc(const grpc::Status& status);
grpc::Status ToGrpc(const absl::Status& status);
absl::Status StatusFromCode(int code, const std::string& message,
                            v1::Reason reason = v1::REASON_UNSPECIFIED);
constexpr const char* kReasonUrl = "type.googleapis.com/hsbn.v1.ErrorDetail";
// `status` with `reason` attached (an OK status stays OK).
absl::Status WithReason(absl::Status status, v1::Reason reason);
// The reason attached to `status`, or REASON_UNSPECIFIED.
v1::Reason ReasonOf(const absl::Status& status);
// `status`'s code and payloads with another message (a wrapper that adds context).
absl::Status WithMessage(const absl::Status& status, absl::string_view message);
// "MEMBER_ABORTED" for REASON_MEMBER_ABORTED; "UNSPECIFIED" for unknown values.
const char* ReasonName(v1::Reason reason);

const char* PhaseName(v1::Phase phase);   // "forward", "backward"

// Every scope, one row each: the one table of what a scope is. Its value in the API (hsbn::Scope,
// HSBN_SCOPE_*, Python's hsbn.SCOPES), its name, the wire value its rounds carry (auto is a
// client policy: its rounds go as shadow, node, group or global, so SCOPE_UNSPECIFIED), and what
// callers branch on. ScopeName, ParseScope, the metrics' labels, the client's names and checks,
// the C ABI's hsbn_scope_* and through them Python read it. Adding a scope is a row here plus
// its behaviour.
struct ScopeEntry {
  int api;          // hsbn::Scope / HSBN_SCOPE_* (1, 2, ...: the row's index + 1)
  const char* name;
  v1::Scope scope;  // on the wire; SCOPE_UNSPECIFIED: never on the wire (auto)
  bool cross_node;  // some round of it waits on other nodes (group tier or root)
  bool round_stats; // its rounds are counted under its own name (auto's under the scope used)
  bool late;        // forward answered with the node's statistics, the job's arrive later
  bool late_backward;  // its backward rounds too (the job's sums arrive later)
};
inline constexpr ScopeEntry kScopes[] = {
    // api name      wire scope             cross  stats  late   late_backward
    {1, "node", v1::SCOPE_NODE, false, true, false, false},
    {2, "global", v1::SCOPE_GLOBAL, true, true, false, false},
    {3, "shadow", v1::SCOPE_SHADOW, true, true, false, false},
    {4, "group", v1::SCOPE_GROUP, true, true, false, false},
    {5, "auto", v1::SCOPE_UNSPECIFIED, true, false, false, false},
    {6, "renorm", v1::SCOPE_RENORM, true, true, true, false},
    {7, "lagged", v1::SCOPE_LAGGED, true, true, true, true},
};
inline constexpr int kScopeCount = int(std::size(kScopes));
// The row of API value `api`, or nullptr.
const ScopeEntry* ScopeByApi(int api);
// The row named `name` (any scope, auto too), or nullptr.
const ScopeEntry* ScopeByName(absl::string_view name);
// The names of every scope, ", "-separated, in API order (for "must be one of ..." errors).
std::string ScopeNames();
// kScopes' name of wire value `scope`, or `unknown` for a value no row carries.
const char* ScopeName(v1::Scope scope, const char* unknown = "unknown-scope");
// kScopes' wire value of `name`; SCOPE_UNSPECIFIED if unknown or not on the wire (auto).
v1::Scope ParseScope(const std::string& name);
// "op 3, seq 7, forward"
std::string RoundName(uint32_t op, uint64_t seq, v1::Phase phase);

// The one way to build a failed round's Result (the sender fills `session`).
v1::Result ErrorResult(uint32_t op, uint64_t seq, v1::Phase phase, const absl::Status& status);

// The one check of a worker's layout, as torchrun names it (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK): LOCAL_WORLD_SIZE workers on every node, ranked node by node.
// INVALID_ARGUMENT naming the variable otherwise. `max_world_size` > 0 also bounds WORLD_SIZE
// (RESOURCE_EXHAUSTED naming the aggregator's --max-world-size). `group_nodes` (K of group
// scope, HSBN_GROUP_NODES; 0: no groups) must divide the number of nodes (CheckGroupNodes).
absl::Status CheckWorkerLayout(int64_t rank, int64_t world_size, int64_t local_rank,
                               int64_t local_world_size, int64_t node_rank,
                               int64_t max_world_size = 0, int64_t group_nodes = 0);
// K nodes per group: 0 (no groups), or a positive divisor of `num_nodes`. INVALID_ARGUMENT
// naming both numbers otherwise.
absl::Status CheckGroupNodes(int64_t group_nodes, int64_t num_nodes);

// Why `address`, given as `label` (a flag like "--listen" or a variable like "HSBN_ADDRESS"),
// is not an aggregator address ("" when it is): unix:PATH (when `unix_ok`; a path that fits a
// Unix socket), or HOST:PORT with HOST a name, an IPv4 address or a bracketed IPv6 address and
// PORT a decimal number from `min_port` to 65535. gRPC would take a port above 65535 modulo
// 65536, and a path without unix: as a host name to resolve: a path is answered with the
// spelling that works. The one address check of the aggregator's flags, the client and `hsbn
// status`.
std::string AddressError(absl::string_view label, absl::string_view address, bool unix_ok,
                         int min_port);

// Untrusted text made safe for an error message or a log line: bytes outside printable ASCII
// become \xNN, and text past `max` bytes is cut with "...".
std::string Printable(absl::string_view text, size_t max = 256);

}  // namespace hsbn::wire

#endif  // HSBN_WIRE_H_

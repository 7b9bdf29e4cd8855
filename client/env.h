// client/env.h — the one table of the environment variables hsbn's client reads, and the one
// parser of them.
//
// Every variable a trainer process reads (torchrun's layout and every HSBN_* the client
// library, the C ABI or the Python package takes) has one entry here: its name, type, range or
// choices, what an unset one means, and a line of documentation. The C++ client
// (ClientOptions::FromEnv), the C ABI (hsbn_client_create, hsbn_env_get) and Python (through
// hsbn_env_get) all read variables through Resolve, so a value means the same thing everywhere
// and an invalid one is refused naming the variable. docs/ENVIRONMENT.md is generated from the
// table (`hsbn env --markdown`) and a test keeps the two equal.
//
// Thread safety: the table is immutable; a Source is immutable after construction.
#ifndef HSBN_CLIENT_ENV_H_
#define HSBN_CLIENT_ENV_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace hsbn::env {

enum class Type {
  kInt,      // a decimal integer within [min, max]
  kNumber,   // a finite decimal number >= 0
  kFlag,     // 0 or 1
  kChoice,   // one of `choices` ("a|b")
  kText,     // any non-empty text
  kAddress,  // a sidecar address: unix:PATH, unix-abstract:NAME, HOST:PORT, dns:/ipv4:/ipv6:
  kPath,     // a file
};

struct Var {
  const char* name;
  Type type;
  int64_t min = 0;               // kInt
  int64_t max = 0;               // kInt
  const char* choices = "";      // kChoice: "auto|grpc"
  const char* unset = "";        // the value an unset (or empty) variable takes, as text; ""
                                 // for none
  const char* fallback = "";     // another variable read when this one is unset ("" for none)
  bool required = false;         // unset (and no fallback) is an error
  bool python_only = false;      // read by the Python package, not by libhsbn
  const char* doc = "";          // one line: what it sets
};

// Every variable, in documentation order.
absl::Span<const Var> Table();
// The entry of `name`, or nullptr.
const Var* Find(absl::string_view name);

// An environment to read: the process's, or a given list of "NAME=VALUE" entries (a later
// entry wins; a variable not among them is unset).
class Source {
 public:
  static Source Process();
  static Source Entries(const char* const* entries);  // NULL-terminated
  // The variable's text, or nullopt when it is unset or empty.
  std::optional<std::string> Get(absl::string_view name) const;

 private:
  bool process_ = true;
  std::map<std::string, std::string, std::less<>> entries_;
};

// The value `var` has in `source`, checked against its table entry and written canonically
// (integers in decimal, flags as 0/1, numbers as the shortest round-tripping decimal): its own
// text, else its fallback variable's (HSBN_JOB_ID: TORCHELASTIC_RUN_ID unless "none";
// HSBN_TOKEN: the contents of HSBN_TOKEN_FILE; HSBN_INCARNATION: TORCHELASTIC_RESTART_COUNT),
// else the table's `unset` text ("" when there is none). INVALID_ARGUMENT naming the variable
// and its value for a value outside its type or range, or an unset required one; NOT_FOUND for
// a name not in the table.
absl::StatusOr<std::string> Resolve(const Source& source, absl::string_view name);
// Resolve, typed. REQUIRES: `name` has that type in the table.
absl::StatusOr<int64_t> Int(const Source& source, absl::string_view name);
absl::StatusOr<double> Number(const Source& source, absl::string_view name);
absl::StatusOr<bool> Flag(const Source& source, absl::string_view name);

// INVALID_ARGUMENT unless `address` is one a client can connect to: gRPC's unix-abstract:,
// dns:, ipv4: and ipv6: targets, or what wire::AddressError admits (unix:PATH, HOST:PORT with a
// port in [1, 65535]). `what` names where it came from (e.g. "HSBN_ADDRESS"). A bare path is
// answered with its unix: spelling.
absl::Status CheckAddress(absl::string_view address, absl::string_view what);

// docs/ENVIRONMENT.md: the table as Markdown.
std::string Markdown();

}  // namespace hsbn::env

#endif  // HSBN_CLIENT_ENV_H_

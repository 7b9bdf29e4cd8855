// hsbn/status.h — an operator's view of an aggregator: its Status RPC, without joining a job.
//
// QueryStatus opens its own channel to a sidecar or a root, asks for the status of one job or
// of all jobs, and closes it. It never joins, so it changes nothing at the aggregator and
// needs no RANK / WORLD_SIZE. With job tokens on, the aggregator answers only for the job whose
// token the query presents.
//
// Thread safety: the functions are reentrant; each call has its own channel.
#ifndef HSBN_STATUS_H_
#define HSBN_STATUS_H_

#include <chrono>
#include <string>

#include "absl/status/statusor.h"

namespace hsbn {

namespace v1 {
class StatusResponse;
}

struct StatusQuery {
  std::string address;            // "unix:/path.sock" or "host:port"
  std::string job_id;             // empty: every job the aggregator shows this caller
  std::string token;              // the job's token, when the aggregator has --token-file
  bool include_upstream = false;  // a sidecar also asks its root
  std::chrono::milliseconds timeout{5000};
  // TLS, for a root with --tls-cert (TCP only). tls_ca empty: plaintext. tls_cert/tls_key: a
  // client certificate for a root with --tls-client-ca. tls_name: the name the root's
  // certificate carries when it is not the host in `address`. All are PEM file paths.
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_name;
};

// The aggregator's answer. Errors: UNAVAILABLE when nothing answers at the address (the
// message names it), the aggregator's own code otherwise (UNAUTHENTICATED for a wrong token).
absl::StatusOr<v1::StatusResponse> QueryStatus(const StatusQuery& query);

// A StatusResponse as JSON text (protobuf JSON names, every field printed).
absl::StatusOr<std::string> StatusToJson(const v1::StatusResponse& status);

}  // namespace hsbn

#endif  // HSBN_STATUS_H_

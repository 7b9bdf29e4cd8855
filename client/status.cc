#include "hsbn/status.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "wire.h"

namespace hsbn {

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read the ", what, " file ", path));
  }
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const StatusQuery& q) {
  if (q.tls_ca.empty()) {
    if (!q.tls_cert.empty() || !q.tls_key.empty()) {
      return absl::InvalidArgumentError("a TLS client certificate needs the root's CA as well");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (q.address.rfind("unix:", 0) == 0) {
    return absl::InvalidArgumentError(
        "TLS is for TCP addresses; an aggregator's Unix sockets are plaintext");
  }
  if (q.tls_cert.empty() != q.tls_key.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate needs both its cert and its key");
  }
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadPem(q.tls_ca, "CA");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (!q.tls_cert.empty()) {
    auto cert = ReadPem(q.tls_cert, "client certificate");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(q.tls_key, "client key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<v1::StatusResponse> QueryStatus(const StatusQuery& query) {
  if (query.address.empty()) return absl::InvalidArgumentError("no aggregator address given");
  auto creds = Credentials(query);
  if (!creds.ok()) return creds.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (!query.tls_name.empty()) args.SetSslTargetNameOverride(query.tls_name);
  auto channel = grpc::CreateCustomChannel(query.address, *creds, args);
  auto stub = v1::Aggregator::NewStub(channel);

  v1::StatusRequest req;
  req.set_job_id(query.job_id);
  req.set_include_upstream(query.include_upstream);
  req.set_token(query.token);
  v1::StatusResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + query.timeout);
  grpc::Status s = stub->Status(&ctx, req, &resp);
  if (!s.ok()) {
    absl::Status st = wire::FromGrpc(s);
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      st = absl::DeadlineExceededError(absl::StrCat("no answer within ", query.timeout.count(),
                                                    " ms"));
    }
    return absl::Status(st.code(), absl::StrCat("Status of the aggregator at ", query.address,
                                                " failed: ", st.message(),
                                                st.code() == absl::StatusCode::kUnavailable
                                                    ? " (is an hsbn-aggregator listening there?)"
                                                    : ""));
  }
  return resp;
}

absl::StatusOr<std::string> StatusToJson(const v1::StatusResponse& status) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  auto st = google::protobuf::util::MessageToJsonString(status, &json, opts);
  if (!st.ok()) return absl::InternalError(std::string(st.message()));
  return json;
}

}  // namespace hsbn

// hsbn-aggregator: the hsbn aggregation service, in the node (sidecar) or root role.
#include <malloc.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "aggregator.h"
#include "grpcpp/grpcpp.h"
#include "log.h"

namespace {

using hsbn::server::AggregatorOptions;
using hsbn::server::Log;
using hsbn::server::LogLevel;

constexpr char kUsage[] = R"(hsbn-aggregator — the hsbn BatchNorm statistics aggregator.

One binary, two roles. A node aggregator (sidecar) runs on every node; the node's trainer
processes join it, and it reduces node-scope rounds itself. For global and shadow scope it
forwards each node partial to the root over one persistent stream. A root aggregator joins the
nodes. A job on a single node needs no root.

Usage:
  hsbn-aggregator --role=node --listen=unix:/run/hsbn/hsbn.sock [--upstream=root-host:7070]
  hsbn-aggregator --role=root --listen=0.0.0.0:7070

Flags:
  --role=node|root          Which role this process plays (required).
  --listen=ADDR[,ADDR...]   Where to listen: unix:/path/to.sock or host:port (port 0 picks a
                            free port). Default: unix:/tmp/hsbn.sock for node,
                            0.0.0.0:7070 for root.
  --upstream=ADDR           Node role: the root aggregator (host:port or unix:/path). Needed
                            for global and shadow scope in jobs that span several nodes.
  --id=NAME                 Name used in logs, errors and status. Default: role@hostname.
  --ready-file=PATH         Once listening, write the bound addresses there, one per line
                            (written atomically; lets launchers wait for readiness).
  --round-timeout-ms=N      A round that is not complete N ms after its first contribution
                            fails with DEADLINE_EXCEEDED naming the missing ranks. Default 30000.
  --max-jobs=N              Jobs served at once; more are refused with RESOURCE_EXHAUSTED.
                            Default 256.
  --max-open-rounds=N       Rounds in flight per job. Default 4096.
  --max-channels=N          Channels per round (BN layer width). Default 65536.
  --event-threads=N         Threads that run gRPC events, each with its own completion queue
                            (a stream stays on one). Default 1: fewest thread wake-ups per
                            round. More lets a root that saturates one core use several.
  --socket-mode=OCTAL       Permissions of Unix sockets created here. Default 0660.
  --log-level=LEVEL         debug, info, warn or error. Default info (or HSBN_LOG_LEVEL).

 Metrics:
  --metrics-listen=HOST:PORT  Serve Prometheus metrics at http://HOST:PORT/metrics (plain
                            HTTP; port 0 picks a free port). The --ready-file then gets a last
                            line metrics=http://HOST:PORT. Default: off.

 TLS (TCP only; Unix sockets stay plaintext, protected by --socket-mode and their directory):
  --tls-cert=FILE           PEM certificate chain this aggregator presents on its TCP
                            listeners (with --tls-key). Clients must then use TLS.
  --tls-key=FILE            PEM private key of --tls-cert.
  --tls-client-ca=FILE      Require client certificates signed by this PEM CA (mutual TLS):
                            connections without one are refused. Needs --tls-cert.
  --upstream-ca=FILE        Node role: connect to --upstream over TLS and accept only a
                            certificate signed by this PEM CA.
  --upstream-cert=FILE      Node role: PEM client certificate for the upstream, for a root with
                            --tls-client-ca (with --upstream-key; needs --upstream-ca).
  --upstream-key=FILE       PEM private key of --upstream-cert.
  --upstream-tls-name=NAME  The name the root's certificate must carry, when it differs from
                            the host in --upstream.

 Job tokens:
  --token-file=FILE         Every Join must present its job's token (clients: HSBN_TOKEN
                            or HSBN_TOKEN_FILE), else UNAUTHENTICATED. Lines `job_id token`;
                            # starts a comment; job id * gives the token of every job without
                            a line. A sidecar passes its workers' token on to the root. Read
                            at start and again on SIGHUP. Refused if others can read it or its
                            group can write it (mode & 0027).
  --allow-insecure-token-file  Accept a --token-file that others can read.

  --help                    Show this text.

Signals: SIGTERM or SIGINT fail every open round with UNAVAILABLE (clients reconnect to a
restarted aggregator), stop the server and exit with status 0. SIGHUP reads --token-file again
(on an error the old tokens stay in force).
)";

struct Flags {
  std::map<std::string, std::string> values;
};

// Flags that take no value (--name, or --name=true|false).
const char* const kBoolFlags[] = {"allow-insecure-token-file"};

bool ReadPem(const std::string& flag, const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "hsbn-aggregator: --" << flag << "=" << path << " cannot be read: "
              << std::strerror(errno) << "\n";
    return false;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  if (out->find("-----BEGIN") == std::string::npos) {
    std::cerr << "hsbn-aggregator: --" << flag << "=" << path << " is not a PEM file\n";
    return false;
  }
  return true;
}

bool ParseInt(const std::string& flag, const std::string& text, int64_t min, int64_t* out) {
  if (!absl::SimpleAtoi(text, out) || *out < min) {
    std::cerr << "hsbn-aggregator: --" << flag << "=" << text << " is not an integer >= " << min
              << "\n";
    return false;
  }
  return true;
}

// Removes a stale Unix socket file; refuses if another process is listening on it.
bool PrepareUnixSocket(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return true;
  if (!S_ISSOCK(st.st_mode)) {
    std::cerr << "hsbn-aggregator: " << path << " exists and is not a socket; remove it or "
              << "choose another --listen path\n";
    return false;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  if (live) {
    std::cerr << "hsbn-aggregator: another process is already listening on " << path << "\n";
    return false;
  }
  unlink(path.c_str());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built with mutex deadlock detection on, and gRPC's locks are Abseil
  // mutexes: every lock then updates a global lock graph. The aggregator's lock order is fixed
  // by design; do not pay for the graph on every gRPC lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Keep freed heap instead of returning it to the kernel after each burst: every round
  // allocates and frees its buffers, and a trimmed heap page-faults on the next round.
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  mallopt(M_MMAP_THRESHOLD, 16 << 20);
  static const std::vector<std::string> kKnown = {
      "role", "listen", "upstream", "id", "ready-file", "round-timeout-ms", "max-jobs",
      "event-threads",
      "max-open-rounds", "max-channels", "socket-mode", "log-level", "metrics-listen",
      "tls-cert", "tls-key", "tls-client-ca", "upstream-ca", "upstream-cert", "upstream-key",
      "upstream-tls-name", "token-file", "allow-insecure-token-file"};
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg.rfind("--", 0) != 0) {
      std::cerr << "hsbn-aggregator: unexpected argument '" << arg << "' (see --help)\n";
      return 2;
    }
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    bool is_bool = false;
    for (const char* b : kBoolFlags) is_bool = is_bool || name.substr(0, eq) == b;
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      if (is_bool && value != "true" && value != "false" && value != "1" && value != "0") {
        std::cerr << "hsbn-aggregator: --" << name << " takes no value, or true/false\n";
        return 2;
      }
    } else if (is_bool) {
      value = "true";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      std::cerr << "hsbn-aggregator: --" << name << " needs a value (see --help)\n";
      return 2;
    }
    bool known = false;
    for (const auto& k : kKnown) known = known || k == name;
    if (!known) {
      std::cerr << "hsbn-aggregator: unknown flag --" << name << " (see --help)\n";
      return 2;
    }
    flags.values[name] = value;
  }
  auto get = [&](const std::string& k, const std::string& def) {
    auto it = flags.values.find(k);
    return it == flags.values.end() ? def : it->second;
  };

  AggregatorOptions options;
  const std::string role = get("role", "");
  if (role == "node") {
    options.role = AggregatorOptions::Role::kNode;
  } else if (role == "root") {
    options.role = AggregatorOptions::Role::kRoot;
  } else {
    std::cerr << "hsbn-aggregator: --role must be node or root (see --help)\n";
    return 2;
  }
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  options.id = get("id", absl::StrCat(role, "@", host));
  options.upstream = get("upstream", "");
  if (!options.upstream.empty() && options.role == AggregatorOptions::Role::kRoot) {
    std::cerr << "hsbn-aggregator: --upstream is for the node role; a root has no parent\n";
    return 2;
  }
  int64_t v;
  if (!ParseInt("round-timeout-ms", get("round-timeout-ms", "30000"), 1, &v)) return 2;
  options.limits.round_timeout = std::chrono::milliseconds(v);
  if (!ParseInt("max-jobs", get("max-jobs", "256"), 1, &v)) return 2;
  options.max_jobs = int32_t(v);
  if (!ParseInt("max-open-rounds", get("max-open-rounds", "4096"), 1, &v)) return 2;
  options.limits.max_open_rounds = int32_t(v);
  if (!ParseInt("max-channels", get("max-channels", "65536"), 1, &v)) return 2;
  if (v > (1 << 22)) {
    std::cerr << "hsbn-aggregator: --max-channels is at most 4194304\n";
    return 2;
  }
  options.limits.max_channels = int32_t(v);
  if (!ParseInt("event-threads", get("event-threads", "1"), 1, &v)) return 2;
  if (v > 64) {
    std::cerr << "hsbn-aggregator: --event-threads is at most 64\n";
    return 2;
  }
  const int event_threads = int(v);
  const std::string mode_text = get("socket-mode", "0660");
  const long socket_mode = std::strtol(mode_text.c_str(), nullptr, 8);
  LogLevel level = LogLevel::kInfo;
  const char* env_level = std::getenv("HSBN_LOG_LEVEL");
  const std::string level_name = get("log-level", env_level ? env_level : "info");
  if (!hsbn::server::ParseLogLevel(level_name, &level)) {
    std::cerr << "hsbn-aggregator: --log-level must be debug, info, warn or error\n";
    return 2;
  }
  hsbn::server::SetLogLevel(level);
  hsbn::server::SetLogName(options.id);

  const std::string default_listen =
      options.role == AggregatorOptions::Role::kRoot ? "0.0.0.0:7070" : "unix:/tmp/hsbn.sock";
  std::vector<std::string> listen =
      absl::StrSplit(get("listen", default_listen), ',', absl::SkipEmpty());
  if (listen.empty()) {
    std::cerr << "hsbn-aggregator: --listen names no address\n";
    return 2;
  }

  // TLS on the TCP listeners.
  const std::string tls_cert = get("tls-cert", ""), tls_key = get("tls-key", "");
  const std::string tls_client_ca = get("tls-client-ca", "");
  std::shared_ptr<grpc::ServerCredentials> tcp_credentials = grpc::InsecureServerCredentials();
  if (tls_cert.empty() != tls_key.empty()) {
    std::cerr << "hsbn-aggregator: --tls-cert and --tls-key go together\n";
    return 2;
  }
  if (!tls_client_ca.empty() && tls_cert.empty()) {
    std::cerr << "hsbn-aggregator: --tls-client-ca needs --tls-cert and --tls-key (mutual TLS "
                 "is TLS plus client certificates)\n";
    return 2;
  }
  if (!tls_cert.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    if (!ReadPem("tls-cert", tls_cert, &pair.cert_chain)) return 2;
    if (!ReadPem("tls-key", tls_key, &pair.private_key)) return 2;
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    if (!tls_client_ca.empty() && !ReadPem("tls-client-ca", tls_client_ca, &ssl.pem_root_certs)) {
      return 2;
    }
    tcp_credentials = grpc::SslServerCredentials(ssl);
    bool any_tcp = false;
    for (const auto& l : listen) any_tcp = any_tcp || l.rfind("unix:", 0) != 0;
    if (!any_tcp) {
      Log(LogLevel::kWarn, "--tls-cert is set but every --listen address is a Unix socket, "
                           "which stays plaintext; TLS is not used");
    }
  }

  // TLS to the upstream.
  const std::string up_ca = get("upstream-ca", ""), up_cert = get("upstream-cert", ""),
                    up_key = get("upstream-key", ""), up_name = get("upstream-tls-name", "");
  if (!up_ca.empty() || !up_cert.empty() || !up_key.empty() || !up_name.empty()) {
    if (options.upstream.empty()) {
      std::cerr << "hsbn-aggregator: --upstream-ca, --upstream-cert, --upstream-key and "
                   "--upstream-tls-name configure the link to --upstream, which is not set\n";
      return 2;
    }
    if (up_ca.empty()) {
      std::cerr << "hsbn-aggregator: --upstream-cert, --upstream-key and --upstream-tls-name "
                   "need --upstream-ca (the CA that signed the root's certificate)\n";
      return 2;
    }
    if (up_cert.empty() != up_key.empty()) {
      std::cerr << "hsbn-aggregator: --upstream-cert and --upstream-key go together\n";
      return 2;
    }
    if (!ReadPem("upstream-ca", up_ca, &options.upstream_ca_pem)) return 2;
    if (!up_cert.empty() && (!ReadPem("upstream-cert", up_cert, &options.upstream_cert_pem) ||
                             !ReadPem("upstream-key", up_key, &options.upstream_key_pem))) {
      return 2;
    }
    options.upstream_tls_name = up_name;
  }

  // Job tokens.
  const std::string token_file = get("token-file", "");
  const std::string insecure = get("allow-insecure-token-file", "false");
  const bool allow_insecure = insecure == "true" || insecure == "1";
  if (!token_file.empty()) {
    auto store = hsbn::server::TokenStore::Load(token_file, allow_insecure);
    if (!store.ok()) {
      std::cerr << "hsbn-aggregator: " << store.status().message() << "\n";
      return 2;
    }
    options.tokens = *store;
    Log(LogLevel::kInfo, absl::StrCat("job tokens required: ", options.tokens->size(),
                                      " entr", options.tokens->size() == 1 ? "y" : "ies",
                                      " in ", token_file));
  } else if (allow_insecure) {
    std::cerr << "hsbn-aggregator: --allow-insecure-token-file without --token-file\n";
    return 2;
  }

  // Metrics.
  const std::string metrics_listen = get("metrics-listen", "");
  if (!metrics_listen.empty()) {
    options.metrics = std::make_shared<hsbn::server::Metrics>(role, !options.upstream.empty());
    hsbn::server::MetricsLimits limits;
    limits.max_jobs = options.max_jobs;
    limits.max_open_rounds = options.limits.max_open_rounds;
    limits.max_channels = options.limits.max_channels;
    limits.max_world_size = options.max_world_size;
    limits.memory_budget_bytes = options.memory_budget_bytes;
    limits.max_queued_bytes = options.max_queued_bytes;
    limits.max_unbound_bytes = options.max_unbound_bytes;
    options.metrics->SetLimits(limits);
  }

  // Signals are handled by a waiting thread (sigwait), so block them before threads start.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  hsbn::server::Aggregator service(options);
  // Stops the metrics endpoint (which reads `service`) before `service` goes, on every return.
  struct StopMetrics {
    std::shared_ptr<hsbn::server::Metrics> metrics;
    ~StopMetrics() {
      if (metrics) metrics->StopServing();
    }
  } stop_metrics{options.metrics};
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  // Sidecars ping their root every 10 s on an idle link (parent_link.cc); allow it.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  std::vector<int> ports(listen.size(), 0);
  std::vector<std::string> unix_paths;
  for (size_t i = 0; i < listen.size(); ++i) {
    if (listen[i].rfind("unix:", 0) == 0) {
      const std::string path = listen[i].substr(5);
      if (!PrepareUnixSocket(path)) return 1;
      unix_paths.push_back(path);
    }
    const bool unix_socket = listen[i].rfind("unix:", 0) == 0;
    builder.AddListeningPort(listen[i],
                             unix_socket ? grpc::InsecureServerCredentials() : tcp_credentials,
                             &ports[i]);
  }
  builder.RegisterService(service.service());
  // One completion queue per event thread: a call's events all come back on the queue it was
  // accepted on, and its thread runs them; the sidecar's link to the root uses the first.
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs;
  for (int i = 0; i < event_threads; ++i) cqs.push_back(builder.AddCompletionQueue());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::cerr << "hsbn-aggregator: could not listen on " << get("listen", default_listen)
              << " (address in use, or a directory that does not exist?)\n";
    return 1;
  }
  service.Start(std::move(cqs));
  std::vector<std::string> bound;
  for (size_t i = 0; i < listen.size(); ++i) {
    if (listen[i].rfind("unix:", 0) == 0) {
      chmod(listen[i].substr(5).c_str(), mode_t(socket_mode));
      bound.push_back(listen[i]);
    } else {
      if (ports[i] == 0) {
        std::cerr << "hsbn-aggregator: could not listen on " << listen[i] << "\n";
        return 1;
      }
      const size_t colon = listen[i].rfind(':');
      bound.push_back(absl::StrCat(listen[i].substr(0, colon), ":", ports[i]));
    }
  }
  std::string joined;
  for (const auto& b : bound) joined += (joined.empty() ? "" : ", ") + b;
  std::string metrics_line;
  if (options.metrics) {
    options.metrics->SetStateSource([&service] {
      hsbn::v1::StatusResponse status;
      service.FillStatus("", &status);
      return status;
    });
    auto served = options.metrics->Serve(metrics_listen);
    if (!served.ok()) {
      std::cerr << "hsbn-aggregator: " << served.status().message() << "\n";
      return 1;
    }
    metrics_line = absl::StrCat("metrics=http://", *served);
  }
  Log(LogLevel::kInfo,
      absl::StrCat("ready: ", role, " aggregator listening on ", joined,
                   tls_cert.empty() ? "" : (tls_client_ca.empty() ? " (TCP: TLS)"
                                                                  : " (TCP: mutual TLS)"),
                   options.upstream.empty() ? "" : ", root at " + options.upstream,
                   options.upstream_ca_pem.empty() ? "" : " (TLS)",
                   metrics_line.empty() ? "" : ", " + metrics_line));
  const std::string ready = get("ready-file", "");
  if (!ready.empty()) {
    const std::string tmp = ready + ".tmp";
    {
      std::ofstream out(tmp);
      for (const auto& b : bound) out << b << "\n";
      if (!metrics_line.empty()) out << metrics_line << "\n";
    }
    if (std::rename(tmp.c_str(), ready.c_str()) != 0) {
      std::cerr << "hsbn-aggregator: cannot write --ready-file " << ready << ": "
                << std::strerror(errno) << "\n";
      return 1;
    }
  }

  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGHUP) break;
    if (!options.tokens) {
      Log(LogLevel::kInfo, "SIGHUP: nothing to reload (no --token-file)");
      continue;
    }
    auto n = options.tokens->Reload();
    if (n.ok()) {
      Log(LogLevel::kInfo, absl::StrCat("SIGHUP: reloaded ", options.tokens->path(), ": ", *n,
                                        " entr", *n == 1 ? "y" : "ies"));
    } else {
      Log(LogLevel::kError, absl::StrCat("SIGHUP: ", n.status().message(),
                                         "; the previous tokens stay in force"));
    }
  }
  Log(LogLevel::kInfo, absl::StrCat("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                                    "; failing open rounds and stopping"));
  if (options.metrics) options.metrics->StopServing();
  service.Shutdown(sig == SIGTERM ? "SIGTERM" : "SIGINT");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  server->Wait();
  // Then the completion queue: drained on the event thread, every call state deleted.
  service.StopEvents();
  for (const auto& path : unix_paths) unlink(path.c_str());
  Log(LogLevel::kInfo, "stopped");
  return 0;
}

// hsbn-aggregator: the hsbn aggregation service, in the node (sidecar) or root role.
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
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
  --socket-mode=OCTAL       Permissions of Unix sockets created here. Default 0660.
  --log-level=LEVEL         debug, info, warn or error. Default info (or HSBN_LOG_LEVEL).
  --help                    Show this text.

Signals: SIGTERM or SIGINT fail every open round with UNAVAILABLE (clients reconnect to a
restarted aggregator), stop the server and exit with status 0.
)";

struct Flags {
  std::map<std::string, std::string> values;
};

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
  static const std::vector<std::string> kKnown = {
      "role", "listen", "upstream", "id", "ready-file", "round-timeout-ms", "max-jobs",
      "max-open-rounds", "max-channels", "socket-mode", "log-level"};
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
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
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

  // Signals are handled by a waiting thread (sigwait), so block them before threads start.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  hsbn::server::Aggregator service(options);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  std::vector<int> ports(listen.size(), 0);
  std::vector<std::string> unix_paths;
  for (size_t i = 0; i < listen.size(); ++i) {
    if (listen[i].rfind("unix:", 0) == 0) {
      const std::string path = listen[i].substr(5);
      if (!PrepareUnixSocket(path)) return 1;
      unix_paths.push_back(path);
    }
    builder.AddListeningPort(listen[i], grpc::InsecureServerCredentials(), &ports[i]);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::cerr << "hsbn-aggregator: could not listen on " << get("listen", default_listen)
              << " (address in use, or a directory that does not exist?)\n";
    return 1;
  }
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
  Log(LogLevel::kInfo, absl::StrCat("ready: ", role, " aggregator listening on ", joined,
                                    options.upstream.empty() ? "" : ", root at " + options.upstream));
  const std::string ready = get("ready-file", "");
  if (!ready.empty()) {
    const std::string tmp = ready + ".tmp";
    {
      std::ofstream out(tmp);
      for (const auto& b : bound) out << b << "\n";
    }
    if (std::rename(tmp.c_str(), ready.c_str()) != 0) {
      std::cerr << "hsbn-aggregator: cannot write --ready-file " << ready << ": "
                << std::strerror(errno) << "\n";
      return 1;
    }
  }

  int sig = 0;
  sigwait(&signals, &sig);
  Log(LogLevel::kInfo, absl::StrCat("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                                    "; failing open rounds and stopping"));
  service.Shutdown(sig == SIGTERM ? "SIGTERM" : "SIGINT");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  server->Wait();
  for (const auto& path : unix_paths) unlink(path.c_str());
  Log(LogLevel::kInfo, "stopped");
  return 0;
}

// hsbn-aggregator: the hsbn aggregation service, in the node (sidecar) or root role.
#include <malloc.h>
#include <netdb.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "aggregator.h"
#include "grpc/support/log.h"
#include "grpcpp/grpcpp.h"
#include "log.h"
#include "wire.h"
#include "version.h"

namespace {

using hsbn::server::AggregatorOptions;
using hsbn::server::Log;
using hsbn::server::LogLevel;

// --help: kIntro, then every flag of the table below by group, then kSignals.
constexpr char kIntro[] = R"(hsbn-aggregator — the hsbn BatchNorm statistics aggregator.

One binary, three roles. A node aggregator (sidecar) runs on every node; the node's trainer
processes join it, and it reduces node-scope rounds itself. For global, shadow and renorm
scope it forwards each node partial to its parent over one persistent stream. A root
aggregator joins the nodes. A job on a single node needs no root. Optionally a group
aggregator between the sidecars and the root serves each group of HSBN_GROUP_NODES
consecutive nodes (a rack): group rounds complete there, and it forwards one merged partial
per group to the root (docs/DEPLOY.md, "Group tier").

Usage:
  hsbn-aggregator --role=node --listen=unix:/run/hsbn/hsbn.sock [--upstream=PARENT:7070]
  hsbn-aggregator --role=group --listen=0.0.0.0:7071 --upstream=root-host:7070
  hsbn-aggregator --role=root --listen=0.0.0.0:7070
)";

constexpr char kSignals[] = R"(Signals: SIGTERM or SIGINT stop admitting Joins and new rounds, then fail every open round
with UNAVAILABLE (the step in flight is lost: restart the job; its workers join a restarted
aggregator), stop the server and exit with status 0. SIGHUP reads --token-file again (on an
error the old tokens stay in force).
)";

constexpr char kFlagsGroup[] = "Flags";
constexpr size_t kHelpWidth = 96;   // longest help line
constexpr size_t kHelpColumn = 28;  // where flag descriptions start

// Words of `text` in lines: the first at most `first` wide, the others at most `rest`.
std::vector<std::string> Wrap(const std::string& text, size_t first, size_t rest) {
  std::vector<std::string> lines(1);
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    const size_t width = lines.size() == 1 ? first : rest;
    if (!lines.back().empty() && lines.back().size() + 1 + word.size() > width) {
      lines.emplace_back();
    }
    if (!lines.back().empty()) lines.back() += ' ';
    lines.back() += std::string(word);
  }
  return lines;
}

// Writes --help in the layout the README and deploy/ quote: "  --name=VALUE  description",
// descriptions wrapped at column 28, "Default X." from the flag's default; groups in the order
// of their first flag, the first headed "Flags:", the others " Group:".
class HelpFormatter final : public CLI::Formatter {
 public:
  std::string make_help(const CLI::App* app, std::string, CLI::AppFormatMode) const override {
    std::ostringstream out;
    out << app->get_description() << "\n";
    std::vector<std::string> groups;
    for (const CLI::Option* opt : app->get_options()) {
      if (std::find(groups.begin(), groups.end(), opt->get_group()) == groups.end()) {
        groups.push_back(opt->get_group());
      }
    }
    for (const std::string& group : groups) {
      out << (group == kFlagsGroup ? "Flags:\n" : absl::StrCat("\n ", group, ":\n"));
      for (const CLI::Option* opt : app->get_options()) {
        if (opt->get_group() == group) out << Line(opt);
      }
    }
    out << "\n" << app->get_footer();
    return out.str();
  }

 private:
  static std::string Line(const CLI::Option* opt) {
    std::string left = "  --" + opt->get_single_name();
    if (!opt->get_type_name().empty()) left += "=" + opt->get_type_name();
    std::string desc = opt->get_description();
    if (!opt->get_default_str().empty()) desc += " Default " + opt->get_default_str() + ".";
    const size_t indent = std::max(kHelpColumn, left.size() + 2);
    std::vector<std::string> lines =
        Wrap(desc, kHelpWidth - indent, kHelpWidth - kHelpColumn);
    std::string out = left + std::string(indent - left.size(), ' ') + lines[0] + "\n";
    for (size_t i = 1; i < lines.size(); ++i) {
      out += std::string(kHelpColumn, ' ') + lines[i] + "\n";
    }
    return out;
  }
};

// " (1 GiB)" for a whole number of KiB, MiB or GiB; "" otherwise.
std::string Binary(int64_t bytes) {
  static const char* kUnits[] = {"GiB", "MiB", "KiB"};
  for (int i = 0; i < 3; ++i) {
    const int64_t unit = int64_t(1) << (30 - 10 * i);
    if (bytes >= unit && bytes % unit == 0) return absl::StrCat(" (", bytes / unit, " ", kUnits[i], ")");
  }
  return "";
}

// Flags to add to one CLI::App: each sets a field (or a local) when given; the value the
// target holds before parsing is the default --help states. A value out of range is refused
// with a message that names the flag and the range.
class FlagTable {
 public:
  explicit FlagTable(CLI::App* app) : app_(app) {}
  void group(std::string name) { group_ = std::move(name); }

  // --name=VALUE, any text.
  void Text(const std::string& name, const std::string& value, std::string* out,
            const std::string& help) {
    app_->add_option("--" + name, *out, help)->type_name(value)->group(group_);
  }
  // --name=a|b|c: one of `choices`.
  // `value`: its name in --help; empty: the choices, a|b|c.
  void Choice(const std::string& name, const std::string& value,
              const std::vector<std::string>& choices, std::string* out, const std::string& help) {
    const std::string flag = "--" + name;
    app_->add_option_function<std::string>(
            flag,
            [flag, choices, out](const std::string& v) {
              if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
                throw CLI::ValidationError(
                    flag, absl::StrCat("'", hsbn::server::LogSafe(v, 64), "' is not one of ",
                                       absl::StrJoin(choices, ", ")));
              }
              *out = v;
            },
            help)
        ->type_name(value.empty() ? absl::StrJoin(choices, "|") : value)
        ->group(group_);
  }
  // --name=N: a decimal integer in [min, max], passed to `set`; `def` is the default.
  void Int(const std::string& name, int64_t def, int64_t min, int64_t max,
           std::function<void(int64_t)> set, const std::string& help) {
    const std::string flag = "--" + name;
    std::string def_text = std::to_string(def);
    if (absl::EndsWith(name, "bytes")) def_text += Binary(def);
    app_->add_option_function<std::string>(
            flag,
            [flag, min, max, set](const std::string& v) {
              int64_t n;
              if (!absl::SimpleAtoi(v, &n) || n < min || n > max) {
                throw CLI::ValidationError(
                    flag, absl::StrCat("'", hsbn::server::LogSafe(v, 64),
                                       "' is not a decimal integer from ", min, " to ", max));
              }
              set(n);
            },
            help)
        ->type_name("N")
        ->default_str(def_text)
        ->group(group_);
  }
  template <typename T>
  void Int(const std::string& name, T* out, int64_t min, int64_t max, const std::string& help) {
    Int(name, int64_t(*out), min, max, [out](int64_t n) { *out = T(n); }, help);
  }
  void Millis(const std::string& name, std::chrono::milliseconds* out, int64_t max,
              const std::string& help) {
    Int(name, int64_t(out->count()), 1, max,
        [out](int64_t n) { *out = std::chrono::milliseconds(n); }, help);
  }
  // --name=OCTAL: permission bits, 0 to 0777, octal digits only.
  void Mode(const std::string& name, mode_t* out, const std::string& help) {
    const std::string flag = "--" + name;
    char def[8];
    std::snprintf(def, sizeof def, "%04o", unsigned(*out));
    app_->add_option_function<std::string>(
            flag,
            [flag, out](const std::string& v) {
              const bool octal = !v.empty() && v.size() <= 4 &&
                                 v.find_first_not_of("01234567") == std::string::npos;
              const unsigned long mode = octal ? std::strtoul(v.c_str(), nullptr, 8) : 01000;
              if (mode > 0777) {
                throw CLI::ValidationError(
                    flag, absl::StrCat("'", hsbn::server::LogSafe(v, 64),
                                       "' is not an octal permission mode from 0 to 0777 "
                                       "(e.g. 0660)"));
              }
              *out = mode_t(mode);
            },
            help)
        ->type_name("OCTAL")
        ->default_str(def)
        ->group(group_);
  }
  // --name, or --name=true|false.
  void Bool(const std::string& name, bool* out, const std::string& help) {
    app_->add_flag("--" + name, *out, help)->group(group_);
  }

 private:
  CLI::App* app_;
  std::string group_ = kFlagsGroup;
};

// Everything the flags set besides AggregatorOptions.
struct Settings {
  std::string role, listen, ready_file, log_level = "info", metrics_listen;
  std::string tls_cert, tls_key, tls_client_ca;
  std::string upstream_ca, upstream_cert, upstream_key;
  std::string token_file;
  bool allow_insecure_token_file = false;
  int event_threads = 1;
  mode_t socket_mode = 0660;
  std::string shm = "on";
  int64_t metrics_max_jobs = int64_t(hsbn::server::Metrics::kDefaultMaxJobLabels);
  int log_lines_per_second = hsbn::server::kDefaultLogLinesPerSecond;
};

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// The table of flags: one place for names, defaults, ranges and --help.
void AddFlags(FlagTable& f, Settings* s, AggregatorOptions* o) {
  f.Choice("role", "", {"node", "group", "root"}, &s->role,
           "Which role this process plays (required).");
  f.Text("listen", "ADDR[,ADDR...]", &s->listen,
         "Where to listen: unix:/path/to.sock or host:port (port 0 picks a free port). "
         "Default: unix:/tmp/hsbn.sock for node, 0.0.0.0:7070 for root and group.");
  f.Text("upstream", "ADDR", &o->upstream,
         "Node role: the parent aggregator, the root or the node's group aggregator "
         "(host:port or unix:/path); needed for group, global, shadow and renorm scope in "
         "jobs that span several nodes. Group role (required): the root.");
  f.Text("id", "NAME", &o->id, "Name used in logs, errors and status. Default: role@hostname.");
  f.Text("ready-file", "PATH", &s->ready_file,
         "Once listening, write the bound addresses there, one per line (written atomically; "
         "lets launchers wait for readiness).");
  f.Millis("round-timeout-ms", &o->limits.round_timeout, kInt32Max,
           "A round that is not complete N ms after its first contribution fails with "
           "DEADLINE_EXCEEDED naming the missing ranks.");
  f.Int("event-threads", &s->event_threads, 1, 64,
        "Threads that run gRPC events, each with its own completion queue (a stream stays on "
        "one). 1: fewest thread wake-ups per round. More lets a root that saturates one core "
        "use several. At most 64.");
  f.Int("poll-us", &o->poll_us, 0, 100000,
        "Node and group roles: after forwarding a global or group partial, the first event "
        "thread polls for the parent's answer instead of sleeping, yielding the core between "
        "looks, for twice the time answers have been taking, at most N microseconds, and not "
        "at all while they take longer: a thread wake-up fewer per round for up to N us of CPU. "
        "Default 0: sleep (docs/DEPLOY.md, Latency).");
  f.Int("lagged-hold-ms", int64_t(o->lagged_hold.count()), 0, 60000,
        [o](int64_t n) { o->lagged_hold = std::chrono::milliseconds(n); },
        "Node role: a job's lagged partials wait for the end of their pass (when "
        "it has had every layer of the previous pass, or a frame of another kind or phase "
        "comes) and go to the parent together, at most N ms after the first: one "
        "message and wake-up per pass on each hop instead of one per layer. 0: each leaves at "
        "once (docs/PROTOCOL.md, Lagged scope).");
  f.Mode("socket-mode", &s->socket_mode,
         "Permissions of Unix sockets created here, octal, at most 0777. The socket has them "
         "from the moment it exists. With tokens off they are the trust boundary.");
  f.Choice("log-level", "LEVEL", {"debug", "info", "warn", "error"}, &s->log_level,
           "debug, info, warn or error. Default info (or HSBN_LOG_LEVEL).");

  f.group("Limits (exceeding one answers the offender only; docs/DEPLOY.md, Limits)");
  f.Int("max-jobs", &o->max_jobs, 1, kInt32Max,
        "Jobs served at once; more are refused with RESOURCE_EXHAUSTED.");
  f.Int("max-open-rounds", &o->limits.max_open_rounds, 1, kInt32Max, "Rounds in flight per job.");
  f.Int("max-channels", &o->limits.max_channels, 1, 1 << 22,
        "Channels per round (BN layer width). At most 4194304.");
  f.Int("max-world-size", &o->max_world_size, 1, kInt32Max,
        "Largest WORLD_SIZE (and LOCAL_WORLD_SIZE) a Join may declare.");
  f.Int("memory-budget-bytes", &o->memory_budget_bytes, 1, kInt64Max,
        "Round data of all jobs together; a round that would exceed it is refused.");
  f.Int("max-queued-bytes", &o->max_queued_bytes, 1, kInt64Max,
        "Bytes queued for one stream and not yet sent; a reader slower than that is dropped.");
  f.Millis("write-deadline-ms", &o->write_deadline, kInt32Max,
           "Longest wait for one write to a stream; a reader that does not take it is dropped.");
  f.Millis("attach-timeout-ms", &o->attach_timeout, kInt32Max,
           "A job whose members joined but never opened their stream is dropped after N ms.");
  f.Int("max-unbound-bytes", &o->max_unbound_bytes, 1, kInt64Max,
        "Bytes a stream may send before it attaches to a session; more closes it.");
  f.Int("log-lines-per-second", &s->log_lines_per_second, 1, 1000000,
        "Log lines per second about invalid input and failed rounds, per kind; the rest are "
        "counted and reported as suppressed.");

  f.Text("divergence-dir", "DIR", &o->divergence_dir,
         "Root and group roles: when a job ends, write its shadow-mode divergence record (per "
         "layer op, with the layer's name when the workers gave it, and node, and per group for "
         "a job with groups) to DIR/JOB.divergence.json, so it outlives the job. Above group "
         "aggregators the root records per group and each group aggregator per node. Default: "
         "off.");

  f.group("Shared-memory node path (node role; docs/PROTOCOL.md)");
  f.Choice("shm", "", {"on", "off"}, &s->shm,
           "on: a job's node rounds travel through a per-job shared-memory segment when every "
           "local rank offers it (the trainers fetch it on the socket --listen's path + \".shm\", "
           "or an abstract socket for a TCP --listen); off: always the gRPC stream. Default on.");
  f.Int("shm-max-channels", &o->shm_max_channels, 1, 1 << 20,
        "Largest round (BN channels) that travels through shared memory; larger rounds use the "
        "gRPC stream. Sets the segment size: at 8 local ranks and the default ring, 8192 "
        "channels make a 21 MiB segment.");
  f.Int("shm-ring", &o->shm_ring, 1, 256,
        "Rounds in flight per worker in the segment; a worker with more waits for a slot.");
  f.Millis("shm-wait-ms", &o->shm_wait, kInt32Max,
           "How long the sidecar waits for every local rank of a job to fetch the segment before "
           "the node falls back to the gRPC stream.");

  f.group("Metrics");
  f.Text("metrics-listen", "HOST:PORT", &s->metrics_listen,
         "Serve Prometheus metrics at http://HOST:PORT/metrics (plain HTTP; port 0 picks a "
         "free port). The --ready-file then gets a last line metrics=http://HOST:PORT. "
         "Default: off.");
  f.Int("metrics-max-jobs", &s->metrics_max_jobs, 1, 1 << 20,
        "Jobs with a job_id label of their own at a time; the others count as job_id=_other.");

  f.group("TLS (TCP only; Unix sockets stay plaintext, protected by --socket-mode and their "
          "directory)");
  f.Text("tls-cert", "FILE", &s->tls_cert,
         "PEM certificate chain this aggregator presents on its TCP listeners (with "
         "--tls-key). Clients must then use TLS.");
  f.Text("tls-key", "FILE", &s->tls_key, "PEM private key of --tls-cert.");
  f.Text("tls-client-ca", "FILE", &s->tls_client_ca,
         "Require client certificates signed by this PEM CA (mutual TLS): connections without "
         "one are refused. Needs --tls-cert.");
  f.Text("upstream-ca", "FILE", &s->upstream_ca,
         "Node and group roles: connect to --upstream over TLS and accept only a certificate signed by "
         "this PEM CA.");
  f.Text("upstream-cert", "FILE", &s->upstream_cert,
         "Node and group roles: PEM client certificate for the upstream, for a parent with "
         "--tls-client-ca "
         "(with --upstream-key; needs --upstream-ca).");
  f.Text("upstream-key", "FILE", &s->upstream_key, "PEM private key of --upstream-cert.");
  f.Text("upstream-tls-name", "NAME", &o->upstream_tls_name,
         "The name the parent's certificate must carry, when it differs from the host in "
         "--upstream.");

  f.group("Job tokens");
  f.Text("token-file", "FILE", &s->token_file,
         "Every Join must present its job's token (clients: HSBN_TOKEN or HSBN_TOKEN_FILE), "
         "else UNAUTHENTICATED. Lines `job_id token`; # starts a comment; job id * gives the "
         "token of every job without a line. A sidecar passes its workers' token on to the "
         "root. Read at start and again on SIGHUP. Refused if others can read it or its group "
         "can write it (mode & 0027).");
  f.Bool("allow-insecure-token-file", &s->allow_insecure_token_file,
         "Accept a --token-file that others can read.");
}

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

std::string AddressError(const std::string& flag, const std::string& address, bool unix_ok,
                         int min_port) {
  return hsbn::wire::AddressError(absl::StrCat("--", flag), address, unix_ok, min_port);
}

// Whether a TCP `address` (HOST:PORT, already checked) is held by a listening socket now: a
// bind without SO_REUSEPORT, as gRPC's with GRPC_ARG_ALLOW_REUSEPORT=0, fails EADDRINUSE.
bool TcpAddressInUse(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), address.c_str() + colon + 1, &hints, &found) != 0) return false;
  bool in_use = false;
  for (addrinfo* a = found; a != nullptr && !in_use; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    in_use = bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE;
    close(fd);
  }
  freeaddrinfo(found);
  return in_use;
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

// Every member stream holds a connection, one fd at this end: a root of N nodes (or a group
// aggregator of K) needs N + ~20 fds, and the soft limit is often 1024. Raises the soft limit
// to the hard one (the administrator's ceiling) and returns it.
static rlim_t RaiseOpenFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur;
}

namespace {

using hsbn::server::Aggregator;

// main's steps. Each prints what is wrong (naming the flag and the fix) and returns false, or
// an exit status; main then exits with status 2 for a command-line error, 1 for one of serving.

// Signals are handled by sigwait at the end of main. Blocked first, before anything (gRPC
// credentials, the server) can start a thread, so that every thread inherits the mask: a
// SIGTERM during start-up then waits for sigwait instead of killing the process.
sigset_t BlockSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return signals;
}

void TuneProcess() {
  // Debian's Abseil is built with mutex deadlock detection on, and gRPC's locks are Abseil
  // mutexes: every lock then updates a global lock graph. The aggregator's lock order is fixed
  // by design; do not pay for the graph on every gRPC lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Keep freed heap instead of returning it to the kernel after each burst: every round
  // allocates and frees its buffers, and a trimmed heap page-faults on the next round.
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  mallopt(M_MMAP_THRESHOLD, 16 << 20);
}

// Parses the command line into `settings` and `options`: -1 to go on, else the exit status
// (--help and --version: 0; a bad flag: 2).
int ParseFlags(CLI::App& app, int argc, char** argv, Settings* settings,
               AggregatorOptions* options) {
  if (const char* env_level = std::getenv("HSBN_LOG_LEVEL")) settings->log_level = env_level;
  app.description(kIntro);
  app.footer(kSignals);
  app.formatter(std::make_shared<HelpFormatter>());
  // Like the parser this replaced: a flag given twice takes its last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag();
  FlagTable table(&app);
  AddFlags(table, settings, options);
  app.set_help_flag("--help,-h", "Show this text.")->group(kFlagsGroup);
  const std::string version =
      absl::StrCat("hsbn-aggregator ", hsbn::server::kHsbnVersion, " (commit ",
                   hsbn::server::kHsbnGitCommit, ")");
  app.set_version_flag("--version", version, "Print the version and the git commit, and exit.")
      ->group(kFlagsGroup);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "hsbn-aggregator: " << e.what() << " (see --help)\n";
    return 2;
  }
  return -1;
}

// --role, --id, and the flags that belong to another role.
bool ResolveRole(const CLI::App& app, const Settings& settings, AggregatorOptions* options) {
  const std::string& role = settings.role;
  if (role == "node") {
    options->role = AggregatorOptions::Role::kNode;
  } else if (role == "group") {
    options->role = AggregatorOptions::Role::kGroup;
  } else if (role == "root") {
    options->role = AggregatorOptions::Role::kRoot;
  } else {
    std::cerr << "hsbn-aggregator: --role must be node, group or root (see --help)\n";
    return false;
  }
  if (options->role == AggregatorOptions::Role::kGroup && options->upstream.empty()) {
    std::cerr << "hsbn-aggregator: --role=group needs --upstream=<root address>: a group "
                 "aggregator forwards its groups' global rounds to the root\n";
    return false;
  }
  if (app.count("--id") == 0) {
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    options->id = absl::StrCat(role, "@", host);
  }
  // A flag of the other role would do nothing: say so instead of ignoring it.
  struct RoleFlag {
    const char* flag;
    const char* roles;  // the roles it is for, as --help says them
    const char* why;
  };
  const RoleFlag kRoleFlags[] = {
      {"--upstream", "node or group", "a root has no parent"},
      {"--upstream-ca", "node or group", "a root has no parent"},
      {"--upstream-cert", "node or group", "a root has no parent"},
      {"--upstream-key", "node or group", "a root has no parent"},
      {"--upstream-tls-name", "node or group", "a root has no parent"},
      {"--shm", "node", "shared memory serves the trainers of one node"},
      {"--shm-max-channels", "node", "shared memory serves the trainers of one node"},
      {"--shm-ring", "node", "shared memory serves the trainers of one node"},
      {"--shm-wait-ms", "node", "shared memory serves the trainers of one node"},
      {"--divergence-dir", "root or group",
       "shadow divergence is computed above the sidecars; give it to the root's (and the group "
       "aggregators') command line"},
  };
  for (const RoleFlag& f : kRoleFlags) {
    if (app.count(f.flag) == 0 || absl::StrContains(f.roles, role)) continue;
    std::cerr << "hsbn-aggregator: " << f.flag << " is for --role=" << f.roles << " only ("
              << f.why << "); remove it from this --role=" << role << " command line\n";
    return false;
  }
  if (!options->upstream.empty()) {
    if (std::string e = AddressError("upstream", options->upstream, true, 1); !e.empty()) {
      std::cerr << "hsbn-aggregator: " << e << "\n";
      return false;
    }
  }
  return true;
}

bool SetUpLogging(const Settings& settings, const AggregatorOptions& options) {
  LogLevel level = LogLevel::kInfo;
  if (!hsbn::server::ParseLogLevel(settings.log_level, &level)) {
    std::cerr << "hsbn-aggregator: HSBN_LOG_LEVEL must be debug, info, warn or error\n";
    return false;
  }
  hsbn::server::SetLogLevel(level);
  hsbn::server::SetLogName(options.id);
  // gRPC's own lines (a failed bind prints ~600 characters before our error that names the
  // fix) go through our log at debug level, unless the user asked gRPC for them directly.
  if (std::getenv("GRPC_VERBOSITY") == nullptr && std::getenv("GRPC_TRACE") == nullptr) {
    gpr_set_log_function([](gpr_log_func_args* a) {
      hsbn::server::Log(LogLevel::kDebug, absl::StrCat("grpc: ", a->message, " (", a->file, ":",
                                                       a->line, ")"));
    });
  }
  hsbn::server::SetLogRateLimit(settings.log_lines_per_second);
  return true;
}

// --listen (the role's default when not given) and --metrics-listen checked; the shared-memory
// hand-off socket named: next to the first Unix socket (same directory, same mode), or an
// abstract one (named at random) when the sidecar listens on TCP only.
bool ResolveAddresses(const CLI::App& app, const Settings& settings, AggregatorOptions* options,
                      std::vector<std::string>* listen) {
  options->socket_mode = settings.socket_mode;
  options->shm = settings.shm == "on";
  const std::string default_listen =
      options->role == AggregatorOptions::Role::kNode ? "unix:/tmp/hsbn.sock" : "0.0.0.0:7070";
  const std::string listen_flag = app.count("--listen") == 0 ? default_listen : settings.listen;
  *listen = absl::StrSplit(listen_flag, ',', absl::SkipEmpty());
  if (listen->empty()) {
    std::cerr << "hsbn-aggregator: --listen names no address\n";
    return false;
  }
  for (const auto& l : *listen) {
    if (std::string e = AddressError("listen", l, true, 0); !e.empty()) {
      std::cerr << "hsbn-aggregator: " << e << "\n";
      return false;
    }
  }
  if (!settings.metrics_listen.empty()) {
    if (std::string e = AddressError("metrics-listen", settings.metrics_listen, false, 0);
        !e.empty()) {
      std::cerr << "hsbn-aggregator: " << e << "\n";
      return false;
    }
  }
  for (const auto& l : *listen) {
    if (l.rfind("unix:", 0) == 0) {
      options->shm_socket = l.substr(5) + ".shm";
      break;
    }
  }
  if (options->shm_socket.empty()) {
    const hsbn::server::SessionId r = hsbn::server::SessionId::Random();
    options->shm_socket = absl::StrCat("@hsbn-shm-", getpid(), "-", absl::Hex(r.hi));
  }
  return true;
}

// TLS on the TCP listeners (--tls-cert, --tls-key, --tls-client-ca).
bool ServerCredentials(const Settings& settings, const std::vector<std::string>& listen,
                       std::shared_ptr<grpc::ServerCredentials>* credentials) {
  const std::string& tls_cert = settings.tls_cert;
  const std::string& tls_key = settings.tls_key;
  const std::string& tls_client_ca = settings.tls_client_ca;
  *credentials = grpc::InsecureServerCredentials();
  if (tls_cert.empty() != tls_key.empty()) {
    std::cerr << "hsbn-aggregator: --tls-cert and --tls-key go together\n";
    return false;
  }
  if (!tls_client_ca.empty() && tls_cert.empty()) {
    std::cerr << "hsbn-aggregator: --tls-client-ca needs --tls-cert and --tls-key (mutual TLS "
                 "is TLS plus client certificates)\n";
    return false;
  }
  if (tls_cert.empty()) return true;
  grpc::SslServerCredentialsOptions ssl(
      tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  if (!ReadPem("tls-cert", tls_cert, &pair.cert_chain)) return false;
  if (!ReadPem("tls-key", tls_key, &pair.private_key)) return false;
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls_client_ca.empty() && !ReadPem("tls-client-ca", tls_client_ca, &ssl.pem_root_certs)) {
    return false;
  }
  *credentials = grpc::SslServerCredentials(ssl);
  bool any_tcp = false;
  for (const auto& l : listen) any_tcp = any_tcp || l.rfind("unix:", 0) != 0;
  if (!any_tcp) {
    Log(LogLevel::kWarn, "--tls-cert is set but every --listen address is a Unix socket, "
                         "which stays plaintext; TLS is not used");
  }
  return true;
}

// TLS to the upstream (--upstream-ca, --upstream-cert, --upstream-key, --upstream-tls-name).
bool UpstreamCredentials(const Settings& settings, AggregatorOptions* options) {
  const std::string& up_ca = settings.upstream_ca;
  const std::string& up_cert = settings.upstream_cert;
  const std::string& up_key = settings.upstream_key;
  const std::string& up_name = options->upstream_tls_name;
  if (up_ca.empty() && up_cert.empty() && up_key.empty() && up_name.empty()) return true;
  if (options->upstream.empty()) {
    std::cerr << "hsbn-aggregator: --upstream-ca, --upstream-cert, --upstream-key and "
                 "--upstream-tls-name configure the link to --upstream, which is not set\n";
    return false;
  }
  if (up_ca.empty()) {
    std::cerr << "hsbn-aggregator: --upstream-cert, --upstream-key and --upstream-tls-name "
                 "need --upstream-ca (the CA that signed the root's certificate)\n";
    return false;
  }
  if (up_cert.empty() != up_key.empty()) {
    std::cerr << "hsbn-aggregator: --upstream-cert and --upstream-key go together\n";
    return false;
  }
  if (!ReadPem("upstream-ca", up_ca, &options->upstream_ca_pem)) return false;
  return up_cert.empty() || (ReadPem("upstream-cert", up_cert, &options->upstream_cert_pem) &&
                             ReadPem("upstream-key", up_key, &options->upstream_key_pem));
}

// Job tokens (--token-file).
bool LoadTokens(const Settings& settings, AggregatorOptions* options) {
  const std::string& token_file = settings.token_file;
  const bool allow_insecure = settings.allow_insecure_token_file;
  if (token_file.empty()) {
    if (!allow_insecure) return true;
    std::cerr << "hsbn-aggregator: --allow-insecure-token-file without --token-file\n";
    return false;
  }
  auto store = hsbn::server::TokenStore::Load(token_file, allow_insecure);
  if (!store.ok()) {
    std::cerr << "hsbn-aggregator: " << store.status().message() << "\n";
    return false;
  }
  options->tokens = *store;
  Log(LogLevel::kInfo, absl::StrCat("job tokens required: ", options->tokens->size(), " entr",
                                    options->tokens->size() == 1 ? "y" : "ies", " in ",
                                    token_file));
  return true;
}

// Metrics (--metrics-listen): the registry, with the limits it reports; served later.
void SetUpMetrics(const Settings& settings, AggregatorOptions* options) {
  if (settings.metrics_listen.empty()) return;
  options->metrics = std::make_shared<hsbn::server::Metrics>(
      settings.role, !options->upstream.empty(), size_t(settings.metrics_max_jobs));
  hsbn::server::MetricsLimits limits;
  limits.max_jobs = options->max_jobs;
  limits.max_open_rounds = options->limits.max_open_rounds;
  limits.max_channels = options->limits.max_channels;
  limits.max_world_size = options->max_world_size;
  limits.memory_budget_bytes = options->memory_budget_bytes;
  limits.max_queued_bytes = options->max_queued_bytes;
  limits.max_unbound_bytes = options->max_unbound_bytes;
  options->metrics->SetLimits(limits);
}

// The gRPC server and what serving needs of it.
struct Listening {
  std::unique_ptr<grpc::Server> server;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs;  // one per event thread
  std::vector<int> ports;               // per --listen address: the TCP port bound
  std::vector<std::string> bound;       // the addresses served (TCP ports resolved)
  std::vector<std::string> unix_paths;  // removed at exit
};

// The gRPC server, bound and started (BuildAndStart), its queues and ports in `out`; null when
// it cannot serve (said).

std::unique_ptr<grpc::Server> BuildServer(const Settings& settings,
                                          const AggregatorOptions& options,
                                          const std::vector<std::string>& listen,
                                          std::shared_ptr<grpc::ServerCredentials> tcp,
                                          Aggregator& service, Listening* out) {
  grpc::ServerBuilder builder;
  // The largest message a peer of this protocol sends: one contribution of --max-channels, or
  // a sidecar's batch (at most 4 MiB, parent_link.cc). Anything larger is refused by gRPC before
  // it is parsed, so a hostile stream cannot make the event thread parse a huge message.
  const int64_t one = 16 * int64_t(options.limits.max_channels) + 4096;
  const int64_t most = std::max<int64_t>(one, int64_t(4) << 20) + (64 << 10);
  builder.SetMaxReceiveMessageSize(int(std::min<int64_t>(most, INT32_MAX)));
  builder.SetMaxSendMessageSize(64 << 20);
  // Sidecars ping their root every 10 s on an idle link (parent_link.cc); allow it.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  // No SO_REUSEPORT: a second aggregator on a TCP port another one holds must fail to start,
  // as on a Unix socket, not share the port (sidecars would then split between the two).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  out->ports.assign(listen.size(), 0);
  for (size_t i = 0; i < listen.size(); ++i) {
    const bool unix_socket = listen[i].rfind("unix:", 0) == 0;
    if (unix_socket) {
      const std::string path = listen[i].substr(5);
      if (!PrepareUnixSocket(path)) return nullptr;
      out->unix_paths.push_back(path);
    }
    builder.AddListeningPort(listen[i], unix_socket ? grpc::InsecureServerCredentials() : tcp,
                             &out->ports[i]);
  }
  builder.RegisterService(service.service());
  // One completion queue per event thread: a call's events all come back on the queue it was
  // accepted on, and its thread runs them; the sidecar's link to the root uses the first.
  for (int i = 0; i < settings.event_threads; ++i) out->cqs.push_back(builder.AddCompletionQueue());
  // Unix sockets get --socket-mode from the moment they exist: bind() creates the socket file
  // with mode 0777 & ~umask, so the umask is set to the complement of --socket-mode while the
  // server binds its ports (BuildAndStart binds on this thread), and restored after. A chmod
  // after bind would leave a window in which the socket had the umask's wider mode. Nothing
  // else in the process creates files meanwhile (the metrics endpoint and the ready file come
  // later), so the temporary umask touches only the sockets.
  const mode_t saved_umask = umask(0777 & ~settings.socket_mode);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  umask(saved_umask);
  if (server) return server;
  for (const auto& l : listen) {
    if (!absl::StartsWith(l, "unix:") && TcpAddressInUse(l)) {
      std::cerr << "hsbn-aggregator: --listen=" << l << ": another process is already "
                << "listening on that port; stop it, or give this one another port\n";
      return nullptr;
    }
  }
  std::cerr << "hsbn-aggregator: could not listen on --listen=" << absl::StrJoin(listen, ",")
            << " (a host that is not this machine's, or a directory that does not exist?)\n";
  return nullptr;
}

// The addresses served, as bound: a Unix socket with --socket-mode, a TCP port resolved.
bool CheckBound(const Settings& settings, const std::vector<std::string>& listen,
                Listening* serving) {
  const std::vector<int>& ports = serving->ports;
  std::vector<std::string>* bound = &serving->bound;
  for (size_t i = 0; i < listen.size(); ++i) {
    if (listen[i].rfind("unix:", 0) == 0) {
      struct stat st;
      const std::string path = listen[i].substr(5);
      if (stat(path.c_str(), &st) != 0 || (st.st_mode & 07777) != settings.socket_mode) {
        std::cerr << "hsbn-aggregator: " << path << " did not get --socket-mode " << std::oct
                  << settings.socket_mode << std::dec << " at bind; refusing to serve\n";
        return false;
      }
      bound->push_back(listen[i]);
    } else {
      if (ports[i] == 0) {
        std::cerr << "hsbn-aggregator: could not listen on " << listen[i] << "\n";
        return false;
      }
      const size_t colon = listen[i].rfind(':');
      bound->push_back(absl::StrCat(listen[i].substr(0, colon), ":", ports[i]));
    }
  }
  return true;
}

// Serves the metrics (if asked), logs "ready: ...", and writes --ready-file.
bool Announce(const Settings& settings, const AggregatorOptions& options, Aggregator& service,
              const std::vector<std::string>& bound, rlim_t open_files) {
  std::string metrics_line;
  if (options.metrics) {
    options.metrics->SetStateSource([&service] {
      hsbn::v1::StatusResponse status;
      service.FillStatus("", &status);
      return status;
    });
    auto served = options.metrics->Serve(settings.metrics_listen);
    if (!served.ok()) {
      std::cerr << "hsbn-aggregator: " << served.status().message() << "\n";
      return false;
    }
    metrics_line = absl::StrCat("metrics=http://", *served);
  }
  Log(LogLevel::kInfo,
      absl::StrCat("ready: ", settings.role, " aggregator listening on ",
                   absl::StrJoin(bound, ", "),
                   settings.tls_cert.empty()
                       ? ""
                       : (settings.tls_client_ca.empty() ? " (TCP: TLS)" : " (TCP: mutual TLS)"),
                   options.upstream.empty() ? "" : ", root at " + options.upstream,
                   options.upstream_ca_pem.empty() ? "" : " (TLS)",
                   metrics_line.empty() ? "" : ", " + metrics_line,
                   open_files == RLIM_INFINITY
                       ? std::string()
                       : absl::StrCat("; open files: at most ", uint64_t(open_files),
                                      " (one per member connection; docs/DEPLOY.md, Limits)")));
  const std::string& ready = settings.ready_file;
  if (ready.empty()) return true;
  const std::string tmp = ready + ".tmp";
  {
    std::ofstream out(tmp);
    for (const auto& b : bound) out << b << "\n";
    if (!metrics_line.empty()) out << metrics_line << "\n";
  }
  if (std::rename(tmp.c_str(), ready.c_str()) != 0) {
    std::cerr << "hsbn-aggregator: cannot write --ready-file " << ready << ": "
              << std::strerror(errno) << "\n";
    return false;
  }
  return true;
}

// Until SIGTERM or SIGINT: SIGHUP reloads --token-file. Returns the stopping signal.
int AwaitStop(const sigset_t& signals, const AggregatorOptions& options) {
  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGHUP) return sig;
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
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t signals = BlockSignals();
  TuneProcess();
  AggregatorOptions options;
  Settings settings;
  CLI::App app;
  if (int status = ParseFlags(app, argc, argv, &settings, &options); status >= 0) return status;
  std::vector<std::string> listen;
  std::shared_ptr<grpc::ServerCredentials> tcp_credentials;
  if (!ResolveRole(app, settings, &options) || !SetUpLogging(settings, options) ||
      !ResolveAddresses(app, settings, &options, &listen) ||
      !ServerCredentials(settings, listen, &tcp_credentials) ||
      !UpstreamCredentials(settings, &options)) {
    return 2;
  }
  const rlim_t open_files = RaiseOpenFileLimit();
  if (!LoadTokens(settings, &options)) return 2;
  SetUpMetrics(settings, &options);

  Aggregator service(options);
  // Stops the metrics endpoint (which reads `service`) before `service` goes, on every return.
  struct StopMetrics {
    std::shared_ptr<hsbn::server::Metrics> metrics;
    ~StopMetrics() {
      if (metrics) metrics->StopServing();
    }
  } stop_metrics{options.metrics};
  Listening serving;
  serving.server = BuildServer(settings, options, listen, tcp_credentials, service, &serving);
  if (!serving.server) return 1;
  service.Start(std::move(serving.cqs));
  if (!CheckBound(settings, listen, &serving) ||
      !Announce(settings, options, service, serving.bound, open_files)) {
    return 1;
  }

  const int sig = AwaitStop(signals, options);
  Log(LogLevel::kInfo, absl::StrCat("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                                    "; failing open rounds and stopping"));
  if (options.metrics) options.metrics->StopServing();
  service.Shutdown(sig == SIGTERM ? "SIGTERM" : "SIGINT");
  serving.server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  serving.server->Wait();
  // Then the completion queue: drained on the event thread, every call state deleted.
  service.StopEvents();
  for (const auto& path : serving.unix_paths) unlink(path.c_str());
  Log(LogLevel::kInfo, "stopped");
  return 0;
}

#include "local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace hsbn::cluster {

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(
    const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
    const std::string& log_path) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int log_fd = -1;
  if (!log_path.empty()) {
    log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) return absl::InternalError(absl::StrCat("cannot open log ", log_path));
  }
  // The child's environment is built here, before fork: after fork in a multithreaded parent
  // the child may only do async-signal-safe work (setenv allocates).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (env.count(name) == 0) env_strings.push_back(entry);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (log_fd >= 0) {
      dup2(log_fd, 1);
      dup2(log_fd, 2);
    }
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  if (log_fd >= 0) close(log_fd);
  return std::unique_ptr<Subprocess>(new Subprocess(pid, log_path));
}

Subprocess::~Subprocess() {
  if (!exited_) {
    kill(pid_, SIGKILL);
    Wait(std::chrono::seconds(5));
  }
}

bool Subprocess::Running() { return Wait(std::chrono::milliseconds(0)) < 0; }

void Subprocess::Signal(int sig) {
  if (exited_) return;
  kill(pid_, sig);
  if (sig == SIGSTOP) {
    // Returns once the process has stopped: a kill only makes the signal pending, and the
    // process may run on (and answer) until the kernel delivers it.
    int status = 0;
    pid_t r;
    while ((r = waitpid(pid_, &status, WUNTRACED)) < 0 && errno == EINTR) {
    }
    if (r == pid_ && !WIFSTOPPED(status)) {  // it ended first: keep its exit for Wait
      exited_ = true;
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
  }
}

int Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (exited_) return code_;
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return code_;
    }
    if (r < 0) {
      exited_ = true;
      return code_;
    }
    if (std::chrono::steady_clock::now() >= until) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int Subprocess::Stop(std::chrono::milliseconds grace) {
  Signal(SIGTERM);
  int code = Wait(grace);
  if (code < 0) {
    Signal(SIGKILL);
    code = Wait(std::chrono::seconds(5));
  }
  return code;
}

std::string LocalCluster::DefaultAggregatorPath() {
  if (const char* p = std::getenv("HSBN_AGGREGATOR"); p != nullptr && *p != '\0') return p;
#ifdef HSBN_BUILD_AGGREGATOR
  return HSBN_BUILD_AGGREGATOR;
#else
  return "hsbn-aggregator";
#endif
}

std::string LocalCluster::DefaultLinkProxyPath() {
  if (const char* p = std::getenv("HSBN_LINKPROXY"); p != nullptr && *p != '\0') return p;
#ifdef HSBN_BUILD_LINKPROXY
  return HSBN_BUILD_LINKPROXY;
#else
  return "hsbn-linkproxy";
#endif
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(ClusterOptions options) {
  if (options.nodes < 1 || options.workers_per_node < 1) {
    return absl::InvalidArgumentError("a cluster needs at least one node and one worker");
  }
  if (options.link_delay_ms < 0 || options.link_delay_ms > 600000) {
    return absl::InvalidArgumentError(absl::StrCat("link_delay_ms must be within [0, 600000], got ",
                                                   options.link_delay_ms));
  }
  if (options.link_delay_us < 0) options.link_delay_us = int64_t(options.link_delay_ms) * 1000;
  if (options.link_delay_us > 600000000 || options.group_link_delay_us < 0 ||
      options.group_link_delay_us > 600000000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "link_delay_us and group_link_delay_us must be within [0, 600000000], got ",
        options.link_delay_us, " and ", options.group_link_delay_us));
  }
  if (options.link_delay_us > 0 || options.group_link_delay_us > 0) options.link_proxy = true;
  if (options.group_nodes < 0 || (options.group_nodes > 0 && options.nodes % options.group_nodes)) {
    return absl::InvalidArgumentError(absl::StrCat("group_nodes (", options.group_nodes,
                                                   ") must divide nodes (", options.nodes, ")"));
  }
  if (options.group_tier && (options.group_nodes < 1 || options.nodes < 2 || !options.root)) {
    return absl::InvalidArgumentError(
        "group_tier needs group_nodes >= 1, at least two nodes and a root");
  }
  if (options.aggregator.empty()) options.aggregator = DefaultAggregatorPath();
  if (access(options.aggregator.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("hsbn-aggregator not found at '", options.aggregator,
                                            "'; build it or set HSBN_AGGREGATOR"));
  }
  bool own = false;
  if (options.dir.empty()) {
    char tmpl[] = "/tmp/hsbn-cluster-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
    options.dir = tmpl;
    own = true;
  }
  std::unique_ptr<LocalCluster> c(new LocalCluster(std::move(options)));
  c->own_dir_ = own;
  if (c->options_.nodes > 1 && c->options_.root) {
    std::string bound;
    std::vector<std::string> flags = {"--role=root", "--listen=127.0.0.1:0"};
    flags.insert(flags.end(), c->options_.root_flags.begin(), c->options_.root_flags.end());
    auto root = c->StartAggregator("root", std::move(flags), &bound);
    if (!root.ok()) return root.status();
    c->root_ = std::move(*root);
    c->root_address_ = bound;
  }
  if (c->options_.link_proxy && !c->root_address_.empty()) {
    if (c->options_.linkproxy.empty()) c->options_.linkproxy = DefaultLinkProxyPath();
    if (access(c->options_.linkproxy.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("hsbn-linkproxy not found at '",
                                              c->options_.linkproxy,
                                              "'; build it or set HSBN_LINKPROXY"));
    }
  }
  if (c->options_.group_tier) {
    const int groups = c->options_.nodes / c->options_.group_nodes;
    c->groups_.resize(groups);
    c->group_addresses_.resize(groups);
    for (int g = 0; g < groups; ++g) {
      if (absl::Status s = c->StartGroup(g, "127.0.0.1:0"); !s.ok()) return s;
    }
  }
  if (c->options_.link_proxy && !c->root_address_.empty()) {
    c->proxies_.resize(c->options_.nodes);
    c->proxy_addresses_.resize(c->options_.nodes);
    for (int n = 0; n < c->options_.nodes; ++n) {
      const bool tier = c->options_.group_tier;
      auto address = c->StartLinkProxy(
          absl::StrCat("link", n),
          tier ? c->group_addresses_[n / c->options_.group_nodes] : c->root_address_,
          tier ? c->options_.group_link_delay_us : c->options_.link_delay_us, &c->proxies_[n]);
      if (!address.ok()) return address.status();
      c->proxy_addresses_[n] = *address;
    }
  }
  c->sidecars_.resize(c->options_.nodes);
  for (int n = 0; n < c->options_.nodes; ++n) {
    if (absl::Status s = c->StartSidecar(n); !s.ok()) return s;
  }
  return c;
}

std::string LocalCluster::sidecar_address(int node) const {
  return absl::StrCat("unix:", options_.dir, "/node", node, ".sock");
}

absl::StatusOr<std::unique_ptr<Subprocess>> LocalCluster::StartAggregator(
    const std::string& name, std::vector<std::string> flags, std::string* bound) {
  const std::string ready = absl::StrCat(options_.dir, "/", name, ".ready");
  std::remove(ready.c_str());
  std::vector<std::string> argv = {options_.aggregator};
  for (auto& f : flags) argv.push_back(std::move(f));
  argv.push_back("--id=" + name);
  argv.push_back("--ready-file=" + ready);
  for (const auto& f : options_.extra_flags) argv.push_back(f);
  auto p = Subprocess::Spawn(argv, {}, absl::StrCat(options_.dir, "/", name, ".log"));
  if (!p.ok()) return p.status();
  auto address = WaitReady(name, ready, p->get());
  if (!address.ok()) return address.status();
  *bound = *address;
  return p;
}

absl::StatusOr<std::string> LocalCluster::WaitReady(const std::string& name,
                                                    const std::string& ready, Subprocess* p) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream in(ready);
    std::string line;
    if (in && std::getline(in, line) && !line.empty()) return line;
    if (!p->Running()) {
      return absl::InternalError(absl::StrCat("'", name, "' exited at start; see ",
                                              p->log_path()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("'", name, "' did not become ready in 20 s"));
}

absl::StatusOr<std::string> LocalCluster::StartLinkProxy(const std::string& name,
                                                         const std::string& target,
                                                         int64_t delay_us,
                                                         std::unique_ptr<Subprocess>* out) {
  const std::string ready = absl::StrCat(options_.dir, "/", name, ".ready");
  std::remove(ready.c_str());
  std::vector<std::string> argv = {
      options_.linkproxy, "--target=" + target, "--listen=127.0.0.1:0",
      absl::StrCat("--delay-us=", delay_us),
      absl::StrCat("--control=", options_.dir, "/", name, ".control"), "--ready-file=" + ready};
  auto p = Subprocess::Spawn(argv, {}, absl::StrCat(options_.dir, "/", name, ".log"));
  if (!p.ok()) return p.status();
  auto address = WaitReady(name, ready, p->get());
  if (!address.ok()) return address.status();
  *out = std::move(*p);
  return *address;
}

absl::Status LocalCluster::StartGroup(int g, const std::string& listen) {
  // The group aggregator's link to the root: through a proxy of its own when links are
  // simulated (started once; a restarted group aggregator keeps it).
  std::string upstream = root_address_;
  if (options_.link_proxy) {
    if (group_proxies_.empty()) {
      group_proxies_.resize(groups_.size());
      group_proxy_addresses_.resize(groups_.size());
    }
    if (!group_proxies_[g]) {
      auto address = StartLinkProxy(absl::StrCat("link-group", g), root_address_,
                                    options_.link_delay_us, &group_proxies_[g]);
      if (!address.ok()) return address.status();
      group_proxy_addresses_[g] = *address;
    }
    upstream = group_proxy_addresses_[g];
  }
  std::vector<std::string> flags = {"--role=group", "--listen=" + listen,
                                    "--upstream=" + upstream};
  flags.insert(flags.end(), options_.group_flags.begin(), options_.group_flags.end());
  std::string bound;
  auto p = StartAggregator(absl::StrCat("group", g), std::move(flags), &bound);
  if (!p.ok()) return p.status();
  groups_[g] = std::move(*p);
  group_addresses_[g] = bound;
  return absl::OkStatus();
}

absl::Status LocalCluster::RestartGroup(int g) {
  if (g < 0 || g >= int(groups_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("this cluster has no group ", g));
  }
  const std::string address = group_addresses_[g];
  groups_[g]->Stop();
  return StartGroup(g, address);
}

absl::StatusOr<std::string> LocalCluster::LinkCommand(int node, const std::string& command) {
  if (proxies_.empty()) {
    return absl::FailedPreconditionError("this cluster has no link proxies (link_proxy)");
  }
  if (node < 0 || node >= options_.nodes) {
    return absl::InvalidArgumentError(absl::StrCat("no node ", node));
  }
  const std::string path = absl::StrCat(options_.dir, "/link", node, ".control");
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError("control socket path too long: " + path);
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("link proxy ", node, " does not answer on ", path));
  }
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const std::string line = command + "\n";
  std::string answer;
  if (send(fd, line.data(), line.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(line.size())) {
    char ch;
    while (recv(fd, &ch, 1, 0) == 1 && ch != '\n') answer += ch;
  }
  close(fd);
  if (answer.rfind("ok", 0) == 0) return answer.size() > 3 ? answer.substr(3) : "";
  if (answer.empty()) {
    return absl::UnavailableError(absl::StrCat("link proxy ", node, " gave no answer"));
  }
  return absl::InvalidArgumentError(absl::StrCat("link proxy ", node, ": ", answer));
}

absl::Status LocalCluster::StartSidecar(int node) {
  std::vector<std::string> flags = {"--role=node", "--listen=" + sidecar_address(node)};
  if (!proxy_addresses_.empty()) {
    flags.push_back("--upstream=" + proxy_addresses_[node]);
  } else if (!groups_.empty()) {
    flags.push_back("--upstream=" + group_addresses_[node / options_.group_nodes]);
  } else if (!root_address_.empty()) {
    flags.push_back("--upstream=" + root_address_);
  }
  std::string bound;
  auto p = StartAggregator(absl::StrCat("node", node), flags, &bound);
  if (!p.ok()) return p.status();
  sidecars_[node] = std::move(*p);
  return absl::OkStatus();
}

absl::Status LocalCluster::RestartSidecar(int node) {
  sidecars_.at(node)->Stop();
  return StartSidecar(node);
}

absl::Status LocalCluster::RestartRoot() {
  if (!root_) return absl::FailedPreconditionError("this cluster has no root");
  const std::string address = root_address_;
  root_->Stop();
  std::string bound;
  std::vector<std::string> flags = {"--role=root", "--listen=" + address};
  flags.insert(flags.end(), options_.root_flags.begin(), options_.root_flags.end());
  auto root = StartAggregator("root", std::move(flags), &bound);
  if (!root.ok()) return root.status();
  root_ = std::move(*root);
  return absl::OkStatus();
}

std::map<std::string, std::string> LocalCluster::WorkerEnv(int rank,
                                                           const std::string& job_id) const {
  const int node = rank / options_.workers_per_node;
  std::map<std::string, std::string> env = {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world_size())},
          {"LOCAL_RANK", std::to_string(rank % options_.workers_per_node)},
          {"LOCAL_WORLD_SIZE", std::to_string(options_.workers_per_node)},
          {"GROUP_RANK", std::to_string(node)},
          {"HSBN_JOB_ID", job_id},
          {"HSBN_ADDRESS", sidecar_address(node)}};
  if (options_.group_nodes > 0) env["HSBN_GROUP_NODES"] = std::to_string(options_.group_nodes);
  return env;
}

void LocalCluster::Stop() {
  for (auto& s : sidecars_) {
    if (s) s->Stop();
  }
  for (auto& p : proxies_) {
    if (p) p->Stop();
  }
  for (auto& g : groups_) {
    if (g) g->Stop();
  }
  for (auto& p : group_proxies_) {
    if (p) p->Stop();
  }
  if (root_) root_->Stop();
}

LocalCluster::~LocalCluster() {
  Stop();
  if (own_dir_ && std::getenv("HSBN_KEEP_CLUSTER_DIR") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(options_.dir, ec);
  }
}

}  // namespace hsbn::cluster

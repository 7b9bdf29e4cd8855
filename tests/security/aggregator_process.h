// tests/security/aggregator_process.h — helpers for tests that run real hsbn-aggregator
// processes with flags of their own (TLS, tokens, metrics): start one and wait for its ready
// file, run a round on several in-process clients at once, scrape /metrics over plain HTTP.
// Used by tests/security and tests/metrics. Loopback only.
#ifndef HSBN_TESTS_SECURITY_AGGREGATOR_PROCESS_H_
#define HSBN_TESTS_SECURITY_AGGREGATOR_PROCESS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "hsbn/client.h"
#include "local_cluster.h"

namespace hsbn::testing {

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteFile(const std::string& path, const std::string& text, int mode) {
  { std::ofstream(path, std::ios::trunc) << text; }
  chmod(path.c_str(), mode_t(mode));
}

// A fresh temporary directory, removed (recursively) when the object goes.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/hsbn-sec-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() {
    if (!std::getenv("HSBN_KEEP_TEST_DIRS")) {
      std::string cmd = "rm -rf '" + path_ + "'";
      if (std::system(cmd.c_str()) != 0) {
      }
    }
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct Aggregator {
  std::unique_ptr<cluster::Subprocess> process;
  std::vector<std::string> ready_lines;  // the --ready-file, line by line
  std::string address;                   // its first line: the first bound address
  std::string metrics;                   // host:port from a `metrics=http://...` line
  std::string log_path;
  std::string log() const { return ReadAll(log_path); }
};

// Starts hsbn-aggregator with `flags` (plus --id=NAME and --ready-file) and waits until it is
// ready. Fails with the log's contents if it exits first.
inline absl::StatusOr<Aggregator> StartAggregator(const std::string& dir, const std::string& name,
                                                  std::vector<std::string> flags) {
  Aggregator a;
  a.log_path = absl::StrCat(dir, "/", name, ".log");
  const std::string ready = absl::StrCat(dir, "/", name, ".ready");
  std::remove(ready.c_str());
  std::vector<std::string> argv = {cluster::LocalCluster::DefaultAggregatorPath()};
  for (auto& f : flags) argv.push_back(std::move(f));
  argv.push_back("--id=" + name);
  argv.push_back("--ready-file=" + ready);
  argv.push_back("--log-level=debug");
  auto p = cluster::Subprocess::Spawn(argv, {}, a.log_path);
  if (!p.ok()) return p.status();
  a.process = std::move(*p);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream in(ready);  // written atomically: complete once it exists
    if (in) {
      std::string line;
      while (std::getline(in, line)) {
        if (line.empty()) continue;
        a.ready_lines.push_back(line);
        if (line.rfind("metrics=http://", 0) == 0) a.metrics = line.substr(15);
      }
      if (!a.ready_lines.empty()) {
        a.address = a.ready_lines[0];
        return a;
      }
    }
    if (!a.process->Running()) {
      return absl::InternalError(absl::StrCat("aggregator ", name, " exited at start:\n", a.log()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("aggregator ", name, " not ready in 20 s"));
}

// Runs hsbn-aggregator with `flags` and expects it to exit within 10 s; returns its exit code
// and output.
inline std::pair<int, std::string> RunAggregatorToExit(const std::string& dir,
                                                       const std::string& name,
                                                       std::vector<std::string> flags) {
  const std::string log = absl::StrCat(dir, "/", name, ".log");
  std::vector<std::string> argv = {cluster::LocalCluster::DefaultAggregatorPath()};
  for (auto& f : flags) argv.push_back(std::move(f));
  auto p = cluster::Subprocess::Spawn(argv, {}, log);
  if (!p.ok()) return {-1, std::string(p.status().message())};
  const int code = (*p)->Wait(std::chrono::seconds(10));
  return {code, ReadAll(log)};
}

// One worker's place in a job.
inline ClientOptions WorkerOptions(const std::string& address, const std::string& job, int rank,
                                   int world_size, int local_world_size,
                                   const std::string& token = "") {
  ClientOptions o;
  o.address = address;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world_size;
  o.local_world_size = local_world_size;
  o.local_rank = rank % local_world_size;
  o.node_rank = rank / local_world_size;
  o.token = token;
  o.connect_timeout = std::chrono::milliseconds(5000);
  return o;
}

// The inputs worker `rank` contributes to a round: `count` samples whose per-channel mean is
// rank + c and whose m2 is count * (1 + c) (variance 1 + c).
struct RoundOut {
  absl::Status status;
  int64_t count = 0;
  std::vector<double> a, b;
};

// Every client contributes to forward round (op, seq) with `scope`, at the same time; returns
// each client's outcome, in order.
inline std::vector<RoundOut> ForwardRound(const std::vector<Client*>& clients, uint32_t op,
                                          uint64_t seq, Scope scope, int channels = 4,
                                          const std::vector<double>* means = nullptr) {
  std::vector<RoundOut> out(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] {
      const int rank = clients[i]->options().rank;
      const int64_t count = 10;
      std::vector<double> mean(channels), m2(channels);
      for (int c = 0; c < channels; ++c) {
        mean[c] = means ? (*means)[i] : double(rank + c);
        m2[c] = double(count) * (1.0 + c);
      }
      RoundOut& r = out[i];
      r.a.resize(channels);
      r.b.resize(channels);
      r.status = clients[i]->Forward(op, seq, scope, channels, count, mean.data(), m2.data(),
                                     &r.count, r.a.data(), r.b.data());
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// GET http://host:port/path; returns the body. `timeout` bounds each read and write (a
// backstop, so that a server that never answers fails the test instead of hanging it).
inline absl::StatusOr<std::string> HttpGet(
    const std::string& host_port, const std::string& path = "/metrics",
    std::chrono::seconds timeout = std::chrono::seconds(60)) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError("bad address " + host_port);
  }
  std::string host = host_port.substr(0, colon);
  if (host == "0.0.0.0") host = "127.0.0.1";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{};
  tv.tv_sec = time_t(timeout.count());
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return absl::UnavailableError("cannot connect to " + host_port);
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port,
                                       "\r\nConnection: close\r\n\r\n");
  if (write(fd, req.data(), req.size()) != ssize_t(req.size())) {
    close(fd);
    return absl::UnavailableError("write failed");
  }
  std::string response;
  char buf[65536];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0) {
      close(fd);
      return absl::DeadlineExceededError(absl::StrCat("no answer from ", host_port, " in ",
                                                      timeout.count(), " s"));
    }
    if (n == 0) break;
    response.append(buf, size_t(n));
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos ||
      response.find(" 200 ") == std::string::npos) {
    return absl::InternalError("bad HTTP response: " + response.substr(0, 200));
  }
  return response.substr(body + 4);
}

// The value of the sample `name` whose labels include every one of `labels`, from Prometheus
// text; NaN if there is none.
inline double Sample(const std::string& text, const std::string& name,
                     const std::map<std::string, std::string>& labels = {}) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t end_name = line.find_first_of("{ ");
    if (end_name == absl::string_view::npos || line.substr(0, end_name) != name) continue;
    std::map<std::string, std::string> have;
    size_t pos = end_name;
    if (line[pos] == '{') {
      const size_t close = line.find("} ", pos);
      if (close == absl::string_view::npos) continue;
      absl::string_view inner = line.substr(pos + 1, close - pos - 1);
      while (!inner.empty()) {
        const size_t eq = inner.find("=\"");
        if (eq == absl::string_view::npos) break;
        const size_t q = inner.find('"', eq + 2);
        if (q == absl::string_view::npos) break;
        have[std::string(inner.substr(0, eq))] = std::string(inner.substr(eq + 2, q - eq - 2));
        inner = inner.substr(q + 1);
        if (!inner.empty() && inner[0] == ',') inner = inner.substr(1);
      }
      pos = close + 1;
    }
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = have.find(k);
      match = match && it != have.end() && it->second == v;
    }
    if (!match) continue;
    double value;
    absl::string_view rest = absl::StripAsciiWhitespace(line.substr(pos));
    rest = rest.substr(0, rest.find(' '));
    if (absl::SimpleAtod(rest, &value)) return value;
  }
  return std::nan("");
}

}  // namespace hsbn::testing

#endif  // HSBN_TESTS_SECURITY_AGGREGATOR_PROCESS_H_

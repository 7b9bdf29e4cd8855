// hsbn-synthetic: the end-to-end check of the aggregation service on one machine.
//
// Orchestrator (default): starts a root and one sidecar per simulated node (LocalCluster),
// runs one worker process per rank, each doing forward and backward rounds in every requested
// scope on synthetic data whose distribution differs per worker; every worker checks every
// result against the statistics of the concatenated data computed directly, and the
// orchestrator checks that all members of a round got bitwise the same result. Prints a table
// of rounds, latency percentiles and verification per scope.
//
// Worker (--worker): one trainer-like process; environment as torchrun sets it.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "hsbn/client.h"
#include "local_cluster.h"
#include "synthetic.h"

namespace {

constexpr char kUsage[] = R"(hsbn-synthetic — run and verify hsbn rounds end to end on this machine.

Starts a root aggregator, one sidecar per simulated node and one worker process per rank.
Each worker runs forward and backward rounds on synthetic data (each worker's data has its own
distribution), checks every result against the statistics of the concatenated data computed
directly, and the members' results are checked to be bitwise identical.

Usage: hsbn-synthetic [flags]

Flags:
  --nodes=N               simulated nodes (default 2)
  --workers-per-node=N    worker processes per node (default 4)
  --rounds=N              rounds per scope and phase, per worker (default 1000)
  --layers=N              distinct BN layers (op ids) the rounds cycle through (default 8)
  --channels=N            channels per layer (default 128)
  --batch=N               values per channel per worker and round (default 4)
  --batch-sizes=a,b,...   per-rank batch sizes instead of --batch (0 = an empty batch)
  --scopes=LIST           comma-separated: node, global, shadow (default node,global)
  --seed=N                data seed (default 1)
  --round-timeout-ms=N    aggregators' round timeout (default 30000)
  --keep                  keep the cluster directory (logs) and print its path
  --help                  show this text

Worker-only flags (used by the orchestrator and the tests):
  --worker  --report=FILE  --dump=FILE  --hang-at=K (stop answering before round K)
)";

struct Config {
  int nodes = 2, workers_per_node = 4;
  int64_t rounds = 1000, layers = 8, channels = 128, batch = 4;
  std::vector<int64_t> batch_sizes;
  std::vector<std::string> scopes = {"node", "global"};
  uint64_t seed = 1;
  int64_t round_timeout_ms = 30000;
  bool keep = false, worker = false;
  std::string report, dump;
  int64_t hang_at = -1;

  int64_t BatchOf(int rank) const {
    return batch_sizes.empty() ? batch : batch_sizes.at(size_t(rank));
  }
};

bool ParseFlags(int argc, char** argv, Config* c, std::vector<std::string>* forward) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    std::string name = arg, value;
    if (size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    auto num = [&](int64_t* out) {
      if (!absl::SimpleAtoi(value, out) || *out < 0) {
        std::cerr << "hsbn-synthetic: " << name << " needs a non-negative integer\n";
        return false;
      }
      return true;
    };
    int64_t v = 0;
    bool pass = true;  // passed on to workers
    if (name == "--nodes") {
      if (!num(&v) || v < 1) return false;
      c->nodes = int(v);
    } else if (name == "--workers-per-node") {
      if (!num(&v) || v < 1) return false;
      c->workers_per_node = int(v);
    } else if (name == "--rounds") {
      if (!num(&c->rounds)) return false;
    } else if (name == "--layers") {
      if (!num(&c->layers) || c->layers < 1) return false;
    } else if (name == "--channels") {
      if (!num(&c->channels) || c->channels < 1) return false;
    } else if (name == "--batch") {
      if (!num(&c->batch)) return false;
    } else if (name == "--batch-sizes") {
      c->batch_sizes.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        int64_t b;
        if (!absl::SimpleAtoi(part, &b) || b < 0) {
          std::cerr << "hsbn-synthetic: --batch-sizes takes non-negative integers\n";
          return false;
        }
        c->batch_sizes.push_back(b);
      }
    } else if (name == "--scopes") {
      c->scopes = absl::StrSplit(value, ',', absl::SkipEmpty());
      for (const auto& s : c->scopes) {
        if (!hsbn::ParseScope(s).ok()) {
          std::cerr << "hsbn-synthetic: unknown scope '" << s << "'\n";
          return false;
        }
      }
    } else if (name == "--seed") {
      if (!num(&v)) return false;
      c->seed = uint64_t(v);
    } else if (name == "--round-timeout-ms") {
      if (!num(&c->round_timeout_ms) || c->round_timeout_ms < 1) return false;
    } else if (name == "--keep") {
      c->keep = true;
      pass = false;
    } else if (name == "--worker") {
      c->worker = true;
      pass = false;
    } else if (name == "--report") {
      c->report = value;
      pass = false;
    } else if (name == "--dump") {
      c->dump = value;
      pass = false;
    } else if (name == "--hang-at") {
      if (!num(&c->hang_at)) return false;
      pass = false;
    } else {
      std::cerr << "hsbn-synthetic: unknown flag " << arg << " (see --help)\n";
      return false;
    }
    if (pass) forward->push_back(arg);
  }
  const int world = c->nodes * c->workers_per_node;
  if (!c->batch_sizes.empty() && int(c->batch_sizes.size()) != world) {
    std::cerr << "hsbn-synthetic: --batch-sizes needs " << world << " values, one per rank\n";
    return false;
  }
  return true;
}

uint64_t Fnv(const std::vector<double>& a, const std::vector<double>& b, int64_t count) {
  uint64_t h = 1469598103934665603ull;
  auto eat = [&](const void* p, size_t n) {
    const unsigned char* s = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ s[i]) * 1099511628211ull;
  };
  eat(&count, sizeof count);
  eat(a.data(), a.size() * sizeof(double));
  eat(b.data(), b.size() * sizeof(double));
  return h;
}

std::string Hex(const std::vector<double>& v) {
  std::string out;
  char buf[40];
  for (double x : v) {
    std::snprintf(buf, sizeof buf, " %a", x);
    out += buf;
  }
  return out;
}

// ----------------------------------------------------------------------------------- worker

int RunWorker(const Config& cfg) {
  auto options = hsbn::ClientOptions::FromEnv();
  if (!options.ok()) {
    std::cerr << "worker: " << options.status().message() << "\n";
    return 2;
  }
  auto client_or = hsbn::Client::Connect(*options);
  if (!client_or.ok()) {
    std::cerr << "worker " << options->rank << ": " << client_or.status().message() << "\n";
    return 3;
  }
  hsbn::Client& client = **client_or;
  const int rank = options->rank, lws = options->local_world_size, node = options->node_rank;
  const int world = options->world_size;
  const int64_t C = cfg.channels;
  std::ofstream report(cfg.report.empty() ? "/dev/null" : cfg.report);
  std::ofstream dump(cfg.dump.empty() ? "/dev/null" : cfg.dump);
  int64_t bad = 0, checked = 0;
  uint64_t round_index = 0;  // distinct data per (scope, round)
  for (size_t si = 0; si < cfg.scopes.size(); ++si) {
    const hsbn::Scope scope = *hsbn::ParseScope(cfg.scopes[si]);
    // Members of the statistics: the node for node and shadow scope, everyone for global.
    int first = node * lws, last = first + lws;
    if (scope == hsbn::Scope::kGlobal) first = 0, last = world;
    std::vector<int64_t> fwd_us, bwd_us;
    for (int64_t k = 0; k < cfg.rounds; ++k, ++round_index) {
      const uint32_t op = uint32_t(si * cfg.layers + k % cfg.layers);
      const uint64_t seq = uint64_t(k / cfg.layers);
      if (cfg.hang_at >= 0 && int64_t(round_index) == cfg.hang_at) {
        report << "hang " << round_index << std::endl;
        for (;;) pause();
      }
      const int64_t n = cfg.BatchOf(rank);
      const std::vector<double> x = hsbn::synthetic::Input(cfg.seed, rank, round_index, n, C);
      const auto local = hsbn::synthetic::LocalMoments(x, n, C);
      std::vector<double> mean(C), m2(C);
      int64_t count = 0;
      auto t0 = std::chrono::steady_clock::now();
      absl::Status s = client.Forward(op, seq, scope, C, n, local.a.data(), local.b.data(), &count,
                                      mean.data(), m2.data());
      auto t1 = std::chrono::steady_clock::now();
      if (!s.ok()) {
        report << "error forward " << round_index << " " << int(s.code()) << " " << s.message()
               << std::endl;
        std::cerr << "worker " << rank << ": " << s.ToString() << "\n";
        return 4;
      }
      fwd_us.push_back(std::chrono::duration_cast<std::chrono::microseconds>(t1 - t0).count());
      const std::vector<double> dy = hsbn::synthetic::Grad(cfg.seed, rank, round_index, n, C);
      const auto lb = hsbn::synthetic::LocalBackward(x, dy, n, C, mean);
      std::vector<double> sum_dy(C), sum_dy_xmu(C);
      int64_t bcount = 0;
      t0 = std::chrono::steady_clock::now();
      s = client.Backward(op, seq, scope, C, n, lb.a.data(), lb.b.data(), &bcount, sum_dy.data(),
                          sum_dy_xmu.data());
      t1 = std::chrono::steady_clock::now();
      if (!s.ok()) {
        report << "error backward " << round_index << " " << int(s.code()) << " " << s.message()
               << std::endl;
        std::cerr << "worker " << rank << ": " << s.ToString() << "\n";
        return 4;
      }
      bwd_us.push_back(std::chrono::duration_cast<std::chrono::microseconds>(t1 - t0).count());
      // Check against the directly computed statistics of the scope's concatenated data.
      std::vector<std::vector<double>> xs, dys;
      std::vector<int64_t> counts;
      for (int r = first; r < last; ++r) {
        const int64_t nr = cfg.BatchOf(r);
        xs.push_back(hsbn::synthetic::Input(cfg.seed, r, round_index, nr, C));
        dys.push_back(hsbn::synthetic::Grad(cfg.seed, r, round_index, nr, C));
        counts.push_back(nr);
      }
      const auto ref = hsbn::synthetic::ReferenceMoments(xs, counts, C);
      const auto refb = hsbn::synthetic::ReferenceBackward(xs, dys, counts, C, mean);
      double err = std::max(hsbn::synthetic::MaxRelativeError(mean, ref.a, 1e-6),
                            hsbn::synthetic::MaxRelativeError(m2, ref.b, 1e-6));
      err = std::max(err, hsbn::synthetic::MaxRelativeError(sum_dy, refb.a, 1.0));
      err = std::max(err, hsbn::synthetic::MaxRelativeError(sum_dy_xmu, refb.b, 1.0));
      ++checked;
      if (count != ref.count || bcount != ref.count || !(err < 1e-11)) {
        ++bad;
        report << "mismatch " << cfg.scopes[si] << " " << round_index << " count " << count
               << " want " << ref.count << " err " << err << std::endl;
      }
      report << "hash " << cfg.scopes[si] << " " << round_index << " " << std::hex
             << Fnv(mean, m2, count) << " " << Fnv(sum_dy, sum_dy_xmu, bcount) << std::dec
             << "\n";
      dump << "F " << cfg.scopes[si] << " " << round_index << " " << count << Hex(mean) << " |"
           << Hex(m2) << "\n";
      dump << "B " << cfg.scopes[si] << " " << round_index << " " << bcount << Hex(sum_dy)
           << " |" << Hex(sum_dy_xmu) << "\n";
      if (rank == 0 && cfg.rounds >= 10 && (k + 1) % (cfg.rounds / 5 == 0 ? 1 : cfg.rounds / 5) == 0) {
        std::fprintf(stderr, "  [%s scope] %lld/%lld rounds\n", cfg.scopes[si].c_str(),
                     (long long)(k + 1), (long long)cfg.rounds);
      }
    }
    report << "lat " << cfg.scopes[si] << " forward";
    for (int64_t us : fwd_us) report << " " << us;
    report << "\nlat " << cfg.scopes[si] << " backward";
    for (int64_t us : bwd_us) report << " " << us;
    report << "\n";
  }
  report << "checked " << checked << " bad " << bad << std::endl;
  return bad == 0 ? 0 : 5;
}

// ----------------------------------------------------------------------------- orchestrator

double Percentile(std::vector<int64_t> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5));
  return double(v[i]);
}

int RunOrchestrator(const Config& cfg, const std::vector<std::string>& forward,
                    const char* self) {
  hsbn::cluster::ClusterOptions opts;
  opts.nodes = cfg.nodes;
  opts.workers_per_node = cfg.workers_per_node;
  opts.extra_flags = {absl::StrCat("--round-timeout-ms=", cfg.round_timeout_ms)};
  auto cluster_or = hsbn::cluster::LocalCluster::Start(opts);
  if (!cluster_or.ok()) {
    std::cerr << "hsbn-synthetic: " << cluster_or.status().message() << "\n";
    return 1;
  }
  auto& cluster = **cluster_or;
  if (cfg.keep) setenv("HSBN_KEEP_CLUSTER_DIR", "1", 1);
  const int world = cluster.world_size();
  std::fprintf(stderr,
               "hsbn-synthetic: %d node(s) x %d workers, %lld rounds per scope and phase, C=%lld; "
               "cluster in %s\n",
               cfg.nodes, cfg.workers_per_node, (long long)cfg.rounds, (long long)cfg.channels,
               cluster.dir().c_str());
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  std::string self_path = len > 0 ? std::string(exe, size_t(len)) : self;
  std::vector<std::unique_ptr<hsbn::cluster::Subprocess>> workers;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {self_path, "--worker",
                                     absl::StrCat("--report=", cluster.dir(), "/worker", r, ".txt")};
    argv.insert(argv.end(), forward.begin(), forward.end());
    auto p = hsbn::cluster::Subprocess::Spawn(argv, cluster.WorkerEnv(r, "hsbn-synthetic"), "");
    if (!p.ok()) {
      std::cerr << "hsbn-synthetic: " << p.status().message() << "\n";
      return 1;
    }
    workers.push_back(std::move(*p));
  }
  int failed = 0;
  for (int r = 0; r < world; ++r) {
    const int code = workers[r]->Wait(std::chrono::hours(1));
    if (code != 0) {
      std::cerr << "hsbn-synthetic: worker " << r << " exited with status " << code << "\n";
      ++failed;
    }
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Gather latencies, verification counts and result hashes.
  std::map<std::pair<std::string, std::string>, std::vector<int64_t>> lat;
  std::map<std::pair<std::string, std::string>, std::map<int, std::string>> hashes;  // by group
  int64_t checked = 0, bad = 0;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(absl::StrCat(cluster.dir(), "/worker", r, ".txt"));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string kind;
      ls >> kind;
      if (kind == "lat") {
        std::string scope, phase;
        ls >> scope >> phase;
        int64_t us;
        while (ls >> us) lat[{scope, phase}].push_back(us);
      } else if (kind == "hash") {
        std::string scope, round, hf, hb;
        ls >> scope >> round >> hf >> hb;
        const int group = scope == "global" ? 0 : r / cfg.workers_per_node;
        auto& seen = hashes[{scope, round}];
        auto it = seen.find(group);
        if (it == seen.end()) {
          seen[group] = hf + hb;
        } else if (it->second != hf + hb) {
          seen[group] = "DIFFERENT";
        }
      } else if (kind == "checked") {
        int64_t c, b;
        std::string word;
        ls >> c >> word >> b;
        checked += c;
        bad += b;
      }
    }
  }
  std::map<std::string, bool> identical;
  for (const auto& [key, groups] : hashes) {
    bool same = true;
    for (const auto& [g, h] : groups) same = same && h != "DIFFERENT";
    auto [it, inserted] = identical.emplace(key.first, same);
    if (!inserted) it->second = it->second && same;
  }
  std::printf("\n| scope  | phase    | rounds | p50 (us) | p90 (us) | p99 (us) | max (us) | verified | identical on members |\n");
  std::printf("|--------|----------|--------|----------|----------|----------|----------|----------|----------------------|\n");
  for (const auto& scope : cfg.scopes) {
    for (const char* phase : {"forward", "backward"}) {
      const auto& v = lat[{scope, phase}];
      const bool ok = failed == 0 && bad == 0 && checked > 0;
      std::printf("| %-6s | %-8s | %6zu | %8.0f | %8.0f | %8.0f | %8.0f | %-8s | %-20s |\n",
                  scope.c_str(), phase, v.size(), Percentile(v, 0.5), Percentile(v, 0.9),
                  Percentile(v, 0.99), Percentile(v, 1.0), ok ? "yes" : "NO",
                  identical.count(scope) && identical[scope] ? "yes" : "NO");
    }
  }
  std::printf("\n%lld worker-rounds checked against the directly computed statistics, %lld "
              "mismatches; %d worker(s) failed; %.1f s wall.\n",
              (long long)checked, (long long)bad, failed, wall);
  bool all_identical = !identical.empty();
  for (const auto& [s, same] : identical) all_identical = all_identical && same;
  const bool ok = failed == 0 && bad == 0 && checked > 0 && all_identical;
  std::printf("%s\n", ok ? "RESULT: every round verified" : "RESULT: VERIFICATION FAILED");
  if (cfg.keep) std::printf("logs kept in %s\n", cluster.dir().c_str());
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  std::vector<std::string> forward;
  if (!ParseFlags(argc, argv, &cfg, &forward)) return 2;
  signal(SIGPIPE, SIG_IGN);
  return cfg.worker ? RunWorker(cfg) : RunOrchestrator(cfg, forward, argv[0]);
}

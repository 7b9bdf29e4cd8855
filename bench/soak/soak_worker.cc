// hsbn-soak-worker — trainer processes of the soak and fault-injection runs (bench/soak).
//
// One process plays the given local ranks of one node of one job, a thread and an
// hsbn::Client per rank. Each rank runs --steps steps (0: until killed); a step is, for every
// layer op in [0, --layers), a forward round, then (after all forward rounds returned) a
// backward round, all of a phase in flight at once. Layer op uses scope
// --scopes[op % n] (node, global or shadow). Every contribution is a function of (incarnation,
// rank, op, seq, phase, channel), so each result is checked against the direct computation
// over the ranks its scope covers (shadow is answered with node statistics): a result of
// another round, another incarnation or with a member missing fails the check.
//
// --churn=K makes the job leave and join again every K steps as a new job (job id
// "<job>-g<generation>"); every member of the job does the same, so they stay in step.
//
// Output (stdout, one line each, flushed):
//   P <job> <rank> <steps done> <rounds ok>      every --progress-every steps of each rank
//   FAIL <job> <rank> <op> <seq> <phase> <scope> <code> <message>   a round failed: exit 3
//   WRONG <job> <rank> <op> <seq> <phase> <scope> <what>            a wrong result: exit 2
//   DONE <job> <rank> <steps> <rounds ok>                           a rank finished
// A failed round ends the process, as it ends a trainer (torchrun then restarts the job).
//
//   hsbn-soak-worker --address=ADDR --job=ID --nodes=N --local-world=K --node-rank=I
//       [--local-ranks=0,1] [--steps=S] [--layers=L] [--channels=C] [--scopes=node,global,shadow]
//       [--incarnation=I] [--churn=K] [--progress-every=P] [--round-timeout-ms=T]
//       [--connect-timeout-ms=T] [--group-nodes=K]   (K: nodes per group, for scope group)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hsbn/client.h"

namespace hsbn::soak {
namespace {

std::mutex g_out_mu;

void Emit(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_out_mu);
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string Flag(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind(prefix, 0) == 0) return argv[i] + prefix.size();
  }
  return def;
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) {
    if (!part.empty()) out.push_back(part);
  }
  return out;
}

// A deterministic value in [-1, 1) from the round's coordinates (splitmix64).
double Hash(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 17) * 0x94D049BB133111EBull ^ (d + 101) * 0xD6E8FEB86659FD93ull ^ (e + 7);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

struct Contribution {
  int64_t count;
  std::vector<double> a, b;
};

struct Layout {
  int nodes, local_world, channels;
  uint64_t incarnation;
  int group_nodes = 0;  // --group-nodes: nodes per group (group scope), 0: none
};

Contribution Make(const Layout& l, int rank, uint32_t op, uint64_t seq, Phase phase) {
  Contribution c;
  const uint64_t key = (l.incarnation << 40) ^ (uint64_t(op) << 32) ^ seq;
  c.count = 1 + static_cast<int64_t>((Hash(key, rank, int(phase), 1, 9) + 1.0) * 2.5);  // 1..5
  c.a.resize(l.channels);
  c.b.resize(l.channels);
  for (int ch = 0; ch < l.channels; ++ch) {
    const double u = Hash(key, rank, int(phase), ch, 2), v = Hash(key, rank, int(phase), ch, 3);
    if (phase == Phase::kForward) {
      c.a[ch] = 4.0 * u;                         // mean
      c.b[ch] = c.count * (1.5 + v);             // m2 >= 0
    } else {
      c.a[ch] = 10.0 * u;                        // sum_dy
      c.b[ch] = 10.0 * v;                        // sum_dy_xmu
    }
  }
  return c;
}

// The direct computation: Chan's pooled moments written out (not the library's merge), in
// long double, over the ranks the scope covers.
Contribution Expected(const Layout& l, int my_rank, uint32_t op, uint64_t seq, Phase phase,
                      Scope scope) {
  std::vector<int> ranks;
  const int node = my_rank / l.local_world;
  for (int r = 0; r < l.nodes * l.local_world; ++r) {
    const int r_node = r / l.local_world;
    const bool same_group = l.group_nodes > 0 && r_node / l.group_nodes == node / l.group_nodes;
    if (scope == Scope::kGlobal || r_node == node || (scope == Scope::kGroup && same_group)) {
      ranks.push_back(r);
    }
  }
  std::vector<Contribution> cs;
  for (int r : ranks) cs.push_back(Make(l, r, op, seq, phase));
  Contribution e;
  e.count = 0;
  for (const auto& c : cs) e.count += c.count;
  e.a.assign(l.channels, 0);
  e.b.assign(l.channels, 0);
  for (int ch = 0; ch < l.channels; ++ch) {
    long double sa = 0, sb = 0;
    if (phase == Phase::kForward) {
      for (const auto& c : cs) sa += static_cast<long double>(c.count) * c.a[ch];
      const long double mean = sa / e.count;
      for (const auto& c : cs) {
        const long double d = c.a[ch] - mean;
        sb += c.b[ch] + c.count * d * d;
      }
      e.a[ch] = static_cast<double>(mean);
      e.b[ch] = static_cast<double>(sb);
    } else {
      for (const auto& c : cs) {
        sa += c.a[ch];
        sb += c.b[ch];
      }
      e.a[ch] = static_cast<double>(sa);
      e.b[ch] = static_cast<double>(sb);
    }
  }
  return e;
}

bool Close(double got, double want) {
  return std::fabs(got - want) <= 1e-9 * (1.0 + std::fabs(want));
}

struct Config {
  std::string address, job;
  Layout layout;
  int node_rank;
  int64_t steps;
  int layers;
  std::vector<Scope> scopes;
  int64_t churn;
  int64_t progress_every;
  int64_t round_timeout_ms;
  int64_t connect_timeout_ms;
};

const char* PhaseName(Phase p) { return p == Phase::kForward ? "fwd" : "bwd"; }

// Runs one rank; returns 0, or ends the whole process with 2 (wrong result) or 3 (failure).
int RunRank(const Config& cfg, int local_rank) {
  const Layout& l = cfg.layout;
  const int rank = cfg.node_rank * l.local_world + local_rank;
  int64_t step = 0, rounds_ok = 0, generation = 0;
  std::unique_ptr<Client> client;
  std::string job;
  while (cfg.steps == 0 || step < cfg.steps) {
    if (!client) {
      job = cfg.churn > 0 ? absl::StrCat(cfg.job, "-g", generation) : cfg.job;
      ClientOptions o;
      o.address = cfg.address;
      o.job_id = job;
      o.rank = rank;
      o.world_size = l.nodes * l.local_world;
      o.local_rank = local_rank;
      o.local_world_size = l.local_world;
      o.node_rank = cfg.node_rank;
      o.round_timeout = std::chrono::milliseconds(cfg.round_timeout_ms);
      o.connect_timeout = std::chrono::milliseconds(cfg.connect_timeout_ms);
      o.incarnation = l.incarnation;  // the run number a restarting launcher gives (faults.py)
      o.group_nodes = l.group_nodes;
      auto c = Client::Connect(o);
      if (!c.ok()) {
        Emit(absl::StrCat("FAIL ", job, " ", rank, " - ", step, " join - ",
                          absl::StatusCodeToString(c.status().code()), " ",
                          c.status().message()));
        std::_Exit(3);
      }
      client = std::move(*c);
    }
    // seq counts the layer's calls within this job (generation): it restarts at 0 on rejoin.
    const uint64_t seq = cfg.churn > 0 ? static_cast<uint64_t>(step % cfg.churn)
                                       : static_cast<uint64_t>(step);
    for (Phase phase : {Phase::kForward, Phase::kBackward}) {
      std::vector<std::shared_ptr<PendingRound>> pending(cfg.layers);
      std::vector<Contribution> ins(cfg.layers);
      absl::Status first_error;
      int first_op = -1;
      for (int op = 0; op < cfg.layers; ++op) {
        const Scope scope = cfg.scopes[op % cfg.scopes.size()];
        ins[op] = Make(l, rank, op, seq, phase);
        auto p = client->Start(phase, op, seq, scope, l.channels, ins[op].count,
                               ins[op].a.data(), ins[op].b.data());
        if (!p.ok()) {
          if (first_op < 0) {
            first_error = p.status();
            first_op = op;
          }
        } else {
          pending[op] = *p;
        }
      }
      std::vector<double> oa(l.channels), ob(l.channels);
      for (int op = 0; op < cfg.layers; ++op) {
        const Scope scope = cfg.scopes[op % cfg.scopes.size()];
        if (!pending[op]) continue;
        int64_t out_count = -1;
        absl::Status s = client->Wait(*pending[op], &out_count, oa.data(), ob.data());
        if (!s.ok()) {
          if (first_op < 0) {
            first_error = s;
            first_op = op;
          }
          continue;
        }
        const Contribution want = Expected(l, rank, op, seq, phase,
                                           scope == Scope::kShadow ? Scope::kNode : scope);
        std::string what;
        if (out_count != want.count) {
          what = absl::StrCat("count ", out_count, " != ", want.count);
        }
        for (int ch = 0; ch < l.channels && what.empty(); ++ch) {
          if (!Close(oa[ch], want.a[ch]) || !Close(ob[ch], want.b[ch])) {
            what = absl::StrCat("channel ", ch, ": (", oa[ch], ", ", ob[ch], ") != (",
                                want.a[ch], ", ", want.b[ch], ")");
          }
        }
        if (!what.empty()) {
          Emit(absl::StrCat("WRONG ", job, " ", rank, " ", op, " ", seq, " ", PhaseName(phase),
                            " ", ScopeName(scope), " ", what));
          std::_Exit(2);  // a trainer that trusted it would now be wrong; stop at once
        }
        ++rounds_ok;
      }
      if (first_op >= 0) {
        Emit(absl::StrCat("FAIL ", job, " ", rank, " ", first_op, " ", seq, " ",
                          PhaseName(phase), " ", ScopeName(cfg.scopes[first_op % cfg.scopes.size()]),
                          " ", absl::StatusCodeToString(first_error.code()), " ",
                          first_error.message()));
        std::_Exit(3);  // a failed round ends a trainer (its other threads with it)
      }
    }
    ++step;
    if (cfg.progress_every > 0 && step % cfg.progress_every == 0) {
      Emit(absl::StrCat("P ", job, " ", rank, " ", step, " ", rounds_ok));
    }
    if (cfg.churn > 0 && step % cfg.churn == 0) {
      client.reset();  // leaves the job
      ++generation;
    }
  }
  Emit(absl::StrCat("DONE ", cfg.job, " ", rank, " ", step, " ", rounds_ok));
  return 0;
}

int Main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help") {
      std::printf("see the header of bench/soak/soak_worker.cc\n");
      return 0;
    }
  }
  Config cfg;
  cfg.address = Flag(argc, argv, "address", "");
  cfg.job = Flag(argc, argv, "job", "soak");
  cfg.layout.nodes = std::atoi(Flag(argc, argv, "nodes", "1").c_str());
  cfg.layout.local_world = std::atoi(Flag(argc, argv, "local-world", "1").c_str());
  cfg.layout.channels = std::atoi(Flag(argc, argv, "channels", "8").c_str());
  cfg.layout.incarnation = std::strtoull(Flag(argc, argv, "incarnation", "0").c_str(), nullptr, 10);
  cfg.node_rank = std::atoi(Flag(argc, argv, "node-rank", "0").c_str());
  cfg.layout.group_nodes = std::atoi(Flag(argc, argv, "group-nodes", "0").c_str());
  cfg.steps = std::atoll(Flag(argc, argv, "steps", "0").c_str());
  cfg.layers = std::atoi(Flag(argc, argv, "layers", "3").c_str());
  cfg.churn = std::atoll(Flag(argc, argv, "churn", "0").c_str());
  cfg.progress_every = std::atoll(Flag(argc, argv, "progress-every", "100").c_str());
  cfg.round_timeout_ms = std::atoll(Flag(argc, argv, "round-timeout-ms", "0").c_str());
  cfg.connect_timeout_ms = std::atoll(Flag(argc, argv, "connect-timeout-ms", "20000").c_str());
  for (const auto& s : Split(Flag(argc, argv, "scopes", "node,global,shadow"))) {
    auto sc = ParseScope(s);
    if (!sc.ok()) {
      std::fprintf(stderr, "hsbn-soak-worker: --scopes: %s\n", std::string(sc.status().message()).c_str());
      return 1;
    }
    cfg.scopes.push_back(*sc);
  }
  std::vector<int> locals;
  for (const auto& s : Split(Flag(argc, argv, "local-ranks", ""))) locals.push_back(std::atoi(s.c_str()));
  if (locals.empty()) {
    for (int i = 0; i < cfg.layout.local_world; ++i) locals.push_back(i);
  }
  if (cfg.address.empty() || cfg.layout.nodes < 1 || cfg.layout.local_world < 1 ||
      cfg.layout.channels < 1 || cfg.layers < 1 || cfg.scopes.empty() || cfg.steps < 0 ||
      cfg.churn < 0 || cfg.round_timeout_ms < 0 || cfg.connect_timeout_ms < 0 ||
      cfg.layout.group_nodes < 0) {
    std::fprintf(stderr, "hsbn-soak-worker: bad flags (see --help)\n");
    return 1;
  }
  for (int lr : locals) {
    if (lr < 0 || lr >= cfg.layout.local_world) {
      std::fprintf(stderr, "hsbn-soak-worker: --local-ranks: %d is outside [0, %d)\n", lr,
                   cfg.layout.local_world);
      return 1;
    }
  }
  std::vector<int> codes(locals.size(), 0);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < locals.size(); ++i) {
    threads.emplace_back([&, i] { codes[i] = RunRank(cfg, locals[i]); });
  }
  for (auto& t : threads) t.join();
  int code = 0;
  for (int c : codes) code = std::max(code, c);
  return code;
}

}  // namespace
}  // namespace hsbn::soak

int main(int argc, char** argv) { return hsbn::soak::Main(argc, argv); }

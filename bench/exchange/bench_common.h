// bench_common.h — the workload every exchange benchmark worker runs, whatever its transport.
//
// A worker process is given a plan on its command line (channel counts, rounds, ResNet-50
// steps) and an `Exchange` function that performs one round: it contributes `2*C + 1` doubles
// (count, then the two per-channel arrays, the same bytes hsbn sends) and receives the reduced
// ones. RunPlan times every round with a monotonic clock and writes the samples, one line per
// case, to the file named by --out; bench/exchange/run.py pools the files of all ranks.
//
// Output format (text, one case per line):
//   lat <channels> <phase> <scope> <ns> <ns> ...     one sample per timed round
//   step <scope> <ns> <ns> ...                       one sample per ResNet-50 step (106 rounds)
//   cost <rounds> <user ns> <sys ns> <voluntary csw> <involuntary csw>
//                                                    this process during the plan (all
//                                                    threads, warm-up included): CPU per round
//
// Every loop is bounded by a count fixed on the command line, identical on every rank (a
// collective cannot stop on a per-rank timer); the driver bounds the wall time.
//
// Not thread-safe; one plan per process.
#ifndef HSBN_BENCH_EXCHANGE_BENCH_COMMON_H_
#define HSBN_BENCH_EXCHANGE_BENCH_COMMON_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/resource.h>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace hsbn_bench {

enum class Phase { kForward = 1, kBackward = 2 };
enum class Scope { kNode = 1, kGlobal = 2 };

inline const char* PhaseName(Phase p) { return p == Phase::kForward ? "fwd" : "bwd"; }
inline const char* ScopeName(Scope s) { return s == Scope::kNode ? "node" : "global"; }

// ResNet-50's 53 BatchNorm layers in forward execution order (torchvision: stem; then per
// bottleneck bn1, bn2, bn3, and the downsample BN after bn3 in each stage's first block).
inline std::vector<int> ResNet50Channels() {
  std::vector<int> c = {64};
  const int widths[4] = {64, 128, 256, 512};
  const int blocks[4] = {3, 4, 6, 3};
  for (int s = 0; s < 4; ++s) {
    for (int b = 0; b < blocks[s]; ++b) {
      c.push_back(widths[s]);
      c.push_back(widths[s]);
      c.push_back(widths[s] * 4);
      if (b == 0) c.push_back(widths[s] * 4);
    }
  }
  return c;  // 53 entries
}

// Command line: --key=value or --key value. Unknown keys are kept for the caller.
class Args {
 public:
  Args(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) continue;
      a = a.substr(2);
      auto eq = a.find('=');
      if (eq != std::string::npos) {
        kv_[a.substr(0, eq)] = a.substr(eq + 1);
      } else if (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) {
        kv_[a] = argv[++i];
      } else {
        kv_[a] = "1";
      }
    }
  }
  bool Has(const std::string& k) const { return kv_.count(k) != 0; }
  std::string Str(const std::string& k, const std::string& def = "") const {
    auto it = kv_.find(k);
    return it == kv_.end() ? def : it->second;
  }
  long long Int(const std::string& k, long long def) const {
    auto it = kv_.find(k);
    return it == kv_.end() ? def : std::atoll(it->second.c_str());
  }
  std::vector<std::string> List(const std::string& k, const std::string& def) const {
    std::vector<std::string> out;
    std::stringstream ss(Str(k, def));
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (!item.empty()) out.push_back(item);
    }
    return out;
  }

 private:
  std::map<std::string, std::string> kv_;
};

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "bench: %s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

// One round: `in` and `out` hold 2*channels + 1 doubles: [count | a[C] | b[C]].
using ExchangeFn = std::function<void(int channels, Phase phase, Scope scope, const double* in,
                                      double* out, uint32_t op, uint64_t seq)>;

struct Plan {
  std::vector<int> channels;        // --channels 64,256,1024,2048
  std::vector<Phase> phases;        // --phases fwd,bwd (baselines: fwd only; a sum is a sum)
  std::vector<Scope> scopes;        // --scopes node,global (baselines: node only)
  int rounds = 200;                 // --rounds: timed rounds per case
  int warmup = 20;                  // --warmup: untimed rounds per case
  int resnet_steps = 0;             // --resnet-steps: timed ResNet-50 steps per scope
  int resnet_warmup = 2;            // --resnet-warmup
  std::vector<Scope> resnet_scopes;  // --resnet-scopes (default: --scopes)
  std::string out;                  // --out: sample file

  static Plan FromArgs(const Args& args) {
    Plan p;
    for (const auto& c : args.List("channels", "256")) p.channels.push_back(std::atoi(c.c_str()));
    for (const auto& s : args.List("phases", "fwd"))
      p.phases.push_back(s == "bwd" ? Phase::kBackward : Phase::kForward);
    for (const auto& s : args.List("scopes", "node"))
      p.scopes.push_back(s == "global" ? Scope::kGlobal : Scope::kNode);
    for (const auto& s : args.List("resnet-scopes", args.Str("scopes", "node")))
      p.resnet_scopes.push_back(s == "global" ? Scope::kGlobal : Scope::kNode);
    p.rounds = static_cast<int>(args.Int("rounds", p.rounds));
    p.warmup = static_cast<int>(args.Int("warmup", p.warmup));
    p.resnet_steps = static_cast<int>(args.Int("resnet-steps", p.resnet_steps));
    p.resnet_warmup = static_cast<int>(args.Int("resnet-warmup", p.resnet_warmup));
    p.out = args.Str("out");
    if (p.out.empty()) Die("--out FILE is required");
    return p;
  }
};

// Deterministic, rank-dependent contribution: count, then a and b (b >= 0, as m2 must be).
inline void FillContribution(int rank, int channels, std::vector<double>* buf) {
  buf->assign(2 * channels + 1, 0.0);
  (*buf)[0] = 8.0 + rank;
  for (int c = 0; c < channels; ++c) {
    (*buf)[1 + c] = 0.001 * c + 0.1 * rank;
    (*buf)[1 + channels + c] = 1.0 + 0.01 * c + rank;
  }
}

// Runs the plan and writes the samples. Op numbers: latency cases use op = 1000 + case index so
// that they never collide with the ResNet-50 layers (op = layer index 0..52).
inline void RunPlan(const Plan& plan, int rank, const ExchangeFn& exchange) {
  std::FILE* f = std::fopen(plan.out.c_str(), "w");
  if (!f) Die("cannot write " + plan.out);
  rusage ru0{};
  ::getrusage(RUSAGE_SELF, &ru0);
  int max_c = 2048;
  for (int c : plan.channels) max_c = std::max(max_c, c);
  std::vector<double> in, out(2 * max_c + 1);
  std::vector<int64_t> samples;
  int64_t rounds_total = 0;
  uint32_t case_op = 1000;
  for (int channels : plan.channels) {
    FillContribution(rank, channels, &in);
    for (Scope scope : plan.scopes) {
      for (Phase phase : plan.phases) {
        const uint32_t op = case_op++;
        samples.clear();
        samples.reserve(plan.rounds);
        uint64_t seq = 0;
        for (int i = 0; i < plan.warmup; ++i) {
          exchange(channels, phase, scope, in.data(), out.data(), op, seq++);
        }
        for (int i = 0; i < plan.rounds; ++i) {
          const int64_t t0 = NowNs();
          exchange(channels, phase, scope, in.data(), out.data(), op, seq++);
          samples.push_back(NowNs() - t0);
        }
        rounds_total += plan.warmup + plan.rounds;
        std::fprintf(f, "lat %d %s %s", channels, PhaseName(phase), ScopeName(scope));
        for (int64_t s : samples) std::fprintf(f, " %lld", static_cast<long long>(s));
        std::fprintf(f, "\n");
        std::fflush(f);
      }
    }
  }
  if (plan.resnet_steps > 0) {
    const std::vector<int> layers = ResNet50Channels();
    std::vector<std::vector<double>> inputs(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) FillContribution(rank, layers[l], &inputs[l]);
    // One invocation per layer and phase per step. seq keeps counting across scopes: a round's
    // key is (op, seq, phase), so restarting it would replay rounds the aggregator has finished.
    uint64_t seq = 0;
    for (Scope scope : plan.resnet_scopes) {
      samples.clear();
      for (int step = 0; step < plan.resnet_warmup + plan.resnet_steps; ++step, ++seq) {
        const int64_t t0 = NowNs();
        for (size_t l = 0; l < layers.size(); ++l) {
          exchange(layers[l], Phase::kForward, scope, inputs[l].data(), out.data(),
                   static_cast<uint32_t>(l), seq);
        }
        for (size_t l = layers.size(); l-- > 0;) {
          exchange(layers[l], Phase::kBackward, scope, inputs[l].data(), out.data(),
                   static_cast<uint32_t>(l), seq);
        }
        if (step >= plan.resnet_warmup) samples.push_back(NowNs() - t0);
        rounds_total += 2 * static_cast<int64_t>(layers.size());
      }
      std::fprintf(f, "step %s", ScopeName(scope));
      for (int64_t s : samples) std::fprintf(f, " %lld", static_cast<long long>(s));
      std::fprintf(f, "\n");
      std::fflush(f);
    }
  }
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  auto ns = [](const timeval& tv) {
    return static_cast<long long>(tv.tv_sec) * 1000000000LL + tv.tv_usec * 1000LL;
  };
  std::fprintf(f, "cost %lld %lld %lld %ld %ld\n", static_cast<long long>(rounds_total),
               ns(ru.ru_utime) - ns(ru0.ru_utime), ns(ru.ru_stime) - ns(ru0.ru_stime),
               ru.ru_nvcsw - ru0.ru_nvcsw, ru.ru_nivcsw - ru0.ru_nivcsw);
  std::fclose(f);
}

// Element-wise sum of `n` doubles: the reduction every allreduce baseline performs.
inline void SumInto(double* acc, const double* x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

}  // namespace hsbn_bench

#endif  // HSBN_BENCH_EXCHANGE_BENCH_COMMON_H_

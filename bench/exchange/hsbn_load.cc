// hsbn_load — aggregator throughput load: many concurrent jobs, one thread per worker, each
// with its own hsbn_client, keeping --inflight rounds in flight (hsbn_round_start / _wait).
// One process plays one node's workers of every job; run one per node for global scope.
//
// Stopping is agreed through the rounds themselves, so every member of a job runs the same
// rounds: a worker contributes count 1 while it wants to go on and count 2^30 once --seconds
// have passed; every member sees the same reduced count and stops after the same round (then
// drains the rounds already started, which every member started too).
//
// Writes JSON to --out: {"rounds": R, "seconds": S, "rounds_total": T}: R rounds completed (by
// all jobs, counted once per round) in the timed window of S seconds after a warm-up, T all
// rounds completed.
//
//   hsbn_load --address=ADDR --jobs=J --local-world=K --nodes=N --node-rank=I --scope=node|global
//             --channels=C --inflight=D --seconds=S --out=FILE
#include <atomic>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "hsbn/hsbn.h"

namespace hsbn_bench {
namespace {

constexpr int64_t kStopCount = int64_t{1} << 30;

struct JobCounters {
  int64_t warm_rounds = -1;  // rounds completed when the warm-up ended
  int64_t rounds = 0;
  int64_t end_ns = 0;
};

int Main(const Args& args) {
  const std::string address = args.Str("address");
  const int jobs = static_cast<int>(args.Int("jobs", 8));
  const int local = static_cast<int>(args.Int("local-world", 2));
  const int nodes = static_cast<int>(args.Int("nodes", 1));
  const int node_rank = static_cast<int>(args.Int("node-rank", 0));
  const hsbn_scope scope = args.Str("scope", "node") == "global" ? HSBN_SCOPE_GLOBAL
                                                                 : HSBN_SCOPE_NODE;
  const int channels = static_cast<int>(args.Int("channels", 256));
  const int inflight = static_cast<int>(args.Int("inflight", 4));
  const double seconds = std::atof(args.Str("seconds", "3").c_str());
  const double warm_seconds = std::min(1.0, seconds / 4);
  std::vector<JobCounters> counters(jobs);
  std::atomic<int> failures{0};
  std::vector<std::string> job_ids(jobs);
  for (int j = 0; j < jobs; ++j) job_ids[j] = "load-" + std::to_string(j);

  const int64_t t_start = NowNs();
  const int64_t t_warm = t_start + static_cast<int64_t>(warm_seconds * 1e9);
  const int64_t t_stop = t_start + static_cast<int64_t>((warm_seconds + seconds) * 1e9);
  auto worker = [&](int job, int local_rank) {
    hsbn_options opt;
    hsbn_options_init(&opt);
    opt.address = address.c_str();
    opt.job_id = job_ids[job].c_str();
    opt.rank = node_rank * local + local_rank;
    opt.world_size = nodes * local;
    opt.local_rank = local_rank;
    opt.local_world_size = local;
    opt.node_rank = node_rank;
    opt.connect_timeout_ms = 20000;
    hsbn_client* client = nullptr;
    if (hsbn_client_create(&opt, &client) != HSBN_OK) {
      std::fprintf(stderr, "hsbn_load: create: %s\n", hsbn_last_error());
      ++failures;
      return;
    }
    std::vector<double> a(channels), b(channels), oa(channels), ob(channels);
    for (int c = 0; c < channels; ++c) {
      a[c] = 0.001 * c + 0.1 * opt.rank;
      b[c] = 1.0 + c;
    }
    std::deque<hsbn_round*> window;
    uint64_t next_seq = 0;
    int64_t done = 0;
    bool stopping = false;
    auto start_one = [&]() {
      const int64_t count = NowNs() >= t_stop ? kStopCount : 1;
      hsbn_round* r = nullptr;
      if (hsbn_round_start(client, HSBN_PHASE_FORWARD, 0, next_seq++, scope, channels, count,
                           a.data(), b.data(), &r) != HSBN_OK) {
        return false;
      }
      window.push_back(r);
      return true;
    };
    bool ok = true;
    for (int i = 0; i < inflight && ok; ++i) ok = start_one();
    // Bounded: at most 10^8 rounds, and the stop count ends it within one window of --seconds.
    while (ok && !window.empty() && done < 100000000) {
      hsbn_round* r = window.front();
      window.pop_front();
      int64_t out_count = 0;
      if (hsbn_round_wait(r, &out_count, oa.data(), ob.data()) != HSBN_OK) {
        std::fprintf(stderr, "hsbn_load: round: %s\n", hsbn_last_error());
        ok = false;
        break;
      }
      ++done;
      if (local_rank == 0) {
        JobCounters& jc = counters[job];
        if (jc.warm_rounds < 0 && NowNs() >= t_warm) jc.warm_rounds = done;
        jc.rounds = done;
        jc.end_ns = NowNs();
      }
      if (out_count >= kStopCount) stopping = true;
      if (!stopping) ok = start_one();
    }
    if (!ok) ++failures;
    hsbn_client_destroy(client);
  };
  std::vector<std::thread> threads;
  for (int j = 0; j < jobs; ++j) {
    for (int l = 0; l < local; ++l) threads.emplace_back(worker, j, l);
  }
  for (auto& t : threads) t.join();
  int64_t timed = 0, total = 0, end_ns = t_warm;
  for (const auto& jc : counters) {
    total += jc.rounds;
    if (jc.warm_rounds >= 0) timed += jc.rounds - jc.warm_rounds;
    end_ns = std::max(end_ns, jc.end_ns);
  }
  std::FILE* f = std::fopen(args.Str("out").c_str(), "w");
  if (!f) Die("cannot write --out");
  std::fprintf(f, "{\"rounds\": %lld, \"seconds\": %.6f, \"rounds_total\": %lld, \"failures\": %d}\n",
               static_cast<long long>(timed), (end_ns - t_warm) / 1e9,
               static_cast<long long>(total), failures.load());
  std::fclose(f);
  return failures.load() == 0 ? 0 : 1;
}

}  // namespace
}  // namespace hsbn_bench

int main(int argc, char** argv) {
  hsbn_bench::Args args(argc, argv);
  return hsbn_bench::Main(args);
}

// A root, 2 sidecars and 8 worker processes on this machine: results equal the statistics of
// the concatenated data, are bitwise identical on every member and identical across reruns
// (the reruns with 3 event threads per aggregator, and with --poll-us).
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "local_cluster.h"
#include "synthetic.h"

namespace hsbn {
namespace {

using cluster::LocalCluster;
using cluster::Subprocess;

constexpr int kNodes = 2, kPerNode = 4, kWorld = kNodes * kPerNode;
constexpr int kRounds = 12, kChannels = 33;
const std::vector<int64_t> kBatch = {3, 0, 5, 1, 4, 4, 2, 7};  // uneven, one empty

struct Line {
  int64_t count;
  std::vector<double> a, b;
  std::string raw;  // the exact text (hex floats), for bitwise comparison
};
// dump[(kind, scope, round)] for one worker
using Dump = std::map<std::tuple<char, std::string, int>, Line>;

Dump ReadDump(const std::string& path) {
  Dump d;
  std::ifstream in(path);
  std::string text;
  while (std::getline(in, text)) {
    std::istringstream ls(text);
    char kind;
    std::string scope;
    int round;
    Line line;
    ls >> kind >> scope >> round >> line.count;
    std::string tok;
    bool second = false;
    while (ls >> tok) {
      if (tok == "|") {
        second = true;
        continue;
      }
      (second ? line.b : line.a).push_back(std::strtod(tok.c_str(), nullptr));
    }
    line.raw = text;
    d[{kind, scope, round}] = line;
  }
  return d;
}

// `flags` go to every aggregator; with them, the aggregators must also exit 0 on SIGTERM.
std::vector<Dump> RunJob(const std::string& tag, std::vector<std::string> flags = {}) {
  cluster::ClusterOptions opts;
  opts.nodes = kNodes;
  opts.workers_per_node = kPerNode;
  opts.extra_flags = flags;
  auto c = LocalCluster::Start(opts);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return {};
  std::string sizes;
  for (int64_t b : kBatch) sizes += (sizes.empty() ? "" : ",") + std::to_string(b);
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (int r = 0; r < kWorld; ++r) {
    auto p = Subprocess::Spawn(
        {HSBN_SYNTHETIC, "--worker", absl::StrCat("--rounds=", kRounds), "--layers=3",
         absl::StrCat("--channels=", kChannels), "--batch-sizes=" + sizes,
         "--scopes=node,global", "--seed=5", absl::StrCat("--dump=", (*c)->dir(), "/dump", r),
         absl::StrCat("--report=", (*c)->dir(), "/report", r)},
        (*c)->WorkerEnv(r, "cluster-test-" + tag), absl::StrCat((*c)->dir(), "/worker", r, ".log"));
    EXPECT_TRUE(p.ok());
    workers.push_back(std::move(*p));
  }
  std::vector<Dump> dumps;
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(workers[r]->Wait(std::chrono::seconds(120)), 0) << "worker " << r;
    dumps.push_back(ReadDump(absl::StrCat((*c)->dir(), "/dump", r)));
  }
  if (!flags.empty()) {
    for (int n = 0; n < kNodes; ++n) EXPECT_EQ((*c)->sidecar(n)->Stop(), 0) << "sidecar " << n;
    EXPECT_EQ((*c)->root()->Stop(), 0) << "root";
  }
  return dumps;
}

TEST(Cluster, TwoNodesByFourWorkersEqualConcatenatedDataIdenticallyOnEveryMemberAndRerun) {
  const std::vector<Dump> first = RunJob("a");
  ASSERT_EQ(first.size(), size_t(kWorld));
  int checked = 0;
  for (const std::string scope : {"node", "global"}) {
    for (int k = 0; k < kRounds; ++k) {
      const int round_index = (scope == "node" ? 0 : kRounds) + k;
      for (int group = 0; group < (scope == "global" ? 1 : kNodes); ++group) {
        const int lo = scope == "global" ? 0 : group * kPerNode;
        const int hi = scope == "global" ? kWorld : lo + kPerNode;
        std::vector<std::vector<double>> xs, dys;
        std::vector<int64_t> counts;
        for (int r = lo; r < hi; ++r) {
          xs.push_back(synthetic::Input(5, r, round_index, kBatch[r], kChannels));
          dys.push_back(synthetic::Grad(5, r, round_index, kBatch[r], kChannels));
          counts.push_back(kBatch[r]);
        }
        const auto want = synthetic::ReferenceMoments(xs, counts, kChannels);
        const Line& f0 = first[lo].at({'F', scope, round_index});
        const Line& b0 = first[lo].at({'B', scope, round_index});
        EXPECT_EQ(f0.count, want.count);
        EXPECT_LT(synthetic::MaxRelativeError(f0.a, want.a, 1e-6), 1e-13) << scope << " " << k;
        EXPECT_LT(synthetic::MaxRelativeError(f0.b, want.b, 1e-6), 1e-12) << scope << " " << k;
        // Backward sums use the reduced mean, as every worker did.
        const auto wantb = synthetic::ReferenceBackward(xs, dys, counts, kChannels, f0.a);
        EXPECT_EQ(b0.count, want.count);
        EXPECT_LT(synthetic::MaxRelativeError(b0.a, wantb.a, 1.0), 1e-13);
        EXPECT_LT(synthetic::MaxRelativeError(b0.b, wantb.b, 1.0), 1e-13);
        for (int r = lo; r < hi; ++r) {  // bitwise identical on every member
          EXPECT_EQ(first[r].at({'F', scope, round_index}).raw, f0.raw) << "rank " << r;
          EXPECT_EQ(first[r].at({'B', scope, round_index}).raw, b0.raw) << "rank " << r;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kRounds * (kNodes + 1));
  // Node scope really is per node: the two nodes' statistics differ.
  EXPECT_NE(first[0].at({'F', "node", 0}).raw.substr(10), first[4].at({'F', "node", 0}).raw.substr(10));
  auto expect_same = [&](const std::vector<Dump>& rerun, const char* what) {
    ASSERT_EQ(rerun.size(), size_t(kWorld)) << what;
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(first[r].size(), rerun[r].size()) << what;
      for (const auto& [key, line] : first[r]) {
        EXPECT_EQ(rerun[r].at(key).raw, line.raw) << what << " differs, rank " << r;
      }
    }
  };
  // The rerun's aggregators run 3 event threads each (--event-threads): streams on different
  // threads, results written across them; the bits must not change.
  expect_same(RunJob("b", {"--event-threads=3"}), "the rerun");
  // And with --poll-us (the sidecars poll for the root's answers; the root ignores it):
  // only who waits how changes, never the bits.
  expect_same(RunJob("c", {"--poll-us=2000"}), "the --poll-us run");
}

}  // namespace
}  // namespace hsbn

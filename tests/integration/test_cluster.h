// Shared by the integration tests: starting a LocalCluster, and a worker's client for one rank
// of it, in torchrun's layout (rank = node * workers_per_node + local rank).
#ifndef HSBN_TESTS_INTEGRATION_TEST_CLUSTER_H_
#define HSBN_TESTS_INTEGRATION_TEST_CLUSTER_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "local_cluster.h"

namespace hsbn::testing {

// A root (when nodes > 1) and one sidecar per node; `flags` go to every aggregator. A failure
// is a test failure (and nullptr).
inline std::unique_ptr<cluster::LocalCluster> StartCluster(int nodes, int per_node,
                                                           std::vector<std::string> flags = {}) {
  cluster::ClusterOptions opts;
  opts.nodes = nodes;
  opts.workers_per_node = per_node;
  opts.extra_flags = std::move(flags);
  auto c = cluster::LocalCluster::Start(opts);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

inline ClientOptions RankOptions(const cluster::LocalCluster& c, int rank, const std::string& job,
                                 std::chrono::milliseconds round_timeout = {}) {
  ClientOptions o;
  o.address = c.sidecar_address(rank / c.workers_per_node());
  o.job_id = job;
  o.rank = rank;
  o.world_size = c.world_size();
  o.local_rank = rank % c.workers_per_node();
  o.local_world_size = c.workers_per_node();
  o.node_rank = rank / c.workers_per_node();
  o.round_timeout = round_timeout;
  return o;
}

// Connects rank `rank` to its node's sidecar; a failure is a test failure (and nullptr).
inline std::unique_ptr<Client> ConnectRank(const cluster::LocalCluster& c, int rank,
                                           const std::string& job,
                                           std::chrono::milliseconds round_timeout = {}) {
  auto client = Client::Connect(RankOptions(c, rank, job, round_timeout));
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// Connects every rank of `c` to job `job` with the given group size, auto policy and round
// timeout; a failure is a test failure (and a null entry).
inline std::vector<std::unique_ptr<Client>> ConnectJob(
    const cluster::LocalCluster& c, const std::string& job, int group_nodes,
    AutoPolicy policy = {}, std::chrono::milliseconds round_timeout = {}) {
  std::vector<std::unique_ptr<Client>> out;
  for (int r = 0; r < c.world_size(); ++r) {
    ClientOptions o = RankOptions(c, r, job, round_timeout);
    o.group_nodes = group_nodes;
    o.auto_policy = policy;
    auto client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    out.push_back(client.ok() ? std::move(*client) : nullptr);
  }
  return out;
}

// Runs fn(rank) for ranks 0..ranks-1, each on a thread of its own (rounds block), and joins
// them.
inline void OnEveryRank(int ranks, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

}  // namespace hsbn::testing

#endif  // HSBN_TESTS_INTEGRATION_TEST_CLUSTER_H_

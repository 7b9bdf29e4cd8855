// A worker's client for one rank of a LocalCluster, in torchrun's layout (rank = node *
// workers_per_node + local rank), shared by the integration tests that run in-process clients.
#ifndef HSBN_TESTS_INTEGRATION_RANK_CLIENT_H_
#define HSBN_TESTS_INTEGRATION_RANK_CLIENT_H_

#include <chrono>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "local_cluster.h"

namespace hsbn::testing {

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

}  // namespace hsbn::testing

#endif  // HSBN_TESTS_INTEGRATION_RANK_CLIENT_H_

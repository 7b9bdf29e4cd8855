// LocalCluster's simulated cross-node link (ClusterOptions::link_delay_ms): every sidecar reaches
// the root through its own hsbn-linkproxy. Asserted through the proxies' own counters: a
// global round crosses each node's link up and down, every chunk held at least the delay; node
// rounds do not cross it.
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "test_cluster.h"

namespace hsbn {
namespace {

using testing::ConnectRank;

std::map<std::string, int64_t> LinkStats(cluster::LocalCluster& c, int node) {
  auto answer = c.LinkCommand(node, "stats");
  EXPECT_TRUE(answer.ok()) << answer.status();
  std::map<std::string, int64_t> kv;
  std::istringstream in(answer.ok() ? *answer : "");
  for (std::string w; in >> w;) {
    const size_t eq = w.find('=');
    if (w.substr(0, eq) != "mode") kv[w.substr(0, eq)] = std::stoll(w.substr(eq + 1));
  }
  return kv;
}

// `rounds` blocking forward rounds of `scope` on every client, one thread per client.
void RunRounds(std::vector<std::unique_ptr<Client>>& clients, Scope scope, uint64_t first_seq,
               int rounds) {
  std::vector<std::thread> threads;
  for (auto& client : clients) {
    threads.emplace_back([&client, scope, first_seq, rounds] {
      std::vector<double> mean = {1, 2}, m2 = {1, 1}, om(2), o2(2);
      for (int i = 0; i < rounds; ++i) {
        int64_t count = 0;
        absl::Status s = client->Forward(0, first_seq + i, scope, 2, 2, mean.data(), m2.data(),
                                         &count, om.data(), o2.data());
        EXPECT_TRUE(s.ok()) << s;
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(LinkDelay, GlobalRoundsCrossTheDelayedLinkBothWaysAndNodeRoundsDoNot) {
  constexpr int kDelayMs = 40, kRounds = 10;
  cluster::ClusterOptions opts;
  opts.nodes = 2;
  opts.workers_per_node = 1;
  opts.link_delay_ms = kDelayMs;
  auto c = cluster::LocalCluster::Start(opts);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_NE((*c)->link_proxy(0), nullptr);
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(ConnectRank(**c, r, "link-delay"));
  ASSERT_TRUE(clients[0] && clients[1]);

  RunRounds(clients, Scope::kGlobal, 0, 1);  // the sidecars' links to the root are up
  std::vector<std::map<std::string, int64_t>> before;
  for (int n = 0; n < 2; ++n) before.push_back(LinkStats(**c, n));
  RunRounds(clients, Scope::kNode, 100, kRounds);
  for (int n = 0; n < 2; ++n) {
    // Node rounds never leave the node; at most a keepalive ping may cross meanwhile.
    const auto after = LinkStats(**c, n);
    EXPECT_LT(after.at("up_chunks") - before[n].at("up_chunks"), kRounds / 2) << "node " << n;
    EXPECT_LT(after.at("down_chunks") - before[n].at("down_chunks"), kRounds / 2);
  }
  for (int n = 0; n < 2; ++n) ASSERT_TRUE((*c)->LinkCommand(n, "stats-reset").ok());
  RunRounds(clients, Scope::kGlobal, 1, kRounds);
  for (int n = 0; n < 2; ++n) {
    const auto st = LinkStats(**c, n);
    // One round at a time: each sends its node's partial up and gets the result down.
    EXPECT_GE(st.at("up_chunks"), kRounds) << "node " << n;
    EXPECT_GE(st.at("down_chunks"), kRounds) << "node " << n;
    EXPECT_GE(st.at("up_held_min_us"), kDelayMs * 1000) << "node " << n;
    EXPECT_GE(st.at("down_held_min_us"), kDelayMs * 1000) << "node " << n;
    EXPECT_EQ(st.at("delay_up_ms"), kDelayMs);
  }
}

TEST(LinkDelay, ADroppedLinkFailsGlobalRoundsNamingTheRootAndResumeHealsIt) {
  cluster::ClusterOptions opts;
  opts.nodes = 2;
  opts.workers_per_node = 1;
  opts.link_proxy = true;
  auto c = cluster::LocalCluster::Start(opts);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(ConnectRank(**c, r, "link-drop"));
  ASSERT_TRUE(clients[0] && clients[1]);
  RunRounds(clients, Scope::kGlobal, 0, 1);
  auto dropped = (*c)->LinkCommand(0, "drop");
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(*dropped, "drop reset=1");
  // Node 0's sidecar lost the root: its global round fails naming the link, and so does the
  // other node's (the root answers it that node 0 is gone, or the deadline).
  std::vector<double> mean = {1, 2}, m2 = {1, 1}, om(2), o2(2);
  int64_t count = 0;
  absl::Status s0 = clients[0]->Forward(0, 1, Scope::kGlobal, 2, 2, mean.data(), m2.data(),
                                        &count, om.data(), o2.data());
  EXPECT_EQ(s0.code(), absl::StatusCode::kUnavailable) << s0;
  EXPECT_NE(s0.message().find("root"), std::string::npos) << s0;
  ASSERT_TRUE((*c)->LinkCommand(0, "resume").ok());
  // The sidecar reconnects through the proxy: after a failed connect it fails forwards at once
  // for 2 s (server/parent_link.cc), and gRPC retries within 1 s, so rounds succeed again once
  // it has. Rounds are retried until one does; every failure meanwhile is UNAVAILABLE. The
  // 60 s bound is a backstop against a hang, not a timing assertion.
  absl::Status last;
  const auto backstop = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (uint64_t seq = 10; std::chrono::steady_clock::now() < backstop; ++seq) {
    std::vector<absl::Status> st(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        std::vector<double> a = {1, 2}, b = {1, 1}, oa(2), ob(2);
        int64_t n = 0;
        st[r] = clients[r]->Forward(0, seq, Scope::kGlobal, 2, 2, a.data(), b.data(), &n,
                                    oa.data(), ob.data());
      });
    }
    for (auto& t : threads) t.join();
    last = st[0].ok() ? st[1] : st[0];
    if (last.ok()) break;
    EXPECT_EQ(last.code(), absl::StatusCode::kUnavailable) << last;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // pace the retries
  }
  EXPECT_TRUE(last.ok()) << last;
  EXPECT_GE(LinkStats(**c, 0).at("accepted"), 2);  // the sidecar connected again
}

TEST(LinkDelay, ANegativeDelayIsRefusedNamingIt) {
  cluster::ClusterOptions opts;
  opts.link_delay_ms = -1;
  auto c = cluster::LocalCluster::Start(opts);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("link_delay_ms"), std::string::npos) << c.status();
}

}  // namespace
}  // namespace hsbn

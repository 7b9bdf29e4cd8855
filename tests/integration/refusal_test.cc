// A Join refused for its layout (a mismatched WORLD_SIZE, nodes pointed at the wrong sidecar)
// reaches every member of the job at once, with the reason and the member it is about, instead
// of a deadline that blames another rank; a stranger without the job's token cannot cause it.
// Real aggregator processes; the "grpc:" run repeats them with HSBN_TRANSPORT=grpc.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "local_cluster.h"
#include "test_cluster.h"
#include "wire.h"

namespace hsbn {
namespace {

using std::chrono::milliseconds;
using testing::ConnectRank;
using testing::RankOptions;
using testing::StartCluster;

constexpr milliseconds kLong{600000};  // only the refusal can end a round before this
const char* kLongFlag = "--round-timeout-ms=600000";

absl::Status Round(Client& c, uint64_t seq) {
  double mean = 1, m2 = 0, out_mean, out_m2;
  int64_t count;
  return c.Forward(1, seq, Scope::kNode, 1, 1, &mean, &m2, &count, &out_mean, &out_m2);
}

TEST(Refusals, AMismatchedWorldSizeFailsTheWaitingRankAtOnceNamingTheRefusedOne) {
  auto c = StartCluster(1, 2, {kLongFlag});
  ASSERT_TRUE(c);
  auto rank0 = ConnectRank(*c, 0, "mismatch", kLong);
  ASSERT_TRUE(rank0);
  absl::Status waited;
  std::thread waiter([&] { waited = Round(*rank0, 0); });
  // Rank 1 launched with another WORLD_SIZE: refused, naming what differs.
  ClientOptions bad = RankOptions(*c, 1, "mismatch", kLong);
  bad.world_size = 4;
  bad.local_world_size = 4;
  auto refused = Client::Connect(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(wire::ReasonOf(refused.status()), v1::REASON_LAYOUT) << refused.status();
  // Rank 0's round fails at once (not at the 10-minute deadline) with the same reason, naming
  // rank 1 and the field; so does its next one.
  waiter.join();
  for (const absl::Status& s : {waited, Round(*rank0, 1)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(wire::ReasonOf(s), v1::REASON_LAYOUT) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 1")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "world_size=4")) << s;
  }
}

TEST(Refusals, WithTokensAStrangerWithoutTheJobsTokenCannotFailIt) {
  char dir[] = "/tmp/hsbn-refusal-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string tokens = std::string(dir) + "/tokens";
  {
    std::ofstream f(tokens);
    f << "victim token-of-victim\n";
  }
  ASSERT_EQ(chmod(tokens.c_str(), 0600), 0);
  auto c = StartCluster(1, 2, {kLongFlag, "--token-file=" + tokens});
  ASSERT_TRUE(c);
  ClientOptions o0 = RankOptions(*c, 0, "victim", kLong);
  o0.token = "token-of-victim";
  auto rank0 = Client::Connect(o0);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  auto pending = (*rank0)->Start(Phase::kForward, 1, 0, Scope::kNode, 1, 1,
                                 std::vector<double>{1}.data(), std::vector<double>{0}.data());
  ASSERT_TRUE(pending.ok()) << pending.status();
  // A stranger with a colliding job id and another layout, without the job's token.
  ClientOptions stranger = RankOptions(*c, 1, "victim", kLong);
  stranger.world_size = 4;
  stranger.local_world_size = 4;
  stranger.token = "not-the-token";
  auto refused = Client::Connect(stranger);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  // The victim's round is untouched: it completes when its real rank 1 comes.
  ClientOptions o1 = RankOptions(*c, 1, "victim", kLong);
  o1.token = "token-of-victim";
  auto rank1 = Client::Connect(o1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  std::thread other([&] { EXPECT_TRUE(Round(**rank1, 0).ok()); });
  double out_a, out_b;
  int64_t count;
  absl::Status s = (*rank0)->Wait(**pending, &count, &out_a, &out_b);
  other.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(count, 2);
  std::remove(tokens.c_str());
  rmdir(dir);
}

// Node 1's ranks pointed at node 0's sidecar: refused there, and node 0's ranks, whose node
// rounds already run (through shared memory where the node can), fail their next round at
// once naming the refused rank.
TEST(Refusals, ANodePointedAtAnotherNodesSidecarFailsThatNodesRanksAtOnce) {
  auto c = StartCluster(2, 2, {kLongFlag});
  ASSERT_TRUE(c);
  auto a = ConnectRank(*c, 0, "wrong-sidecar", kLong);
  auto b = ConnectRank(*c, 1, "wrong-sidecar", kLong);
  ASSERT_TRUE(a && b);
  {
    std::thread t([&] { EXPECT_TRUE(Round(*b, 0).ok()); });
    EXPECT_TRUE(Round(*a, 0).ok());
    t.join();
  }
  absl::Status waited;
  std::thread waiter([&] { waited = Round(*a, 1); });  // rank 1 does not come
  ClientOptions stray = RankOptions(*c, 2, "wrong-sidecar", kLong);
  stray.address = c->sidecar_address(0);
  auto refused = Client::Connect(stray);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(wire::ReasonOf(refused.status()), v1::REASON_LAYOUT) << refused.status();
  waiter.join();
  for (const absl::Status& s : {waited, Round(*b, 1)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(wire::ReasonOf(s), v1::REASON_LAYOUT) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 2")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "GROUP_RANK")) << s;
  }
}

}  // namespace
}  // namespace hsbn

// Client::Abort with real aggregator processes: the aborting client's rounds end at once, and
// every other rank's rounds fail at once naming it and its reason (never at the round's
// deadline, which these tests set to 10 minutes); a worker's Abort frame can fail no other
// job's rounds. Run over both node transports (the "grpc:" run sets HSBN_TRANSPORT=grpc).
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/hsbn.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "local_cluster.h"
#include "test_cluster.h"
#include "wire.h"

namespace hsbn {
namespace {

using std::chrono::milliseconds;
using testing::ConnectRank;
using testing::StartCluster;

constexpr milliseconds kLong{600000};  // only an abort can end a round before this
const char* kLongFlag = "--round-timeout-ms=600000";

// One forward round of one channel, blocking.
absl::Status Round(Client& c, uint32_t op, uint64_t seq, Scope scope) {
  double mean = 1, m2 = 0, out_mean, out_m2;
  int64_t count;
  return c.Forward(op, seq, scope, 1, 1, &mean, &m2, &count, &out_mean, &out_m2);
}

// Runs Round on every client at once (the node's transport is decided at a first round).
void RoundTogether(const std::vector<Client*>& clients, uint32_t op, uint64_t seq, Scope scope) {
  std::vector<std::thread> threads;
  for (Client* c : clients) {
    threads.emplace_back([=] { EXPECT_TRUE(Round(*c, op, seq, scope).ok()); });
  }
  for (auto& t : threads) t.join();
}

TEST(Abort, EndsTheCallersWaitAndFailsTheOtherRankOfTheNodeAtOnceWithTheReason) {
  auto c = StartCluster(1, 2, {kLongFlag});
  ASSERT_TRUE(c);
  auto a = ConnectRank(*c, 0, "abort-node", kLong);
  auto b = ConnectRank(*c, 1, "abort-node", kLong);
  ASSERT_TRUE(a && b);
  RoundTogether({a.get(), b.get()}, 1, 0, Scope::kNode);
  absl::Status waited;
  std::thread waiter([&] { waited = Round(*a, 1, 1, Scope::kNode); });  // rank 1 never comes
  // From another thread, whether or not the waiter has started to wait: both must end it.
  a->Abort("loss is NaN");
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_TRUE(absl::StrContains(waited.message(), "loss is NaN")) << waited;
  absl::Status later = Round(*a, 1, 2, Scope::kNode);
  EXPECT_EQ(later.code(), absl::StatusCode::kAborted) << later;
  absl::Status other = Round(*b, 1, 1, Scope::kNode);
  EXPECT_EQ(other.code(), absl::StatusCode::kAborted) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "rank 0")) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "loss is NaN")) << other;
}

TEST(Abort, FailsAnotherNodesGlobalRoundAtOnceNamingTheRankAndTheReason) {
  auto c = StartCluster(2, 1, {kLongFlag});
  ASSERT_TRUE(c);
  auto a = ConnectRank(*c, 0, "abort-global", kLong);
  auto b = ConnectRank(*c, 1, "abort-global", kLong);
  ASSERT_TRUE(a && b);
  RoundTogether({a.get(), b.get()}, 1, 0, Scope::kGlobal);
  // Rank 1 waits in a global round that rank 0 never joins; rank 0 aborts.
  auto pending = b->Start(Phase::kForward, 1, 1, Scope::kGlobal, 1, 1,
                          std::vector<double>{1}.data(), std::vector<double>{0}.data());
  ASSERT_TRUE(pending.ok()) << pending.status();
  a->Abort("operator pressed Ctrl-C");
  double out_a, out_b;
  int64_t count;
  absl::Status s = b->Wait(**pending, &count, &out_a, &out_b);
  // At the root the aborted rank's node is down (NodeState), the code of a node that lost a
  // worker; the message names the rank and its reason.
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 0")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "aborted")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "operator pressed Ctrl-C")) << s;
}

TEST(Abort, CAbiAbortsAndWaitsInSlices) {
  auto c = StartCluster(1, 2, {kLongFlag});
  ASSERT_TRUE(c);
  auto b = ConnectRank(*c, 1, "abort-c", kLong);
  ASSERT_TRUE(b);
  hsbn_options o;
  hsbn_options_init(&o);
  const std::string address = c->sidecar_address(0);
  o.address = address.c_str();
  o.job_id = "abort-c";
  o.rank = 0;
  o.world_size = 2;
  o.local_rank = 0;
  o.local_world_size = 2;
  o.node_rank = 0;
  o.round_timeout_ms = kLong.count();
  hsbn_client* a = nullptr;
  ASSERT_EQ(hsbn_client_create(&o, &a), HSBN_OK) << hsbn_last_error();
  double mean = 1, m2 = 0;
  hsbn_round* round = nullptr;
  ASSERT_EQ(hsbn_round_start(a, HSBN_PHASE_FORWARD, 1, 0, HSBN_SCOPE_NODE, 1, 1, &mean, &m2,
                             &round),
            HSBN_OK)
      << hsbn_last_error();
  int done = 1;
  int64_t count;
  // Rank 1 never contributes: a slice ends with the round still open.
  EXPECT_EQ(hsbn_round_wait_for(round, 10, &done, &count, &mean, &m2), HSBN_OK);
  EXPECT_EQ(done, 0);
  ASSERT_EQ(hsbn_client_abort(a, "checkpoint failed"), HSBN_OK);
  hsbn_result r = HSBN_OK;
  while (done == 0) r = hsbn_round_wait_for(round, 200, &done, &count, &mean, &m2);
  EXPECT_EQ(r, HSBN_ABORTED);
  EXPECT_TRUE(absl::StrContains(hsbn_last_error(), "checkpoint failed")) << hsbn_last_error();
  absl::Status other = Round(*b, 1, 0, Scope::kNode);
  EXPECT_EQ(other.code(), absl::StatusCode::kAborted) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "rank 0")) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "checkpoint failed")) << other;
  hsbn_client_destroy(a);
}

// A worker's Abort frame says "this rank is gone": it reaches only the job of a session
// attached to its stream, whatever round or session it names.
TEST(Abort, AFrameNamingAnotherJobsRoundOrSessionFailsNothingThere) {
  auto c = StartCluster(1, 2, {kLongFlag});
  ASSERT_TRUE(c);
  auto victim0 = ConnectRank(*c, 0, "victim", kLong);
  ASSERT_TRUE(victim0);
  // The stranger: a worker of its own job on a raw stream.
  auto stub = v1::Aggregator::NewStub(
      grpc::CreateChannel(c->sidecar_address(0), grpc::InsecureChannelCredentials()));
  v1::JoinRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_2);
  req.set_job_id("stranger");
  req.set_kind(v1::MEMBER_KIND_WORKER);
  req.set_rank(0);
  req.set_world_size(1);
  req.set_local_rank(0);
  req.set_local_world_size(1);
  req.set_node_rank(0);
  v1::JoinResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Join(&ctx, req, &resp).ok());
  }
  grpc::ClientContext ctx;
  auto stream = stub->Exchange(&ctx);
  v1::ClientFrame attach;
  attach.mutable_attach()->add_sessions(resp.session());
  ASSERT_TRUE(stream->Write(attach));
  // The victim's rank 0 waits in op 1 seq 0 for its rank 1.
  auto pending = victim0->Start(Phase::kForward, 1, 0, Scope::kNode, 1, 1,
                                std::vector<double>{1}.data(), std::vector<double>{0}.data());
  ASSERT_TRUE(pending.ok()) << pending.status();
  // Aborts naming the victim's round: with a session that is not the stranger's (not attached
  // here), and with the stranger's own session.
  for (const std::string& session : {std::string(16, 'x'), resp.session()}) {
    v1::ClientFrame f;
    f.mutable_abort()->set_session(session);
    f.mutable_abort()->set_op(1);
    f.mutable_abort()->set_seq(0);
    f.mutable_abort()->set_phase(v1::PHASE_FORWARD);
    f.mutable_abort()->set_code(int(grpc::StatusCode::ABORTED));
    f.mutable_abort()->set_message("hostile");
    ASSERT_TRUE(stream->Write(f));
  }
  // A contribution after them: its answer says they were handled (one stream's frames are
  // handled in order). The stranger's own abort ended its own membership: NOT_FOUND.
  v1::ClientFrame f;
  v1::Contribution* contribution = f.mutable_contribution();
  contribution->set_session(resp.session());
  contribution->set_op(1);
  contribution->set_phase(v1::PHASE_FORWARD);
  contribution->set_scope(v1::SCOPE_NODE);
  contribution->set_channels(1);
  contribution->set_count(1);
  const double one = 1, zero = 0;
  wire::PackPayload(&one, &zero, 1, contribution->mutable_data());
  ASSERT_TRUE(stream->Write(f));
  v1::ServerFrame answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.result().code(), int(grpc::StatusCode::NOT_FOUND)) << answer.DebugString();
  // The victim's round is untouched: it completes when its rank 1 comes.
  auto victim1 = ConnectRank(*c, 1, "victim", kLong);
  ASSERT_TRUE(victim1);
  std::thread rank1([&] { EXPECT_TRUE(Round(*victim1, 1, 0, Scope::kNode).ok()); });
  double out_a, out_b;
  int64_t count;
  absl::Status s = victim0->Wait(**pending, &count, &out_a, &out_b);
  rank1.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(count, 2);
  ctx.TryCancel();
}

}  // namespace
}  // namespace hsbn

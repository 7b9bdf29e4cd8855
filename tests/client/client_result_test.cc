// What the client takes from its aggregator's answers and its options (client/result.h),
// including what tests/fuzz found a hostile aggregator or environment could do.
#include "result.h"

#include <chrono>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "wire.h"

namespace hsbn::client_internal {
namespace {

using std::chrono::milliseconds;

TEST(ClientResult, AnOkAnswerIsCopiedIntoTheCallersArrays) {
  v1::Result r;
  r.set_count(6);
  std::vector<double> a = {1.5, -2.0}, b = {0.25, 4.0};
  wire::PackPayload(a.data(), b.data(), 2, r.mutable_data());
  const Answer answer = TakeAnswer(&r);
  int64_t count = 0;
  std::vector<double> out_a(2), out_b(2);
  ASSERT_TRUE(DeliverAnswer(answer, 2, &count, out_a.data(), out_b.data()).ok());
  EXPECT_EQ(count, 6);
  EXPECT_EQ(out_a, a);
  EXPECT_EQ(out_b, b);
}

TEST(ClientResult, APayloadOfTheWrongSizeIsInternalAndWritesNothing) {
  v1::Result r;
  r.set_data(std::string(24, '\0'));  // 1.5 channels' worth
  const Answer answer = TakeAnswer(&r);
  int64_t count = -1;
  std::vector<double> out(2, 7.0);
  EXPECT_EQ(DeliverAnswer(answer, 2, &count, out.data(), out.data()).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(count, -1);
  EXPECT_EQ(out, std::vector<double>(2, 7.0));
}

TEST(ClientResult, AnUnknownCodeIsAFailureNotOk) {
  v1::Result r;
  r.set_code(-3);
  EXPECT_EQ(TakeAnswer(&r).status.code(), absl::StatusCode::kUnknown);
}

TEST(ClientResult, RoundWaitIsTheCallersOrTheAggregatorsPlusFiveSeconds) {
  EXPECT_EQ(RoundWait(milliseconds(1500), 30000), milliseconds(1500));
  EXPECT_EQ(RoundWait(milliseconds(0), 30000), milliseconds(35000));
  EXPECT_EQ(RoundWait(milliseconds(-1), 100), milliseconds(5100));
}

TEST(ClientResult, AnAggregatorsHugeOrNegativeRoundTimeoutCannotOverflowADeadline) {
  // Found by tests/fuzz/fuzz_client_results: JoinResponse.round_timeout_ms near INT64_MAX made
  // `now + wait` overflow (undefined behaviour), a negative one failed every round at once.
  const auto huge = RoundWait(milliseconds(0), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(huge, milliseconds(kMaxWaitMs) + std::chrono::seconds(5));
  const auto now = std::chrono::steady_clock::now();
  EXPECT_GT(now + huge, now);
  EXPECT_EQ(RoundWait(milliseconds(0), std::numeric_limits<int64_t>::min()), milliseconds(5000));
  EXPECT_EQ(RoundWait(milliseconds(std::numeric_limits<int64_t>::max()), 0),
            milliseconds(kMaxWaitMs));
}

ClientOptions Layout() {
  ClientOptions o;
  o.job_id = "j";
  o.rank = 0;
  o.world_size = 1;
  o.local_rank = 0;
  o.local_world_size = 1;
  o.node_rank = 0;
  return o;
}

TEST(ClientOptions, AConnectTimeoutOutsideZeroToMaxWaitIsRefusedNamingTheVariable) {
  ClientOptions o = Layout();
  EXPECT_TRUE(o.Validate().ok());
  o.connect_timeout = milliseconds(std::numeric_limits<int64_t>::max());
  absl::Status s = o.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("HSBN_CONNECT_TIMEOUT_MS"), std::string::npos) << s;
  o.connect_timeout = milliseconds(-1);
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientOptions, FromEnvRefusesALayoutVariableOutsideInt32NamingIt) {
  // Found by tests/fuzz/fuzz_env: LOCAL_RANK=4294967296 was taken as local rank 0.
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("LOCAL_RANK", "4294967296", 1);
  setenv("LOCAL_WORLD_SIZE", "1", 1);
  setenv("GROUP_RANK", "0", 1);
  setenv("HSBN_JOB_ID", "j", 1);
  absl::StatusOr<ClientOptions> o = ClientOptions::FromEnv();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("LOCAL_RANK=4294967296"), std::string::npos) << o.status();
  setenv("LOCAL_RANK", "0", 1);
  EXPECT_TRUE(ClientOptions::FromEnv().ok());
  setenv("HSBN_CONNECT_TIMEOUT_MS", "-5", 1);
  EXPECT_EQ(ClientOptions::FromEnv().status().code(), absl::StatusCode::kInvalidArgument);
  unsetenv("HSBN_CONNECT_TIMEOUT_MS");
}

}  // namespace
}  // namespace hsbn::client_internal

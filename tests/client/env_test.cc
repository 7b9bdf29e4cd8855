// The environment table (client/env.h): every type parsed and refused the same way whichever
// entry point reads it, fallbacks, and the C ABI's hsbn_env_get and hsbn_client_create.
#include "env.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/hsbn.h"
#include "wire.h"

namespace hsbn::env {
namespace {

Source Of(std::vector<const char*> entries) {
  entries.push_back(nullptr);
  return Source::Entries(entries.data());
}

std::string Value(const Source& s, const char* name) {
  absl::StatusOr<std::string> v = Resolve(s, name);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : "";
}

std::string Refusal(const Source& s, const char* name) {
  absl::StatusOr<std::string> v = Resolve(s, name);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << name;
  return std::string(v.status().message());
}

TEST(EnvTable, EveryEntryHasANameATypeAndADocLine) {
  ASSERT_GT(Table().size(), 20u);
  for (const Var& v : Table()) {
    EXPECT_EQ(Find(v.name), &v) << v.name << " appears twice";
    EXPECT_NE(std::string(v.doc), "") << v.name;
    if (*v.fallback != '\0') {
      EXPECT_NE(Find(v.fallback), nullptr) << v.name;
    }
    if (v.type == Type::kInt && *v.unset != '\0') {
      // The default itself passes the check.
      EXPECT_EQ(Value(Of({}), v.name), v.unset) << v.name;
    }
  }
  EXPECT_EQ(Find("HSBN_NO_SUCH"), nullptr);
  EXPECT_EQ(Resolve(Of({}), "HSBN_NO_SUCH").status().code(), absl::StatusCode::kNotFound);
}

TEST(EnvTable, IntegersAreCheckedAgainstTheirRangeAndNamed) {
  EXPECT_EQ(Value(Of({"HSBN_GROUP_NODES=4"}), "HSBN_GROUP_NODES"), "4");
  EXPECT_EQ(Value(Of({}), "HSBN_GROUP_NODES"), "0");
  EXPECT_EQ(Value(Of({"HSBN_GROUP_NODES="}), "HSBN_GROUP_NODES"), "0");  // empty: unset
  EXPECT_NE(Refusal(Of({"HSBN_GROUP_NODES=-1"}), "HSBN_GROUP_NODES").find("HSBN_GROUP_NODES=-1"),
            std::string::npos);
  EXPECT_NE(Refusal(Of({"HSBN_GROUP_NODES=x"}), "HSBN_GROUP_NODES")
                .find("HSBN_GROUP_NODES='x' is not an integer"),
            std::string::npos);
  // Digits past int64 are out of range, not misread.
  EXPECT_NE(Refusal(Of({"HSBN_INCARNATION=99999999999999999999"}), "HSBN_INCARNATION")
                .find("out of range"),
            std::string::npos);
  EXPECT_NE(Refusal(Of({"LOCAL_RANK=4294967296"}), "LOCAL_RANK").find("LOCAL_RANK=4294967296"),
            std::string::npos);
  EXPECT_NE(Refusal(Of({"HSBN_AUTO_WARMUP=0"}), "HSBN_AUTO_WARMUP").find("[1, "),
            std::string::npos);
}

TEST(EnvTable, FlagsAreZeroOrOneOnly) {
  EXPECT_EQ(Value(Of({"HSBN_STRICT_FINITE=1"}), "HSBN_STRICT_FINITE"), "1");
  EXPECT_EQ(Value(Of({"HSBN_STRICT_FINITE=0"}), "HSBN_STRICT_FINITE"), "0");
  EXPECT_EQ(Value(Of({}), "HSBN_STRICT_FINITE"), "0");
  // Once on through one reader and off through another; now refused by all.
  for (const char* bad : {"HSBN_STRICT_FINITE=2", "HSBN_STRICT_FINITE=true", "HSBN_STRICT_FINITE=on"}) {
    EXPECT_NE(Refusal(Of({bad}), "HSBN_STRICT_FINITE").find("is not 0 or 1"), std::string::npos)
        << bad;
  }
}

TEST(EnvTable, NumbersChoicesAndAddresses) {
  EXPECT_EQ(Value(Of({"HSBN_AUTO_MAX_MEAN_SHIFT=0.25"}), "HSBN_AUTO_MAX_MEAN_SHIFT"), "0.25");
  EXPECT_EQ(Value(Of({}), "HSBN_AUTO_MAX_MEAN_SHIFT"), "0.05");
  for (const char* bad : {"HSBN_AUTO_MAX_MEAN_SHIFT=-1", "HSBN_AUTO_MAX_MEAN_SHIFT=nan",
                          "HSBN_AUTO_MAX_MEAN_SHIFT=inf", "HSBN_AUTO_MAX_MEAN_SHIFT=abc"}) {
    EXPECT_NE(Refusal(Of({bad}), "HSBN_AUTO_MAX_MEAN_SHIFT").find("HSBN_AUTO_MAX_MEAN_SHIFT="),
              std::string::npos)
        << bad;
  }
  EXPECT_EQ(Value(Of({"HSBN_TRANSPORT=grpc"}), "HSBN_TRANSPORT"), "grpc");
  EXPECT_EQ(Value(Of({}), "HSBN_TRANSPORT"), "auto");
  EXPECT_NE(Refusal(Of({"HSBN_TRANSPORT=shm"}), "HSBN_TRANSPORT").find("not one of auto, grpc"),
            std::string::npos);
  EXPECT_EQ(Value(Of({}), "HSBN_ADDRESS"), "unix:/tmp/hsbn.sock");
  for (const char* good : {"unix:/tmp/x.sock", "unix-abstract:hsbn", "127.0.0.1:7070",
                           "localhost:1", "[::1]:65535", "dns:///host:7070"}) {
    EXPECT_TRUE(CheckAddress(good, "HSBN_ADDRESS").ok()) << good;
  }
  EXPECT_NE(Refusal(Of({"HSBN_ADDRESS=/run/hsbn.sock"}), "HSBN_ADDRESS")
                .find("a Unix socket is written HSBN_ADDRESS=unix:/run/hsbn.sock"),
            std::string::npos);
  for (const char* bad : {"127.0.0.1:99999", "127.0.0.1:0", "notaport", "host:", "unix:",
                          "host:12a"}) {
    EXPECT_FALSE(CheckAddress(bad, "HSBN_ADDRESS").ok()) << bad;
  }
}

TEST(EnvTable, FallbacksStandInForUnsetVariables) {
  EXPECT_EQ(Value(Of({"TORCHELASTIC_RUN_ID=abc"}), "HSBN_JOB_ID"), "abc");
  EXPECT_EQ(Value(Of({"HSBN_JOB_ID=j", "TORCHELASTIC_RUN_ID=abc"}), "HSBN_JOB_ID"), "j");
  // torchrun without --rdzv_id says "none": not a job id.
  EXPECT_NE(Refusal(Of({"TORCHELASTIC_RUN_ID=none"}), "HSBN_JOB_ID").find("HSBN_JOB_ID is not set"),
            std::string::npos);
  EXPECT_EQ(Value(Of({"TORCHELASTIC_RESTART_COUNT=3"}), "HSBN_INCARNATION"), "3");
  EXPECT_EQ(Value(Of({"HSBN_INCARNATION=7", "TORCHELASTIC_RESTART_COUNT=3"}), "HSBN_INCARNATION"),
            "7");
  EXPECT_NE(Refusal(Of({"TORCHELASTIC_RESTART_COUNT=-2"}), "HSBN_INCARNATION")
                .find("TORCHELASTIC_RESTART_COUNT=-2"),
            std::string::npos);
  const std::string path = ::testing::TempDir() + "/hsbn-env-token";
  std::ofstream(path) << "  secret-token\n";
  const std::string entry = "HSBN_TOKEN_FILE=" + path;
  EXPECT_EQ(Value(Of({entry.c_str()}), "HSBN_TOKEN"), "secret-token");
  EXPECT_EQ(Value(Of({"HSBN_TOKEN=t", entry.c_str()}), "HSBN_TOKEN"), "t");
  EXPECT_NE(Refusal(Of({"HSBN_TOKEN_FILE=/nonexistent/token"}), "HSBN_TOKEN")
                .find("HSBN_TOKEN_FILE=/nonexistent/token cannot be read"),
            std::string::npos);
  std::remove(path.c_str());
  EXPECT_NE(Refusal(Of({}), "RANK").find("RANK is not set"), std::string::npos);
}

TEST(EnvTable, FromEnvReadsAGivenEnvironmentOnlyAndEveryField) {
  Source s = Of({"RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=1",
                 "HSBN_JOB_ID=j", "HSBN_STRICT_FINITE=1", "HSBN_GROUP_NODES=2",
                 "HSBN_TRANSPORT=grpc", "HSBN_INCARNATION=5", "HSBN_AUTO_WARMUP=9",
                 "HSBN_AUTO_MAX_MEAN_SHIFT=0.5", "HSBN_AUTO_MAX_LOG_VAR_RATIO=0.25",
                 "HSBN_AUTO_RECHECK_EVERY=11", "HSBN_CONNECT_TIMEOUT_MS=0",
                 "HSBN_ROUND_TIMEOUT_MS=1234"});
  absl::StatusOr<ClientOptions> o = ClientOptions::FromEnv(s);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rank, 3);
  EXPECT_EQ(o->node_rank, 1);
  EXPECT_TRUE(o->strict_finite);
  EXPECT_EQ(o->group_nodes, 2);
  EXPECT_EQ(o->transport, "grpc");
  EXPECT_EQ(o->incarnation, 5u);
  EXPECT_EQ(o->auto_policy.warmup_rounds, 9);
  EXPECT_EQ(o->auto_policy.max_mean_shift, 0.5);
  EXPECT_EQ(o->auto_policy.max_log_var_ratio, 0.25);
  EXPECT_EQ(o->auto_policy.recheck_every, 11);
  EXPECT_EQ(o->connect_timeout.count(), 10000);  // 0: the default, as in the C ABI and Python
  EXPECT_EQ(o->round_timeout.count(), 1234);
  // The strict flag means the same through the C ABI: refused, naming the variable.
  Source bad = Of({"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1",
                   "GROUP_RANK=0", "HSBN_JOB_ID=j", "HSBN_STRICT_FINITE=2"});
  EXPECT_NE(ClientOptions::FromEnv(bad).status().message().find("HSBN_STRICT_FINITE='2'"),
            std::string::npos);
}

TEST(EnvTable, TheCAbiReadsTheSameTable) {
  const char* entries[] = {"HSBN_STRICT_FINITE=2", "HSBN_GROUP_NODES=3", nullptr};
  char buf[64];
  size_t needed = 0;
  EXPECT_EQ(hsbn_env_get(entries, "HSBN_GROUP_NODES", buf, sizeof buf, &needed), HSBN_OK);
  EXPECT_STREQ(buf, "3");
  EXPECT_EQ(needed, 2u);
  EXPECT_EQ(hsbn_env_get(entries, "HSBN_STRICT_FINITE", buf, sizeof buf, &needed),
            HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("HSBN_STRICT_FINITE='2'"), std::string::npos);
  EXPECT_EQ(hsbn_env_get(entries, "NOT_A_VARIABLE", buf, sizeof buf, &needed), HSBN_NOT_FOUND);
  int n = 0;
  while (hsbn_env_name(n) != nullptr) ++n;
  EXPECT_EQ(size_t(n), Table().size());
  // hsbn_client_create refuses the same value before connecting, whichever way it comes: from
  // the options' environment or from the process's.
  hsbn_options o;
  hsbn_options_init(&o);
  o.address = "unix:/nonexistent/hsbn.sock";
  o.job_id = "j";
  o.rank = o.local_rank = o.node_rank = 0;
  o.world_size = o.local_world_size = 1;
  o.env = entries;
  hsbn_client* client = nullptr;
  EXPECT_EQ(hsbn_client_create(&o, &client), HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("HSBN_STRICT_FINITE"), std::string::npos);
  o.env = nullptr;
  setenv("HSBN_STRICT_FINITE", "2", 1);
  EXPECT_EQ(hsbn_client_create(&o, &client), HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("HSBN_STRICT_FINITE"), std::string::npos);
  unsetenv("HSBN_STRICT_FINITE");
  // An invalid transport is refused too (it once meant "shared memory").
  const char* transport[] = {"HSBN_TRANSPORT=shm", nullptr};
  o.env = transport;
  EXPECT_EQ(hsbn_client_create(&o, &client), HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("HSBN_TRANSPORT='shm'"), std::string::npos);
  // A path without unix: is answered with the spelling that works, before any wait.
  o.env = nullptr;
  o.address = "/run/hsbn.sock";
  EXPECT_EQ(hsbn_client_create(&o, &client), HSBN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(hsbn_last_error()).find("unix:/run/hsbn.sock"), std::string::npos);
}

TEST(EnvTable, MarkdownListsEveryVariable) {
  const std::string md = Markdown();
  for (const Var& v : Table()) {
    EXPECT_NE(md.find(std::string("| `") + v.name + "` |"), std::string::npos) << v.name;
  }
}

}  // namespace
}  // namespace hsbn::env

// The scope table (proto/wire.h, kScopes) is the one definition: the client's names and
// parsing, the C ABI's hsbn_scope_* and the wire names all read it.
TEST(ScopeTable, TheClientAndTheCAbiReadTheOneTable) {
  ASSERT_EQ(hsbn_scope_count(), hsbn::wire::kScopeCount);
  ASSERT_EQ(hsbn_scope_count(), 7);
  std::vector<std::string> names;
  for (int v = 1; v <= hsbn_scope_count(); ++v) {
    const hsbn::wire::ScopeEntry& e = hsbn::wire::kScopes[v - 1];
    ASSERT_NE(hsbn_scope_name(v), nullptr);
    EXPECT_STREQ(hsbn_scope_name(v), e.name);
    EXPECT_STREQ(hsbn::ScopeName(hsbn::Scope(v)), e.name);
    absl::StatusOr<hsbn::Scope> parsed = hsbn::ParseScope(e.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(int(*parsed), v);
    const int flags = hsbn_scope_flags(v);
    EXPECT_EQ((flags & HSBN_SCOPE_ON_WIRE) != 0, e.scope != hsbn::v1::SCOPE_UNSPECIFIED);
    if (e.scope != hsbn::v1::SCOPE_UNSPECIFIED) {
      EXPECT_STREQ(hsbn::wire::ScopeName(e.scope), e.name);
    }
    names.push_back(std::string(e.name) + ":" + std::to_string(flags));
  }
  // The properties, spelled out once more here on purpose: a change to the table is a change
  // of behaviour that this test makes visible.
  const int C = HSBN_SCOPE_CROSS_NODE, S = HSBN_SCOPE_ROUND_STATS, W = HSBN_SCOPE_ON_WIRE,
            L = HSBN_SCOPE_LATE, B = HSBN_SCOPE_LATE_BACKWARD;
  auto n = [](const char* name, int f) { return std::string(name) + ":" + std::to_string(f); };
  EXPECT_EQ(names, (std::vector<std::string>{
                       n("node", S | W), n("global", C | S | W), n("shadow", C | S | W),
                       n("group", C | S | W), n("auto", C), n("renorm", C | S | W | L),
                       n("lagged", C | S | W | L | B)}));
  EXPECT_EQ(hsbn_scope_name(0), nullptr);
  EXPECT_EQ(hsbn_scope_name(8), nullptr);
  EXPECT_EQ(hsbn_scope_flags(-1), -1);
  EXPECT_EQ(hsbn_scope_flags(8), -1);
  absl::StatusOr<hsbn::Scope> bad = hsbn::ParseScope("Global");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message())
                .find("is not one of node, global, shadow, group, auto, renorm, lagged"),
            std::string::npos)
      << bad.status();
}

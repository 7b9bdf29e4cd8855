// hsbn-aggregator's flags (server/main.cc, CLI11): --help lists every flag with its default,
// --version names the build, values are validated and refused with exit status 2 naming the
// flag, `--name=value` and `--name value` both work and a repeated flag takes its last value.
// Real processes; the values that reach AggregatorOptions are read back from /metrics gauges.
#include <string>
#include <vector>

#include "aggregator_process.h"
#include "gtest/gtest.h"
#include "version.h"

namespace hsbn {
namespace {

using testing::RunAggregatorToExit;
using testing::Sample;
using testing::StartAggregator;
using testing::TempDir;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Flags, HelpListsEveryLimitFlagWithTheDefaultOfAggregatorOptions) {
  TempDir dir;
  auto [code, help] = RunAggregatorToExit(dir.path(), "help", {"--help"});
  ASSERT_EQ(code, 0) << help;
  // The defaults stated are those of server/aggregator.h (and metrics.h, log.h).
  for (const char* line : {
           "--max-world-size=N", "Default 16384.",
           "--memory-budget-bytes=N", "Default 1073741824 (1 GiB).",
           "--max-queued-bytes=N", "Default 67108864 (64 MiB).",
           "--write-deadline-ms=N", "Default 10000.",
           "--attach-timeout-ms=N", "Default 60000.",
           "--max-unbound-bytes=N", "Default 1048576 (1 MiB).",
           "--metrics-max-jobs=N", "Default 64.",
           "--log-lines-per-second=N", "Default 10.",
           "--max-jobs=N", "Default 256.",
           "--round-timeout-ms=N", "Default 30000.",
           "--socket-mode=OCTAL", "Default 0660.",
           "--allow-insecure-token-file ", "--version ", "--help ",
           // The prose of the old usage text is still there.
           "Usage:", "Signals: SIGTERM", "TLS (TCP only", "Job tokens:", "HSBN_TOKEN_FILE"}) {
    EXPECT_TRUE(Contains(help, line)) << line;
  }
  // -h is --help.
  auto [code_h, help_h] = RunAggregatorToExit(dir.path(), "h", {"-h"});
  EXPECT_EQ(code_h, 0);
  EXPECT_EQ(help_h, help);
}

TEST(Flags, VersionPrintsTheProjectVersionAndCommit) {
  TempDir dir;
  auto [code, out] = RunAggregatorToExit(dir.path(), "version", {"--version"});
  EXPECT_EQ(code, 0) << out;
  // "hsbn-aggregator VERSION (commit COMMIT)". The commit is the one CMake saw when it last
  // configured the binary, which may differ from this test's copy of version.h, so only its
  // presence is checked here (Metrics.BuildInfoAndVersionFlagAgree compares it with
  // hsbn_build_info from the same binary).
  const std::string prefix = std::string("hsbn-aggregator ") + server::kHsbnVersion + " (commit ";
  ASSERT_EQ(out.rfind(prefix, 0), 0u) << out;
  ASSERT_GT(out.size(), prefix.size() + 2) << out;
  EXPECT_EQ(out.substr(out.size() - 2), ")\n") << out;
  EXPECT_EQ(out.find(' ', prefix.size()), std::string::npos) << out;
}

TEST(Flags, BadValuesAreRefusedWithStatus2NamingTheFlag) {
  TempDir dir;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--role=nod"}, "--role"},
      {{}, "--role must be node, group or root"},
      {{"--role=node", "--max-jobs=0"}, "--max-jobs"},
      {{"--role=node", "--max-jobs=12abc"}, "--max-jobs"},
      {{"--role=node", "--max-jobs=0x10"}, "--max-jobs"},  // decimal only
      {{"--role=node", "--max-jobs=2147483648"}, "--max-jobs"},
      {{"--role=node", "--max-channels=4194305"}, "--max-channels"},
      {{"--role=node", "--event-threads=65"}, "--event-threads"},
      {{"--role=node", "--max-world-size=-1"}, "--max-world-size"},
      {{"--role=node", "--memory-budget-bytes=lots"}, "--memory-budget-bytes"},
      {{"--role=node", "--max-queued-bytes=0"}, "--max-queued-bytes"},
      {{"--role=node", "--write-deadline-ms=0"}, "--write-deadline-ms"},
      {{"--role=node", "--attach-timeout-ms=1.5"}, "--attach-timeout-ms"},
      {{"--role=node", "--max-unbound-bytes="}, "--max-unbound-bytes"},
      {{"--role=node", "--metrics-max-jobs=0"}, "--metrics-max-jobs"},
      {{"--role=node", "--log-lines-per-second=0"}, "--log-lines-per-second"},
      {{"--role=node", "--log-level=loud"}, "--log-level"},
      {{"--role=node", "--socket-mode=banana"}, "--socket-mode"},
      {{"--role=node", "--allow-insecure-token-file=maybe"}, "--allow-insecure-token-file"},
      {{"--role=node", "--no-such-flag=1"}, "--no-such-flag"},
      {{"--role=node", "stray"}, "stray"},
      {{"--role=root", "--upstream=x:1"}, "--upstream is for --role=node or group only"},
      {{"--role=group"}, "--role=group needs --upstream=<root address>"},
      {{"--role=group", "--upstream=x:1", "--shm=off"}, "--shm is for --role=node only"},
      // Addresses are checked before anything listens or connects (issue 26).
      {{"--role=root", "--listen=127.0.0.1:99999"},
       "--listen=127.0.0.1:99999: the port must be a number from 0 to 65535"},
      {{"--role=root", "--listen=127.0.0.1:-1"}, "--listen=127.0.0.1:-1: the port must be"},
      {{"--role=root", "--listen=0.0.0.0:7070,127.0.0.1:70000"},
       "--listen=127.0.0.1:70000: the port must be"},
      {{"--role=root", "--listen=7070"}, "--listen=7070 has no port"},
      {{"--role=root", "--listen=::1:7070"}, "an IPv6 address goes in brackets"},
      {{"--role=root", "--listen=:7070"}, "--listen=:7070 has no valid host"},
      {{"--role=node", "--listen=/run/hsbn/hsbn.sock"},
       "--listen=/run/hsbn/hsbn.sock is a path: a Unix socket is written "
       "--listen=unix:/run/hsbn/hsbn.sock"},
      {{"--role=node", "--listen=unix:"}, "--listen=unix: names no socket"},
      {{"--role=node", "--upstream=notaport"}, "--upstream=notaport has no port"},
      {{"--role=node", "--upstream=root:0"}, "--upstream=root:0: the port must be a number from 1"},
      {{"--role=node", "--upstream=root:65536"}, "--upstream=root:65536: the port must be"},
      {{"--role=node", "--metrics-listen=9464"}, "--metrics-listen=9464 has no port"},
      {{"--role=node", "--metrics-listen=unix:/tmp/m.sock"}, "--metrics-listen takes HOST:PORT"},
      // Flags of the other role would do nothing.
      {{"--role=node", "--divergence-dir=/tmp"}, "--divergence-dir is for --role=root or group only"},
      {{"--role=root", "--shm=off"}, "--shm is for --role=node only"},
      {{"--role=root", "--shm-ring=4"}, "--shm-ring is for --role=node only"},
      {{"--role=root", "--upstream-ca=ca.pem"}, "--upstream-ca is for --role=node or group only"},
  };
  for (const auto& [flags, part] : cases) {
    auto [code, log] = RunAggregatorToExit(dir.path(), "bad", flags);
    EXPECT_EQ(code, 2) << flags.size() << " " << part << ": " << log;
    EXPECT_TRUE(Contains(log, part)) << part << ": " << log;
    EXPECT_TRUE(Contains(log, "hsbn-aggregator: ")) << log;
  }
}

// gRPC sets SO_REUSEPORT by default, so a second root on a TCP port started and said "ready",
// and sidecars split between the two (issue 26). A TCP port in use is refused like a Unix
// socket in use, naming the flag, and the first root serves on.
TEST(Flags, ASecondAggregatorOnATcpPortInUseIsRefused) {
  TempDir dir;
  auto first = StartAggregator(dir.path(), "first", {"--role=root", "--listen=127.0.0.1:0"});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(Contains(first->address, "127.0.0.1:")) << first->address;
  auto [code, log] = RunAggregatorToExit(dir.path(), "second",
                                         {"--role=root", "--listen=" + first->address});
  EXPECT_EQ(code, 1) << log;
  EXPECT_TRUE(Contains(log, "hsbn-aggregator: --listen=" + first->address +
                                ": another process is already listening on that port"))
      << log;
  EXPECT_FALSE(Contains(log, "ready: ")) << log;
  // The same for a Unix socket, as before.
  auto node = StartAggregator(dir.path(), "node", {"--role=node", "--listen=unix:" + (dir / "n.sock")});
  ASSERT_TRUE(node.ok()) << node.status();
  auto [code2, log2] = RunAggregatorToExit(
      dir.path(), "node2", {"--role=node", "--listen=unix:" + (dir / "n.sock")});
  EXPECT_EQ(code2, 1) << log2;
  EXPECT_TRUE(Contains(log2, "another process is already listening")) << log2;
  EXPECT_TRUE(first->process->Running());
  EXPECT_EQ(first->process->Stop(), 0);
  EXPECT_EQ(node->process->Stop(), 0);
}

TEST(Flags, ValuesReachTheOptionsInBothSyntaxesAndTheLastOfARepeatedFlagWins) {
  TempDir dir;
  auto agg = StartAggregator(
      dir.path(), "vals",
      {"--role", "node", "--listen=unix:" + (dir / "vals.sock"), "--metrics-listen",
       "127.0.0.1:0", "--max-jobs=3", "--max-jobs=9", "--max-open-rounds", "11",
       "--max-channels=12", "--max-world-size=13", "--memory-budget-bytes=14000000",
       "--max-queued-bytes=15000", "--max-unbound-bytes=16000", "--write-deadline-ms=17",
       "--attach-timeout-ms=18", "--metrics-max-jobs=19", "--log-lines-per-second=20"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  auto body = testing::HttpGet(agg->metrics);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(Sample(*body, "hsbn_max_jobs"), 9);
  EXPECT_EQ(Sample(*body, "hsbn_max_open_rounds"), 11);
  EXPECT_EQ(Sample(*body, "hsbn_max_channels"), 12);
  EXPECT_EQ(Sample(*body, "hsbn_max_world_size"), 13);
  EXPECT_EQ(Sample(*body, "hsbn_memory_budget_bytes"), 14000000);
  EXPECT_EQ(Sample(*body, "hsbn_max_queued_bytes"), 15000);
  EXPECT_EQ(Sample(*body, "hsbn_max_unbound_bytes"), 16000);
  EXPECT_EQ(agg->process->Stop(), 0);
}

TEST(Flags, TheDefaultsReachTheOptions) {
  TempDir dir;
  auto agg = StartAggregator(dir.path(), "defaults",
                             {"--role=root", "--listen=127.0.0.1:0",
                              "--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(agg.ok()) << agg.status();
  auto body = testing::HttpGet(agg->metrics);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(Sample(*body, "hsbn_max_jobs"), 256);
  EXPECT_EQ(Sample(*body, "hsbn_max_open_rounds"), 4096);
  EXPECT_EQ(Sample(*body, "hsbn_max_channels"), 65536);
  EXPECT_EQ(Sample(*body, "hsbn_max_world_size"), 16384);
  EXPECT_EQ(Sample(*body, "hsbn_memory_budget_bytes"), double(int64_t(1) << 30));
  EXPECT_EQ(Sample(*body, "hsbn_max_queued_bytes"), double(int64_t(64) << 20));
  EXPECT_EQ(Sample(*body, "hsbn_max_unbound_bytes"), double(int64_t(1) << 20));
  EXPECT_EQ(agg->process->Stop(), 0);
}

}  // namespace
}  // namespace hsbn

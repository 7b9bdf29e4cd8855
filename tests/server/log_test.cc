// server/log.h: LogSafe makes untrusted text one bounded log line; LogRateLimiter and
// LogLimited let a few lines of a kind through per second and report how many they dropped.
#include "log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace hsbn::server {
namespace {

using std::chrono::milliseconds;
using Clock = LogRateLimiter::Clock;

TEST(LogSafe, PrintableAsciiStaysAsItIs) {
  EXPECT_EQ(LogSafe("job-7 rank 3: 'ok' \"x\" (a/b)"), "job-7 rank 3: 'ok' \"x\" (a/b)");
  EXPECT_EQ(LogSafe(""), "");
}

TEST(LogSafe, NewlinesControlBytesAndNonAsciiAreEscapedSoNoLineCanBeForged) {
  EXPECT_EQ(LogSafe("a\nINFO forged"), "a\\x0aINFO forged");
  EXPECT_EQ(LogSafe("\r\t\x1b[31m"), "\\x0d\\x09\\x1b[31m");
  EXPECT_EQ(LogSafe(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(LogSafe("\x7f\xff\xc3\xa9"), "\\x7f\\xff\\xc3\\xa9");
  // A backslash is doubled, so an escape in the output always came from LogSafe.
  EXPECT_EQ(LogSafe("a\\x0ab"), "a\\\\x0ab");
}

TEST(LogSafe, LongTextIsCutAtTheLimitAndSaysItsLength) {
  const std::string id(32 << 20, 'j');  // a 32 MiB job id
  const std::string safe = LogSafe(id);
  EXPECT_EQ(safe, std::string(kLogSafeMaxBytes, 'j') + "...(33554432 bytes)");
  EXPECT_EQ(LogSafe("abcdef", 3), "abc...(6 bytes)");
  EXPECT_EQ(LogSafe("abc", 3), "abc");
  // The cut counts input bytes; escaping may make the output longer, at most 4x.
  EXPECT_EQ(LogSafe("\n\n\n\n", 2), "\\x0a\\x0a...(4 bytes)");
}

TEST(LogRateLimiter, LetsNLinesThroughPerWindowThenCountsTheRest) {
  LogRateLimiter limiter(3, std::chrono::seconds(1));
  const Clock::time_point t0{};
  for (int i = 0; i < 3; ++i) {
    const auto d = limiter.Admit(t0 + milliseconds(i));
    EXPECT_TRUE(d.log) << i;
    EXPECT_EQ(d.suppressed_before, 0) << i;
  }
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Admit(t0 + milliseconds(10 + i)).log);
  // Still the same window: nothing to report yet.
  EXPECT_EQ(limiter.TakeSuppressed(t0 + milliseconds(999)), 0);
  // The first line of the next window passes and carries the count of the last one.
  const auto d = limiter.Admit(t0 + milliseconds(1000));
  EXPECT_TRUE(d.log);
  EXPECT_EQ(d.suppressed_before, 5);
  // The count is reported once.
  EXPECT_EQ(limiter.Admit(t0 + milliseconds(1001)).suppressed_before, 0);
}

TEST(LogRateLimiter, TakeSuppressedReportsABurstThatNoLaterLineFollows) {
  LogRateLimiter limiter(1, std::chrono::seconds(1));
  const Clock::time_point t0{};
  EXPECT_TRUE(limiter.Admit(t0).log);
  EXPECT_FALSE(limiter.Admit(t0 + milliseconds(1)).log);
  EXPECT_FALSE(limiter.Admit(t0 + milliseconds(2)).log);
  EXPECT_EQ(limiter.TakeSuppressed(t0 + milliseconds(500)), 0);  // window still open
  EXPECT_EQ(limiter.TakeSuppressed(t0 + milliseconds(1500)), 2);
  EXPECT_EQ(limiter.TakeSuppressed(t0 + milliseconds(1600)), 0);
  // A new burst starts a new window with its own allowance.
  EXPECT_TRUE(limiter.Admit(t0 + milliseconds(5000)).log);
  EXPECT_EQ(limiter.Admit(t0 + milliseconds(5000)).suppressed_before, 0);
}

// Runs `body` with stderr going to a file; returns what was written.
template <typename F>
std::string CaptureStderr(F body) {
  char path[] = "/tmp/hsbn-log-test-XXXXXX";
  const int fd = mkstemp(path);
  std::fflush(stderr);
  const int saved = dup(STDERR_FILENO);
  dup2(fd, STDERR_FILENO);
  body();
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  std::remove(path);
  return ss.str();
}

int CountLines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) {
    ++n;
  }
  return n;
}

TEST(LogLimited, AFloodOfOneKindIsCutToTheRateAndOtherKindsStillLog) {
  SetLogLevel(LogLevel::kInfo);
  SetLogRateLimit(4);
  int logged = 0;
  const std::string out = CaptureStderr([&] {
    // 1000 lines in a row: far less than a second on any machine, but the test does not
    // depend on it: whatever windows they span, each lets at most 4 through.
    for (int i = 0; i < 1000; ++i) {
      logged += LogLimited(LogLevel::kWarn, LogKind::kInvalidFrame, "bad frame") ? 1 : 0;
    }
    EXPECT_TRUE(LogLimited(LogLevel::kWarn, LogKind::kJoinRefused, "join refused"));
  });
  EXPECT_EQ(CountLines(out, "bad frame"), logged);
  EXPECT_GE(logged, 4);
  EXPECT_LT(logged, 1000);
  EXPECT_EQ(CountLines(out, "join refused"), 1);
  SetLogRateLimit(kDefaultLogLinesPerSecond);
}

TEST(LogLimited, BelowTheLogLevelNothingIsLoggedOrCounted) {
  SetLogLevel(LogLevel::kError);
  const std::string out = CaptureStderr([] {
    EXPECT_FALSE(LogLimited(LogLevel::kWarn, LogKind::kPeer, "quiet"));
  });
  EXPECT_EQ(out, "");
  SetLogLevel(LogLevel::kInfo);
}

}  // namespace
}  // namespace hsbn::server

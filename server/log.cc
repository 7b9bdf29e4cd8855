#include "log.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "wire.h"

namespace hsbn::server {
namespace {
std::atomic<int> g_level{int(LogLevel::kInfo)};
std::mutex g_mu;
std::string g_name = "hsbn";

// One limiter per LogKind, never destroyed (lines may be logged during exit).
struct RateLimits {
  absl::Mutex mu;
  std::vector<LogRateLimiter> limiters ABSL_GUARDED_BY(mu) = std::vector<LogRateLimiter>(
      size_t(LogKind::kCount), LogRateLimiter(kDefaultLogLinesPerSecond, std::chrono::seconds(1)));
};
RateLimits& Rates() {
  static auto* rates = new RateLimits;
  return *rates;
}

std::string SuppressedLine(LogKind kind, int64_t n) {
  return absl::StrCat("suppressed ", n, " ", LogKindName(kind), " line", n == 1 ? "" : "s",
                      " (more than the log rate limit in one second)");
}
}  // namespace

void SetLogLevel(LogLevel level) { g_level = int(level); }

bool ParseLogLevel(const std::string& name, LogLevel* out) {
  if (name == "debug") *out = LogLevel::kDebug;
  else if (name == "info") *out = LogLevel::kInfo;
  else if (name == "warn") *out = LogLevel::kWarn;
  else if (name == "error") *out = LogLevel::kError;
  else return false;
  return true;
}

void SetLogName(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_name = name;
}

bool LogEnabled(LogLevel level) { return int(level) >= g_level.load(); }

void Log(LogLevel level, const std::string& message) {
  if (!LogEnabled(level)) return;
  static const char* kNames[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(
                         now.time_since_epoch()).count() % 1000);
  std::tm tm;
  gmtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "%s.%03dZ %s [%s] %s\n", stamp, ms, kNames[int(level)], g_name.c_str(),
               message.c_str());
  std::fflush(stderr);
}

std::string LogSafe(absl::string_view text, size_t max_bytes) {
  // The escaping is wire::Printable's, the one definition shared with error messages.
  std::string out = wire::Printable(text, max_bytes);
  if (text.size() > max_bytes) absl::StrAppend(&out, "(", text.size(), " bytes)");
  return out;
}

const char* LogKindName(LogKind kind) {
  switch (kind) {
    case LogKind::kJoinRefused: return "join_refused";
    case LogKind::kInvalidFrame: return "invalid_frame";
    case LogKind::kUnauthenticated: return "unauthenticated";
    case LogKind::kRefused: return "refused";
    case LogKind::kPeer: return "peer";
    case LogKind::kRoundFailed: return "round_failed";
    default: return "other";
  }
}

LogRateLimiter::Decision LogRateLimiter::Admit(Clock::time_point now) {
  Decision d;
  if (open_ && now - window_start_ >= window_) {
    d.suppressed_before = suppressed_;
    suppressed_ = 0;
    open_ = false;
  }
  if (!open_) {
    open_ = true;
    window_start_ = now;
    passed_ = 0;
  }
  if (passed_ < lines_per_window_) {
    ++passed_;
    d.log = true;
  } else {
    ++suppressed_;
  }
  return d;
}

int64_t LogRateLimiter::TakeSuppressed(Clock::time_point now) {
  if (!open_ || now - window_start_ < window_) return 0;
  const int64_t n = suppressed_;
  suppressed_ = 0;
  open_ = false;
  return n;
}

void SetLogRateLimit(int lines_per_second) {
  RateLimits& r = Rates();
  absl::MutexLock lock(&r.mu);
  for (LogRateLimiter& l : r.limiters) l.set_lines_per_window(std::max(1, lines_per_second));
}

bool LogLimited(LogLevel level, LogKind kind, const std::string& message) {
  if (!LogEnabled(level) || kind >= LogKind::kCount) return false;
  LogRateLimiter::Decision d;
  {
    RateLimits& r = Rates();
    absl::MutexLock lock(&r.mu);
    d = r.limiters[size_t(kind)].Admit(LogRateLimiter::Clock::now());
  }
  if (d.suppressed_before > 0) Log(level, SuppressedLine(kind, d.suppressed_before));
  if (d.log) Log(level, message);
  return d.log;
}

void LogFlushSuppressed() {
  const auto now = LogRateLimiter::Clock::now();
  for (int i = 0; i < int(LogKind::kCount); ++i) {
    int64_t n;
    {
      RateLimits& r = Rates();
      absl::MutexLock lock(&r.mu);
      n = r.limiters[size_t(i)].TakeSuppressed(now);
    }
    if (n > 0) Log(LogLevel::kWarn, SuppressedLine(LogKind(i), n));
  }
}

}  // namespace hsbn::server

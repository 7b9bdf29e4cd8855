#include "log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace hsbn::server {
namespace {
std::atomic<int> g_level{int(LogLevel::kInfo)};
std::mutex g_mu;
std::string g_name = "hsbn";

std::mutex g_rate_mu;  // guards the limiters
// One limiter per LogKind, never destroyed (lines may be logged during exit).
std::vector<LogRateLimiter>& Limiters() {
  static auto* limiters = new std::vector<LogRateLimiter>(
      size_t(LogKind::kCount),
      LogRateLimiter(kDefaultLogLinesPerSecond, std::chrono::seconds(1)));
  return *limiters;
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
  static const char kHex[] = "0123456789abcdef";
  const absl::string_view kept = text.substr(0, max_bytes);
  std::string out;
  out.reserve(kept.size() + 16);
  for (const char ch : kept) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out += ch;
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > max_bytes) absl::StrAppend(&out, "...(", text.size(), " bytes)");
  return out;
}

const char* LogKindName(LogKind kind) {
  switch (kind) {
    case LogKind::kJoinRefused: return "join_refused";
    case LogKind::kInvalidFrame: return "invalid_frame";
    case LogKind::kUnauthenticated: return "unauthenticated";
    case LogKind::kRefused: return "refused";
    case LogKind::kPeer: return "peer";
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
  std::lock_guard<std::mutex> lock(g_rate_mu);
  for (int i = 0; i < int(LogKind::kCount); ++i) {
    Limiters()[i].set_lines_per_window(lines_per_second < 1 ? 1 : lines_per_second);
  }
}

bool LogLimited(LogLevel level, LogKind kind, const std::string& message) {
  if (!LogEnabled(level) || kind >= LogKind::kCount) return false;
  LogRateLimiter::Decision d;
  {
    std::lock_guard<std::mutex> lock(g_rate_mu);
    d = Limiters()[int(kind)].Admit(LogRateLimiter::Clock::now());
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
      std::lock_guard<std::mutex> lock(g_rate_mu);
      n = Limiters()[i].TakeSuppressed(now);
    }
    if (n > 0) Log(LogLevel::kWarn, SuppressedLine(LogKind(i), n));
  }
}

}  // namespace hsbn::server

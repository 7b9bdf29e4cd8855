#include "log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace hsbn::server {
namespace {
std::atomic<int> g_level{int(LogLevel::kInfo)};
std::mutex g_mu;
std::string g_name = "hsbn";
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

}  // namespace hsbn::server

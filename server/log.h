// server/log.h — one-line, human-readable log messages on stderr.
//
// Every line: time, level, the aggregator's id, then a sentence. HSBN_LOG_LEVEL or
// --log-level picks the threshold (debug, info, warn, error).
//
// Text that a client chose (job ids, messages, anything from the wire) goes through LogSafe
// before it is put in a line, so that it cannot forge lines or flood the log. Lines about
// invalid input go through LogLimited, which lets through at most a few lines per second per
// kind and then says how many it dropped.
//
// Thread safety: every function is thread-safe.
#ifndef HSBN_SERVER_LOG_H_
#define HSBN_SERVER_LOG_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace hsbn::server {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool ParseLogLevel(const std::string& name, LogLevel* out);
void SetLogName(const std::string& name);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, const std::string& message);

// Untrusted text made safe for a log line (wire::Printable, plus the length when cut):
// printable ASCII (0x20..0x7e) other than backslash stays as it is; every other byte (newline,
// carriage return, escape, NUL, backslash, bytes of UTF-8 sequences) becomes `\xNN`. Only the
// first `max_bytes` bytes of `text` are kept; a longer text ends in `...(N bytes)`, N its full
// length. The result is one line, at most 4 * max_bytes + 24 bytes long.
constexpr size_t kLogSafeMaxBytes = 256;
std::string LogSafe(absl::string_view text, size_t max_bytes = kLogSafeMaxBytes);

// Kinds of lines about invalid or hostile input, and about what a client can cause at will,
// each rate-limited on its own (LogLimited).
enum class LogKind {
  kJoinRefused = 0,  // a Join answered with an error
  kInvalidFrame,     // a malformed or invalid contribution, frame or message on a stream
  kUnauthenticated,  // a missing or wrong token, a session the stream may not use
  kRefused,          // a resource limit hit (RESOURCE_EXHAUSTED)
  kPeer,             // anything else a client did wrong (broken streams, protocol misuse)
  kRoundFailed,      // a round that failed (a client can fail rounds as fast as it can send)
  kCount             // not a kind: the number of kinds
};
const char* LogKindName(LogKind kind);  // "join_refused", "invalid_frame", ...

// Default for SetLogRateLimit: lines per second per kind.
constexpr int kDefaultLogLinesPerSecond = 10;
// At most `lines_per_second` (>= 1) lines of one kind per second pass LogLimited.
void SetLogRateLimit(int lines_per_second);

// Logs `message` (already made safe with LogSafe where it carries untrusted text) unless lines
// of `kind` are over their rate: then counts it as suppressed. The first line of that kind
// that passes again is preceded by one line "suppressed K <kind> lines"; so is a call of
// LogFlushSuppressed once the second is over. Returns whether `message` was logged.
bool LogLimited(LogLevel level, LogKind kind, const std::string& message);
// Writes the "suppressed K <kind> lines" line of every kind whose second is over and that
// dropped lines in it. Meant for a periodic thread (the aggregator's tick), so the count of a
// burst is reported even if no later line of its kind comes.
void LogFlushSuppressed();

// The rate limit behind LogLimited, one per kind: windows of `window` length starting at the
// first line of a burst; at most `lines_per_window` lines pass per window. Exposed for tests,
// which pass the time in. Not thread-safe (LogLimited holds a lock around it).
class LogRateLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  LogRateLimiter(int lines_per_window, Clock::duration window)
      : lines_per_window_(lines_per_window), window_(window) {}

  struct Decision {
    bool log = false;             // log this line
    int64_t suppressed_before = 0;  // report this many suppressed lines first (a closed window)
  };
  // A line at `now`.
  Decision Admit(Clock::time_point now);
  // The lines suppressed in a window that is over at `now` (0 if none or still open); resets.
  int64_t TakeSuppressed(Clock::time_point now);
  void set_lines_per_window(int n) { lines_per_window_ = n; }

 private:
  int lines_per_window_;
  Clock::duration window_;
  bool open_ = false;
  Clock::time_point window_start_;
  int64_t passed_ = 0;      // lines logged in the current window
  int64_t suppressed_ = 0;  // lines dropped in the current (or last, unreported) window
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_LOG_H_

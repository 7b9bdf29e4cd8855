// server/log.h — one-line, human-readable log messages on stderr.
//
// Every line: time, level, the aggregator's id, then a sentence. HSBN_LOG_LEVEL or
// --log-level picks the threshold (debug, info, warn, error). Thread-safe.
#ifndef HSBN_SERVER_LOG_H_
#define HSBN_SERVER_LOG_H_

#include <string>

namespace hsbn::server {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool ParseLogLevel(const std::string& name, LogLevel* out);
void SetLogName(const std::string& name);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, const std::string& message);

}  // namespace hsbn::server

#endif  // HSBN_SERVER_LOG_H_

// The runner of minitest (gtest/gtest.h here): runs every registered test in registration
// order, prints GoogleTest's summary lines, exits 1 if any test failed. --gtest_filter takes
// GoogleTest's syntax (POSITIVE[-NEGATIVE], ':'-lists of patterns with * and ?).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace testing::internal {

TestState& Current() {
  static TestState s;
  return s;
}
std::vector<TestEntry>& Registry() {
  static std::vector<TestEntry> r;
  return r;
}
std::vector<std::function<void()>>& Expanders() {
  static std::vector<std::function<void()>> e;
  return e;
}
void ReportFailure(const char* file, int line, const std::string& text) {
  std::printf("%s:%d: Failure\n%s\n", file, line, text.c_str());
  for (auto it = Current().traces.rbegin(); it != Current().traces.rend(); ++it)
    std::printf("  trace: %s\n", it->c_str());
}

namespace {
bool Match(const char* pat, const char* s) {
  if (*pat == '\0') return *s == '\0';
  if (*pat == '*') return Match(pat + 1, s) || (*s && Match(pat, s + 1));
  if (*s && (*pat == '?' || *pat == *s)) return Match(pat + 1, s + 1);
  return false;
}

bool MatchAny(const std::string& patterns, const std::string& name) {
  size_t start = 0;
  while (start <= patterns.size()) {
    size_t end = patterns.find(':', start);
    if (end == std::string::npos) end = patterns.size();
    if (Match(patterns.substr(start, end - start).c_str(), name.c_str())) return true;
    start = end + 1;
  }
  return false;
}

// GoogleTest's filter: POSITIVE[-NEGATIVE], each a ':'-list of patterns with * and ?.
bool Selected(const std::string& filter, const std::string& name) {
  const size_t dash = filter.find('-');
  std::string pos = filter.substr(0, dash);
  const std::string neg = dash == std::string::npos ? "" : filter.substr(dash + 1);
  if (pos.empty()) pos = "*";
  return MatchAny(pos, name) && !(neg.size() && MatchAny(neg, name));
}
}  // namespace

}  // namespace testing::internal

int main(int argc, char** argv) {
  using namespace testing::internal;
  std::string filter = "*";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--gtest_filter=", 15) == 0) filter = argv[i] + 15;
  for (auto& expand : Expanders()) expand();
  std::vector<std::string> failed, skipped;
  int ran = 0;
  std::printf("[==========] Running tests (minitest).\n");
  for (const TestEntry& t : Registry()) {
    const std::string full = t.suite + "." + t.name;
    if (!Selected(filter, full)) continue;
    Current() = TestState();
    std::printf("[ RUN      ] %s\n", full.c_str());
    std::fflush(stdout);
    t.run();
    ++ran;
    if (Current().failed) {
      failed.push_back(full);
      std::printf("[  FAILED  ] %s\n", full.c_str());
    } else if (Current().skipped) {
      skipped.push_back(full);
      std::printf("%s\n[  SKIPPED ] %s\n", Current().skip_message.c_str(), full.c_str());
    } else {
      std::printf("[       OK ] %s\n", full.c_str());
    }
    std::fflush(stdout);
  }
  std::printf("[==========] %d tests ran.\n", ran);
  std::printf("[  PASSED  ] %d tests.\n", ran - static_cast<int>(failed.size() + skipped.size()));
  if (!skipped.empty()) {
    std::printf("[  SKIPPED ] %zu tests, listed below:\n", skipped.size());
    for (const auto& s : skipped) std::printf("[  SKIPPED ] %s\n", s.c_str());
  }
  if (!failed.empty()) {
    std::printf("[  FAILED  ] %zu tests, listed below:\n", failed.size());
    for (const auto& s : failed) std::printf("[  FAILED  ] %s\n", s.c_str());
  }
  return failed.empty() ? 0 : 1;
}

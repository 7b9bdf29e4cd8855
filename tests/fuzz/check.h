// tests/fuzz/check.h — how a fuzzer reports a broken invariant: a message naming it, then
// abort(), which libFuzzer reports as a crash and saves the input that caused it.
#ifndef HSBN_TESTS_FUZZ_CHECK_H_
#define HSBN_TESTS_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

namespace hsbn::fuzz {

[[noreturn]] inline void Violation(const std::string& what) {
  std::fprintf(stderr, "hsbn fuzz: INVARIANT VIOLATED: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace hsbn::fuzz

#define HSBN_FUZZ_CHECK(cond, what)                                           \
  do {                                                                        \
    if (!(cond)) ::hsbn::fuzz::Violation(std::string(#cond) + ": " + (what)); \
  } while (0)

#endif  // HSBN_TESTS_FUZZ_CHECK_H_

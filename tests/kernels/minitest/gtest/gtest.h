// minitest — a stand-in for the part of GoogleTest that tests/kernels uses, for kernels-only
// builds (cmake -DHSBN_KERNELS_ONLY=ON) on a machine without GoogleTest (the GPU check
// machine). With GoogleTest present the real one is used; this header is never on that path.
//
// Supported: TEST, TEST_P + INSTANTIATE_TEST_SUITE_P (Values, ValuesIn, a name function),
// EXPECT_/ASSERT_ TRUE FALSE EQ NE LT LE GT GE NEAR FLOAT_EQ DOUBLE_EQ STREQ with << messages,
// SCOPED_TRACE, GTEST_SKIP, ::testing::Test::HasFatalFailure. The runner (minitest_main.cc)
// prints GoogleTest's summary lines ("[  PASSED  ] N tests.", "[  SKIPPED ] N tests, listed
// below:", "[  FAILED  ] ...") and exits non-zero on a failure; --gtest_filter=PATTERN (with *
// and ?, GoogleTest's POSITIVE[-NEGATIVE] syntax) selects tests; other flags are ignored.
#ifndef HSBN_MINITEST_GTEST_H_
#define HSBN_MINITEST_GTEST_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace testing {
namespace internal {

struct TestState {
  bool failed = false;
  bool fatal = false;
  bool skipped = false;
  std::string skip_message;
  std::vector<std::string> traces;
};
TestState& Current();

struct TestEntry {
  std::string suite, name;
  std::function<void()> run;
};
std::vector<TestEntry>& Registry();
std::vector<std::function<void()>>& Expanders();  // TEST_P suites, expanded before running
void ReportFailure(const char* file, int line, const std::string& text);

class Message {
 public:
  template <typename T>
  Message& operator<<(const T& v) {
    os_ << v;
    return *this;
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

class AssertHelper {
 public:
  AssertHelper(const char* file, int line, bool fatal, std::string summary)
      : file_(file), line_(line), fatal_(fatal), summary_(std::move(summary)) {}
  void operator=(const Message& m) const {
    std::string text = summary_;
    const std::string extra = m.str();
    if (!extra.empty()) text += "\n" + extra;
    Current().failed = true;
    if (fatal_) Current().fatal = true;
    ReportFailure(file_, line_, text);
  }

 private:
  const char* file_;
  int line_;
  bool fatal_;
  std::string summary_;
};

struct SkipHelper {
  void operator=(const Message& m) const {
    Current().skipped = true;
    Current().skip_message = m.str();
  }
};

template <typename T, typename = void>
struct Streamable : std::false_type {};
template <typename T>
struct Streamable<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<T>())>>
    : std::true_type {};

template <typename T>
std::string Print(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, unsigned char> || std::is_same_v<T, signed char>) {
    os << static_cast<int>(v);
  } else if constexpr (Streamable<T>::value) {
    os.precision(17);
    os << v;
  } else if constexpr (std::is_enum_v<T>) {
    os << static_cast<long long>(v);
  } else {
    os << "<" << sizeof(T) << "-byte object>";
  }
  return os.str();
}

template <typename A, typename B>
std::string Compared(const char* ea, const char* op, const char* eb, const A& a, const B& b) {
  return std::string("Expected: (") + ea + ") " + op + " (" + eb + "), actual: " + Print(a) +
         " vs " + Print(b);
}

// Distance in units in the last place, as GoogleTest's FLOAT_EQ / DOUBLE_EQ (<= 4 ULPs).
template <typename F>
bool AlmostEqual(F a, F b) {
  if (std::isnan(a) || std::isnan(b)) return false;
  using U = std::conditional_t<sizeof(F) == 4, uint32_t, uint64_t>;
  auto biased = [](F f) {
    U u;
    std::memcpy(&u, &f, sizeof u);
    const U sign = U(1) << (sizeof(U) * 8 - 1);
    return (u & sign) ? ~u + 1 : u | sign;
  };
  const U x = biased(a), y = biased(b);
  return (x > y ? x - y : y - x) <= 4;
}

// Checks: "" when they pass, else what failed.
inline std::string CheckBool(bool value, bool want, const char* expr) {
  if (value == want) return "";
  return std::string("Value of: ") + expr + "\n  Actual: " + (value ? "true" : "false") +
         "\nExpected: " + (want ? "true" : "false");
}
template <typename A, typename B, typename Op>
std::string CheckCmp(const char* ea, const char* op, const char* eb, const A& a, const B& b,
                     Op cmp) {
  return cmp(a, b) ? std::string() : Compared(ea, op, eb, a, b);
}
template <typename A, typename B, typename T>
std::string CheckNear(const char* ea, const char* eb, const A& a, const B& b, const T& tol) {
  const double d = std::fabs(static_cast<double>(a) - static_cast<double>(b));
  if (d <= static_cast<double>(tol)) return "";
  return Compared(ea, "near", eb, a, b) + " (difference " + Print(d) + ", tolerance " +
         Print(tol) + ")";
}
inline std::string CheckStrEq(const char* ea, const char* eb, const char* a, const char* b) {
  if ((a == nullptr && b == nullptr) || (a && b && std::strcmp(a, b) == 0)) return "";
  return std::string("Expected equal strings: (") + ea + ") vs (" + eb + "), actual: \"" +
         (a ? a : "(null)") + "\" vs \"" + (b ? b : "(null)") + "\"";
}

class ScopedTrace {
 public:
  template <typename T>
  ScopedTrace(const char* file, int line, const T& msg) {
    std::ostringstream os;
    os << file << ":" << line << ": " << msg;
    Current().traces.push_back(os.str());
  }
  ~ScopedTrace() { Current().traces.pop_back(); }
};

}  // namespace internal

class Test {
 public:
  virtual ~Test() = default;
  virtual void SetUp() {}
  virtual void TearDown() {}
  virtual void TestBody() = 0;
  static bool HasFatalFailure() { return internal::Current().fatal; }
  static bool HasFailure() { return internal::Current().failed; }
};

template <typename T>
class WithParamInterface {
 public:
  using ParamType = T;
  static const T& GetParam() { return *current_; }
  static inline const T* current_ = nullptr;
};

template <typename T>
class TestWithParam : public Test, public WithParamInterface<T> {};

template <typename T>
struct TestParamInfo {
  TestParamInfo(const T& p, size_t i) : param(p), index(i) {}
  T param;
  size_t index;
};

template <typename... Ts>
struct ValueList {
  std::tuple<Ts...> values;
  template <typename T>
  std::vector<T> Get() const {
    return std::apply([](const Ts&... v) { return std::vector<T>{static_cast<T>(v)...}; },
                      values);
  }
};
template <typename... Ts>
ValueList<Ts...> Values(Ts... v) {
  return {std::make_tuple(v...)};
}

template <typename E>
struct ValuesInList {
  std::vector<E> values;
  template <typename T>
  std::vector<T> Get() const {
    return std::vector<T>(values.begin(), values.end());
  }
};
template <typename C>
auto ValuesIn(const C& c) {
  using E = std::decay_t<decltype(*std::begin(c))>;
  return ValuesInList<E>{std::vector<E>(std::begin(c), std::end(c))};
}

namespace internal {

template <typename Fixture>
struct ParamSuite {
  using T = typename Fixture::ParamType;
  struct Pattern {
    std::string name;
    std::function<std::unique_ptr<Test>()> make;
  };
  struct Instance {
    std::string prefix;
    std::vector<T> values;
    std::function<std::string(const TestParamInfo<T>&)> name;
  };
  static std::vector<Pattern>& Patterns() {
    static std::vector<Pattern> p;
    return p;
  }
  static std::vector<Instance>& Instances() {
    static std::vector<Instance> i;
    return i;
  }
  static bool Register(const char* suite) {
    static const bool once = [suite] {
      Expanders().push_back([suite] { Expand(suite); });
      return true;
    }();
    return once;
  }
  static void Expand(const std::string& suite) {
    for (const Instance& inst : Instances())
      for (const Pattern& pat : Patterns())
        for (size_t i = 0; i < inst.values.size(); ++i) {
          const std::string tag =
              inst.name ? inst.name(TestParamInfo<T>(inst.values[i], i)) : std::to_string(i);
          auto values = std::make_shared<std::vector<T>>(inst.values);
          auto make = pat.make;
          Registry().push_back({inst.prefix + "/" + suite, pat.name + "/" + tag, [values, i, make] {
                                  WithParamInterface<T>::current_ = &(*values)[i];
                                  std::unique_ptr<Test> t = make();
                                  t->SetUp();
                                  if (!Test::HasFatalFailure() && !Current().skipped) t->TestBody();
                                  t->TearDown();
                                }});
        }
  }
  static bool AddPattern(const char* suite, const char* name,
                         std::function<std::unique_ptr<Test>()> make) {
    Register(suite);
    Patterns().push_back({name, std::move(make)});
    return true;
  }
  template <typename Gen, typename... NameFn>
  static bool AddInstance(const char* suite, const char* prefix, const Gen& gen, NameFn... fn) {
    Register(suite);
    Instance inst{prefix, gen.template Get<T>(), nullptr};
    if constexpr (sizeof...(NameFn) > 0) inst.name = [fn...](const TestParamInfo<T>& i) {
      return std::string((fn(i), ...));
    };
    Instances().push_back(std::move(inst));
    return true;
  }
};

inline bool AddTest(const char* suite, const char* name, std::function<std::unique_ptr<Test>()> make) {
  Registry().push_back({suite, name, [make] {
                          std::unique_ptr<Test> t = make();
                          t->SetUp();
                          if (!Test::HasFatalFailure() && !Current().skipped) t->TestBody();
                          t->TearDown();
                        }});
  return true;
}

}  // namespace internal
}  // namespace testing

#define MINITEST_CONCAT2_(a, b) a##b
#define MINITEST_CONCAT_(a, b) MINITEST_CONCAT2_(a, b)

#define TEST(suite, name)                                                                     \
  class suite##_##name##_Test : public ::testing::Test {                                      \
   public:                                                                                    \
    void TestBody() override;                                                                 \
  };                                                                                          \
  static const bool suite##_##name##_registered_ = ::testing::internal::AddTest(              \
      #suite, #name, [] { return std::unique_ptr<::testing::Test>(new suite##_##name##_Test); }); \
  void suite##_##name##_Test::TestBody()

#define TEST_P(fixture, name)                                                                 \
  class fixture##_##name##_Test : public fixture {                                            \
   public:                                                                                    \
    void TestBody() override;                                                                 \
  };                                                                                          \
  static const bool fixture##_##name##_registered_ =                                          \
      ::testing::internal::ParamSuite<fixture>::AddPattern(#fixture, #name, [] {              \
        return std::unique_ptr<::testing::Test>(new fixture##_##name##_Test);                 \
      });                                                                                     \
  void fixture##_##name##_Test::TestBody()

#define INSTANTIATE_TEST_SUITE_P(prefix, fixture, ...)                        \
  static const bool prefix##_##fixture##_instantiated_ =                      \
      ::testing::internal::ParamSuite<fixture>::AddInstance(#fixture, #prefix, __VA_ARGS__)

// `failure` is evaluated once: an empty string when the check passed, else its description.
#define MINITEST_CHECK_(failure, fatal)                                                     \
  if (const std::string minitest_failure_ = (failure); minitest_failure_.empty()) {         \
  } else                                                                                    \
    MINITEST_RETURN_##fatal ::testing::internal::AssertHelper(__FILE__, __LINE__, fatal,    \
                                                               minitest_failure_) =         \
        ::testing::internal::Message()
#define MINITEST_RETURN_true return
#define MINITEST_RETURN_false

#define MINITEST_BOOL_(expr, want, fatal) \
  MINITEST_CHECK_(::testing::internal::CheckBool(static_cast<bool>(expr), want, #expr), fatal)
#define MINITEST_CMP_(a, op, b, fatal)                                                        \
  MINITEST_CHECK_(::testing::internal::CheckCmp(                                              \
                      #a, #op, #b, (a), (b),                                                  \
                      [](const auto& x, const auto& y) { return static_cast<bool>(x op y); }), \
                  fatal)
#define MINITEST_NEAR_(a, b, tol, fatal) \
  MINITEST_CHECK_(::testing::internal::CheckNear(#a, #b, (a), (b), (tol)), fatal)
#define MINITEST_FEQ_(F, a, b, fatal)                                                    \
  MINITEST_CHECK_(::testing::internal::CheckCmp(                                         \
                      #a, "~=", #b, static_cast<F>(a), static_cast<F>(b),                \
                      [](F x, F y) { return ::testing::internal::AlmostEqual<F>(x, y); }), \
                  fatal)
#define MINITEST_STREQ_(a, b, fatal) \
  MINITEST_CHECK_(::testing::internal::CheckStrEq(#a, #b, (a), (b)), fatal)

#define EXPECT_TRUE(c) MINITEST_BOOL_(c, true, false)
#define EXPECT_FALSE(c) MINITEST_BOOL_(c, false, false)
#define ASSERT_TRUE(c) MINITEST_BOOL_(c, true, true)
#define ASSERT_FALSE(c) MINITEST_BOOL_(c, false, true)
#define EXPECT_EQ(a, b) MINITEST_CMP_(a, ==, b, false)
#define EXPECT_NE(a, b) MINITEST_CMP_(a, !=, b, false)
#define EXPECT_LT(a, b) MINITEST_CMP_(a, <, b, false)
#define EXPECT_LE(a, b) MINITEST_CMP_(a, <=, b, false)
#define EXPECT_GT(a, b) MINITEST_CMP_(a, >, b, false)
#define EXPECT_GE(a, b) MINITEST_CMP_(a, >=, b, false)
#define ASSERT_EQ(a, b) MINITEST_CMP_(a, ==, b, true)
#define ASSERT_NE(a, b) MINITEST_CMP_(a, !=, b, true)
#define ASSERT_LT(a, b) MINITEST_CMP_(a, <, b, true)
#define ASSERT_LE(a, b) MINITEST_CMP_(a, <=, b, true)
#define ASSERT_GT(a, b) MINITEST_CMP_(a, >, b, true)
#define ASSERT_GE(a, b) MINITEST_CMP_(a, >=, b, true)
#define EXPECT_NEAR(a, b, t) MINITEST_NEAR_(a, b, t, false)
#define ASSERT_NEAR(a, b, t) MINITEST_NEAR_(a, b, t, true)
#define EXPECT_FLOAT_EQ(a, b) MINITEST_FEQ_(float, a, b, false)
#define ASSERT_FLOAT_EQ(a, b) MINITEST_FEQ_(float, a, b, true)
#define EXPECT_DOUBLE_EQ(a, b) MINITEST_FEQ_(double, a, b, false)
#define ASSERT_DOUBLE_EQ(a, b) MINITEST_FEQ_(double, a, b, true)
#define EXPECT_STREQ(a, b) MINITEST_STREQ_(a, b, false)
#define ASSERT_STREQ(a, b) MINITEST_STREQ_(a, b, true)
#define ADD_FAILURE() MINITEST_CHECK_(std::string("Failed"), false)
#define FAIL() MINITEST_CHECK_(std::string("Failed"), true)

#define GTEST_SKIP() return ::testing::internal::SkipHelper() = ::testing::internal::Message()
#define SCOPED_TRACE(msg) \
  ::testing::internal::ScopedTrace MINITEST_CONCAT_(minitest_trace_, __LINE__)(__FILE__, __LINE__, (msg))

#endif  // HSBN_MINITEST_GTEST_H_

// Stand-in for Abseil's absl::StrCat, for HSBN_KERNELS_ONLY builds without Abseil (see
// kernels/compat/README.md). Numbers print as an ostream prints them (6 significant digits for
// floating point, as Abseil's StrCat does).
#ifndef HSBN_COMPAT_ABSL_STRINGS_STR_CAT_H_
#define HSBN_COMPAT_ABSL_STRINGS_STR_CAT_H_

#include <sstream>
#include <string>

namespace absl {

template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace absl

#endif  // HSBN_COMPAT_ABSL_STRINGS_STR_CAT_H_

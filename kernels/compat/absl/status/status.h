// Stand-in for Abseil's absl::Status, for HSBN_KERNELS_ONLY builds without Abseil (see
// kernels/compat/README.md): the subset hsbn's kernels, their tests and benchmark use.
#ifndef HSBN_COMPAT_ABSL_STATUS_STATUS_H_
#define HSBN_COMPAT_ABSL_STATUS_STATUS_H_

#include <ostream>
#include <string>
#include <string_view>
#include <utility>

namespace absl {

// Same values as Abseil's (and gRPC's) codes: the C ABI returns them as ints.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string_view message)
      : code_(code), message_(code == StatusCode::kOk ? "" : std::string(message)) {}
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  std::string_view message() const { return message_; }
  std::string ToString() const {
    return ok() ? "OK" : "code " + std::to_string(static_cast<int>(code_)) + ": " + message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

inline Status OkStatus() { return Status(); }
inline Status InvalidArgumentError(std::string_view m) {
  return Status(StatusCode::kInvalidArgument, m);
}
inline Status FailedPreconditionError(std::string_view m) {
  return Status(StatusCode::kFailedPrecondition, m);
}
inline Status UnimplementedError(std::string_view m) {
  return Status(StatusCode::kUnimplemented, m);
}
inline Status InternalError(std::string_view m) { return Status(StatusCode::kInternal, m); }
inline Status ResourceExhaustedError(std::string_view m) {
  return Status(StatusCode::kResourceExhausted, m);
}

}  // namespace absl

#endif  // HSBN_COMPAT_ABSL_STATUS_STATUS_H_

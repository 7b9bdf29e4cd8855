// server/tokens.h — per-job tokens (--token-file): which Join may enter which job.
//
// The file has one `job_id token` pair per line; `#` starts a comment, blank lines are
// ignored, and the job id `*` gives a token for every job that has no line of its own. A Join
// must present its job's token (clients send HSBN_TOKEN or the contents of HSBN_TOKEN_FILE).
// Tokens are compared in constant time (in the presented token's contents) and never appear in
// an error message or a log line.
//
// Thread safety: all methods are thread-safe; Reload swaps the whole table at once.
#ifndef HSBN_SERVER_TOKENS_H_
#define HSBN_SERVER_TOKENS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace hsbn::server {

class TokenStore {
 public:
  // Reads and parses `path`. Unless `allow_insecure`, refuses a file that other users can read
  // or write, or that its group can write (mode & 0027): a token file is a secret.
  static absl::StatusOr<std::shared_ptr<TokenStore>> Load(const std::string& path,
                                                          bool allow_insecure);
  // Parses file contents (no file-mode check); `origin` names the source in errors.
  static absl::StatusOr<std::map<std::string, std::string>> Parse(const std::string& text,
                                                                  const std::string& origin);

  // Reads the file again; on any error the old table stays in force. Returns the number of
  // entries now in force.
  absl::StatusOr<size_t> Reload();

  // OK if `token` is the token for `job_id`; UNAUTHENTICATED, with a message that says what to
  // fix, otherwise. `who` names the joining member ("rank 3", "the sidecar of node 1").
  absl::Status Check(const std::string& job_id, const std::string& token,
                     const std::string& who) const;

  size_t size() const;
  const std::string& path() const { return path_; }

  // Constant-time equality in the contents of `presented` (its length may leak, not its bytes).
  static bool SameToken(const std::string& expected, const std::string& presented);

 private:
  TokenStore(std::string path, bool allow_insecure) : path_(std::move(path)),
                                                      allow_insecure_(allow_insecure) {}
  const std::string path_;
  const bool allow_insecure_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const std::map<std::string, std::string>> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_TOKENS_H_

#include "tokens.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hsbn::server {

namespace {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, bool allow_insecure) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("--token-file ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("--token-file ", path,
                                                   " is not a regular file"));
  }
  if (!allow_insecure && (st.st_mode & 0027) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    return absl::PermissionDeniedError(absl::StrCat(
        "--token-file ", path, " has mode ", mode, ": other users can read it, or its group can "
        "write it. It holds secrets: `chmod 600 ", path, "` (0640 or 0440 when a group must "
        "read it, as with Kubernetes Secrets), or pass --allow-insecure-token-file"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat("--token-file ", path,
                                                    " cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> TokenStore::Parse(const std::string& text,
                                                                     const std::string& origin) {
  std::map<std::string, std::string> tokens;
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    absl::string_view line = raw;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    // Never quote the line: it holds a token.
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin, " line ", line_no, ": expected `job_id token` (two fields), found ",
          fields.size(), " field(s)"));
    }
    const std::string job(fields[0]);
    if (!tokens.emplace(job, std::string(fields[1])).second) {
      return absl::InvalidArgumentError(absl::StrCat(origin, " line ", line_no, ": job '", job,
                                                     "' has a second token line"));
    }
  }
  return tokens;
}

absl::StatusOr<std::shared_ptr<TokenStore>> TokenStore::Load(const std::string& path,
                                                             bool allow_insecure) {
  std::shared_ptr<TokenStore> store(new TokenStore(path, allow_insecure));
  absl::StatusOr<size_t> n = store->Reload();
  if (!n.ok()) return n.status();
  return store;
}

absl::StatusOr<size_t> TokenStore::Reload() {
  absl::StatusOr<std::string> text = ReadTokenFile(path_, allow_insecure_);
  if (!text.ok()) return text.status();
  auto parsed = Parse(*text, absl::StrCat("--token-file ", path_));
  if (!parsed.ok()) return parsed.status();
  auto table = std::make_shared<const std::map<std::string, std::string>>(std::move(*parsed));
  const size_t n = table->size();
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(table);
  return n;
}

size_t TokenStore::size() const {
  absl::MutexLock lock(&mu_);
  return tokens_ ? tokens_->size() : 0;
}

bool TokenStore::SameToken(const std::string& expected, const std::string& presented) {
  // The time depends on the expected token's length only, never on where the bytes differ.
  volatile unsigned char diff = expected.size() == presented.size() ? 0 : 1;
  const size_t n = presented.size();
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char p = i < n ? static_cast<unsigned char>(presented[i]) : 0;
    diff = diff | (static_cast<unsigned char>(expected[i]) ^ p);
  }
  return diff == 0;
}

absl::Status TokenStore::Check(const std::string& job_id, const std::string& token,
                               const std::string& who) const {
  std::shared_ptr<const std::map<std::string, std::string>> tokens;
  {
    absl::MutexLock lock(&mu_);
    tokens = tokens_;
  }
  const std::string* expected = nullptr;
  if (tokens) {
    auto it = tokens->find(job_id);
    if (it == tokens->end()) it = tokens->find("*");
    if (it != tokens->end()) expected = &it->second;
  }
  if (expected == nullptr) {
    return absl::UnauthenticatedError(absl::StrCat(
        who, " of job '", job_id, "' was refused: this aggregator requires job tokens "
        "(--token-file) and has none for job '", job_id, "'. Add a line `", job_id,
        " TOKEN` to its token file (and reload it with SIGHUP), or run the job under an id "
        "that has one (HSBN_JOB_ID)"));
  }
  if (token.empty()) {
    return absl::UnauthenticatedError(absl::StrCat(
        who, " of job '", job_id, "' presented no token, and this aggregator requires one "
        "(--token-file). Give every process of the job its token: HSBN_TOKEN=TOKEN, or "
        "HSBN_TOKEN_FILE=PATH of a file that holds it"));
  }
  if (!SameToken(*expected, token)) {
    return absl::UnauthenticatedError(absl::StrCat(
        who, " of job '", job_id, "' presented a token that is not the job's token in this "
        "aggregator's --token-file. Check HSBN_TOKEN or HSBN_TOKEN_FILE (and the job id, "
        "HSBN_JOB_ID); a sidecar passes its workers' token on to the root, so the root's token "
        "file needs the same token"));
  }
  return absl::OkStatus();
}

}  // namespace hsbn::server

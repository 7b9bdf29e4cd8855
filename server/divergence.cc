#include "divergence.h"

#include <cctype>
#include <cstdio>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace hsbn::server {

std::string FileNameOf(const std::string& job_id) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (size_t i = 0; i < job_id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(job_id[i]);
    if (std::isalnum(c) || c == '_' || c == '-' || (c == '.' && i > 0)) {
      out.push_back(char(c));
    } else {
      out += '%';
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

absl::StatusOr<std::string> SaveDivergence(const Job& job, const std::string& dir) {
  v1::JobStatus status;
  job.FillStatus(&status);
  if (status.divergence_size() == 0) return std::string();
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  if (!google::protobuf::util::MessageToJsonString(status, &json, print).ok()) {
    return absl::InternalError("cannot print the divergence record as JSON");
  }
  const std::string path = absl::StrCat(dir, "/", FileNameOf(job.id()), ".divergence.json");
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << json << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp, " (--divergence-dir)"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return path;
}

}  // namespace hsbn::server

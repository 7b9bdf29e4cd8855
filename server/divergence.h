// server/divergence.h — a finished job's shadow divergence record (docs/PROTOCOL.md, "Shadow
// scope"), written to --divergence-dir when the aggregator drops the job.
#ifndef HSBN_SERVER_DIVERGENCE_H_
#define HSBN_SERVER_DIVERGENCE_H_

#include <string>

#include "absl/status/statusor.h"
#include "job.h"

namespace hsbn::server {

// Writes the job's divergence record, as its Status's JSON, to
// `dir`/<job id as a file name>.divergence.json (written to a .tmp file and renamed, so a reader
// never sees half of it). Returns the path; "" when the job has no record; an error naming the
// path when it cannot be written.
absl::StatusOr<std::string> SaveDivergence(const Job& job, const std::string& dir);

// A job id as a file name: [A-Za-z0-9._-] kept, every other byte as %XX, and a leading '.'
// escaped too, so no id can name a path outside the directory or a hidden file.
std::string FileNameOf(const std::string& job_id);

}  // namespace hsbn::server

#endif  // HSBN_SERVER_DIVERGENCE_H_

#include "round.h"

#include "absl/strings/str_join.h"
#include "wire.h"

namespace hsbn::wire {

std::string MemberNames::operator()(int32_t index) const {
  if (!nodes) {
    return absl::StrCat("rank ", Rank(index), " (node ", node_rank, ", local rank ", index, ")");
  }
  if (member_nodes > 1) {
    const int64_t first = int64_t(index) * member_nodes;
    return absl::StrCat("group ", index, " (nodes ", first, "-", first + member_nodes - 1, ")");
  }
  const int64_t node = int64_t(node_rank) + index;
  const int64_t first = node * local_world_size;
  return absl::StrCat("node ", node, " (ranks ", first, "-", first + local_world_size - 1, ")");
}

absl::Status InvalidContribution(const std::string& who, const std::string& round,
                                 absl::string_view field, absl::string_view what) {
  return wire::WithReason(
      absl::InvalidArgumentError(absl::StrCat(who, " sent an invalid contribution to round ",
                                              round, ": field '", field, "' ", what)),
      v1::REASON_INVALID_CONTRIBUTION);
}

absl::Status DiffersFromFirst(const std::string& who, const std::string& round,
                              absl::string_view field, absl::string_view got,
                              const std::string& first_who, absl::string_view first) {
  return InvalidContribution(
      who, round, field,
      absl::StrCat("is ", got, " but ", first_who, " sent ", first,
                   field == "channels" ? "; every worker must run the same model" : ""));
}

absl::Status TooManyChannels(const std::string& who, int64_t channels, const std::string& round,
                             int64_t limit) {
  return absl::ResourceExhaustedError(absl::StrCat(
      who, " sent ", channels, " channels (field 'channels') to round ", round,
      ", more than this aggregator's limit --max-channels=", limit,
      "; raise the limit or split the layer"));
}

absl::Status CountsOverflow(const RoundRef& r, const std::vector<std::string>& who) {
  return wire::WithReason(absl::InvalidArgumentError(absl::StrCat(
      "round ", r.round, " of job '", r.job, "': the members' counts overflow int64 when summed (",
      absl::StrJoin(who, ", "), "); a count is the number of values per channel behind a "
      "contribution")), v1::REASON_COUNT_OVERFLOW);
}

absl::Status MergedNonFinite(const RoundRef& r) {
  return wire::WithReason(absl::InvalidArgumentError(absl::StrCat(
      "round ", r.round, " of job '", r.job, "': the merged statistics overflow to Inf or NaN "
      "although every contribution was finite; the values are too large (this job is strict: "
      "HSBN_STRICT_FINITE)")), v1::REASON_NONFINITE);
}

namespace {
absl::Status CannotComplete(const RoundRef& r, const std::string& who, absl::string_view why,
                            absl::string_view detail, v1::Reason reason) {
  return wire::WithReason(absl::UnavailableError(absl::StrCat("round ", r.round, " of job '", r.job,
                                             "' cannot complete: ", who, why, detail,
                                             "; the job cannot make progress until that "
                                             "process rejoins")), reason);
}
}  // namespace

absl::Status MemberGone(const RoundRef& r, const std::string& who, Gone why) {
  return CannotComplete(r, who,
                        why == Gone::kLeft ? " left the job"
                                           : " disconnected (its stream broke: the process "
                                             "probably exited or was killed)",
                        "",
                        why == Gone::kLeft ? v1::REASON_MEMBER_LEFT
                                           : v1::REASON_MEMBER_DISCONNECTED);
}

absl::Status MemberDown(const RoundRef& r, const std::string& who, absl::string_view down) {
  return CannotComplete(r, who, " is down: ", down, v1::REASON_NODE_DOWN);
}

absl::Status MemberAborted(const RoundRef& r, const std::string& who, absl::string_view reason) {
  return wire::WithReason(
      absl::AbortedError(absl::StrCat("round ", r.round, " of job '", r.job,
                                      "' cannot complete: ", who, " aborted (", reason,
                                      "); the job cannot make progress without it")),
      v1::REASON_MEMBER_ABORTED);
}

absl::Status TimedOut(const RoundRef& r, std::chrono::milliseconds timeout,
                      const std::vector<std::string>& missing) {
  return wire::WithReason(
      absl::DeadlineExceededError(absl::StrCat(
          "round ", r.round, " of job '", r.job, "' timed out after ", timeout.count(),
          " ms waiting for ", absl::StrJoin(missing, ", "),
          ". Those processes crashed, hung, or did not run this BN layer; every worker must run "
          "the same layers in the same order")),
      v1::REASON_TIMED_OUT);
}

absl::Status RootSilent(const RoundRef& r, std::chrono::milliseconds waited) {
  return wire::WithReason(
      absl::DeadlineExceededError(absl::StrCat(
          "round ", r.round, " of job '", r.job, "': the root aggregator did not answer within ",
          waited.count(), " ms; check the root and the nodes' sidecars")),
      v1::REASON_ROOT_SILENT);
}

std::string ScopeWord(int32_t scope) { return ScopeName(v1::Scope(scope)); }

}  // namespace hsbn::wire

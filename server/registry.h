// server/registry.h — the jobs and sessions of one aggregator, independent of any transport.
//
// The Registry admits Joins (validating the layout and the token, bounding world sizes and the
// number of jobs), draws each member's secret session, binds sessions to streams only for
// callers that may use them, answers who may see which job in Status, and decides when a job
// ends: when every member left or lost its stream, or when no member has been attached to a
// stream for --attach-timeout-ms. It owns the process-wide MemoryBudget that every Job charges.
// Transports (the gRPC member streams, the upstream link) call it; it calls none of them:
// what must happen on the wire comes back as Actions.
//
// Thread safety: all public methods are thread-safe. The registry's mutex is never held while
// a Job's is taken by a caller (Join is the one place that takes both, registry first).
#ifndef HSBN_SERVER_REGISTRY_H_
#define HSBN_SERVER_REGISTRY_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hsbn/v1/hsbn.pb.h"
#include "job.h"
#include "session.h"
#include "tokens.h"

namespace hsbn::server {

struct RegistryOptions {
  std::string id = "hsbn-aggregator";   // this aggregator's name in errors
  v1::MemberKind joins = v1::MEMBER_KIND_WORKER;  // who joins here: workers (node), sidecars (root)
  // A group aggregator (--role=group): sidecars join it, and each job's are the nodes of one
  // group (node_rank / group_nodes), set by the first.
  bool group_tier = false;
  int32_t max_jobs = 256;
  int32_t max_world_size = 16384;
  Clock::duration attach_timeout = std::chrono::seconds(60);
  int64_t memory_budget_bytes = int64_t(1) << 30;
  JobLimits limits;                      // for every job; its budget is the registry's
  std::shared_ptr<TokenStore> tokens;    // null: no tokens (trust is the socket's permissions)
};

class Registry {
 public:
  struct SessionRef {
    std::shared_ptr<Job> job;
    int32_t index = -1;
  };
  struct Joined {
    SessionId session;
    std::shared_ptr<Job> job;
    int32_t index = -1;
    int32_t num_nodes = 0;
    // The job this Join ended, when it started a new run of it (a higher incarnation).
    std::shared_ptr<Job> replaced;
  };

  explicit Registry(RegistryOptions options);

  // Admits a Join: FAILED_PRECONDITION for a protocol version or member kind this aggregator
  // does not take, UNAUTHENTICATED for a wrong token, INVALID_ARGUMENT for a bad or conflicting
  // layout, RESOURCE_EXHAUSTED past --max-jobs or --max-world-size, Close's status once closed.
  // A refused Join creates no job and replaces no member.
  absl::StatusOr<Joined> Join(const v1::JoinRequest& req, Actions* out);
  // The session's member, if it may be bound by a caller that presents `token`: NOT_FOUND for
  // an unknown session, UNAUTHENTICATED (tokens on) when `token` is not its job's token.
  absl::StatusOr<SessionRef> Authorize(const SessionId& session, const std::string& token) const;
  // The session's member, for a stream that already attached it.
  bool Find(const SessionId& session, SessionRef* out) const;
  // The member leaves: its open rounds fail, its session is forgotten. NOT_FOUND if unknown.
  absl::Status Leave(const SessionId& session, Actions* out, std::string* job_id);
  // Drops the jobs that ended (see above); returns their ids, each with whether it expired
  // (no member attached for the attach timeout) rather than every member being gone.
  struct Dropped {
    std::shared_ptr<Job> job;
    bool expired = false;
  };
  std::vector<Dropped> Sweep(Clock::time_point now);
  // Which jobs a Status request may see: all (or the one named) with tokens off; with tokens
  // on, only the named job, and only with its token (UNAUTHENTICATED otherwise).
  absl::StatusOr<std::vector<std::shared_ptr<Job>>> StatusJobs(const v1::StatusRequest& req) const;
  std::vector<std::shared_ptr<Job>> Jobs() const;
  // Stops admitting: every later Join and Authorize answers `why` (not OK). Returns the jobs,
  // to which no member can be added from here on.
  std::vector<std::shared_ptr<Job>> Close(const absl::Status& why);
  std::shared_ptr<Job> FindJob(const std::string& job_id) const;
  size_t size() const;
  bool tokens_on() const { return options_.tokens != nullptr; }
  const std::shared_ptr<MemoryBudget>& budget() const { return budget_; }

 private:
  absl::Status CheckRequest(const v1::JoinRequest& req, const std::string& who) const;
  // Join's steps: the peer speaks this protocol and is of the kind this role admits; the
  // request's job layout; under mu_, the job found, replaced (a newer run) or created, and the
  // member registered in it and in sessions_ (*joined: its index in, its session and job out).
  absl::Status CheckPeer(const v1::JoinRequest& req) const;
  JobLayout LayoutOf(const v1::JoinRequest& req) const;
  absl::Status AdmitLocked(const v1::JoinRequest& req, const std::string& who,
                           const JobLayout& layout, const SessionId& previous, Joined* joined,
                           Actions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RegistryOptions options_;
  const std::shared_ptr<MemoryBudget> budget_;
  // A layout refusal of a Join to an existing job of the same run also reaches the job's
  // members (Job::Refused). RefuseInJob returns `refusal`.
  absl::Status RefuseInJob(const v1::JoinRequest& req, const absl::Status& refusal, Actions* out)
      ABSL_LOCKS_EXCLUDED(mu_);
  void TellJobLocked(Job& job, const v1::JoinRequest& req, const absl::Status& refusal,
                     Actions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, SessionRef> sessions_ ABSL_GUARDED_BY(mu_);
  absl::Status closed_ ABSL_GUARDED_BY(mu_);  // Close's status
};

// A job id a user wrote: at most 256 bytes of printable ASCII (no spaces, no control bytes).
absl::Status CheckJobId(const std::string& job_id);

}  // namespace hsbn::server

#endif  // HSBN_SERVER_REGISTRY_H_

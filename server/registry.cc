#include "registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "log.h"
#include "wire.h"

namespace hsbn::server {

static absl::Status CheckJobIdText(const std::string& job_id);

absl::Status CheckJobId(const std::string& job_id) {
  absl::Status s = CheckJobIdText(job_id);
  return wire::WithReason(s, v1::REASON_JOB_ID);
}

absl::Status CheckJobIdText(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id is empty: set HSBN_JOB_ID");
  if (job_id.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id is ", job_id.size(), " bytes long; at most 256 are allowed (HSBN_JOB_ID)"));
  }
  for (unsigned char c : job_id) {
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job_id '", wire::Printable(job_id, 64), "' has a byte that is not printable ASCII "
          "(spaces and control characters are not allowed in HSBN_JOB_ID)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Registry::RefuseInJob(const v1::JoinRequest& req, const absl::Status& refusal,
                                   Actions* out) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(req.job_id());
  if (it != jobs_.end()) TellJobLocked(*it->second, req, refusal, out);
  return refusal;
}

void Registry::TellJobLocked(Job& job, const v1::JoinRequest& req, const absl::Status& refusal,
                             Actions* out) {
  // Only a layout refusal, of the job's own run: the job cannot run as launched. (With tokens
  // on, the caller presented the job's token before any layout check.)
  const v1::Reason reason = wire::ReasonOf(refusal);
  if ((reason != v1::REASON_LAYOUT && reason != v1::REASON_GROUP_NODES) ||
      req.incarnation() != job.layout().incarnation) {
    return;
  }
  job.Refused(wire::WithMessage(
                  refusal, absl::StrCat("job '", job.id(), "' cannot run as launched: a process "
                                        "joining it was refused (", refusal.message(), ")")),
              out);
}

Registry::Registry(RegistryOptions options)
    : options_(std::move(options)),
      budget_(std::make_shared<MemoryBudget>(options_.memory_budget_bytes)) {}

absl::Status Registry::CheckRequest(const v1::JoinRequest& req, const std::string& who) const {
  const bool worker = req.kind() == v1::MEMBER_KIND_WORKER;
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " of job '", req.job_id(), "': ", what));
  };
  if (worker) {
    absl::Status s = wire::CheckWorkerLayout(req.rank(), req.world_size(), req.local_rank(),
                                             req.local_world_size(), req.node_rank(),
                                             options_.max_world_size, req.group_nodes());
    if (!s.ok()) {
      return wire::WithMessage(s, absl::StrCat(who, " of job '", req.job_id(), "': ", s.message()));
    }
    return absl::OkStatus();
  }
  if (req.world_size() <= 0) return bad("world_size (WORLD_SIZE) must be positive");
  if (req.world_size() > options_.max_world_size) {
    return wire::WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            who, " of job '", req.job_id(), "': WORLD_SIZE=", req.world_size(),
            " is more than this aggregator serves (--max-world-size=", options_.max_world_size,
            ")")),
        v1::REASON_MAX_WORLD_SIZE);
  }
  if (req.local_world_size() <= 0 || req.world_size() % req.local_world_size() != 0) {
    return bad(absl::StrCat("local_world_size (LOCAL_WORLD_SIZE) is ", req.local_world_size(),
                            "; it must be positive and divide WORLD_SIZE=", req.world_size(),
                            " (hsbn needs as many workers on every node)"));
  }
  const int32_t num_nodes = req.world_size() / req.local_world_size();
  if (req.node_rank() < 0 || req.node_rank() >= num_nodes) {
    return bad(absl::StrCat("node_rank (GROUP_RANK) is ", req.node_rank(), "; the job has ",
                            num_nodes, " nodes"));
  }
  if (absl::Status s = wire::CheckGroupNodes(req.group_nodes(), num_nodes); !s.ok()) {
    return bad(std::string(s.message()));
  }
  const int32_t member_nodes = std::max(1, req.member_nodes());
  if (member_nodes > 1) {
    if (options_.group_tier) {
      return bad(absl::StrCat("a group aggregator (", member_nodes, " nodes) joined a group "
                              "aggregator; group aggregators take node sidecars only, and their "
                              "own --upstream is the root"));
    }
    if (member_nodes != req.group_nodes()) {
      return wire::WithReason(
          bad(absl::StrCat("a group aggregator covering ", member_nodes, " nodes joined, but "
                           "the job's groups have HSBN_GROUP_NODES=", req.group_nodes(),
                           " nodes; a group aggregator serves exactly one group")),
          v1::REASON_GROUP_NODES);
    }
    if (req.node_rank() % member_nodes != 0) {
      return bad(absl::StrCat("a group aggregator's node_rank must be the first node of its "
                              "group (a multiple of ", member_nodes, "), not ", req.node_rank()));
    }
  }
  if (options_.group_tier && req.group_nodes() <= 0) {
    return wire::WithReason(
        bad(absl::StrCat("this is group aggregator ", options_.id, ", but the job was launched "
                         "without groups: set HSBN_GROUP_NODES on every worker, or point this "
                         "node's sidecar (--upstream) at the root")),
        v1::REASON_GROUP_NODES);
  }
  return absl::OkStatus();
}

absl::Status Registry::CheckPeer(const v1::JoinRequest& req) const {
  const bool worker = req.kind() == v1::MEMBER_KIND_WORKER;
  if (req.protocol_version() != v1::PROTOCOL_VERSION_2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the client speaks hsbn protocol version ", req.protocol_version(), " but aggregator ",
        options_.id, " speaks version ", int(v1::PROTOCOL_VERSION_2),
        "; use the same hsbn release for trainers, sidecars and the root"));
  }
  if (req.kind() != v1::MEMBER_KIND_WORKER && req.kind() != v1::MEMBER_KIND_AGGREGATOR) {
    return absl::InvalidArgumentError("Join: field 'kind' must be worker or aggregator");
  }
  if (req.kind() != options_.joins) {
    if (worker) {
      return absl::FailedPreconditionError(absl::StrCat(
          "aggregator ", options_.id, " is a ", options_.group_tier ? "group aggregator" : "root",
          "; workers join their node's sidecar (--role=node), not the ",
          options_.group_tier ? "group aggregator" : "root", ". Check HSBN_ADDRESS"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "aggregator ", options_.id, " is a node sidecar; only a root (--role=root) or a group "
        "aggregator (--role=group) accepts other aggregators. Check the sidecar's --upstream"));
  }
  return absl::OkStatus();
}

JobLayout Registry::LayoutOf(const v1::JoinRequest& req) const {
  const bool worker = req.kind() == v1::MEMBER_KIND_WORKER;
  JobLayout layout;
  layout.member_kind = req.kind();
  layout.world_size = req.world_size();
  layout.local_world_size = req.local_world_size();
  layout.num_nodes = req.world_size() / req.local_world_size();
  layout.node_rank = worker ? req.node_rank() : -1;
  layout.strict_finite = req.strict_finite();
  layout.group_nodes = req.group_nodes();
  layout.incarnation = req.incarnation();
  layout.member_nodes = worker ? 0 : std::max(1, req.member_nodes());
  layout.group = options_.group_tier ? req.node_rank() / req.group_nodes() : -1;
  return layout;
}

absl::StatusOr<Registry::Joined> Registry::Join(const v1::JoinRequest& req, Actions* out) {
  if (absl::Status s = CheckPeer(req); !s.ok()) return s;
  const bool worker = req.kind() == v1::MEMBER_KIND_WORKER;
  const std::string who =
      worker                   ? absl::StrCat("rank ", req.rank())
      : req.member_nodes() > 1 ? absl::StrCat("the group aggregator of nodes ", req.node_rank(),
                                              "-", int64_t(req.node_rank()) + req.member_nodes() - 1)
                               : absl::StrCat("the sidecar of node ", req.node_rank());
  if (absl::Status s = CheckJobId(req.job_id()); !s.ok()) {
    return wire::WithMessage(s, absl::StrCat(who, ": ", s.message()));
  }
  // Before anything touches the job: a refused Join creates no job and replaces no member.
  if (options_.tokens) {
    if (absl::Status s = options_.tokens->Check(req.job_id(), req.token(), who); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = CheckRequest(req, who); !s.ok()) return RefuseInJob(req, s, out);
  SessionId previous;
  if (!req.previous_session().empty() &&
      !SessionId::FromBytes(req.previous_session(), &previous)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " of job '", req.job_id(), "': previous_session must be 16 bytes (a session from "
        "an earlier Join of this protocol version)"));
  }
  const JobLayout layout = LayoutOf(req);
  const int32_t index = worker                ? req.local_rank()
                        : options_.group_tier ? req.node_rank() % req.group_nodes()
                                              : req.node_rank() / layout.member_nodes;

  Joined joined;
  joined.index = index;
  joined.num_nodes = layout.num_nodes;
  joined.session = SessionId::Random();
  {
    // One critical section from finding (or creating) the job to registering the member, so
    // a sweep can never see a new job without members and drop it.
    absl::MutexLock lock(&mu_);
    if (absl::Status s = AdmitLocked(req, who, layout, previous, &joined, out); !s.ok()) return s;
  }
  if (joined.replaced) {
    Log(LogLevel::kInfo, absl::StrCat("job '", req.job_id(), "': run ",
                                      joined.replaced->layout().incarnation,
                                      " ended by the Join of run ", layout.incarnation));
    joined.replaced->Retire(
        absl::AbortedError(absl::StrCat(
            "job '", req.job_id(), "' was restarted: run (incarnation) ", layout.incarnation,
            " joined, so this round of run ", joined.replaced->layout().incarnation,
            " can never complete")),
        out);
  }
  if (!req.token().empty()) joined.job->SetToken(req.token());
  return joined;
}

absl::Status Registry::AdmitLocked(const v1::JoinRequest& req, const std::string& who,
                                   const JobLayout& layout, const SessionId& previous,
                                   Joined* joined_out, Actions* out) {
  Joined& joined = *joined_out;
  const int32_t index = joined.index;
  if (!closed_.ok()) return closed_;
  auto it = jobs_.find(req.job_id());
  if (it != jobs_.end() && layout.incarnation != it->second->layout().incarnation) {
    const uint64_t current = it->second->layout().incarnation;
    if (layout.incarnation < current) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, " of job '", req.job_id(), "' belongs to run (incarnation) ",
          layout.incarnation, " but aggregator ", options_.id, " already serves run ", current,
          " of that job: a process of an earlier run is still trying to join"));
    }
    // A new run of the job: the old one ends here, and none of its rounds, kept results or
    // sessions can answer the new run (whose seqs start again from 0).
    joined.replaced = it->second;
    std::vector<SessionId> gone;
    for (const auto& [session, ref] : sessions_) {
      if (ref.job == joined.replaced) gone.push_back(session);
    }
    for (const SessionId& session : gone) sessions_.erase(session);
    jobs_.erase(it);
    it = jobs_.end();
  }
  std::shared_ptr<Job> job;
  if (it == jobs_.end()) {
    if (int32_t(jobs_.size()) >= options_.max_jobs) {
      return wire::WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "aggregator ", options_.id, " already serves ", jobs_.size(),
              " jobs, its limit (--max-jobs); job '", req.job_id(), "' was refused")),
          v1::REASON_MAX_JOBS);
    }
    JobLimits limits = options_.limits;
    limits.budget = budget_;
    job = std::make_shared<Job>(req.job_id(), layout, limits);
  } else {
    job = it->second;
    if (absl::Status s = job->CheckLayout(layout, who); !s.ok()) {
      TellJobLocked(*job, req, s, out);
      return s;
    }
  }
  while (sessions_.count(joined.session)) joined.session = SessionId::Random();
  if (absl::Status s = job->AddMember(index, joined.session, previous, Clock::now(), out);
      !s.ok()) {
    return s;
  }
  if (it == jobs_.end()) {
    jobs_.emplace(req.job_id(), job);
    Log(LogLevel::kInfo, absl::StrCat("job '", req.job_id(), "' created: ", layout.world_size,
                                      " workers on ", layout.num_nodes, " node(s)"));
  }
  if (!previous.empty()) {
    auto prev = sessions_.find(previous);
    if (prev != sessions_.end() && prev->second.job == job && prev->second.index == index) {
      sessions_.erase(prev);
    }
  }
  sessions_[joined.session] = SessionRef{job, index};
  joined.job = std::move(job);
  return absl::OkStatus();
}

absl::StatusOr<Registry::SessionRef> Registry::Authorize(const SessionId& session,
                                                         const std::string& token) const {
  SessionRef ref;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.ok()) return closed_;
  }
  if (!Find(session, &ref)) {
    return absl::NotFoundError(
        "unknown session: the aggregator restarted or the job was dropped; the client must Join "
        "again (hsbn clients do this by themselves)");
  }
  if (options_.tokens) {
    absl::Status s = options_.tokens->Check(ref.job->id(), token, ref.job->MemberName(ref.index));
    if (!s.ok()) {
      return absl::UnauthenticatedError(absl::StrCat(
          "Attach: the token presented is not job '", ref.job->id(), "''s token; a stream may "
          "use only sessions of the job whose token it presents"));
    }
  }
  return ref;
}

bool Registry::Find(const SessionId& session, SessionRef* out) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return false;
  *out = it->second;
  return true;
}

absl::Status Registry::Leave(const SessionId& session, Actions* out, std::string* job_id) {
  SessionRef ref;
  if (!Find(session, &ref)) return absl::NotFoundError("unknown session");
  ref.job->MemberGone(ref.index, session, /*left=*/true, Clock::now(), out);
  *job_id = ref.job->id();
  absl::MutexLock lock(&mu_);
  sessions_.erase(session);
  return absl::OkStatus();
}

std::vector<Registry::Dropped> Registry::Sweep(Clock::time_point now) {
  std::vector<Dropped> dropped;
  absl::MutexLock lock(&mu_);
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    bool expired = false;
    if (!it->second->Droppable(now, options_.attach_timeout, &expired)) {
      ++it;
      continue;
    }
    dropped.push_back(Dropped{it->second, expired});
    for (auto s = sessions_.begin(); s != sessions_.end();) {
      if (s->second.job == it->second) {
        sessions_.erase(s++);
      } else {
        ++s;
      }
    }
    it = jobs_.erase(it);
  }
  return dropped;
}

absl::StatusOr<std::vector<std::shared_ptr<Job>>> Registry::StatusJobs(
    const v1::StatusRequest& req) const {
  std::vector<std::shared_ptr<Job>> jobs;
  if (options_.tokens) {
    if (req.job_id().empty()) {
      return absl::UnauthenticatedError(
          "this aggregator requires job tokens: Status shows one job, to a caller that names it "
          "(job_id) and presents its token (HSBN_TOKEN)");
    }
    if (absl::Status s = options_.tokens->Check(req.job_id(), req.token(), "Status"); !s.ok()) {
      return s;
    }
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    if (req.job_id().empty() || id == req.job_id()) jobs.push_back(job);
  }
  return jobs;
}

std::vector<std::shared_ptr<Job>> Registry::Jobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> jobs;
  jobs.reserve(jobs_.size());
  for (const auto& [id, job] : jobs_) jobs.push_back(job);
  return jobs;
}

std::vector<std::shared_ptr<Job>> Registry::Close(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  closed_ = why.ok() ? absl::UnavailableError("the aggregator is shutting down") : why;
  std::vector<std::shared_ptr<Job>> jobs;
  jobs.reserve(jobs_.size());
  for (const auto& [id, job] : jobs_) jobs.push_back(job);
  return jobs;
}

std::shared_ptr<Job> Registry::FindJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

size_t Registry::size() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

}  // namespace hsbn::server

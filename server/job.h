// server/job.h — one job's membership and rounds at one aggregator, independent of gRPC.
//
// A Job holds the members expected at this aggregator (the local ranks of one node at a
// sidecar, the nodes of a group at a group aggregator, the nodes or groups at the root) and the rounds in flight, keyed by (op, seq, phase). It
// validates every contribution, reduces complete rounds in member-index order (so every member
// of a round gets bitwise the same result, run after run), fails rounds that miss their
// deadline or lose a member, and remembers finished rounds for a while so that a late or
// repeated contribution gets the same answer.
//
// The Job never performs I/O: each call fills an Actions value (results to send to members,
// partials to forward to the parent aggregator, aborts to tell the parent) that the caller
// executes after the call returns, outside the job's lock. This keeps the protocol semantics
// testable without sockets and keeps slow I/O out of the critical section.
//
// Nothing here hard-codes the number of levels: an aggregator with a parent forwards the rounds
// whose scope spans more nodes than it covers (JobLayout::covered_nodes); one without a parent
// answers them. Results of forwarded rounds come back down through every level.
//
// Memory: every byte of round data and kept results is charged to the process's MemoryBudget
// (JobLimits::budget) while the job holds it, and released when it lets go or is destroyed.
//
// Thread safety: all public methods are safe to call concurrently (one mutex per job; the lock
// rules are ABSL_GUARDED_BY annotations, checked by Clang's -Wthread-safety).
#ifndef HSBN_SERVER_JOB_H_
#define HSBN_SERVER_JOB_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hsbn/v1/hsbn.pb.h"
#include "round.h"
#include "session.h"

namespace hsbn::server {

using Clock = std::chrono::steady_clock;

// Where results for one member go. Implemented by the Exchange stream's outbox; Send must not
// block. It takes the result by value: the caller builds each member's copy once and moves it.
class ResultSink {
 public:
  virtual ~ResultSink() = default;
  virtual void Send(v1::Result result) = 0;
};

struct RoundKey {
  uint32_t op = 0;
  uint64_t seq = 0;
  v1::Phase phase = v1::PHASE_UNSPECIFIED;
  // 0, or at the root, 1 + the group index of a group-scope round: each group's round is a
  // round of its own (its nodes only), under the same (op, seq, phase) as the others'.
  int32_t group = 0;
  bool operator<(const RoundKey& o) const {
    if (op != o.op) return op < o.op;
    if (seq != o.seq) return seq < o.seq;
    if (phase != o.phase) return phase < o.phase;
    return group < o.group;
  }
  bool operator==(const RoundKey& o) const {
    return op == o.op && seq == o.seq && phase == o.phase && group == o.group;
  }
  template <typename H>
  friend H AbslHashValue(H h, const RoundKey& k) {
    return H::combine(std::move(h), k.op, k.seq, int(k.phase), k.group);
  }
};
std::string Describe(const RoundKey& key);

// The job's shape, as declared by its members at Join. Every member must declare the same.
struct JobLayout {
  v1::MemberKind member_kind = v1::MEMBER_KIND_WORKER;  // who joins this aggregator
  int32_t world_size = 0;
  int32_t local_world_size = 0;
  int32_t num_nodes = 0;
  int32_t node_rank = -1;  // at a sidecar: the node it serves for this job; -1 at the root
  bool strict_finite = false;  // JoinRequest.strict_finite: non-finite values fail rounds
  uint64_t incarnation = 0;    // JoinRequest.incarnation: which run of the job
  int32_t group_nodes = 0;     // JoinRequest.group_nodes: nodes per group, 0: no groups
  // Aggregator members: nodes each covers (1: sidecars; group_nodes: group aggregators).
  int32_t member_nodes = 0;
  // At a group aggregator: the group it serves for this job; -1 elsewhere.
  int32_t group = -1;

  bool workers() const { return member_kind == v1::MEMBER_KIND_WORKER; }
  // The nodes this aggregator covers in the job: its node at a sidecar, its group's at a group
  // aggregator, all at the root. A round spanning more is forwarded to the parent.
  int32_t covered_nodes() const {
    return workers() ? 1 : group >= 0 ? group_nodes : num_nodes;
  }
  int32_t first_node() const {
    return workers() ? node_rank : group >= 0 ? group * group_nodes : 0;
  }
  // Members expected here: local ranks at a sidecar, nodes at a group aggregator or a flat
  // root, groups at a root above group aggregators.
  int32_t expected_members() const {
    return workers() ? local_world_size : covered_nodes() / std::max(1, member_nodes);
  }
  // Whether group rounds here are rounds of a part of the members, keyed by group (a root whose
  // members are nodes, in a job with several groups).
  bool keyed_groups() const {
    return !workers() && group_nodes > 0 && member_nodes < group_nodes &&
           covered_nodes() > group_nodes;
  }
  // The nodes a round of `scope` spans (node: 1, group: group_nodes, else every node).
  int32_t SpanOf(v1::Scope scope) const {
    return scope == v1::SCOPE_NODE ? 1 : scope == v1::SCOPE_GROUP ? group_nodes : num_nodes;
  }
};

struct JobLimits {
  std::chrono::milliseconds round_timeout{30000};
  int32_t max_channels = 65536;
  int32_t max_open_rounds = 4096;
  int32_t finished_rounds_kept = 1024;   // tombstones for late / repeated contributions
  int64_t finished_bytes_kept = 16 << 20;
  bool has_parent = false;               // a sidecar with --upstream
  std::shared_ptr<MemoryBudget> budget;  // null: unbounded (unit tests)
};

// What the caller must do after a Job call returns.
struct Actions {
  struct Delivery {
    std::vector<std::pair<SessionId, std::shared_ptr<ResultSink>>> to;  // session, sink
    std::shared_ptr<const v1::Result> result;  // `session` is filled per recipient
  };
  struct Forward {  // send this partial to the parent aggregator
    RoundKey key;
    v1::Scope scope;
    uint32_t channels;
    int64_t count;
    std::shared_ptr<const std::string> data;
    std::shared_ptr<const v1::AutoDecide> decide;  // the round asks the root to decide; or null
  };
  struct Abort {  // tell the parent that this round failed below it
    RoundKey key;
    absl::Status status;
  };
  struct NodeState {  // tell the parent that this node is down (a worker is gone) or back
    bool healthy;
    std::string message;
  };
  std::vector<Delivery> deliveries;
  std::vector<Forward> forwards;
  std::vector<Abort> aborts;
  std::vector<NodeState> node_states;
  // Layer names this job learned (LayerNames) that the parent has not been told.
  std::vector<v1::LayerName> names;
  // For metrics: every round that finished here, once, OK (its result was sent, or at the root
  // a shadow round was reduced) or failed.
  struct Outcome {
    v1::Scope scope;
    v1::Phase phase;
    absl::StatusCode code;
    Clock::time_point opened;  // its first contribution here; {} when it never opened here
  };
  std::vector<Outcome> outcomes;
  // Who rounds timed out waiting for, one entry per (round, member): "rank 3" at a sidecar,
  // "node 1" at the root, "upstream" when the parent did not answer.
  std::vector<std::string> timed_out;
  std::vector<std::string> log;  // things worth a log line, in words
  // One line per round that failed here, in words: logged through the rate limit, since a
  // client can fail rounds as fast as it can send (LogKind::kRoundFailed).
  std::vector<std::string> round_failures;
  // For metrics: NaN/Inf values seen in contributions and results, per phase (forward,
  // backward), and why requests were refused for lack of a resource (Metrics::Refused).
  int64_t nonfinite[2] = {0, 0};
  std::vector<const char*> refused;
  bool empty() const {
    return deliveries.empty() && forwards.empty() && aborts.empty() && node_states.empty() &&
           names.empty();
  }
};

class Job {
 public:
  Job(std::string id, JobLayout layout, JobLimits limits);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  const std::string& id() const { return id_; }
  const JobLayout& layout() const { return layout_; }

  // Checks that a joining member declares this job's layout. `who` names it in errors.
  absl::Status CheckLayout(const JobLayout& declared, const std::string& who) const;

  // Adds a member at `index` with a new session. Fails with ALREADY_EXISTS if another session
  // holds the index and is connected, unless it is `previous_session` (a reconnect).
  absl::Status AddMember(int32_t index, const SessionId& session,
                         const SessionId& previous_session, Clock::time_point now, Actions* out);
  // Binds a session to a stream's sink. NOT_FOUND if the session is not (or no longer) here.
  absl::Status Attach(int32_t index, const SessionId& session, std::shared_ptr<ResultSink> sink,
                      Clock::time_point now);
  // The member's stream broke (connected=false) or it left (left=true): every open round that
  // still waits for it fails at once, naming it. `aborted` non-empty: a worker said why it is
  // gone (its Abort frame); the rounds fail ABORTED with that reason.
  void MemberGone(int32_t index, const SessionId& session, bool left, Clock::time_point now,
                  Actions* out, absl::string_view aborted = {});
  // True when the job can be dropped: every member left or lost its stream, or no member has
  // been attached to a stream for `attach_timeout` (members that joined and never attached).
  // `expired` (optional) tells which.
  bool Droppable(Clock::time_point now, Clock::duration attach_timeout,
                 bool* expired = nullptr) const;

  // A member's contribution. Validates it first; a bad one fails the round for everyone.
  // Returns false, touching nothing, when `session` is no longer the member's session (it was
  // replaced by a newer Join, or the member left): the caller answers NOT_FOUND.
  bool Contribute(int32_t index, const SessionId& session, const v1::Contribution& c,
                  Clock::time_point now, Actions* out);
  // A child aggregator says a round failed below it.
  void ChildAbort(int32_t index, const v1::Abort& abort, Actions* out);
  // A child aggregator says its node is down (a worker is gone: every open round still waiting
  // for that node fails at once, and so does every new round, until it is back) or back.
  void ChildState(int32_t index, const v1::NodeState& state, Actions* out);
  // A sidecar: whether its node is down in this job (a worker gone, not back yet), and why.
  // Said again to a parent that the sidecar joins anew (a new stream, a restarted root).
  bool NodeDown(std::string* message) const;
  // Layer names from a member: the first name of each op is kept (kMaxNames per job, printable,
  // at most kMaxNameBytes, charged to the memory budget within a quarter of it; others are
  // dropped); with a parent, new ones go up (Actions::names).
  static constexpr size_t kMaxNames = 4096;
  static constexpr size_t kMaxNameBytes = 256;
  void NameLayers(const v1::LayerNames& names, Actions* out);

  // A lagged layer's trip report (v1::LaggedTrip): counted once per (op, seq) for Status;
  // InvalidArgument for a NaN or negative drift or exact_calls outside [1, 2^30],
  // ResourceExhausted past kMaxNames ops or the budget (charged as names are). Changes no round.
  absl::Status RecordTrip(const v1::LaggedTrip& trip);

  // The parent's answer to a round this aggregator forwarded. For a renorm or lagged round
  // (forwarded after its node answer) it goes to every member as the round's late global
  // result. An answer to a round this aggregator neither forwarded nor expects is dropped
  // (logged): it cannot reach a member.
  void ParentResult(const v1::Result& result, Actions* out);
  // A renorm or lagged partial of `channels` went to the parent by another path (the
  // shared-memory transport's queue): its global result, when the parent answers, goes to
  // every member.
  void ExpectLate(const RoundKey& key, uint32_t channels, Clock::time_point now);
  // The link to the parent broke: every round waiting for it fails with `status`.
  void ParentLost(const absl::Status& status, Actions* out);
  // The job was replaced by a new run of it (a Join with a higher incarnation): fails every
  // open round with `status`, without telling the parent (the parent learns from the new run's
  // Join).
  void Retire(const absl::Status& status, Actions* out);
  // Fails rounds whose deadline has passed.
  void Expire(Clock::time_point now, Actions* out);
  // Fails every open round with `status`, and every later contribution (shutdown).
  void FailAll(const absl::Status& status, Actions* out);
  // A process was refused joining this job for its layout: the job cannot run as launched.
  // Every open round fails with `refusal` at once (told to the parent too), and so does every
  // round opened later. The first refusal stands; refusal() returns it (OK: none).
  void Refused(const absl::Status& refusal, Actions* out);
  absl::Status refusal() const;

  // The token this job's members presented at Join here (empty: none). An aggregator presents
  // it when it joins the job at its parent, so one token file format serves every level.
  void SetToken(const std::string& token);
  std::shared_ptr<const std::string> token() const;

  // Bytes this job holds charged to its MemoryBudget (0 once it holds nothing).
  int64_t held_bytes() const;

  void FillStatus(v1::JobStatus* status) const;
  // Human name of a member: "rank 5 (node 1, local rank 1)" or "node 1 (ranks 4-7)".
  wire::MemberNames Names() const;  // how this job names its members (round.h)
  std::string MemberName(int32_t index) const;

 private:
  // CheckLayout's message, without its reason.
  absl::Status LayoutDiffers(const JobLayout& declared, const std::string& who) const;
  struct Slot {
    bool filled = false;
    int64_t count = 0;
    std::string data;
  };
  struct Round {
    RoundKey key;
    v1::Scope scope = v1::SCOPE_UNSPECIFIED;
    uint32_t channels = 0;
    int32_t first_contributor = -1;
    std::vector<Slot> slots;  // one per member; only [lo, hi) take part
    int32_t lo = 0, hi = 0;   // its members: all, or at the root one group's nodes
    int32_t filled = 0;
    std::shared_ptr<const v1::AutoDecide> decide;  // Contribution.decide; null: none
    int64_t charged = 0;     // bytes charged to the budget for this round
    bool forwarded = false;  // waiting for the parent
    // A lagged backward round above the sidecars whose every member contributed: it completes
    // when its forward round does (it is re-centred on the forward's mean).
    bool waits_forward = false;
    Clock::time_point opened;  // first contribution
    Clock::time_point deadline;
  };
  struct Finished {
    absl::Status status;
    std::shared_ptr<const v1::Result> result;  // OK rounds only
    // OK rounds: a hash of each member's contribution, to tell a retransmission (same payload:
    // answered with the result again) from a reused round key (different payload: refused).
    std::vector<uint64_t> contribution_hashes;
    int64_t charged = 0;
  };
  struct Member {
    SessionId session;
    bool joined = false;
    bool connected = false;  // attached to a live stream
    bool gone = false;       // its stream broke or it left; rounds cannot complete without it
    std::string down;        // a child aggregator whose node is down: why (empty: it is not)
    std::string aborted;     // gone by its own Abort frame: its reason (empty: it did not)
    std::shared_ptr<ResultSink> sink;
    int64_t contributions = 0;
  };
  struct DivergenceAcc {
    int64_t rounds = 0;
    double mean_shift_sum = 0, mean_shift_max = 0, var_ratio_sum = 0, log_var_ratio_abs_sum = 0;
    // Adds one round: a partial of `count` values (mean, m2) against the global statistics.
    void Add(int64_t channels, int64_t count, const double* mean, const double* m2,
             int64_t global_count, const double* gmean, const double* gm2);
  };

  absl::Status ValidateLocked(int32_t index, const v1::Contribution& c, const Round* open,
                              Actions* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `scope` names the round's scope in metrics when it never opened here. `key` is taken by
  // value: the caller's may live in the open round this erases.
  void FailRoundLocked(RoundKey key, const absl::Status& status, bool tell_parent,
                       Actions* out, v1::Scope scope = v1::SCOPE_UNSPECIFIED)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails every open round for which `waits(round)` holds, with the status `why(key)`.
  template <typename Waits, typename Why>
  int FailOpenRoundsLocked(Waits waits, Why why, bool tell_parent, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseOpenLocked(std::map<RoundKey, Round>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Contribute's steps: a contribution to a finished round, the checks that refuse one (false:
  // refused, the sender told), opening its round (nullptr: refused), and its slot.
  void AnswerRepeatLocked(int32_t index, const SessionId& session, const RoundKey& key,
                          const v1::Contribution& c, const Finished& finished, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AdmitLocked(int32_t index, const SessionId& session, const RoundKey& key,
                   const v1::Contribution& c, const Round* open, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Round* OpenRoundLocked(int32_t index, const SessionId& session, const RoundKey& key,
                         const v1::Contribution& c, Clock::time_point now, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FillSlotLocked(Round& open, int32_t index, const SessionId& session,
                      const v1::Contribution& c, Actions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the sender and fails the round `key` (it may not be open yet).
  void RefuseLocked(int32_t index, const SessionId& session, const RoundKey& key,
                    v1::Scope scope, const absl::Status& status, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(Round& round, Actions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CompleteLocked's steps after the reduction: false when a forwarded round waits for its
  // parent's answer; otherwise the answer's scope is set (and divergence recorded).
  bool AnswerNowLocked(Round& round, bool forwards, v1::Result* result, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds an auto round's decision to its answer.
  void DecideRoundLocked(const Round& round, v1::Result* result, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static std::vector<uint64_t> HashContributions(const Round& round);
  void FinishLocked(const RoundKey& key, Finished finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeliverLocked(const Round& round, std::shared_ptr<const v1::Result> result, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendFinishedLocked(int32_t index, const SessionId& session, const RoundKey& key,
                          const Finished& finished, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordDivergenceLocked(const Round& round, const v1::Result& global, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Renorm rounds: notes that `key`'s global result is due from the parent / sends every
  // member the late global result (`result`: OK, scope global) or the late failure `status`.
  void ExpectLateLocked(const RoundKey& key, uint32_t channels, Clock::time_point now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeliverLateLocked(const RoundKey& key, std::shared_ptr<const v1::Result> result,
                         const absl::Status& status, Actions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lagged rounds (docs/PROTOCOL.md, "Lagged scope"): keeps what the backward round of
  // `round` (a completed lagged forward, reduced to mean `center`) needs: each member's count
  // and, above the sidecars, each member's mean. Then completes that backward round if it
  // only waited for this.
  void KeepLaggedForwardLocked(const Round& round, const double* center, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why member `index`'s lagged backward contribution `c` cannot be taken (no lagged forward
  // from it under (op, seq), another count or channel count, its forward failed or was
  // forgotten); OK if it can. Told to that member only.
  absl::Status CheckLaggedBackwardLocked(int32_t index, const v1::Contribution& c) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails every late global result still due with `why(key)`.
  template <typename Why>
  void FailLateLocked(Why why, Actions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  using Records = std::map<std::pair<uint32_t, int32_t>, DivergenceAcc>;
  // The record of `key` in `records`, made if need be. A new record is charged to the memory
  // budget (within a quarter of it, so that records never crowd out round data); null when the
  // budget refuses: that round goes unrecorded (and an auto decision without a record for every
  // node or group is global).
  DivergenceAcc* RecordLocked(Records& records, std::pair<uint32_t, int32_t> key, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers only the contributor (`index`, `session`) of round `key` with error `s`.
  void TellSenderLocked(int32_t index, const SessionId& session, const RoundKey& key,
                        const absl::Status& s, Actions* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ScopeReachesParent(v1::Scope scope) const;
  // The key of `c` from member `index`: at the root a group round is keyed by its group.
  RoundKey KeyOf(int32_t index, const v1::Contribution& c) const;
  // Why a new round of members [lo, hi) cannot complete here (a member gone, or a node below
  // down); OK if it can.
  absl::Status BlockedLocked(const RoundKey& key, int32_t lo, int32_t hi) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At the root: the auto-scope decision for `op` from the shadow rounds recorded since its
  // last decision (per group with groups, else per node); resets that record.
  v1::AutoDecision DecideLocked(uint32_t op, const v1::AutoDecide& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Charges `bytes` to the budget (false: refused, nothing charged) / releases them.
  bool ChargeLocked(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts the non-finite values of a payload into out->nonfinite; returns how many.
  static int64_t CountNonFinite(const std::string& data, v1::Phase phase, Actions* out);

  const std::string id_;
  const JobLayout layout_;
  const JobLimits limits_;

  mutable absl::Mutex mu_;
  std::vector<Member> members_ ABSL_GUARDED_BY(mu_);
  std::map<RoundKey, Round> open_ ABSL_GUARDED_BY(mu_);
  // Looked up for every contribution.
  absl::flat_hash_map<RoundKey, Finished> finished_ ABSL_GUARDED_BY(mu_);
  std::deque<RoundKey> finished_order_ ABSL_GUARDED_BY(mu_);
  int64_t finished_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rounds_completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rounds_failed_ ABSL_GUARDED_BY(mu_) = 0;
  // (op, node)
  Records divergence_ ABSL_GUARDED_BY(mu_);
  // (op, group), with groups
  Records group_divergence_ ABSL_GUARDED_BY(mu_);
  // (op, group or node): the record since op's last auto-scope decision
  Records decide_window_ ABSL_GUARDED_BY(mu_);
  int64_t records_refused_ ABSL_GUARDED_BY(mu_) = 0;  // shadow records the budget refused
  // Renorm rounds answered here and forwarded, whose global result is due from the parent:
  // their channels and when the parent's answer is overdue. At most max_open_rounds (past
  // that a round's late result is not relayed: its workers' waits time out).
  struct Late {
    uint32_t channels = 0;
    Clock::time_point deadline;
  };
  std::map<RoundKey, Late> late_ ABSL_GUARDED_BY(mu_);
  // Lagged forward rounds completed here whose backward round has not completed here, by
  // (op, seq): at most max_open_rounds (the oldest are forgotten: their backward is refused),
  // charged to the memory budget within a quarter of it.
  struct LaggedForward {
    absl::Status status;          // not OK: the record could not be kept (the budget)
    uint32_t channels = 0;
    std::vector<int64_t> counts;  // per member
    std::vector<double> means;    // above the sidecars: per member, channels each
    std::vector<double> center;   // above the sidecars: the forward's reduced mean
    int64_t charged = 0;
  };
  std::map<std::pair<uint32_t, uint64_t>, LaggedForward> lagged_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<uint32_t, uint64_t>> lagged_order_ ABSL_GUARDED_BY(mu_);
  void ForgetLaggedLocked(std::map<std::pair<uint32_t, uint64_t>, LaggedForward>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Above the sidecars: the forward record a lagged backward round re-centres on; false when
  // the round waits for it (waits_forward) or failed for want of it.
  bool LaggedForwardOfLocked(Round& round, const LaggedForward** forward, Actions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reduces the round's filled slots in member order into scratch's first 2 × channels
  // (scratch holds 4 × channels); `forward` re-centres a lagged backward's sums.
  absl::Status ReduceSlots(const Round& round, const LaggedForward* forward, double* scratch,
                           int64_t* count, wire::ReduceFault* fault) const;
  int64_t late_dropped_ ABSL_GUARDED_BY(mu_) = 0;  // parent results nobody expected
  absl::flat_hash_map<uint32_t, std::string> names_ ABSL_GUARDED_BY(mu_);  // op -> layer name
  // op -> what RecordTrip counted (ordered: Status lists them by op).
  std::map<uint32_t, v1::LaggedTripStatus> trips_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const std::string> token_ ABSL_GUARDED_BY(mu_);
  bool reported_down_ ABSL_GUARDED_BY(mu_) = false;  // a sidecar that told its parent so
  std::string down_message_ ABSL_GUARDED_BY(mu_);    // what it said
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;            // bytes charged to limits_.budget
  Clock::time_point last_change_ ABSL_GUARDED_BY(mu_);  // a member joined, attached or went
  absl::Status refused_ ABSL_GUARDED_BY(mu_);  // Refused's status
  absl::Status closed_ ABSL_GUARDED_BY(mu_);  // FailAll's status: no round opens any more
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_JOB_H_

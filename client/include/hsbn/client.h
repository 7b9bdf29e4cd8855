// hsbn/client.h — the C++ client of the hsbn aggregation service.
//
// A Client is one trainer process's membership in one job: it joins the job at its node's
// sidecar aggregator and keeps one persistent bidirectional stream to it. Each BatchNorm
// exchange is a round, identified by (op, seq, phase): op is the layer's index in the model,
// seq counts that layer's invocations, phase is forward or backward. Rounds are matched by key,
// so several can be in flight at once (Start/Wait), and the blocking calls (Forward/Backward)
// are Start followed by Wait.
//
// Errors are absl::Status values whose code says what kind of failure it is (see
// docs/PROTOCOL.md) and whose message says what to do. When the stream breaks, rounds in
// flight fail with UNAVAILABLE and the next call reconnects (joining again), so a restarted
// sidecar costs the rounds that were in flight, not the job.
//
// Thread safety: a Client may be used from several threads at once.
#ifndef HSBN_CLIENT_H_
#define HSBN_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsbn {

namespace v1 {
class StatusResponse;
}
namespace env {
class Source;  // an environment to read (client/env.h)
}

// kGroup: the workers of this node's group (ClientOptions::group_nodes consecutive nodes).
// kAuto: not a wire scope but a policy the client runs per op (AutoPolicy): shadow for a
// warm-up, then one global round on which the root decides node (group, when the job has
// groups) or global for that op, the same for every rank; the decision applies from the next
// forward round on (docs/PROTOCOL.md, "Auto scope").
// kRenorm: forward rounds are answered with the node's statistics at once, like kShadow; the
// root reduces the job's statistics off the critical path and every worker later gets them
// (Client::GlobalStats). Its backward rounds are node rounds.
// kLagged: forward and backward rounds are answered with the node's statistics (sums) at once;
// the root reduces the job's statistics (sums) off the critical path and every worker later
// gets them (Client::GlobalStats, Client::GlobalSums). A backward contribution's sum_dy_xmu is
// around the mean of its forward round's node answer; the job's sums are around the job's mean
// of that forward round (docs/PROTOCOL.md, "Lagged scope").
enum class Scope : int {
  kNode = 1, kGlobal = 2, kShadow = 3, kGroup = 4, kAuto = 5, kRenorm = 6, kLagged = 7
};
enum class Phase : int { kForward = 1, kBackward = 2 };

const char* ScopeName(Scope scope);
// "node", "global", "shadow", "group", "auto", "renorm" or "lagged".
absl::StatusOr<Scope> ParseScope(const std::string& name);

// How an auto-scope op decides (every rank must use the same for the same op).
struct AutoPolicy {
  int64_t warmup_rounds = 50;       // forward rounds seq 0 .. warmup_rounds-1 run in shadow
  double max_mean_shift = 0.05;     // thresholds on the root's record (max over nodes/groups of
  double max_log_var_ratio = 0.05;  // the averages over the warm-up); above either: global
  // 0: decide once. N > 0: after a decision at seq D, forward rounds D + N, D + 2N, ... run in
  // shadow, and after warmup_rounds of them the next one (D + N * (warmup_rounds + 1)) decides
  // again from those samples.
  int64_t recheck_every = 0;

  // INVALID_ARGUMENT naming the field unless warmup_rounds >= 1, thresholds finite and >= 0,
  // recheck_every >= 0.
  absl::Status Validate() const;
};

// Reads HSBN_AUTO_WARMUP, HSBN_AUTO_MAX_MEAN_SHIFT, HSBN_AUTO_MAX_LOG_VAR_RATIO and
// HSBN_AUTO_RECHECK_EVERY into *policy where set (INVALID_ARGUMENT for a value that does not
// parse; Validate checks the ranges).
absl::Status AutoPolicyFromEnv(AutoPolicy* policy);
absl::Status AutoPolicyFromEnv(const env::Source& source, AutoPolicy* policy);
// Which run of the job this process belongs to: HSBN_INCARNATION, else torchrun's
// TORCHELASTIC_RESTART_COUNT, else 0 (JoinRequest.incarnation). INVALID_ARGUMENT when set to
// something other than a non-negative integer.
absl::Status IncarnationFromEnv(uint64_t* incarnation);
absl::Status IncarnationFromEnv(const env::Source& source, uint64_t* incarnation);

// An auto-scope op's decision as the client knows it (Client::AutoDecisionOf).
struct AutoDecision {
  bool decided = false;
  Scope scope = Scope::kAuto;  // kNode, kGroup or kGlobal once decided
  double mean_shift = 0;       // the root's numbers behind it (0 for a restored decision)
  double log_var_ratio = 0;
  int64_t rounds = 0;
  int64_t decided_at = -1;     // seq of the round that decided; -1: restored (SetAutoDecision)
};

struct ClientOptions {
  std::string address = "unix:/tmp/hsbn.sock";  // the node's sidecar
  std::string job_id;
  int32_t rank = -1;
  int32_t world_size = -1;
  int32_t local_rank = -1;
  int32_t local_world_size = -1;
  int32_t node_rank = -1;  // GROUP_RANK
  // How long a round call waits for its result; zero: the aggregator's round timeout + 5 s.
  std::chrono::milliseconds round_timeout{0};
  std::chrono::milliseconds connect_timeout{10000};
  std::string token;
  // The job's strict mode (every process of a job must agree): a NaN or Inf in a contribution,
  // or a merge that overflows, fails the round naming the member. Off: non-finite values
  // propagate to every member by IEEE arithmetic, as in torch's SyncBatchNorm.
  bool strict_finite = false;
  // How this worker's node rounds travel: "auto" (shared memory when the sidecar and every
  // local rank can use it, else the gRPC stream), "grpc" (never shared memory), or empty: from
  // HSBN_TRANSPORT (read once, when the client is created), else "auto". Every local rank of a
  // node ends up on the same transport.
  std::string transport;
  // Nodes per group for Scope::kGroup (HSBN_GROUP_NODES); 0: the job has no groups. Must divide
  // the number of nodes; every process of a job must agree.
  int32_t group_nodes = 0;
  // Which run of the job (IncarnationFromEnv): a restarted job's processes must use a higher
  // number than the previous run's, so that no aggregator mistakes them for the old run.
  uint64_t incarnation = 0;
  // HSBN_DEBUG=INFO: say on stderr what the client does, one line each ("hsbn[rank R] ...");
  // rounds are reported when their wait took longer than debug_slow (HSBN_DEBUG_SLOW_MS).
  bool debug = false;
  std::chrono::milliseconds debug_slow{1000};
  // The policy of auto-scope ops without one of their own (Client::SetAutoPolicy); from
  // HSBN_AUTO_WARMUP, HSBN_AUTO_MAX_MEAN_SHIFT, HSBN_AUTO_MAX_LOG_VAR_RATIO,
  // HSBN_AUTO_RECHECK_EVERY.
  AutoPolicy auto_policy;

  // From torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and HSBN_JOB_ID
  // (or TORCHELASTIC_RUN_ID), HSBN_ADDRESS, HSBN_ROUND_TIMEOUT_MS, HSBN_CONNECT_TIMEOUT_MS,
  // HSBN_TOKEN or HSBN_TOKEN_FILE, HSBN_STRICT_FINITE (1/0), HSBN_GROUP_NODES, the
  // HSBN_AUTO_* variables above, HSBN_INCARNATION (or TORCHELASTIC_RESTART_COUNT) and
  // HSBN_TRANSPORT (auto/grpc), HSBN_DEBUG and HSBN_DEBUG_SLOW_MS: docs/ENVIRONMENT.md, parsed
  // by the one table (client/env.h).
  // INVALID_ARGUMENT naming the variable for a value outside its type or range.
  static absl::StatusOr<ClientOptions> FromEnv();
  static absl::StatusOr<ClientOptions> FromEnv(const env::Source& source);
  // Checks the layout for consistency (the errors name the variable to fix).
  absl::Status Validate() const;
};

// Reads HSBN_DEBUG and HSBN_DEBUG_SLOW_MS into options->debug and options->debug_slow.
absl::Status DebugFromEnv(const env::Source& source, ClientOptions* options);

// A round that was started and not yet waited for.
class PendingRound;

// Counters of one kind of round (one scope and phase, or a sum of several): see ClientStats.
struct RoundStats {
  int64_t completed = 0;  // rounds whose result arrived (Wait, Forward or Backward returned OK)
  int64_t failed = 0;     // rounds whose Start, Wait, Forward or Backward returned an error
  // Wall time callers spent blocked on these rounds (completed and failed), in seconds: the
  // whole call for Forward and Backward, the time inside Wait for Start/Wait (Start itself,
  // which copies and sends, is not counted). Rounds waited for concurrently by several threads
  // each count their own wait, so this can exceed elapsed wall time.
  double blocked_seconds = 0;
  double max_blocked_seconds = 0;  // the longest single blocked call

  int64_t rounds() const { return completed + failed; }
  RoundStats& operator+=(const RoundStats& other);
};

// What a Client did since it connected or since its last ResetStats (Client::Stats).
//
// Rounds are counted by the scope and phase they were started with; a round is counted once,
// when its first Wait (or its Forward/Backward) returns, or when Start fails. Calls refused
// before they name a valid scope and phase are not counted. There is no "local" scope at this
// level: a local BatchNorm layer makes no rounds.
struct ClientStats {
  // node, global, shadow, group, auto (always 0: auto counts as what it sent), renorm, lagged
  static constexpr int kScopes = 7;
  static constexpr int kPhases = 2;  // forward, backward
  RoundStats rounds[kScopes][kPhases];  // [int(scope) - 1][int(phase) - 1]
  // GlobalStats and GlobalSums calls (renorm and lagged scope): completed, failed and the time
  // blocked in them, and how many of them found the result not there yet and had to wait.
  RoundStats global_stats;
  int64_t global_stats_waited = 0;
  // Late results the sidecar sent for rounds this client did not start with renorm or lagged
  // scope (or sent twice): dropped, never kept.
  int64_t late_dropped = 0;
  // Serialized protobuf bytes of the frames written to and read from the round streams
  // (contributions, results; gRPC and HTTP/2 framing not included), plus the statistics bytes
  // (16 per channel) of rounds through the node's shared memory, each way.
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  double elapsed_seconds = 0;  // wall time since Connect or the last ResetStats
  // How the node's rounds travel now: "shm", "grpc: <why>" (the sidecar's or this client's
  // reason), or "pending" until the sidecar has heard from every local rank. Rounds wider than
  // the segment's channel cap take the gRPC stream either way.
  std::string transport;

  const RoundStats& of(Scope scope, Phase phase) const {
    return rounds[int(scope) - 1][int(phase) - 1];
  }
  RoundStats of(Scope scope) const;  // both phases
  RoundStats total() const;          // every scope and phase
};

class Client {
 public:
  // Joins the job and opens the stream. Fails with UNAVAILABLE if no sidecar answers within
  // options.connect_timeout, INVALID_ARGUMENT for an inconsistent layout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();  // leaves the job
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Starts a round: copies the inputs (`channels` doubles each: mean and m2 for forward,
  // sum_dy and sum_dy_xmu for backward) and sends them. With Scope::kAuto the client picks the
  // wire scope from the op's state (see Scope); a forward past the decision round while that
  // round has not been waited for is FAILED_PRECONDITION (its ranks could not agree).
  absl::StatusOr<std::shared_ptr<PendingRound>> Start(Phase phase, uint32_t op, uint64_t seq,
                                                      Scope scope, int64_t channels,
                                                      int64_t count, const double* a,
                                                      const double* b);
  // Waits for a started round and writes its result (outputs may alias the inputs).
  absl::Status Wait(PendingRound& round, int64_t* out_count, double* out_a, double* out_b);
  // One slice of Wait: returns after at most `slice` with *done = false while the round is
  // still open (call again; the round's deadline counts from the first slice), else as Wait
  // with *done = true. Lets a caller look at other things (signals) while a round waits.
  absl::Status WaitFor(PendingRound& round, std::chrono::milliseconds slice, bool* done,
                       int64_t* out_count, double* out_a, double* out_b);

  // Gives up on the job: every round in flight and every later one fails at once with ABORTED
  // and `reason`, and the sidecar is told, so every other rank's rounds fail at once too,
  // naming this rank and `reason` (docs/PROTOCOL.md, "Abort"). The first call's reason
  // stands; later calls do nothing. Safe from any thread, also while others wait in rounds.
  // The client cannot be used for rounds afterwards: destroy it (a new one joins again).
  void Abort(const std::string& reason);

  absl::Status Forward(uint32_t op, uint64_t seq, Scope scope, int64_t channels, int64_t count,
                       const double* mean, const double* m2, int64_t* out_count,
                       double* out_mean, double* out_m2);
  absl::Status Backward(uint32_t op, uint64_t seq, Scope scope, int64_t channels, int64_t count,
                        const double* sum_dy, const double* sum_dy_xmu, int64_t* out_count,
                        double* out_sum_dy, double* out_sum_dy_xmu);

  // Renorm scope: the job's (global) statistics of forward round (op, seq), which was started
  // with Scope::kRenorm or kLagged on this client: count and `channels` values each of mean and
  // m2. Waits until the root's result reaches this worker (every worker of the job gets the
  // same bits), at most the round timeout: DEADLINE_EXCEEDED naming the round if the root does not answer,
  // the root's error if the round failed there, UNAVAILABLE if the stream to the sidecar broke.
  // A result stays available for later calls until 4096 newer ones (or 64 MiB) pushed it out.
  // FAILED_PRECONDITION at once for a round this client did not start with renorm or lagged
  // scope (or whose result was pushed out): no result can come for it.
  absl::Status GlobalStats(uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
                           double* out_mean, double* out_m2);
  // GlobalStats in slices of at most `slice` (for callers that must stay interruptible): when
  // the slice ends first, *done = false and nothing is written; call again to go on (the round
  // timeout counts from the first slice). *done = true: as GlobalStats.
  absl::Status GlobalStatsFor(uint32_t op, uint64_t seq, int64_t channels,
                              std::chrono::milliseconds slice, bool* done, int64_t* out_count,
                              double* out_mean, double* out_m2);
  // Whether GlobalStats(op, seq) would return at once (the result, or its failure, is here).
  // Never blocks; reads what the stream has delivered so far.
  bool GlobalStatsReady(uint32_t op, uint64_t seq);
  // GlobalStats's forward results for Scope::kLagged too. Lagged scope's backward: the job's
  // sums of backward round (op, seq): count (the job's, as its forward's), sum_dy[channels] and
  // sum_dy_xmu[channels] = sum of dy * (x - mean) with `mean` the job's mean of forward round
  // (op, seq) (GlobalStats(op, seq)'s), whatever mean each node's ranks contributed around.
  // Waits, fails and keeps results as GlobalStats does; every worker gets the same bits.
  absl::Status GlobalSums(uint32_t op, uint64_t seq, int64_t channels, int64_t* out_count,
                          double* out_sum_dy, double* out_sum_dy_xmu);
  absl::Status GlobalSumsFor(uint32_t op, uint64_t seq, int64_t channels,
                             std::chrono::milliseconds slice, bool* done, int64_t* out_count,
                             double* out_sum_dy, double* out_sum_dy_xmu);
  bool GlobalSumsReady(uint32_t op, uint64_t seq);

  // Names the job's layers (op -> name) for the aggregators' Status and divergence record, which
  // otherwise show op numbers. Sent once on the stream; the aggregators keep the first name of
  // each op (printable ASCII, at most 256 bytes; at most 4096 per job). Names change no round.
  // After a sidecar restart they are not sent again: give them again to have them there.
  absl::Status NameLayers(const std::vector<std::pair<uint32_t, std::string>>& names);

  // Lagged scope's trip guard: layer `op` went exact global at its call of round `seq`, after
  // its job statistics moved by `drift` (>= 0, +Inf allowed), for `exact_calls` (>= 1) calls.
  // Sent on the stream for the sidecar's Status and metrics (one trip per (op, seq), whichever
  // rank's report comes first); changes no round. InvalidArgument for a NaN or negative drift
  // or exact_calls < 1, here, before anything is sent.
  absl::Status ReportLaggedTrip(uint32_t op, uint64_t seq, double drift, int64_t exact_calls);

  // Auto scope, per op. SetAutoPolicy: the op's policy (before its first auto round; a later
  // call with another policy is FAILED_PRECONDITION). AutoDecisionOf: what the op decided so
  // far. SetAutoDecision: restores a decision (node, group or global) saved from an earlier
  // run, so the op skips its warm-up.
  absl::Status SetAutoPolicy(uint32_t op, const AutoPolicy& policy);
  AutoDecision AutoDecisionOf(uint32_t op) const;
  absl::Status SetAutoDecision(uint32_t op, Scope scope);

  // Round counters and blocked time since Connect or the last ResetStats. Cheap (one short
  // lock); safe to call from any thread, also while rounds are in flight.
  ClientStats Stats() const;
  // Zeroes every counter and restarts elapsed_seconds. Rounds in flight are counted when they
  // end, in the new period.
  void ResetStats();

  // The sidecar's status of this client's job (asked with its token), and the root's with
  // include_upstream.
  absl::StatusOr<v1::StatusResponse> Status(bool include_upstream);
  absl::StatusOr<std::string> StatusJson(bool include_upstream);

  const ClientOptions& options() const;
  int32_t num_nodes() const;
  int32_t max_channels() const;
  std::chrono::milliseconds aggregator_round_timeout() const;

 private:
  class Impl;
  friend class PendingRound;  // it names how Impl waits for it (client_impl.h)
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hsbn

#endif  // HSBN_CLIENT_H_

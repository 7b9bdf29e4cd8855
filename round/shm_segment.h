// shm_segment.h — the shared-memory node path: one job's segment on one node, its layout and
// the operations workers and their sidecar perform on it.
//
// A sidecar creates one segment per job and node (a sealed memfd, never a file in /dev/shm) and
// hands its descriptor to each worker of the job that joined and asked for it (server/
// shm_transport.h). Node rounds then run without the sidecar: each worker posts its
// contribution into a slot of its own ring; the worker that finds every local rank's
// contribution for the round's key (op, seq, phase) claims the round, validates and reduces the
// contributions in local-rank order with the aggregator's own reduction (round_merge.h) and
// writes the result into every rank's slot, waking sleepers with a futex. A global or shadow
// round's node partial goes into the sidecar's queue (a doorbell eventfd wakes it); the sidecar
// forwards it to the root and writes the root's answer into the slots.
//
// Layout (docs/PROTOCOL.md, "Shared-memory node path"): a Header, then `ranks` rings of `ring`
// slots, then the sidecar's queue of 2*ring entries; every slot and entry is `slot_bytes` long
// (a SlotHead, then 2 * max_channels doubles). A slot's state word is (generation << 8) | state;
// the generation counts the owner's posts, so a stale reader's compare-and-swap fails.
//
// Trust: every process of the job maps the segment read-write, so any of them may write
// anything anywhere in it. Nothing read from the segment is trusted: offsets come from the
// Geometry each process computed and checked for itself once, at map time; every value read
// from a slot is copied out and validated before use. A hostile worker can make its own job's
// rounds fail or be wrong (as on the gRPC path), never make another process read or write
// outside the segment, and never reach another job (each job has its own memfd).
//
// Thread safety: the operations are lock-free on the shared words; a Segment object is
// immutable after Create/Map and may be used from several threads.
#ifndef HSBN_SHM_SEGMENT_H_
#define HSBN_SHM_SEGMENT_H_

#include <sys/socket.h>
#include <sys/un.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsbn::shm {

constexpr uint64_t kMagic = 0x31766d68736e6268ull;  // "hbnshmv1"
constexpr uint32_t kLayoutVersion = 5;  // 5: lagged scope's counters
constexpr int32_t kMaxRanks = 256;        // local ranks a segment serves
constexpr int32_t kMaxRing = 256;         // slots per rank
constexpr int32_t kMaxChannelCap = 1 << 20;
constexpr size_t kTextBytes = 256;        // the header's text (why the segment is dead)
// A result's error text: room for the stream's messages, which name ranks, addresses and the
// flag to fix (a parent-link failure runs to 300-500 bytes).
constexpr size_t kSlotTextBytes = 1024;
constexpr uint64_t kHeaderBytes = 8192;
constexpr uint64_t kSlotHeadBytes = 1152;

// The header's metric counters: index ranges of scope (v1::Scope up to SCOPE_LAGGED; group
// rounds never travel here, 5 is never used), phase (v1::Phase) and code (google.rpc.Code 0..16).
constexpr int kCountScopes = 8;
constexpr int kCountPhases = 3;
constexpr int kCountCodes = 17;

// The hand-off of a segment over the sidecar's Unix socket (SOCK_SEQPACKET): the worker sends
// one hello, kHelloMagic + its 16-byte session id + its job token (at most kMaxTokenBytes); the
// sidecar answers with the segment's descriptors, or "error: <why>".
constexpr char kHelloMagic[8] = {'H', 'S', 'B', 'N', 'S', 'H', 'M', '1'};
constexpr size_t kSessionBytes = 16;
constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxHelloBytes = sizeof(kHelloMagic) + kSessionBytes + kMaxTokenBytes;

// The sidecar's socket address for `name`: a path, or "@name" for an abstract socket (a
// leading NUL, no file). Returns the address length, or 0 when `name` is empty or too long.
socklen_t SocketAddress(const std::string& name, sockaddr_un* addr);

// A slot's (or queue entry's) state, the low 8 bits of its state word.
enum State : uint32_t {
  kFree = 0,
  kPosted = 1,   // a contribution waits for its round
  kWriting = 2,  // someone is writing the result
  kDone = 3,     // the result (or error) is there for the owner
  kFilling = 4,  // queue: a reducer is writing the entry
  kReady = 5,    // queue: for the sidecar
};

// Queue entry kinds.
enum Kind : uint32_t { kPartial = 1, kAbort = 2 };

struct Key {
  uint32_t op = 0;
  uint64_t seq = 0;
  int32_t phase = 0;  // v1::Phase
  bool operator==(const Key& o) const { return op == o.op && seq == o.seq && phase == o.phase; }
};

// Where things are. Computed by each process from values it checked itself.
struct Geometry {
  int32_t ranks = 0, ring = 0, max_channels = 0, queue = 0;
  uint64_t slot_bytes = 0, total_bytes = 0;
  // INVALID_ARGUMENT for values out of range.
  static absl::StatusOr<Geometry> Make(int64_t ranks, int64_t ring, int64_t max_channels);
  uint64_t slot_offset(int32_t rank, int32_t i) const {
    return kHeaderBytes + (uint64_t(rank) * uint64_t(ring) + uint64_t(i)) * slot_bytes;
  }
  uint64_t queue_offset(int32_t j) const {
    return kHeaderBytes + (uint64_t(ranks) * uint64_t(ring) + uint64_t(j)) * slot_bytes;
  }
};

struct Header {
  uint64_t magic;
  uint32_t version;
  int32_t ranks, ring, max_channels, queue;
  int32_t has_parent;  // the sidecar has a root (--upstream)
  uint64_t total_bytes;
  uint32_t dead;       // nonzero: the sidecar invalidated the segment; dead_text says why
  uint32_t epoch;      // bumped on every change of dead or gone
  char dead_text[kTextBytes];
  uint32_t gone[kMaxRanks];  // per local rank: 0 here, 1 its stream broke, 2 it left,
                             // 3 it aborted (abort_text says why)
  uint64_t completed;        // rounds answered through the segment (for Status)
  uint64_t failed;
  uint64_t posts[kMaxRanks];  // contributions posted per local rank (for Status)
  // For the sidecar's Prometheus counters: rounds answered through the segment by the round's
  // scope (node, global, shadow), phase and google.rpc.Code, and non-finite values seen per
  // phase (in contributions and in the root's results), as the stream path counts them.
  uint64_t rounds[kCountScopes][kCountPhases][kCountCodes];
  uint64_t nonfinite[kCountPhases];
  char abort_text[kTextBytes];  // the reason of the first rank that aborted (gone 3)
  uint32_t abort_set;           // nonzero once abort_text is written
  // Nonzero: a process was refused joining the job for its layout; every round fails with this
  // google.rpc.Code, v1::Reason and text.
  int32_t refused_code;
  int32_t refused_reason;
  char refused_text[kSlotTextBytes];
  int32_t dead_reason;  // with dead: a v1::Reason (SHUTTING_DOWN: the sidecar is stopping)
};
static_assert(sizeof(Header) <= kHeaderBytes, "header too large");

struct SlotHead {
  uint32_t state;     // (generation << 8) | State
  uint32_t claim;     // (generation << 1) | claimed: who reduces the round (rank 0's slot)
  uint32_t sleeping;  // the owner sleeps on state (a waker must FUTEX_WAKE)
  uint32_t kind;      // queue entries: Kind
  uint32_t op;
  int32_t phase;
  uint64_t seq;
  int32_t scope;
  uint32_t channels;
  int64_t count;
  int32_t code;       // results: 0 or a google.rpc.Code
  int32_t reason;     // with a code: a v1::Reason (layout 4)
  uint32_t message_len;
  char message[kSlotTextBytes];
};
static_assert(sizeof(SlotHead) <= kSlotHeadBytes, "slot head too large");

// A copy of what a slot or queue entry held, after validation.
struct QueueEntry {
  Key key;
  int32_t scope = 0;
  uint32_t kind = 0;
  int64_t channels = 0;
  int64_t count = 0;
  int32_t code = 0;
  int32_t reason = 0;  // v1::Reason
  std::string message;
  std::vector<double> data;  // 2 * channels: [a | b]
};

// A round this worker reduced or had reduced: what the reducer saw and did.
struct ReduceOptions {
  int32_t node_rank = 0;  // for names in errors ("rank 5 (node 1, local rank 1)")
  int32_t num_nodes = 1;
  bool strict_finite = false;
  int doorbell = -1;      // eventfd of the sidecar (global and shadow rounds)
  int64_t max_channels_limit = 0;  // the aggregator's --max-channels (JoinResponse)
  std::string job_id;
  int32_t self = -1;      // the calling process's local rank: its own answer is written last
};

class Segment {
 public:
  // Sidecar: a new sealed memfd of `g` (named for /proc only), mapped and initialised.
  static absl::StatusOr<std::unique_ptr<Segment>> Create(const Geometry& g, bool has_parent);
  // Worker: maps the segment behind `fd` (a descriptor it received; not closed here) and checks
  // its header against what this process knows: `ranks` local ranks, the descriptor's size.
  static absl::StatusOr<std::unique_ptr<Segment>> Map(int fd, int32_t ranks);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  int fd() const { return fd_; }  // Create only; -1 after Map
  const Geometry& geometry() const { return g_; }
  Header* header() const { return reinterpret_cast<Header*>(base_); }
  SlotHead* slot(int32_t rank, int32_t i) const {
    return reinterpret_cast<SlotHead*>(base_ + g_.slot_offset(rank, i));
  }
  SlotHead* entry(int32_t j) const {
    return reinterpret_cast<SlotHead*>(base_ + g_.queue_offset(j));
  }
  double* data(SlotHead* s) const {
    return reinterpret_cast<double*>(reinterpret_cast<char*>(s) + kSlotHeadBytes);
  }

  // ---- Worker side ----
  // A free slot of `rank`'s ring, or -1.
  int32_t FindFree(int32_t rank) const;
  // Writes a contribution into `rank`'s slot `i` (free) and publishes it; returns its state
  // word (generation | kPosted), which the owner waits on. A round wider than the segment's
  // channel cap posts its key and channel count only, so that the round fails for every rank
  // (RESOURCE_EXHAUSTED), as at the sidecar.
  uint32_t Post(int32_t rank, int32_t i, const Key& key, int32_t scope, int64_t channels,
                int64_t count, const double* a, const double* b);
  // The round of `key` is complete here if every rank posted it: claims it (once) and reduces
  // it, delivering the result or error to every rank (node rounds, shadow answers) or queueing
  // the node partial for the sidecar (global, shadow). True if this call reduced it.
  bool TryReduce(const Key& key, int32_t hint, const ReduceOptions& options);
  // The owner takes its DONE slot's answer (validated against `channels`) and frees the slot.
  // False when the slot is not DONE with generation `posted`.
  bool Take(int32_t rank, int32_t i, uint32_t posted, int64_t channels, absl::Status* status,
            int64_t* count, std::vector<double>* data);
  // The owner gives up on its posted slot (deadline, failure): true if withdrawn; false if a
  // result is being written or is there (then Take it).
  bool Withdraw(int32_t rank, int32_t i, uint32_t posted);
  // Local ranks that have not posted `key` (for deadline errors).
  std::vector<int32_t> Missing(const Key& key) const;
  // Why no round can complete now: the segment is dead, or a rank that has not posted `key` is
  // gone (empty key: any gone rank). OK otherwise.
  absl::Status Blocked(const Key* key, const ReduceOptions& options) const;
  // Sleeps while `rank`'s slot `i` still has state word `posted`, at most `timeout`.
  void Sleep(int32_t rank, int32_t i, uint32_t posted, std::chrono::nanoseconds timeout);
  uint32_t State(int32_t rank, int32_t i) const;

  // ---- Sidecar side ----
  void MarkGone(int32_t rank, uint32_t why);  // 1 stream broke, 2 left; wakes every sleeper
  // Gone 3: the rank aborted for `reason` (kept: the first aborted rank's); wakes every sleeper.
  void MarkAborted(int32_t rank, const std::string& reason);
  void Revive(int32_t rank);                   // a rejoined rank: empty ring, not gone
  // Every round of the job fails with `status` from now on (a layout refusal); wakes sleepers.
  void Refuse(const absl::Status& status);
  // Invalidates the segment for `why` (a v1::Reason in `reason`); wakes every sleeper.
  void Kill(const std::string& why, int32_t reason = 0);
  // Takes the queue's ready entries (validated; malformed ones are dropped and counted).
  std::vector<QueueEntry> TakeQueue(int* malformed);
  // Writes an answer into every rank's slot that posted `key` (claimed ones: the sidecar's
  // rounds). `data` holds 2 * channels doubles when code == 0.
  int DeliverAll(const Key& key, int32_t code, const std::string& message, int64_t count,
                 int64_t channels, const double* data, int32_t reason = 0);

 private:
  Segment(char* base, const Geometry& g, int fd) : base_(base), g_(g), fd_(fd) {}
  bool FindPosted(int32_t rank, const Key& key, int32_t hint, int32_t* index,
                  uint32_t* state) const;
  // Delivering is two steps: BeginDeliver moves a posted slot to "writing" (false if its owner
  // withdrew it), Deliver writes the answer and publishes it.
  bool BeginDeliver(int32_t rank, int32_t i, uint32_t posted) const;
  std::vector<bool> BeginAll(const std::vector<int32_t>& idx,
                             const std::vector<uint32_t>& posted) const;
  void Deliver(int32_t rank, int32_t i, uint32_t posted, int32_t code, const std::string& message,
               int64_t count, int64_t channels, const double* a, const double* b,
               int32_t reason = 0) const;
  bool Enqueue(const QueueEntry& item, const ReduceOptions& options);
  // TryReduce's steps while it holds a round's claim. CopyChecked copies every rank's
  // contribution into `buf` (rank r's 2 × channels doubles at r × 2 × channels) and checks it
  // as the stream path does; SendPartial queues the node partial for the sidecar; FailClaimed
  // answers every rank still waiting with `error` (and tells the sidecar when `up`).
  absl::Status CopyChecked(const Key& key, const std::vector<int32_t>& idx,
                           const std::vector<uint32_t>& posted, const ReduceOptions& options,
                           int32_t* scope, int64_t* channels, std::vector<int64_t>* counts,
                           std::vector<double>* buf);
  absl::Status SendPartial(const Key& key, int32_t scope, int64_t channels, int64_t count,
                           const std::vector<double>& result, const ReduceOptions& options);
  void FailClaimed(const Key& key, const std::vector<int32_t>& idx,
                   const std::vector<uint32_t>& posted, int32_t scope, bool up,
                   const absl::Status& error, const ReduceOptions& options);
  // Counts one answered round in the header (Status's totals and the metric counters).
  void CountRound(int32_t scope, int32_t phase, int32_t code) const;
  void CountNonFinite(int32_t phase, int64_t values) const;
  void WakeAll() const;

  char* const base_;
  const Geometry g_;
  const int fd_;
};

// Futex helpers on a shared (not process-private) word.
void FutexWake(uint32_t* word);
void FutexWait(uint32_t* word, uint32_t expected, std::chrono::nanoseconds timeout);

}  // namespace hsbn::shm

#endif  // HSBN_SHM_SEGMENT_H_

#include "shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "hsbn/v1/hsbn.pb.h"
#include "round.h"
#include "wire.h"

namespace hsbn::shm {

namespace {

uint32_t Load(const uint32_t* w) { return __atomic_load_n(w, __ATOMIC_SEQ_CST); }
void Store(uint32_t* w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_SEQ_CST); }
bool Cas(uint32_t* w, uint32_t expected, uint32_t desired) {
  return __atomic_compare_exchange_n(w, &expected, desired, false, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST);
}
// Plain fields another process may write at any time: read each once, as a copy.
template <typename T>
T Read(const T* p) {
  T v;
  std::memcpy(&v, static_cast<const void*>(p), sizeof(T));
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  return v;
}
constexpr uint32_t StateOf(uint32_t w) { return w & 0xffu; }
constexpr uint32_t GenOf(uint32_t w) { return w >> 8; }
constexpr uint32_t Word(uint32_t gen, uint32_t state) { return (gen << 8) | state; }

wire::MemberNames Names(const ReduceOptions& o, int32_t ranks) {
  wire::MemberNames names;
  names.node_rank = o.node_rank;
  names.local_world_size = ranks;
  return names;
}

bool ReachesParent(int32_t scope, const ReduceOptions& o) {
  return scope != v1::SCOPE_NODE && o.num_nodes > 1;
}

}  // namespace

socklen_t SocketAddress(const std::string& name, sockaddr_un* addr) {
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  if (name.empty() || name.size() >= sizeof(addr->sun_path)) return 0;
  if (name[0] == '@') {
    std::memcpy(addr->sun_path + 1, name.data() + 1, name.size() - 1);
    return socklen_t(offsetof(sockaddr_un, sun_path) + name.size());
  }
  std::memcpy(addr->sun_path, name.data(), name.size());
  return socklen_t(sizeof(sockaddr_un));
}

void FutexWake(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void FutexWait(uint32_t* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts;
  ts.tv_sec = time_t(timeout.count() / 1000000000);
  ts.tv_nsec = long(timeout.count() % 1000000000);
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

absl::StatusOr<Geometry> Geometry::Make(int64_t ranks, int64_t ring, int64_t max_channels) {
  if (ranks < 1 || ranks > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shared-memory segment serves 1 to ", kMaxRanks, " local ranks, not ", ranks));
  }
  if (ring < 1 || ring > kMaxRing) {
    return absl::InvalidArgumentError(absl::StrCat("ring depth ", ring, " is outside [1, ", kMaxRing, "]"));
  }
  if (max_channels < 1 || max_channels > kMaxChannelCap) {
    return absl::InvalidArgumentError(absl::StrCat("channel cap ", max_channels,
                                                   " is outside [1, ", kMaxChannelCap, "]"));
  }
  Geometry g;
  g.ranks = int32_t(ranks);
  g.ring = int32_t(ring);
  g.max_channels = int32_t(max_channels);
  g.queue = int32_t(2 * ring);
  g.slot_bytes = (kSlotHeadBytes + uint64_t(max_channels) * 2 * sizeof(double) + 63) & ~uint64_t(63);
  g.total_bytes = kHeaderBytes + (uint64_t(ranks) * uint64_t(ring) + uint64_t(g.queue)) * g.slot_bytes;
  return g;
}

absl::StatusOr<std::unique_ptr<Segment>> Segment::Create(const Geometry& g, bool has_parent) {
  const int fd = int(syscall(SYS_memfd_create, "hsbn-node-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("memfd_create failed: ", std::strerror(errno)));
  }
  auto fail = [&](const char* what) {
    const int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat(what, " failed: ", std::strerror(e)));
  };
  if (ftruncate(fd, off_t(g.total_bytes)) != 0) return fail("ftruncate of the segment");
  // Nobody may shrink it under a mapping (a SIGBUS in another process) or grow it.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("sealing the segment");
  }
  void* p = mmap(nullptr, g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap of the segment");
  auto seg = std::unique_ptr<Segment>(new Segment(static_cast<char*>(p), g, fd));
  Header* h = seg->header();
  h->version = kLayoutVersion;
  h->ranks = g.ranks;
  h->ring = g.ring;
  h->max_channels = g.max_channels;
  h->queue = g.queue;
  h->has_parent = has_parent ? 1 : 0;
  h->total_bytes = g.total_bytes;
  __atomic_store_n(&h->magic, kMagic, __ATOMIC_SEQ_CST);
  return seg;
}

absl::StatusOr<std::unique_ptr<Segment>> Segment::Map(int fd, int32_t ranks) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::UnavailableError(absl::StrCat("fstat of the segment: ", std::strerror(errno)));
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    return absl::FailedPreconditionError("the segment is not sealed against shrinking");
  }
  if (st.st_size < off_t(kHeaderBytes)) {
    return absl::FailedPreconditionError("the segment is smaller than its header");
  }
  Header h;
  if (pread(fd, &h, sizeof(h), 0) != ssize_t(sizeof(h))) {
    return absl::UnavailableError("cannot read the segment's header");
  }
  if (h.magic != kMagic || h.version != kLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the segment has layout version ", h.version, "; this client speaks ", kLayoutVersion,
        " (run the same hsbn version in the trainer and the sidecar)"));
  }
  if (h.ranks != ranks) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the segment serves ", h.ranks, " local ranks but LOCAL_WORLD_SIZE=", ranks));
  }
  auto g = Geometry::Make(ranks, h.ring, h.max_channels);
  if (!g.ok()) return g.status();
  if (g->total_bytes != uint64_t(st.st_size) || h.total_bytes != g->total_bytes) {
    return absl::FailedPreconditionError("the segment's size does not match its header");
  }
  void* p = mmap(nullptr, g->total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat("mmap of the segment: ", std::strerror(errno)));
  }
  return std::unique_ptr<Segment>(new Segment(static_cast<char*>(p), *g, -1));
}

Segment::~Segment() {
  munmap(base_, g_.total_bytes);
  if (fd_ >= 0) close(fd_);
}

uint32_t Segment::State(int32_t rank, int32_t i) const { return Load(&slot(rank, i)->state); }

int32_t Segment::FindFree(int32_t rank) const {
  for (int32_t i = 0; i < g_.ring; ++i) {
    if (StateOf(Load(&slot(rank, i)->state)) == kFree) return i;
  }
  return -1;
}

uint32_t Segment::Post(int32_t rank, int32_t i, const Key& key, int32_t scope, int64_t channels,
                       int64_t count, const double* a, const double* b) {
  SlotHead* s = slot(rank, i);
  const uint32_t gen = (GenOf(Load(&s->state)) + 1) & 0xffffffu;
  s->op = key.op;
  s->seq = key.seq;
  s->phase = key.phase;
  s->scope = scope;
  s->channels = uint32_t(channels);
  s->count = count;
  s->code = 0;
  s->message_len = 0;
  if (channels <= g_.max_channels) {
    double* d = data(s);
    std::memcpy(d, a, size_t(channels) * sizeof(double));
    std::memcpy(d + channels, b, size_t(channels) * sizeof(double));
  }
  Store(&s->claim, gen << 1);
  Store(&s->sleeping, 0);
  const uint32_t posted = Word(gen, kPosted);
  __atomic_fetch_add(&header()->posts[rank], 1, __ATOMIC_RELAXED);
  // Sequentially consistent: of the ranks posting one round, the last to post sees every
  // other's post in its scan (TryReduce), so some rank always reduces it.
  Store(&s->state, posted);
  return posted;
}

bool Segment::FindPosted(int32_t rank, const Key& key, int32_t hint, int32_t* index,
                         uint32_t* state) const {
  const int32_t start = hint >= 0 && hint < g_.ring ? hint : 0;
  for (int32_t j = 0; j < g_.ring; ++j) {
    const int32_t i = (start + j) % g_.ring;
    SlotHead* s = slot(rank, i);
    const uint32_t w = Load(&s->state);
    if (StateOf(w) != kPosted) continue;
    if (Read(&s->op) != key.op || Read(&s->seq) != key.seq || Read(&s->phase) != key.phase) {
      continue;
    }
    if (Load(&s->state) != w) continue;
    *index = i;
    *state = w;
    return true;
  }
  return false;
}

std::vector<int32_t> Segment::Missing(const Key& key) const {
  std::vector<int32_t> out;
  int32_t i;
  uint32_t w;
  for (int32_t r = 0; r < g_.ranks; ++r) {
    if (!FindPosted(r, key, 0, &i, &w)) out.push_back(r);
  }
  return out;
}

absl::Status Segment::Blocked(const Key* key, const ReduceOptions& o) const {
  Header* h = header();
  if (Load(&h->dead) != 0) {
    char text[kTextBytes + 1];
    std::memcpy(text, h->dead_text, kTextBytes);
    text[kTextBytes] = '\0';
    return wire::WithReason(
        absl::UnavailableError(absl::StrCat(
            "the node's sidecar invalidated the shared-memory segment of job '", o.job_id, "' (",
            wire::Printable(text, kTextBytes), "); rounds in flight failed. The next call rejoins")),
        static_cast<v1::Reason>(Load(reinterpret_cast<uint32_t*>(&h->dead_reason))));
  }
  if (const uint32_t code = Load(reinterpret_cast<uint32_t*>(&h->refused_code)); code != 0) {
    char text[kSlotTextBytes + 1];
    std::memcpy(text, h->refused_text, kSlotTextBytes);
    text[kSlotTextBytes] = '\0';
    return wire::StatusFromCode(int(code), wire::Printable(text, kSlotTextBytes),
                                static_cast<v1::Reason>(Read(&h->refused_reason)));
  }
  for (int32_t r = 0; r < g_.ranks; ++r) {
    const uint32_t why = Load(&h->gone[r]);
    if (why == 0) continue;
    int32_t i;
    uint32_t w;
    if (key != nullptr && FindPosted(r, *key, 0, &i, &w)) continue;
    const std::string round = key ? wire::RoundName(key->op, key->seq, v1::Phase(key->phase))
                                  : std::string("new rounds");
    if (why == 3) {
      char text[kTextBytes + 1] = {};
      if (Load(&h->abort_set) != 0) std::memcpy(text, h->abort_text, kTextBytes);
      return wire::MemberAborted(wire::RoundRef{round, o.job_id}, Names(o, g_.ranks)(r),
                                 text[0] ? wire::Printable(text, kTextBytes) : "no reason given");
    }
    return wire::MemberGone(wire::RoundRef{round, o.job_id}, Names(o, g_.ranks)(r),
                            why == 2 ? wire::Gone::kLeft : wire::Gone::kDisconnected);
  }
  return absl::OkStatus();
}

void Segment::Sleep(int32_t rank, int32_t i, uint32_t posted, std::chrono::nanoseconds timeout) {
  SlotHead* s = slot(rank, i);
  Store(&s->sleeping, 1);
  if (Load(&s->state) == posted) FutexWait(&s->state, posted, timeout);
  Store(&s->sleeping, 0);
}

bool Segment::BeginDeliver(int32_t rank, int32_t i, uint32_t posted) const {
  return Cas(&slot(rank, i)->state, posted, Word(GenOf(posted), kWriting));
}

void Segment::Deliver(int32_t rank, int32_t i, uint32_t posted, int32_t code,
                      const std::string& message, int64_t count, int64_t channels,
                      const double* a, const double* b, int32_t reason) const {
  SlotHead* s = slot(rank, i);
  const uint32_t gen = GenOf(posted);
  s->code = code;
  s->reason = reason;
  const size_t n = std::min(message.size(), kSlotTextBytes);
  std::memcpy(s->message, message.data(), n);
  s->message_len = uint32_t(n);
  s->count = count;
  s->channels = uint32_t(channels);
  if (code == 0) {
    double* d = data(s);
    std::memcpy(d, a, size_t(channels) * sizeof(double));
    std::memcpy(d + channels, b, size_t(channels) * sizeof(double));
  }
  Store(&s->state, Word(gen, kDone));
  if (Load(&s->sleeping) != 0) FutexWake(&s->state);
}

bool Segment::TryReduce(const Key& key, int32_t hint, const ReduceOptions& o) {
  const int32_t n = g_.ranks;
  thread_local std::vector<int32_t> idx;
  thread_local std::vector<uint32_t> posted;
  thread_local std::vector<double> buf;
  thread_local std::vector<int64_t> counts;
  thread_local std::vector<double> result;  // reused: a round allocates nothing here
  idx.resize(size_t(n));
  posted.resize(size_t(n));
  counts.resize(size_t(n));
  for (int32_t r = 0; r < n; ++r) {
    if (!FindPosted(r, key, hint, &idx[r], &posted[r])) return false;
  }
  // One reducer per round: the rank-0 slot's claim word, tied to that post's generation.
  const uint32_t gen0 = GenOf(posted[0]);
  if (!Cas(&slot(0, idx[0])->claim, gen0 << 1, (gen0 << 1) | 1u)) return false;

  int32_t scope = 0;
  int64_t channels = 0;
  absl::Status error = CopyChecked(key, idx, posted, o, &scope, &channels, &counts, &buf);
  int64_t count = 0;
  wire::ReduceFault fault;
  if (error.ok()) {
    // Names are built only for an error message.
    auto ref = [&] {
      return wire::RoundRef{wire::RoundName(key.op, key.seq, v1::Phase(key.phase)), o.job_id};
    };
    result.resize(2 * size_t(channels));
    error = wire::ReduceRound(
        key.phase == v1::PHASE_FORWARD, channels, n, [&](int i) { return counts[size_t(i)]; },
        [&](int i, const double** ai, const double** bi) {
          *ai = buf.data() + size_t(i) * 2 * size_t(channels);
          *bi = *ai + channels;
          return counts[size_t(i)];
        },
        Names(o, n), o.strict_finite, ref, result.data(), result.data() + channels, &count,
        &fault);
  }
  // A failed round goes up if any rank asked for a scope that reaches the root: the other
  // nodes' ranks may wait there for this node's partial (ranks that disagree on the scope).
  bool up = error.ok() && ReachesParent(scope, o);
  for (int32_t r = 0; r < n && !error.ok() && !up; ++r) {
    up = ReachesParent(Read(&slot(r, idx[r])->scope), o);
  }
  if (error.ok() && up) {
    error = SendPartial(key, scope, channels, count, result, o);
    if (error.ok() && scope == v1::SCOPE_GLOBAL) return true;  // the sidecar answers (root's)
  }
  if (!error.ok()) {
    FailClaimed(key, idx, posted, scope, up, error, o);
    return true;
  }
  std::vector<bool> mine = BeginAll(idx, posted);
  CountRound(scope, key.phase, 0);
  // The waiting ranks first, this process's own answer last: it is not waiting.
  for (int32_t k = 0; k < n; ++k) {
    const int32_t r = o.self >= 0 && o.self < n ? (o.self + 1 + k) % n : k;
    if (mine[size_t(r)]) {
      Deliver(r, idx[r], posted[r], 0, "", count, channels, result.data(),
              result.data() + channels);
    }
  }
  return true;
}

absl::Status Segment::CopyChecked(const Key& key, const std::vector<int32_t>& idx,
                                  const std::vector<uint32_t>& posted, const ReduceOptions& o,
                                  int32_t* scope, int64_t* channels,
                                  std::vector<int64_t>* counts, std::vector<double>* buf) {
  const int32_t n = g_.ranks;
  // Names are built only for an error message.
  auto round = [&] { return wire::RoundName(key.op, key.seq, v1::Phase(key.phase)); };
  const wire::MemberNames names = Names(o, n);
  wire::RoundRules rules;
  rules.forward = key.phase == v1::PHASE_FORWARD;
  rules.group_allowed = false;
  rules.strict_finite = o.strict_finite;
  rules.max_channels = o.max_channels_limit;
  rules.transport_cap = g_.max_channels;
  absl::Status error;
  for (int32_t r = 0; r < n && error.ok(); ++r) {
    SlotHead* s = slot(r, idx[r]);
    wire::ContributionView c;
    c.scope = Read(&s->scope);
    c.channels = Read(&s->channels);
    c.count = Read(&s->count);
    auto who = [&] { return names(r); };
    error = wire::CheckFields(c, rules, who, round);
    if (!error.ok()) break;
    if (r == 0) {
      *scope = c.scope;
      *channels = c.channels;
      buf->resize(size_t(n) * 2 * size_t(*channels));
    } else {
      error = wire::CheckSameRound(c, *channels, *scope, who, [&] { return names(0); }, round);
      if (!error.ok()) break;
    }
    (*counts)[size_t(r)] = c.count;
    double* mine = buf->data() + size_t(r) * 2 * size_t(*channels);
    std::memcpy(mine, data(s), size_t(*channels) * 2 * sizeof(double));
    if (Load(&s->state) != posted[r]) {
      return absl::AbortedError(absl::StrCat("round ", round(), " of job '", o.job_id, "': ",
                                             names(r),
                                             " withdrew its contribution while it was reduced "
                                             "(its wait ended); the round failed"));
    }
    // Checked on this process's copy: another process may still write the slot.
    c.data = reinterpret_cast<const char*>(mine);
    CountNonFinite(key.phase, wire::CountNonFinite(c.data, 2 * *channels));
    error = wire::CheckValues(c, rules, who, round);
  }
  return error;
}

absl::Status Segment::SendPartial(const Key& key, int32_t scope, int64_t channels,
                                  int64_t count, const std::vector<double>& result,
                                  const ReduceOptions& o) {
  QueueEntry partial;
  partial.key = key;
  partial.kind = kPartial;
  partial.scope = scope;
  partial.channels = channels;
  partial.count = count;
  partial.data = result;
  if (Enqueue(partial, o)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "round ", wire::RoundName(key.op, key.seq, v1::Phase(key.phase)), " of job '", o.job_id,
      "': the node's sidecar did not take the node partial (its queue stayed full, or it "
      "invalidated the segment)"));
}

void Segment::FailClaimed(const Key& key, const std::vector<int32_t>& idx,
                          const std::vector<uint32_t>& posted, int32_t scope, bool up,
                          const absl::Status& error, const ReduceOptions& o) {
  if (up) {
    QueueEntry abort;
    abort.key = key;
    abort.kind = kAbort;
    abort.code = int32_t(error.code());
    abort.reason = int32_t(wire::ReasonOf(error));
    abort.message = std::string(error.message());
    Enqueue(abort, o);
  }
  const std::string message(error.message());
  std::vector<bool> mine = BeginAll(idx, posted);
  CountRound(scope != 0 ? scope : Read(&slot(0, idx[0])->scope), key.phase,
             int32_t(error.code()));
  for (int32_t r = 0; r < g_.ranks; ++r) {
    if (mine[size_t(r)]) {
      Deliver(r, idx[r], posted[r], int32_t(error.code()), message, 0, 0, nullptr, nullptr,
              int32_t(wire::ReasonOf(error)));
    }
  }
}

bool Segment::Enqueue(const QueueEntry& item, const ReduceOptions& o) {
  // The sidecar drains the queue whenever its doorbell rings; a full queue waits for it.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int spins = 0;; ++spins) {
    if (Load(&header()->dead) != 0) return false;
    for (int32_t j = 0; j < g_.queue; ++j) {
      SlotHead* e = entry(j);
      const uint32_t w = Load(&e->state);
      if (StateOf(w) != kFree || !Cas(&e->state, w, Word(GenOf(w), kFilling))) continue;
      e->kind = item.kind;
      e->op = item.key.op;
      e->seq = item.key.seq;
      e->phase = item.key.phase;
      e->scope = item.scope;
      e->channels = uint32_t(item.channels);
      e->count = item.count;
      e->code = item.code;
      e->reason = item.reason;
      const size_t len = std::min(item.message.size(), kSlotTextBytes);
      std::memcpy(e->message, item.message.data(), len);
      e->message_len = uint32_t(len);
      if (!item.data.empty()) {
        std::memcpy(data(e), item.data.data(), item.data.size() * sizeof(double));
      }
      Store(&e->state, Word(GenOf(w), kReady));
      if (o.doorbell >= 0) {
        const uint64_t one = 1;
        ssize_t ignored = write(o.doorbell, &one, sizeof(one));
        (void)ignored;
      }
      return true;
    }
    if (std::chrono::steady_clock::now() >= give_up) return false;
    if (spins < 64) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

bool Segment::Take(int32_t rank, int32_t i, uint32_t posted, int64_t channels,
                   absl::Status* status, int64_t* count, std::vector<double>* out) {
  SlotHead* s = slot(rank, i);
  const uint32_t gen = GenOf(posted);
  if (Load(&s->state) != Word(gen, kDone)) return false;
  const int32_t code = Read(&s->code);
  if (code != 0) {
    const uint32_t len = std::min<uint32_t>(Read(&s->message_len), kSlotTextBytes);
    std::string text(s->message, len);
    *status = wire::StatusFromCode(code, wire::Printable(text, kSlotTextBytes),
                                   static_cast<v1::Reason>(Read(&s->reason)));
  } else if (int64_t(Read(&s->channels)) != channels || Read(&s->count) < 0) {
    *status = absl::InternalError(
        "the node's shared-memory segment held a malformed result (wrong channel count or a "
        "negative count); a process of this job wrote into another's slot");
  } else {
    *status = absl::OkStatus();
    *count = Read(&s->count);
    out->resize(2 * size_t(channels));
    std::memcpy(out->data(), data(s), out->size() * sizeof(double));
  }
  Store(&s->state, Word(gen, kFree));
  return true;
}

bool Segment::Withdraw(int32_t rank, int32_t i, uint32_t posted) {
  return Cas(&slot(rank, i)->state, posted, Word(GenOf(posted), kFree));
}

void Segment::WakeAll() const {
  for (int32_t r = 0; r < g_.ranks; ++r) {
    for (int32_t i = 0; i < g_.ring; ++i) FutexWake(&slot(r, i)->state);
  }
}

void Segment::MarkGone(int32_t rank, uint32_t why) {
  if (rank < 0 || rank >= g_.ranks) return;
  // An aborted rank that then leaves or exits stays "aborted": its reason is the news.
  if (Load(&header()->gone[rank]) != 3 || why == 3) Store(&header()->gone[rank], why);
  __atomic_fetch_add(&header()->epoch, 1, __ATOMIC_SEQ_CST);
  WakeAll();
}

void Segment::MarkAborted(int32_t rank, const std::string& reason) {
  if (rank < 0 || rank >= g_.ranks) return;
  Header* h = header();
  if (Load(&h->abort_set) == 0) {
    const size_t n = std::min(reason.size(), kTextBytes - 1);
    std::memcpy(h->abort_text, reason.data(), n);
    h->abort_text[n] = '\0';
    Store(&h->abort_set, 1);
  }
  MarkGone(rank, 3);
}

void Segment::Refuse(const absl::Status& status) {
  Header* h = header();
  if (Load(reinterpret_cast<uint32_t*>(&h->refused_code)) != 0 || status.ok()) return;
  const std::string text(status.message());
  const size_t n = std::min(text.size(), kSlotTextBytes - 1);
  std::memcpy(h->refused_text, text.data(), n);
  h->refused_text[n] = '\0';
  h->refused_reason = int32_t(wire::ReasonOf(status));
  Store(reinterpret_cast<uint32_t*>(&h->refused_code), uint32_t(status.code()));
  __atomic_fetch_add(&h->epoch, 1, __ATOMIC_SEQ_CST);
  WakeAll();
}

void Segment::Revive(int32_t rank) {
  if (rank < 0 || rank >= g_.ranks) return;
  for (int32_t i = 0; i < g_.ring; ++i) {
    SlotHead* s = slot(rank, i);
    Store(&s->state, Word((GenOf(Load(&s->state)) + 1) & 0xffffffu, kFree));
  }
  Store(&header()->gone[rank], 0);
  __atomic_fetch_add(&header()->epoch, 1, __ATOMIC_SEQ_CST);
}

void Segment::Kill(const std::string& why, int32_t reason) {
  Header* h = header();
  const size_t n = std::min(why.size(), kTextBytes - 1);
  std::memcpy(h->dead_text, why.data(), n);
  h->dead_text[n] = '\0';
  Store(reinterpret_cast<uint32_t*>(&h->dead_reason), uint32_t(reason));
  Store(&h->dead, 1);
  __atomic_fetch_add(&h->epoch, 1, __ATOMIC_SEQ_CST);
  WakeAll();
}

std::vector<QueueEntry> Segment::TakeQueue(int* malformed) {
  std::vector<QueueEntry> out;
  for (int32_t j = 0; j < g_.queue; ++j) {
    SlotHead* e = entry(j);
    const uint32_t w = Load(&e->state);
    if (StateOf(w) != kReady) continue;
    QueueEntry it;
    it.kind = Read(&e->kind);
    it.key.op = Read(&e->op);
    it.key.seq = Read(&e->seq);
    it.key.phase = Read(&e->phase);
    it.scope = Read(&e->scope);
    it.channels = Read(&e->channels);
    it.count = Read(&e->count);
    it.code = Read(&e->code);
    it.reason = Read(&e->reason);
    const uint32_t len = std::min<uint32_t>(Read(&e->message_len), kSlotTextBytes);
    it.message = wire::Printable(std::string(e->message, len), kSlotTextBytes);
    bool ok = (it.kind == kPartial || it.kind == kAbort) &&
              (it.key.phase == v1::PHASE_FORWARD || it.key.phase == v1::PHASE_BACKWARD);
    if (ok && it.kind == kPartial) {
      ok = (it.scope == v1::SCOPE_GLOBAL || it.scope == v1::SCOPE_SHADOW ||
            it.scope == v1::SCOPE_RENORM || it.scope == v1::SCOPE_LAGGED) && it.channels >= 1 &&
           it.channels <= g_.max_channels && it.count >= 0;
      if (ok) {
        it.data.resize(2 * size_t(it.channels));
        std::memcpy(it.data.data(), data(e), it.data.size() * sizeof(double));
      }
    }
    if (ok && it.kind == kAbort && (it.code <= 0 || it.code > 16)) it.code = int32_t(absl::StatusCode::kAborted);
    Store(&e->state, Word(GenOf(w) + 1, kFree));
    if (ok) {
      out.push_back(std::move(it));
    } else if (malformed) {
      ++*malformed;
    }
  }
  return out;
}

int Segment::DeliverAll(const Key& key, int32_t code, const std::string& message, int64_t count,
                        int64_t channels, const double* d, int32_t reason) {
  std::vector<int32_t> idx(size_t(g_.ranks), -1);
  std::vector<uint32_t> posted(size_t(g_.ranks), 0);
  for (int32_t r = 0; r < g_.ranks; ++r) {
    if (!FindPosted(r, key, 0, &idx[size_t(r)], &posted[size_t(r)])) idx[size_t(r)] = -1;
  }
  std::vector<bool> mine = BeginAll(idx, posted);
  int delivered = 0;
  for (int32_t r = 0; r < g_.ranks; ++r) {
    if (mine[size_t(r)]) {
      CountRound(Read(&slot(r, idx[size_t(r)])->scope), key.phase, code);
      break;
    }
  }
  if (code == 0 && d != nullptr) {
    CountNonFinite(key.phase, wire::CountNonFinite(reinterpret_cast<const char*>(d), 2 * channels));
  }
  for (int32_t r = 0; r < g_.ranks; ++r) {
    if (!mine[size_t(r)]) continue;
    Deliver(r, idx[size_t(r)], posted[size_t(r)], code, message, count, channels, d,
            d ? d + channels : nullptr, reason);
    ++delivered;
  }
  return delivered;
}

void Segment::CountRound(int32_t scope, int32_t phase, int32_t code) const {
  Header* h = header();
  __atomic_fetch_add(code == 0 ? &h->completed : &h->failed, 1, __ATOMIC_RELAXED);
  // An out-of-range scope or phase (a slot's are written by a worker) counts under 0.
  // A code outside 0..16 counts as UNKNOWN (2), never as OK, as on the stream.
  auto clamp = [](int32_t v, int n) { return v >= 0 && v < n ? v : 0; };
  const int32_t c = code >= 0 && code < kCountCodes ? code : 2;
  __atomic_fetch_add(&h->rounds[clamp(scope, kCountScopes)][clamp(phase, kCountPhases)][c],
                     1, __ATOMIC_RELAXED);
}

void Segment::CountNonFinite(int32_t phase, int64_t values) const {
  if (values <= 0) return;
  const int p = phase >= 0 && phase < kCountPhases ? phase : 0;
  __atomic_fetch_add(&header()->nonfinite[p], uint64_t(values), __ATOMIC_RELAXED);
}

std::vector<bool> Segment::BeginAll(const std::vector<int32_t>& idx,
                                    const std::vector<uint32_t>& posted) const {
  // Every slot leaves "posted" before any gets its answer: a rank that has its answer may
  // leave the job at once, and the others must not then take the round for one that waits
  // for it.
  std::vector<bool> mine(idx.size(), false);
  for (size_t r = 0; r < idx.size(); ++r) {
    mine[r] = idx[r] >= 0 && BeginDeliver(int32_t(r), idx[r], posted[r]);
  }
  return mine;
}

}  // namespace hsbn::shm

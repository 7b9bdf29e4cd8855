#include "shm_channel.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "hsbn/v1/hsbn.pb.h"
#include "round.h"
#include "wire.h"

namespace hsbn::client_internal {

namespace {

constexpr auto kSlice = std::chrono::milliseconds(200);

uint64_t RoundId(int32_t slot, uint32_t posted) { return (uint64_t(uint32_t(slot)) << 32) | posted; }

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

std::string NameOf(const shm::Key& key) {
  return wire::RoundName(key.op, key.seq, v1::Phase(key.phase));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ShmChannel>> ShmChannel::Open(ShmConfig config) {
  auto ch = std::shared_ptr<ShmChannel>(new ShmChannel(std::move(config)));
  const std::string& name = ch->config_.socket;
  sockaddr_un addr;
  const socklen_t len = shm::SocketAddress(name, &addr);
  if (len == 0) {
    return absl::UnavailableError(absl::StrCat("bad shared-memory socket name '", name, "'"));
  }
  ch->sock_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (ch->sock_ < 0 || connect(ch->sock_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot connect to the sidecar's shared-memory "
                                               "socket ", name, ": ", std::strerror(errno)));
  }
  std::string hello(shm::kHelloMagic, sizeof shm::kHelloMagic);
  hello += ch->config_.session;
  hello += ch->config_.token.substr(0, shm::kMaxTokenBytes);
  if (send(ch->sock_, hello.data(), hello.size(), MSG_NOSIGNAL) != ssize_t(hello.size())) {
    return absl::UnavailableError(absl::StrCat("cannot send to the sidecar's shared-memory "
                                               "socket ", name, ": ", std::strerror(errno)));
  }
  return ch;
}

ShmChannel::~ShmChannel() {
  segment_.reset();
  if (doorbell_ >= 0) close(doorbell_);
  if (sock_ >= 0) close(sock_);
}

absl::Status ShmChannel::Await(Clock::time_point deadline) {
  absl::MutexLock lock(&await_mu_);
  if (decided()) return absl::OkStatus();
  const auto now = Clock::now();
  const int ms = deadline <= now ? 0
                                 : int(std::min<int64_t>(
                                       std::chrono::duration_cast<std::chrono::milliseconds>(
                                           deadline - now).count() + 1, 1 << 30));
  pollfd p{sock_, POLLIN, 0};
  const int ready = poll(&p, 1, ms);
  if (ready == 0) {
    return absl::DeadlineExceededError(
        "the sidecar has not decided this node's transport yet: it waits for every local rank "
        "of the job to join (--shm-wait-ms)");
  }
  char text[1024];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  iovec iov{text, sizeof text - 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t got = recvmsg(sock_, &msg, MSG_CMSG_CLOEXEC);
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < n; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        fds.push_back(fd);
      }
    }
  }
  auto close_fds = [&] {
    for (int fd : fds) close(fd);
  };
  if (got <= 0) {
    close_fds();
    return absl::UnavailableError(
        "the sidecar closed its shared-memory socket before answering (it restarted or shut "
        "down); the next call rejoins");
  }
  const std::string answer(text, size_t(got));
  if (answer == "shm" && fds.size() == 2) {
    auto seg = shm::Segment::Map(fds[0], config_.local_world_size);
    close(fds[0]);
    if (!seg.ok()) {
      close(fds[1]);
      // The other ranks use the segment: this rank must not fall back on its own.
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot map the node's shared-memory segment: ", seg.status().message(),
          "; the node's other ranks use it, so this rank cannot run (set HSBN_TRANSPORT=grpc on "
          "every worker of the node)"));
    }
    if ((*seg)->header()->dead != 0) {
      close(fds[1]);
      return absl::UnavailableError(
          "the node's sidecar invalidated its shared-memory segment (it restarted or shut "
          "down); the next call rejoins");
    }
    segment_ = std::move(*seg);
    doorbell_ = fds[1];
    {
      absl::MutexLock lock(&mu_);
      busy_.assign(size_t(segment_->geometry().ring), false);
    }
    if (config_.local_world_size > int32_t(std::thread::hardware_concurrency())) {
      max_spin_ns_ = 5000;  // waiters without cores of their own: spinning delays the last rank
      spin_ns_ = 2000;
    }
    note_ = "shm";
    decided_.store(true, std::memory_order_release);
    return absl::OkStatus();
  }
  close_fds();
  if (answer.rfind("grpc: ", 0) == 0) {
    note_ = wire::Printable(answer, 512);
    decided_.store(true, std::memory_order_release);
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("the sidecar refused the shared-memory hand-off: ",
                                             wire::Printable(answer, 512)));
}

bool ShmChannel::Alive() const {
  if (segment_ && __atomic_load_n(&segment_->header()->dead, __ATOMIC_ACQUIRE) != 0) return false;
  if (gone_.load(std::memory_order_acquire)) return false;
  pollfd p{sock_, POLLIN | POLLRDHUP, 0};
  bool alive = true;
  if (poll(&p, 1, 0) != 0) {
    // Before the answer, data is the answer; after it the sidecar sends nothing more.
    alive = !(p.revents & (POLLRDHUP | POLLHUP | POLLERR)) && !decided();
  }
  if (!alive) gone_.store(true, std::memory_order_release);
  return alive;
}

absl::Status ShmChannel::Stopping() const {
  if (!segment_ || __atomic_load_n(&segment_->header()->dead, __ATOMIC_ACQUIRE) == 0) {
    return absl::OkStatus();
  }
  const shm::Header* h = segment_->header();
  if (__atomic_load_n(&h->dead_reason, __ATOMIC_ACQUIRE) != v1::REASON_SHUTTING_DOWN) {
    return absl::OkStatus();
  }
  char text[shm::kTextBytes + 1];
  std::memcpy(text, h->dead_text, shm::kTextBytes);
  text[shm::kTextBytes] = '\0';
  return wire::WithReason(absl::UnavailableError(wire::Printable(text, shm::kTextBytes)),
                          v1::REASON_SHUTTING_DOWN);
}

bool ShmChannel::AliveRecently() const {
  if (segment_ && __atomic_load_n(&segment_->header()->dead, __ATOMIC_ACQUIRE) != 0) return false;
  if (gone_.load(std::memory_order_acquire)) return false;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          Clock::now().time_since_epoch()).count();
  const int64_t last = polled_at_ns_.load(std::memory_order_relaxed);
  if (now - last < std::chrono::nanoseconds(kAlivePoll).count()) return true;
  polled_at_ns_.store(now, std::memory_order_relaxed);
  return Alive();
}

shm::ReduceOptions ShmChannel::Reduce() const {
  shm::ReduceOptions o;
  o.node_rank = config_.node_rank;
  o.num_nodes = config_.num_nodes;
  o.strict_finite = config_.strict_finite;
  o.doorbell = doorbell_;
  o.job_id = config_.job_id;
  o.max_channels_limit = config_.max_channels;
  o.self = config_.local_rank;
  return o;
}

void ShmChannel::HarvestLocked() {
  const int32_t rank = config_.local_rank;
  const Clock::time_point now = Clock::now();
  for (int32_t i = 0; i < segment_->geometry().ring; ++i) {
    if (!busy_[size_t(i)]) continue;
    const uint32_t w = segment_->State(rank, i);
    if (auto a = abandoned_.find(i); a != abandoned_.end()) {
      // Nobody waits for it: free it once answered, or at the aggregator's deadline.
      absl::Status ignored_status;
      int64_t ignored_count;
      std::vector<double> ignored_data;
      const uint32_t posted = a->second.posted;
      if (segment_->Take(rank, i, posted, 0, &ignored_status, &ignored_count, &ignored_data) ||
          (now >= a->second.deadline && segment_->Withdraw(rank, i, posted)) ||
          (w != posted && (w & 0xffu) != shm::kWriting &&
           w != ((posted & ~0xffu) | shm::kDone))) {
        busy_[size_t(i)] = false;
        abandoned_.erase(a);
      }
      continue;
    }
    if ((w & 0xffu) != shm::kDone) continue;
    const uint32_t posted = (w & ~0xffu) | shm::kPosted;
    Stashed s;
    s.posted = posted;
    // The stash keeps the raw payload; Wait checks it against the round's channels.
    int64_t channels = int64_t(__atomic_load_n(&segment_->slot(rank, i)->channels, __ATOMIC_RELAXED));
    channels = std::clamp<int64_t>(channels, 0, segment_->geometry().max_channels);
    if (!segment_->Take(rank, i, posted, channels, &s.status, &s.count, &s.data)) continue;
    busy_[size_t(i)] = false;
    stash_[RoundId(i, posted)] = std::move(s);
  }
}

absl::StatusOr<ShmRound> ShmChannel::Start(const shm::Key& key, int32_t scope, int64_t channels,
                                           int64_t count, const double* a, const double* b,
                                           Clock::time_point deadline) {
  // Built only for an error message: a round's fast path allocates nothing it does not need.
  auto round = [&] { return wire::RoundName(key.op, key.seq, v1::Phase(key.phase)); };
  const shm::ReduceOptions opts = Reduce();
  if (absl::Status s = segment_->Blocked(&key, opts); !s.ok()) return s;
  if (scope != v1::SCOPE_NODE && config_.num_nodes > 1 && segment_->header()->has_parent == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", config_.node_rank * config_.local_world_size + config_.local_rank, " asked for ",
        wire::ScopeName(v1::Scope(scope)), " scope in round ", round(), ", but job '",
        config_.job_id, "' spans ", config_.num_nodes,
        " nodes and this sidecar has no root: start it with --upstream=<root address>"));
  }
  const int32_t rank = config_.local_rank;
  const int32_t ring = segment_->geometry().ring;
  ShmRound r;
  {
    absl::MutexLock lock(&mu_);
    for (int32_t i = 0; i < ring; ++i) {
      if (!busy_[size_t(i)]) continue;
      const uint32_t w = segment_->State(rank, i);
      if ((w & 0xffu) == shm::kPosted && segment_->slot(rank, i)->op == key.op &&
          segment_->slot(rank, i)->seq == key.seq && segment_->slot(rank, i)->phase == key.phase) {
        return absl::AlreadyExistsError(absl::StrCat(
            "round ", round(), " is already in flight on this client; each (op, seq, phase) is one "
            "round"));
      }
    }
    int32_t slot = -1;
    for (int attempt = 0; slot < 0; ++attempt) {
      for (int32_t i = 0; i < ring && slot < 0; ++i) {
        if (!busy_[size_t(i)] && (segment_->State(rank, i) & 0xffu) == shm::kFree) slot = i;
      }
      if (slot >= 0) break;
      HarvestLocked();
      for (int32_t i = 0; i < ring && slot < 0; ++i) {
        if (!busy_[size_t(i)] && (segment_->State(rank, i) & 0xffu) == shm::kFree) slot = i;
      }
      if (slot >= 0) break;
      // Every slot holds a round in flight: wait for one to finish (rounds are never dropped).
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "round ", round(), ": all ", ring, " shared-memory slots of this rank hold rounds that "
            "did not finish in time (--shm-ring); wait for rounds before starting more"));
      }
      if (!Alive()) {
        return absl::UnavailableError("the node's sidecar is gone (it restarted or shut down); "
                                      "the next call rejoins");
      }
      never_.WaitWithTimeout(&mu_, absl::Microseconds(attempt < 100 ? 50 : 1000));
    }
    busy_[size_t(slot)] = true;
    r.key = key;
    r.scope = scope;
    r.channels = channels;
    r.slot = slot;
    r.started = Clock::now();
    r.posted = segment_->Post(rank, slot, key, scope, channels, count, a, b);
  }
  segment_->TryReduce(key, r.slot, opts);
  return r;
}

absl::Status ShmChannel::Deliver(const absl::Status& s, int64_t count,
                                 const std::vector<double>& data, int64_t channels,
                                 int64_t* out_count, double* out_a, double* out_b) {
  if (!s.ok()) return s;
  if (int64_t(data.size()) != 2 * channels) {
    return absl::InternalError("the node's shared-memory segment held a result of the wrong size");
  }
  if (out_count) *out_count = count;
  if (out_a) std::memcpy(out_a, data.data(), size_t(channels) * sizeof(double));
  if (out_b) std::memcpy(out_b, data.data() + channels, size_t(channels) * sizeof(double));
  return absl::OkStatus();
}

void ShmChannel::Abort(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_flag_.load()) return;
    aborted_ = status;
    aborted_flag_.store(true);
  }
  if (!segment_) return;
  // Takes back this rank's posted contributions, so that no round completes with them now,
  // and wakes its waiters.
  for (int32_t i = 0; i < segment_->geometry().ring; ++i) {
    const uint32_t w = segment_->State(config_.local_rank, i);
    if ((w & 0xffu) == shm::kPosted) segment_->Withdraw(config_.local_rank, i, w);
    shm::FutexWake(&segment_->slot(config_.local_rank, i)->state);
  }
}

absl::Status ShmChannel::AbortStatus() {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

absl::Status ShmChannel::Wait(const ShmRound& r, Clock::time_point client_deadline,
                              std::chrono::milliseconds client_timeout, int64_t* out_count,
                              double* out_a, double* out_b, Clock::time_point slice_end,
                              bool* pending) {
  const int32_t rank = config_.local_rank;
  const shm::ReduceOptions opts = Reduce();
  const bool up = r.scope != v1::SCOPE_NODE && config_.num_nodes > 1;
  // As at the sidecar: a round fails at the aggregator's round timeout naming who is missing;
  // a forwarded round waits a little longer, so that the root's error (naming the missing
  // nodes) comes first.
  const std::chrono::milliseconds aggregator_wait =
      up && r.scope == v1::SCOPE_GLOBAL ? wire::ForwardedBackstop(config_.round_timeout)
                                        : config_.round_timeout;
  const Clock::time_point aggregator_deadline = r.started + aggregator_wait;
  const Clock::time_point deadline = std::min(aggregator_deadline, client_deadline);
  {
    absl::MutexLock lock(&mu_);
    // Waited for again after its caller's own timeout: it is no longer abandoned.
    if (auto a = abandoned_.find(r.slot); a != abandoned_.end() && a->second.posted == r.posted) {
      abandoned_.erase(a);
    }
  }

  auto release = [&](const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    busy_[size_t(r.slot)] = false;
    return s;
  };
  // Spin first, briefly: while the waiters have cores of their own a result often comes
  // within microseconds, and a futex sleep and wake cost more than that.
  const int64_t spin = spin_ns_.load(std::memory_order_relaxed);
  const Clock::time_point spin_end = Clock::now() + std::chrono::nanoseconds(spin);
  bool slept = false;
  while (segment_->State(rank, r.slot) == r.posted && Clock::now() < spin_end) {
    for (int k = 0; k < 32; ++k) CpuRelax();
  }
  for (;;) {
    const uint32_t w = segment_->State(rank, r.slot);
    if (w == r.posted) {
      if (aborted_flag_.load()) {
        // Only this rank's wait ends: the sidecar tells the others, naming this rank.
        if (segment_->Withdraw(rank, r.slot, r.posted)) return release(AbortStatus());
        continue;  // an answer is there or being written: take it
      }
      if (pending != nullptr && Clock::now() >= slice_end && Clock::now() < deadline) {
        *pending = true;
        return absl::OkStatus();
      }
      absl::Status fail = segment_->Blocked(&r.key, opts);
      if (fail.ok() && !Alive()) fail = SidecarGone(r.key);
      const Clock::time_point now = Clock::now();
      if (fail.ok() && now >= deadline) {
        if (now < aggregator_deadline) return Abandon(r, aggregator_deadline, client_timeout);
        fail = TimedOut(r.key, aggregator_wait);
      }
      if (!fail.ok()) {
        // As at the sidecar, the round fails for every rank that is in it, at once.
        segment_->DeliverAll(r.key, int32_t(fail.code()), std::string(fail.message()), 0, 0,
                             nullptr, int32_t(wire::ReasonOf(fail)));
        if (segment_->Withdraw(rank, r.slot, r.posted)) return release(fail);
        continue;  // an answer is there or being written: take it
      }
      slept = true;
      segment_->Sleep(rank, r.slot, r.posted,
                      std::max<Clock::duration>(
                          Clock::duration::zero(),
                          std::min<Clock::duration>({deadline - now, kSlice, slice_end - now})));
      continue;
    }
    if ((w & 0xffu) == shm::kWriting) {
      sched_yield();
      continue;
    }
    absl::Status status;
    int64_t count = 0;
    thread_local std::vector<double> data;  // reused: a round allocates nothing here
    const Taken taken = TakeAnswer(r, &status, &count, &data);
    if (taken == Taken::kAgain) continue;
    if (taken == Taken::kLost) return status;
    if (aborted_flag_.load()) return AbortStatus();  // an answer that came too late
    // Adapt the spin: longer while results come within it, shorter when they do not.
    if (!slept) {
      spin_ns_.store(std::min<int64_t>(std::max<int64_t>(spin * 2, 1000), max_spin_ns_),
                     std::memory_order_relaxed);
    } else {
      spin_ns_.store(spin / 2, std::memory_order_relaxed);
    }
    return Deliver(status, count, data, r.channels, out_count, out_a, out_b);
  }
}

ShmChannel::Taken ShmChannel::TakeAnswer(const ShmRound& r, absl::Status* status,
                                         int64_t* count, std::vector<double>* data) {
  const int32_t rank = config_.local_rank;
  absl::MutexLock lock(&mu_);
  if (auto it = stash_.find(RoundId(r.slot, r.posted)); it != stash_.end()) {
    *status = it->second.status;
    *count = it->second.count;
    *data = std::move(it->second.data);
    stash_.erase(it);
    return Taken::kTaken;
  }
  if (segment_->Take(rank, r.slot, r.posted, r.channels, status, count, data)) {
    busy_[size_t(r.slot)] = false;
    return Taken::kTaken;
  }
  if ((segment_->State(rank, r.slot) & 0xffu) == shm::kDone ||
      segment_->State(rank, r.slot) == r.posted) {
    return Taken::kAgain;  // changed under us (a harvest in progress); look again
  }
  busy_[size_t(r.slot)] = false;
  if (aborted_flag_.load()) {
    *status = aborted_;  // Abort took the contribution back
  } else {
    *status = absl::UnavailableError(absl::StrCat(
        "round ", NameOf(r.key), ": this rank's shared-memory slot was reset (the sidecar "
        "re-admitted this rank, or a process of the job wrote into it); the round is lost"));
  }
  return Taken::kLost;
}

absl::Status ShmChannel::Abandon(const ShmRound& r, Clock::time_point aggregator_deadline,
                                 std::chrono::milliseconds client_timeout) {
  // The caller's own (shorter) timeout: as on the stream, the contribution stays, so the round
  // can still complete for the other ranks; the slot is reclaimed once it does, or at the
  // aggregator's deadline.
  absl::MutexLock lock(&mu_);
  abandoned_[r.slot] = Abandoned{r.posted, aggregator_deadline};
  return absl::DeadlineExceededError(absl::StrCat(
      "round ", NameOf(r.key), ": no answer through the node's shared memory within ",
      client_timeout.count(), " ms"));
}

absl::Status ShmChannel::SidecarGone(const shm::Key& key) const {
  return absl::UnavailableError(absl::StrCat(
      "round ", NameOf(key), ": the node's sidecar is gone (it restarted or shut down), so the "
      "job's shared-memory segment is no longer served; the next call rejoins"));
}

absl::Status ShmChannel::TimedOut(const shm::Key& key,
                                  std::chrono::milliseconds aggregator_wait) const {
  wire::MemberNames member;
  member.node_rank = config_.node_rank;
  member.local_world_size = config_.local_world_size;
  std::vector<std::string> names;
  for (int32_t m : segment_->Missing(key)) names.push_back(member(m));
  const wire::RoundRef ref{NameOf(key), config_.job_id};
  return names.empty() ? wire::RootSilent(ref, aggregator_wait)
                       : wire::TimedOut(ref, config_.round_timeout, names);
}

}  // namespace hsbn::client_internal

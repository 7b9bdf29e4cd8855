#include "shm_transport.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "log.h"
#include "wire.h"

namespace hsbn::server {

namespace {

constexpr size_t kMaxConns = 1024;
constexpr auto kHelloTimeout = std::chrono::seconds(5);

// Sends `text`, with `fds` attached when there are any. Never blocks for long: the socket is
// a fresh SOCK_SEQPACKET connection with room for one small message.
bool SendText(int fd, const std::string& text, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) == ssize_t(text.size());
}

}  // namespace

ShmTransport::ShmTransport(ShmOptions options, Registry* registry, TransportHost* host)
    : options_(std::move(options)), registry_(registry), host_(host) {}

ShmTransport::~ShmTransport() {
  Shutdown(absl::UnavailableError("the sidecar is shutting down"));
}

absl::Status ShmTransport::Start() {
  if (options_.socket.empty() || options_.socket.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory socket name '", options_.socket, "' is empty or too long"));
  }
  listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) return absl::UnavailableError(std::strerror(errno));
  sockaddr_un addr;
  const socklen_t len = shm::SocketAddress(options_.socket, &addr);
  if (options_.socket[0] != '@') unlink(options_.socket.c_str());
  // The socket has --socket-mode from the moment it exists, like the gRPC one.
  const mode_t saved = umask(0777 & ~options_.socket_mode);
  const int bound = bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len);
  const int bind_errno = errno;
  umask(saved);
  if (bound != 0 || listen(listen_fd_, 128) != 0) {
    const std::string why = std::strerror(bound != 0 ? bind_errno : errno);
    close(listen_fd_);
    listen_fd_ = -1;
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.socket, ": ", why));
  }
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("epoll_create1: ", std::strerror(errno)));
  }
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(errno)));
  for (int fd : {listen_fd_, wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::UnavailableError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
    }
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void ShmTransport::Shutdown(const absl::Status& closing) {
  const std::string why(closing.message());
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    for (auto& [id, job] : jobs_) {
      if (job.segment) job.segment->Kill(why, v1::REASON_SHUTTING_DOWN);
    }
  }
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  for (auto& [id, job] : jobs_) ReleaseLocked(job);
  jobs_.clear();
  for (auto& [fd, conn] : conns_) close(fd);
  conns_.clear();
  for (int* fd : {&listen_fd_, &epoll_fd_, &wake_fd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
  if (!options_.socket.empty() && options_.socket[0] != '@') unlink(options_.socket.c_str());
}

ShmTransport::NodeJob& ShmTransport::JobLocked(const std::string& job_id, int32_t ranks) {
  auto [it, inserted] = jobs_.try_emplace(job_id);
  NodeJob& job = it->second;
  if (inserted) {
    job.id = job_id;
    job.ranks = ranks;
    job.offer.assign(size_t(ranks), 0);
    job.waiting.assign(size_t(ranks), -1);
    job.deadline = Clock::now() + options_.wait;
  }
  return job;
}

absl::Status ShmTransport::CheckJoin(const v1::JoinRequest& req) {
  if (req.kind() != v1::MEMBER_KIND_WORKER) return absl::OkStatus();
  // A new run of the job (a higher incarnation) replaces it, segment included (JobDropped): its
  // workers choose their transport afresh.
  if (std::shared_ptr<Job> current = registry_->FindJob(req.job_id());
      current && req.incarnation() > current->layout().incarnation) {
    return absl::OkStatus();
  }
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(req.job_id());
  if (it == jobs_.end() || it->second.decision != Decision::kShm || req.shm_offer()) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "job '", wire::Printable(req.job_id()), "' runs its rounds on this node through shared "
      "memory, but this worker does not offer it (HSBN_TRANSPORT=grpc, another host, or an "
      "older client); every worker of a node must use the same transport: start it as the "
      "others were"));
}

void ShmTransport::Joined(const v1::JoinRequest& req, int32_t index, v1::JoinResponse* resp) {
  if (req.kind() != v1::MEMBER_KIND_WORKER) return;
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  const int32_t ranks = req.local_world_size();
  if (ranks > shm::kMaxRanks) {
    resp->set_shm_note(absl::StrCat("grpc: ", ranks, " local ranks; the shared-memory path "
                                    "serves at most ", shm::kMaxRanks));
    return;
  }
  NodeJob& job = JobLocked(req.job_id(), ranks);
  if (index < 0 || index >= job.ranks) return;
  resp->set_shm_wait_ms(options_.wait.count());
  switch (job.decision) {
    case Decision::kShm:
      resp->set_shm_socket(options_.socket);
      return;
    case Decision::kGrpc:
      resp->set_shm_note(absl::StrCat("grpc: ", job.reason));
      return;
    case Decision::kPending:
      break;
  }
  if (req.shm_offer()) {
    job.offer[size_t(index)] = 1;
    resp->set_shm_socket(options_.socket);
    return;
  }
  job.offer[size_t(index)] = 2;
  DecideGrpcLocked(job, absl::StrCat("local rank ", index, " does not offer shared memory "
                                     "(HSBN_TRANSPORT=grpc, another host, or an older client)"));
  resp->set_shm_note(absl::StrCat("grpc: ", job.reason));
}

void ShmTransport::DecideGrpcLocked(NodeJob& job, const std::string& why) {
  job.decision = Decision::kGrpc;
  job.reason = why;
  Log(LogLevel::kInfo, absl::StrCat("job '", LogSafe(job.id, 256),
                                    "': node rounds use the gRPC stream: ", why));
  const std::string text = absl::StrCat("grpc: ", why);
  for (int& fd : job.waiting) {
    if (fd < 0) continue;
    SendText(fd, text, {});
    if (auto c = conns_.find(fd); c != conns_.end()) c->second.answered = true;
    fd = -1;
  }
}

void ShmTransport::SendShmLocked(NodeJob& job, int fd, int32_t index) {
  job.segment->Revive(index);
  if (!SendText(fd, "shm", {job.segment->fd(), job.doorbell})) {
    CloseConnLocked(fd);
    return;
  }
  if (auto c = conns_.find(fd); c != conns_.end()) c->second.answered = true;
}

void ShmTransport::MaybeDecideLocked(NodeJob& job, Clock::time_point now) {
  if (job.decision != Decision::kPending) return;
  std::vector<std::string> missing;
  for (int32_t i = 0; i < job.ranks; ++i) {
    if (job.waiting[size_t(i)] < 0) missing.push_back(absl::StrCat(i));
  }
  if (!missing.empty()) {
    if (now >= job.deadline) {
      DecideGrpcLocked(job, absl::StrCat("local rank(s) ", absl::StrJoin(missing, ", "),
                                         " did not present their session on ", options_.socket,
                                         " within --shm-wait-ms=", options_.wait.count(),
                                         " (not started, or no access to the socket)"));
    }
    return;
  }
  auto g = shm::Geometry::Make(job.ranks, options_.ring, options_.max_channels);
  if (!g.ok()) {
    DecideGrpcLocked(job, std::string(g.status().message()));
    return;
  }
  const auto& budget = registry_->budget();
  if (budget && !budget->TryCharge(int64_t(g->total_bytes))) {
    DecideGrpcLocked(job, absl::StrCat("the segment's ", g->total_bytes, " bytes do not fit in "
                                       "the aggregator's memory budget (--memory-budget-bytes)"));
    return;
  }
  auto seg = shm::Segment::Create(*g, options_.has_parent);
  const int bell = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = bell;
  std::string failed;
  if (!seg.ok()) {
    failed = std::string(seg.status().message());
  } else if (bell < 0) {
    failed = absl::StrCat("eventfd: ", std::strerror(errno));
  } else if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, bell, &ev) != 0) {
    failed = absl::StrCat("epoll_ctl of the doorbell: ", std::strerror(errno));
  }
  if (!failed.empty()) {
    if (budget) budget->Release(int64_t(g->total_bytes));
    if (bell >= 0) close(bell);
    DecideGrpcLocked(job, failed);
    return;
  }
  job.charged = int64_t(g->total_bytes);
  job.segment = std::move(*seg);
  job.doorbell = bell;
  doorbells_[bell] = job.id;
  job.decision = Decision::kShm;
  Log(LogLevel::kInfo, absl::StrCat("job '", LogSafe(job.id, 256), "': node rounds use shared "
                                    "memory (", job.ranks, " local ranks, segment of ",
                                    g->total_bytes, " bytes, rounds of up to ",
                                    g->max_channels, " channels)"));
  for (int32_t i = 0; i < job.ranks; ++i) {
    const int fd = job.waiting[size_t(i)];
    job.waiting[size_t(i)] = -1;
    SendShmLocked(job, fd, i);
  }
}

void ShmTransport::CloseConnLocked(int fd) {
  (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);  // close() drops it from the set anyway
  close(fd);
  conns_.erase(fd);
  for (auto& [id, job] : jobs_) {
    for (int& w : job.waiting) {
      if (w == fd) w = -1;
    }
  }
}

void ShmTransport::ReleaseLocked(NodeJob& job, const std::string& why) {
  HarvestLocked(job);
  for (int& fd : job.waiting) {
    if (fd >= 0) CloseConnLocked(fd);
  }
  if (job.doorbell >= 0) {
    (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, job.doorbell, nullptr);  // closed next
    doorbells_.erase(job.doorbell);
    close(job.doorbell);
    job.doorbell = -1;
  }
  if (job.segment && job.segment->header()->dead == 0) {
    job.segment->Kill(why);
  }
  job.segment.reset();
  if (job.charged > 0 && registry_->budget()) registry_->budget()->Release(job.charged);
  job.charged = 0;
}

void ShmTransport::Loop() {
  pthread_setname_np(pthread_self(), "hsbn-shm");  // top -H, perf, gdb
  epoll_event events[64];
  for (;;) {
    const int n = epoll_wait(epoll_fd_, events, 64, 100);
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
    }
    for (int k = 0; k < n; ++k) {
      const int fd = events[k].data.fd;
      if (fd == wake_fd_) continue;
      if (fd == listen_fd_) {
        Accept();
        continue;
      }
      std::string bell_job;
      {
        absl::MutexLock lock(&mu_);
        if (auto b = doorbells_.find(fd); b != doorbells_.end()) bell_job = b->second;
      }
      if (!bell_job.empty()) {
        Doorbell(bell_job, fd);
      } else {
        Hello(fd);
      }
    }
    Tick();
  }
}

void ShmTransport::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    absl::MutexLock lock(&mu_);
    if (conns_.size() >= kMaxConns) {
      close(fd);
      continue;
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {  // never watched: never served
      close(fd);
      continue;
    }
    conns_[fd] = HandoffConn{fd, Clock::now(), false};
  }
}

void ShmTransport::Hello(int fd) {
  bool answered;
  {
    absl::MutexLock lock(&mu_);
    auto c = conns_.find(fd);
    if (c == conns_.end()) return;
    answered = c->second.answered;
  }
  char buf[shm::kMaxHelloBytes];
  const ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  if (answered || got <= 0) {
    // After the answer the connection only tells the worker that this sidecar lives; any
    // event on it is its end (or bytes it had no reason to send).
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    absl::MutexLock lock(&mu_);
    CloseConnLocked(fd);
    return;
  }
  auto refuse = [&](const std::string& why) {
    SendText(fd, absl::StrCat("error: ", why), {});
    absl::MutexLock lock(&mu_);
    CloseConnLocked(fd);
  };
  SessionId session;
  constexpr size_t kHead = sizeof(shm::kHelloMagic) + shm::kSessionBytes;
  if (size_t(got) < kHead || std::memcmp(buf, shm::kHelloMagic, sizeof(shm::kHelloMagic)) != 0 ||
      !SessionId::FromBytes(absl::string_view(buf + sizeof(shm::kHelloMagic), shm::kSessionBytes),
                            &session)) {
    refuse("malformed hello (expected the hsbn shared-memory hello with a 16-byte session)");
    return;
  }
  const std::string token(buf + kHead, size_t(got) - kHead);
  auto ref = registry_->Authorize(session, token);
  if (!ref.ok()) {
    refuse(std::string(ref.status().message()));
    return;
  }
  const std::string job_id = ref->job->id();
  const int32_t index = ref->index;
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || index < 0 || index >= it->second.ranks) {
    SendText(fd, "grpc: the sidecar has no shared-memory state for this job", {});
    if (auto c = conns_.find(fd); c != conns_.end()) c->second.answered = true;
    return;
  }
  NodeJob& job = it->second;
  switch (job.decision) {
    case Decision::kShm:
      SendShmLocked(job, fd, index);
      return;
    case Decision::kGrpc:
      SendText(fd, absl::StrCat("grpc: ", job.reason), {});
      if (auto c = conns_.find(fd); c != conns_.end()) c->second.answered = true;
      return;
    case Decision::kPending:
      break;
  }
  if (int old = job.waiting[size_t(index)]; old >= 0 && old != fd) CloseConnLocked(old);
  job.waiting[size_t(index)] = fd;
  MaybeDecideLocked(job, Clock::now());
}

void ShmTransport::Doorbell(const std::string& job_id, int fd) {
  uint64_t rings;
  ssize_t ignored = read(fd, &rings, sizeof rings);
  (void)ignored;
  std::shared_ptr<shm::Segment> seg;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || !it->second.segment) return;
    seg = it->second.segment;
  }
  int malformed = 0;
  std::vector<shm::QueueEntry> items = seg->TakeQueue(&malformed);
  // A lagged backward partial must reach the parent after its forward partial (the parent
  // refuses a backward without its forward), but the queue's entries are taken in slot order.
  // The forward entry was published before the backward one (its node answer came first), so
  // a second look finds it if the first missed it; backward partials go up last.
  auto lagged_backward = [](const shm::QueueEntry& item) {
    return item.kind == shm::kPartial && item.scope == v1::SCOPE_LAGGED &&
           item.key.phase == v1::PHASE_BACKWARD;
  };
  if (std::any_of(items.begin(), items.end(), lagged_backward)) {
    std::vector<shm::QueueEntry> more = seg->TakeQueue(&malformed);
    items.insert(items.end(), std::make_move_iterator(more.begin()),
                 std::make_move_iterator(more.end()));
    std::stable_partition(items.begin(), items.end(),
                          [&](const shm::QueueEntry& item) { return !lagged_backward(item); });
  }
  if (malformed > 0) {
    LogLimited(LogLevel::kWarn, LogKind::kInvalidFrame,
               absl::StrCat("job '", LogSafe(job_id, 256), "': ", malformed,
                            " malformed entries in the shared-memory queue were dropped"));
  }
  if (items.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    for (const shm::QueueEntry& item : items) {
      if (item.kind == shm::kPartial && item.scope == v1::SCOPE_GLOBAL) {
        it->second.forwarded[{item.key.op, item.key.seq, item.key.phase}] =
            Forwarded{item.channels, Clock::now()};
      }
    }
  }
  std::shared_ptr<Job> job = registry_->FindJob(job_id);
  if (!job) return;
  // One item at a time, in the queue's order (Execute sends forwards before aborts).
  for (const shm::QueueEntry& item : items) {
    const RoundKey key{item.key.op, item.key.seq, v1::Phase(item.key.phase)};
    Actions actions;
    if (item.kind == shm::kPartial) {
      // A renorm or lagged round's node answer is in the segment already; its global result
      // comes back through the job, to every worker's stream.
      if (item.scope == v1::SCOPE_RENORM || item.scope == v1::SCOPE_LAGGED) {
        job->ExpectLate(key, uint32_t(item.channels), Clock::now());
      }
      auto data = std::make_shared<std::string>();
      wire::PackPayload(item.data.data(), item.data.data() + item.channels, item.channels,
                        data.get());
      actions.forwards.push_back(Actions::Forward{key, v1::Scope(item.scope),
                                                  uint32_t(item.channels), item.count,
                                                  std::move(data), /*decide=*/nullptr});
    } else {
      actions.aborts.push_back(Actions::Abort{
          key, wire::StatusFromCode(item.code, item.message, static_cast<v1::Reason>(item.reason))});
    }
    host_->Execute(actions, job_id);
  }
}

void ShmTransport::HarvestMetrics() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, job] : jobs_) HarvestLocked(job);
}

void ShmTransport::HarvestLocked(NodeJob& job) {
  if (options_.metrics == nullptr || !job.segment) return;
  const shm::Header* h = job.segment->header();
  constexpr int kRounds = shm::kCountScopes * shm::kCountPhases * shm::kCountCodes;
  job.harvested.resize(size_t(kRounds + shm::kCountPhases), 0);
  // The counters are written by the job's workers: a value that went down (a hostile or buggy
  // write) is taken as the new base and adds nothing, and one step adds at most 2^32, so the
  // exported counters stay monotonic and finite whatever the segment holds.
  auto delta = [&](const uint64_t* word, size_t k) -> int64_t {
    const uint64_t now = __atomic_load_n(word, __ATOMIC_RELAXED);
    const uint64_t before = job.harvested[k];
    job.harvested[k] = now;
    if (now <= before) return 0;
    return int64_t(std::min<uint64_t>(now - before, uint64_t(1) << 32));
  };
  size_t k = 0;
  for (int s = 0; s < shm::kCountScopes; ++s) {
    for (int p = 0; p < shm::kCountPhases; ++p) {
      for (int c = 0; c < shm::kCountCodes; ++c, ++k) {
        if (const int64_t n = delta(&h->rounds[s][p][c], k); n > 0) {
          options_.metrics->RoundsFinished(v1::Scope(s), v1::Phase(p), absl::StatusCode(c), n);
        }
      }
    }
  }
  for (int p = 0; p < shm::kCountPhases; ++p, ++k) {
    if (const int64_t n = delta(&h->nonfinite[p], k); n > 0) {
      options_.metrics->NonFinite(v1::Phase(p), n);
    }
  }
}

void ShmTransport::Tick() {
  const Clock::time_point now = Clock::now();
  absl::MutexLock lock(&mu_);
  for (auto& [id, job] : jobs_) {
    HarvestLocked(job);
    MaybeDecideLocked(job, now);
    // The workers gave up on these long ago (their own deadline); forget them.
    for (auto f = job.forwarded.begin(); f != job.forwarded.end();) {
      if (now - f->second.at > 2 * options_.round_timeout + std::chrono::seconds(10)) {
        f = job.forwarded.erase(f);
      } else {
        ++f;
      }
    }
  }
  std::vector<int> stale;
  for (auto& [fd, conn] : conns_) {
    if (!conn.answered && now - conn.opened > kHelloTimeout) {
      bool waits = false;
      for (auto& [id, job] : jobs_) {
        for (int w : job.waiting) waits = waits || w == fd;
      }
      if (!waits) stale.push_back(fd);
    }
  }
  for (int fd : stale) CloseConnLocked(fd);
}

void ShmTransport::Refused(const std::string& job_id, const absl::Status& refusal) {
  std::shared_ptr<shm::Segment> seg;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    // Ranks that wait for the node's transport must not wait for --shm-wait-ms: the stream,
    // where the job's rounds fail with the refusal at once.
    if (it->second.decision == Decision::kPending) {
      DecideGrpcLocked(it->second, "a process joining the job was refused for its layout");
    }
    seg = it->second.segment;
  }
  if (seg) seg->Refuse(refusal);
}

void ShmTransport::MemberGone(const std::string& job_id, int32_t index, bool left,
                              const std::string& aborted) {
  std::shared_ptr<shm::Segment> seg;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    seg = it->second.segment;
  }
  if (seg && !aborted.empty()) {
    seg->MarkAborted(index, aborted);
  } else if (seg) {
    seg->MarkGone(index, left ? 2 : 1);
  }
}

void ShmTransport::JobDropped(const std::string& job_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  ReleaseLocked(it->second, why);
  jobs_.erase(it);
}

bool ShmTransport::ParentResult(const std::string& job_id, const v1::Result& result) {
  std::shared_ptr<shm::Segment> seg;
  int64_t channels = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || !it->second.segment) return false;
    auto f = it->second.forwarded.find({result.op(), result.seq(), int32_t(result.phase())});
    if (f == it->second.forwarded.end()) return false;
    channels = f->second.channels;
    it->second.forwarded.erase(f);
    seg = it->second.segment;
  }
  const shm::Key key{result.op(), result.seq(), int32_t(result.phase())};
  if (result.code() != 0) {
    seg->DeliverAll(key, result.code(), wire::Printable(result.message(), 1024), 0, 0, nullptr,
                    result.reason());
  } else if (int64_t(result.channels()) != channels ||
             int64_t(result.data().size()) != wire::PayloadBytes(channels) || result.count() < 0) {
    seg->DeliverAll(key, int32_t(absl::StatusCode::kInternal),
                    absl::StrCat("round ", wire::RoundName(key.op, key.seq, v1::Phase(key.phase)),
                                 " of job '", job_id, "': the root aggregator answered with a "
                                 "malformed result; check that the root runs the same hsbn "
                                 "version"),
                    0, 0, nullptr);
  } else {
    std::vector<double> d(2 * size_t(channels));
    std::memcpy(d.data(), result.data().data(), result.data().size());
    seg->DeliverAll(key, 0, "", result.count(), channels, d.data());
  }
  return true;
}

void ShmTransport::ParentLost(const absl::Status& status) {
  std::vector<std::pair<std::shared_ptr<shm::Segment>, shm::Key>> doomed;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : jobs_) {
      for (const auto& [k, f] : job.forwarded) {
        doomed.emplace_back(job.segment, shm::Key{std::get<0>(k), std::get<1>(k), std::get<2>(k)});
      }
      job.forwarded.clear();
    }
  }
  for (auto& [seg, key] : doomed) {
    if (seg) {
      seg->DeliverAll(key, int32_t(status.code()), std::string(status.message()), 0, 0, nullptr,
                      int32_t(wire::ReasonOf(status)));
    }
  }
}

void ShmTransport::AddCounts(const std::string& job_id, v1::JobStatus* status) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || !it->second.segment) return;
  // Written by the job's workers: shown, never trusted for anything else.
  const shm::Header* h = it->second.segment->header();
  const int64_t done = int64_t(__atomic_load_n(&h->completed, __ATOMIC_RELAXED) & (~0ull >> 2));
  const int64_t failed = int64_t(__atomic_load_n(&h->failed, __ATOMIC_RELAXED) & (~0ull >> 2));
  status->set_rounds_completed(status->rounds_completed() + done);
  status->set_rounds_failed(status->rounds_failed() + failed);
  for (v1::MemberStatus& m : *status->mutable_members()) {
    if (m.index() < 0 || m.index() >= it->second.segment->geometry().ranks) continue;
    const uint64_t posts = __atomic_load_n(&h->posts[m.index()], __ATOMIC_RELAXED);
    m.set_contributions(m.contributions() + int64_t(posts & (~0ull >> 2)));
  }
}

std::string ShmTransport::Describe(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return "";
  switch (it->second.decision) {
    case Decision::kShm: return "shm";
    case Decision::kGrpc: return absl::StrCat("grpc: ", it->second.reason);
    case Decision::kPending: return "pending";
  }
  return "";
}

}  // namespace hsbn::server

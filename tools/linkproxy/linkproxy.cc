#include "linkproxy.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <tuple>

namespace hsbn::linkproxy {
namespace {

constexpr size_t kReadSize = 64 * 1024;
constexpr size_t kMaxControlLine = 4096;

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// Closes with an RST instead of a FIN: the peer sees "connection reset", as when a link or a
// middlebox drops the connection.
void CloseWithReset(int fd) {
  if (fd < 0) return;
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

bool Resolve(const std::string& hostport, bool passive, addrinfo** out, std::string* error) {
  std::string host, port;
  if (!SplitHostPort(hostport, &host, &port)) {
    *error = "'" + hostport + "' is not host:port";
    return false;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, out);
  if (rc != 0) {
    *error = "cannot resolve '" + hostport + "': " + gai_strerror(rc);
    return false;
  }
  return true;
}

std::vector<std::string> Words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> w;
  for (std::string s; in >> s;) w.push_back(s);
  return w;
}

// A non-negative decimal integer of at most 10 digits (no sign, no space) in [0, max].
bool ParseCount(const std::string& s, int64_t max, int64_t* out) {
  if (s.empty() || s.size() > 10) return false;
  for (char ch : s) {
    if (ch < '0' || ch > '9') return false;
  }
  const int64_t x = std::stoll(s);
  if (x > max) return false;
  *out = x;
  return true;
}

void AddHeld(DirectionStats& d, int64_t us) {
  d.held_min_us = d.held_min_us < 0 ? us : std::min(d.held_min_us, us);
  d.held_max_us = std::max(d.held_max_us, us);
  d.held_sum_us += us;
}

}  // namespace

int64_t DueUs(int64_t read_us, int64_t delay_us, int64_t previous_due_us) {
  return std::max(read_us + delay_us, previous_due_us);
}

int64_t WaitUs(int64_t now_us, int64_t wake_us, int timeout_ms) {
  int64_t wait = timeout_ms < 0 ? -1 : int64_t{timeout_ms} * 1000;
  if (wake_us >= 0) {
    const int64_t until_due = std::max<int64_t>(0, wake_us - now_us);
    wait = wait < 0 ? until_due : std::min(wait, until_due);
  }
  return wait;
}

const timespec* WaitTimespec(int64_t wait_us, timespec* ts) {
  if (wait_us < 0) return nullptr;
  ts->tv_sec = static_cast<time_t>(wait_us / 1000000);
  ts->tv_nsec = static_cast<long>(wait_us % 1000000) * 1000;
  return ts;
}

bool ParseFlags(const std::vector<std::string>& args, Flags* flags, std::string* error) {
  // For each direction, the last flag that set it in each unit: giving both units is an error.
  std::string up_ms, up_us, down_ms, down_us;
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      flags->help = true;
      return true;
    }
    const size_t eq = a.find('=');
    const std::string name = a.substr(0, eq);
    const std::string v = eq == std::string::npos ? "" : a.substr(eq + 1);
    const bool has_value = eq != std::string::npos;
    if (has_value && name == "--target") {
      flags->options.target = v;
    } else if (has_value && name == "--listen") {
      flags->options.listen = v;
    } else if (has_value && name == "--control") {
      flags->control = v;
    } else if (has_value && name == "--ready-file") {
      flags->ready = v;
    } else if (has_value && (name == "--delay-ms" || name == "--delay-up-ms" ||
                             name == "--delay-down-ms" || name == "--delay-us" ||
                             name == "--delay-up-us" || name == "--delay-down-us")) {
      const bool us = name.compare(name.size() - 3, 3, "-us") == 0;
      const int64_t max = us ? kMaxDelayUs : kMaxDelayMs;
      int64_t x = 0;
      if (!ParseCount(v, max, &x)) {
        *error = name + " must be an integer in [0, " + std::to_string(max) + "], got '" + v + "'";
        return false;
      }
      const int64_t x_us = us ? x : x * 1000;
      const bool up = name.find("-down-") == std::string::npos;
      const bool down = name.find("-up-") == std::string::npos;
      if (up) {
        flags->options.delay_up_us = x_us;
        (us ? up_us : up_ms) = name;
      }
      if (down) {
        flags->options.delay_down_us = x_us;
        (us ? down_us : down_ms) = name;
      }
    } else {
      *error = "unknown argument '" + a + "'";
      return false;
    }
  }
  for (const auto& [dir, ms, us] : {std::make_tuple("up", &up_ms, &up_us),
                                    std::make_tuple("down", &down_ms, &down_us)}) {
    if (!ms->empty() && !us->empty()) {
      *error = *ms + " and " + *us + " both set the " + dir +
               " delay; give each direction in one unit";
      return false;
    }
  }
  if (flags->options.target.empty()) {
    *error = "--target is required";
    return false;
  }
  return true;
}

bool SplitHostPort(const std::string& s, std::string* host, std::string* port) {
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 == s.size()) return false;
  *host = s.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = s.substr(colon + 1);
  for (char ch : *port) {
    if (ch < '0' || ch > '9') return false;
  }
  return port->size() <= 5;
}

struct LinkProxy::Chunk {
  int64_t read_us;  // steady_clock
  int64_t due_us;   // DueUs(): when it may be written on
  std::string data;
  size_t off = 0;
  bool started = false;
};

struct LinkProxy::Direction {
  std::deque<Chunk> q;
  int64_t queued = 0;
  int64_t last_due_us = 0;  // chunks leave in the order they came, whatever the delay
  bool eof = false;         // the source sent FIN
  bool shut = false;        // the FIN was passed on
};

struct LinkProxy::Conn {
  int client = -1;
  int server = -1;
  bool connecting = true;
  bool dead = false;
  Direction up, down;
};

struct LinkProxy::Control {
  Control(int in, int out, bool own) : in_fd(in), out_fd(out), owned(own) {}
  int in_fd;
  int out_fd;
  bool owned;  // an accepted socket: closed on EOF
  bool closed = false;
  std::string buf;
};

LinkProxy::LinkProxy(const Options& options) : options_(options) {}

std::unique_ptr<LinkProxy> LinkProxy::Create(const Options& options, std::string* error) {
  if (options.target.empty()) {
    *error = "--target is required";
    return nullptr;
  }
  std::string host, port;
  if (!SplitHostPort(options.target, &host, &port)) {
    *error = "--target '" + options.target + "' is not host:port";
    return nullptr;
  }
  if (options.delay_up_us < 0 || options.delay_down_us < 0 ||
      options.delay_up_us > kMaxDelayUs || options.delay_down_us > kMaxDelayUs) {
    *error = "delays must be within [0, " + std::to_string(kMaxDelayUs) + "] us";
    return nullptr;
  }
  std::unique_ptr<LinkProxy> p(new LinkProxy(options));
  p->stats_.delay_up_us = options.delay_up_us;
  p->stats_.delay_down_us = options.delay_down_us;
  addrinfo* ai = nullptr;
  if (!Resolve(options.listen, true, &ai, error)) return nullptr;
  for (addrinfo* a = ai; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
      p->listen_fd_ = fd;
      break;
    }
    close(fd);
  }
  freeaddrinfo(ai);
  if (p->listen_fd_ < 0) {
    *error = "cannot listen on '" + options.listen + "': " + std::strerror(errno);
    return nullptr;
  }
  SetNonBlocking(p->listen_fd_);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(p->listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  char hbuf[NI_MAXHOST], sbuf[NI_MAXSERV];
  getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, hbuf, sizeof(hbuf), sbuf, sizeof(sbuf),
              NI_NUMERICHOST | NI_NUMERICSERV);
  p->bound_ = ss.ss_family == AF_INET6 ? std::string("[") + hbuf + "]:" + sbuf
                                       : std::string(hbuf) + ":" + sbuf;
  return p;
}

LinkProxy::~LinkProxy() {
  for (auto& c : conns_) CloseConn(*c);
  for (auto& ctl : controls_) {
    if (ctl->owned && !ctl->closed) close(ctl->in_fd);
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (control_listen_fd_ >= 0) {
    close(control_listen_fd_);
    unlink(control_path_.c_str());
  }
}

std::string LinkProxy::address() const { return bound_; }

void LinkProxy::AddControlFd(int in_fd, int out_fd) {
  controls_.push_back(std::make_unique<Control>(in_fd, out_fd, false));
}

bool LinkProxy::AddControlSocket(const std::string& path, std::string* error) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    *error = "control socket path too long: " + path;
    return false;
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  unlink(path.c_str());
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 16) != 0) {
    *error = "cannot listen on control socket " + path + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return false;
  }
  SetNonBlocking(fd);
  control_listen_fd_ = fd;
  control_path_ = path;
  return true;
}

const char* LinkProxy::Help() {
  return "commands (one per line; each is answered with one line, \"ok ...\" or \"error ...\"):\n"
         "  forward | resume   forward normally (the start state)\n"
         "  drop               reset (RST) every open connection, and reset every new one until\n"
         "                     resume: the link is cut\n"
         "  reset              reset every open connection once; new ones are forwarded\n"
         "  stall              stop reading and writing every connection (and accepting new\n"
         "                     ones), keeping them open, until resume: the link is a black hole\n"
         "  delay UP [DOWN]    hold every chunk UP ms in the up direction (client -> target)\n"
         "                     and DOWN ms (default UP) in the down direction before writing it\n"
         "                     on; each chunk is timestamped when read, so the delay adds\n"
         "                     latency without serializing throughput; order is kept\n"
         "  delay-us UP [DOWN] the same in microseconds (the wait is sub-millisecond: 100 is\n"
         "                     ~100 us, not rounded to a millisecond)\n"
         "  stats              mode, connection counts, the delays (delay_up_ms/delay_down_ms\n"
         "                     rounded down to whole ms; delay_up_us/delay_down_us exact) and\n"
         "                     per-direction traffic: bytes, chunks, and the min/max/sum of\n"
         "                     how long chunks were held (us)\n"
         "  stats-reset        zero the traffic counters (bytes, chunks, held)\n"
         "  quit               close everything and exit\n";
}

std::string LinkProxy::FormatStats(const Stats& s) {
  std::ostringstream o;
  o << "mode=" << s.mode << " open=" << s.open << " accepted=" << s.accepted
    << " refused=" << s.refused << " reset=" << s.reset
    << " delay_up_ms=" << s.delay_up_us / 1000 << " delay_down_ms=" << s.delay_down_us / 1000
    << " delay_up_us=" << s.delay_up_us << " delay_down_us=" << s.delay_down_us;
  for (const auto& [name, d] : {std::make_pair("up", &s.up), std::make_pair("down", &s.down)}) {
    o << " " << name << "_bytes=" << d->bytes << " " << name << "_chunks=" << d->chunks << " "
      << name << "_held_min_us=" << d->held_min_us << " " << name
      << "_held_max_us=" << d->held_max_us << " " << name << "_held_sum_us=" << d->held_sum_us;
  }
  return o.str();
}

Stats LinkProxy::GetStats() const {
  Stats s = stats_;
  s.mode = mode_;
  s.open = 0;
  for (const auto& c : conns_) s.open += c->dead ? 0 : 1;
  return s;
}

std::string LinkProxy::Command(const std::string& line) {
  const std::vector<std::string> w = Words(line);
  if (w.empty()) return "error empty command";
  const std::string& cmd = w[0];
  if ((cmd == "forward" || cmd == "resume") && w.size() == 1) {
    mode_ = "forward";
    return "ok forward";
  }
  if ((cmd == "drop" || cmd == "reset") && w.size() == 1) {
    int n = 0;
    for (auto& c : conns_) {
      if (!c->dead) {
        ResetConn(*c);
        ++n;
      }
    }
    stats_.reset += n;
    if (cmd == "drop") mode_ = "drop";
    return "ok " + cmd + " reset=" + std::to_string(n);
  }
  if (cmd == "stall" && w.size() == 1) {
    mode_ = "stall";
    return "ok stall";
  }
  if ((cmd == "delay" || cmd == "delay-us") && (w.size() == 2 || w.size() == 3)) {
    const bool us = cmd == "delay-us";
    const int64_t max = us ? kMaxDelayUs : kMaxDelayMs;
    int64_t up = 0, down = 0;
    if (!ParseCount(w[1], max, &up) || !ParseCount(w.back(), max, &down)) {
      return "error " + cmd + " takes one or two integers of " +
             (us ? "microseconds" : "milliseconds") + " in [0, " + std::to_string(max) + "]";
    }
    const int64_t scale = us ? 1 : 1000;
    stats_.delay_up_us = up * scale;
    stats_.delay_down_us = down * scale;
    return "ok " + cmd + " up=" + std::to_string(up) + " down=" + std::to_string(down);
  }
  if (cmd == "stats" && w.size() == 1) return "ok " + FormatStats(GetStats());
  if (cmd == "stats-reset" && w.size() == 1) {
    stats_.up = DirectionStats();
    stats_.down = DirectionStats();
    return "ok stats-reset";
  }
  if (cmd == "quit" && w.size() == 1) {
    quit_ = true;
    return "ok quit";
  }
  if (cmd == "help") return "ok see --help";
  return "error unknown command or arguments: '" + line.substr(0, 100) +
         "' (forward, resume, drop, reset, stall, delay UP [DOWN], delay-us UP [DOWN], stats, "
         "stats-reset, quit)";
}

void LinkProxy::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    if (mode_ == "drop") {
      CloseWithReset(fd);
      ++stats_.refused;
      continue;
    }
    StartConnect(fd);
  }
}

void LinkProxy::StartConnect(int client_fd) {
  addrinfo* ai = nullptr;
  std::string error;
  if (!Resolve(options_.target, false, &ai, &error)) {
    CloseWithReset(client_fd);
    ++stats_.refused;
    return;
  }
  int fd = -1;
  for (addrinfo* a = ai; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(ai);
  if (fd < 0) {
    CloseWithReset(client_fd);
    ++stats_.refused;
    return;
  }
  const int one = 1;
  setsockopt(client_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto c = std::make_unique<Conn>();
  c->client = client_fd;
  c->server = fd;
  conns_.push_back(std::move(c));
  ++stats_.accepted;
}

void LinkProxy::ResetConn(Conn& c) {
  if (c.dead) return;
  CloseWithReset(c.client);
  CloseWithReset(c.server);
  c.client = c.server = -1;
  c.dead = true;
}

void LinkProxy::CloseConn(Conn& c) {
  if (c.dead) return;
  close(c.client);
  close(c.server);
  c.client = c.server = -1;
  c.dead = true;
}

void LinkProxy::ReadInto(Conn& c, bool up) {
  Direction& d = up ? c.up : c.down;
  const int src = up ? c.client : c.server;
  if (d.eof || c.dead) return;
  Chunk ch;
  ch.data.resize(kReadSize);
  const ssize_t n = recv(src, ch.data.data(), ch.data.size(), 0);
  if (n < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ResetConn(c);
    return;
  }
  if (n == 0) {
    d.eof = true;
    return;
  }
  ch.data.resize(static_cast<size_t>(n));
  ch.read_us = NowUs();
  ch.due_us = DueUs(ch.read_us, up ? stats_.delay_up_us : stats_.delay_down_us, d.last_due_us);
  d.last_due_us = ch.due_us;
  d.queued += n;
  d.q.push_back(std::move(ch));
}

void LinkProxy::WriteFrom(Conn& c, bool up) {
  Direction& d = up ? c.up : c.down;
  DirectionStats& st = up ? stats_.up : stats_.down;
  const int dst = up ? c.server : c.client;
  while (!c.dead && !d.q.empty()) {
    Chunk& ch = d.q.front();
    const int64_t now = NowUs();
    if (ch.due_us > now) return;
    if (!ch.started) {
      ch.started = true;
      AddHeld(st, now - ch.read_us);
    }
    const ssize_t n = send(dst, ch.data.data() + ch.off, ch.data.size() - ch.off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ResetConn(c);
      return;
    }
    ch.off += static_cast<size_t>(n);
    st.bytes += n;
    d.queued -= n;
    if (ch.off < ch.data.size()) return;
    ++st.chunks;
    d.q.pop_front();
  }
}

void LinkProxy::FinishDirections(Conn& c) {
  if (c.dead || c.connecting) return;
  for (bool up : {true, false}) {
    Direction& d = up ? c.up : c.down;
    if (d.eof && d.q.empty() && !d.shut) {
      shutdown(up ? c.server : c.client, SHUT_WR);
      d.shut = true;
    }
  }
  if (c.up.shut && c.down.shut) CloseConn(c);
}

void LinkProxy::ServeControl(Control& ctl) {
  char buf[1024];
  const ssize_t n = read(ctl.in_fd, buf, sizeof(buf));
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) {
    ctl.closed = true;
    if (ctl.owned) {
      close(ctl.in_fd);
    } else {
      quit_ = true;  // stdin closed: whoever started us is gone
    }
    return;
  }
  ctl.buf.append(buf, static_cast<size_t>(n));
  size_t nl;
  while ((nl = ctl.buf.find('\n')) != std::string::npos) {
    std::string line = ctl.buf.substr(0, nl);
    ctl.buf.erase(0, nl + 1);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::string answer = Command(line) + "\n";
    // Answers are short; a controller that does not read them loses them, never blocks us.
    (void)!write(ctl.out_fd, answer.data(), answer.size());
  }
  if (ctl.buf.size() > kMaxControlLine) {
    const std::string answer = "error command line too long\n";
    (void)!write(ctl.out_fd, answer.data(), answer.size());
    ctl.buf.clear();
  }
}

bool LinkProxy::Step(int timeout_ms) {
  if (quit_) return false;
  enum Kind { kListen, kControlListen, kControl, kClient, kServer };
  std::vector<pollfd> fds;
  std::vector<std::pair<Kind, size_t>> tags;
  const bool stalled = mode_ == "stall";
  if (!stalled) {
    fds.push_back({listen_fd_, POLLIN, 0});
    tags.push_back({kListen, 0});
  }
  if (control_listen_fd_ >= 0) {
    fds.push_back({control_listen_fd_, POLLIN, 0});
    tags.push_back({kControlListen, 0});
  }
  for (size_t i = 0; i < controls_.size(); ++i) {
    if (controls_[i]->closed) continue;
    fds.push_back({controls_[i]->in_fd, POLLIN, 0});
    tags.push_back({kControl, i});
  }
  const int64_t now = NowUs();
  int64_t wake_us = -1;  // when the earliest held chunk is due
  auto want_write = [&](const Direction& d) {
    if (d.q.empty()) return false;
    const int64_t due = d.q.front().due_us;
    if (due <= now) return true;
    wake_us = wake_us < 0 ? due : std::min(wake_us, due);
    return false;
  };
  if (!stalled) {
    for (size_t i = 0; i < conns_.size(); ++i) {
      Conn& c = *conns_[i];
      if (c.dead) continue;
      if (c.connecting) {
        fds.push_back({c.server, POLLOUT, 0});
        tags.push_back({kServer, i});
        continue;
      }
      short ce = 0, se = 0;
      if (!c.up.eof && c.up.queued < options_.max_queued_bytes) ce |= POLLIN;
      if (!c.down.eof && c.down.queued < options_.max_queued_bytes) se |= POLLIN;
      if (want_write(c.down)) ce |= POLLOUT;
      if (want_write(c.up)) se |= POLLOUT;
      fds.push_back({c.client, ce, 0});
      tags.push_back({kClient, i});
      fds.push_back({c.server, se, 0});
      tags.push_back({kServer, i});
    }
  }
  // ppoll, not poll: its timeout is a timespec, so the loop wakes when a chunk is due to the
  // microsecond (poll's whole milliseconds would hold a 100 us delay up to 1 ms).
  timespec ts{};
  const int rc =
      ppoll(fds.data(), fds.size(), WaitTimespec(WaitUs(now, wake_us, timeout_ms), &ts), nullptr);
  if (rc < 0 && errno != EINTR) return false;
  for (size_t k = 0; rc > 0 && k < fds.size(); ++k) {
    const short ev = fds[k].revents;
    if (ev == 0) continue;
    const auto [kind, i] = tags[k];
    switch (kind) {
      case kListen:
        Accept();
        break;
      case kControlListen: {
        const int fd = accept4(control_listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) controls_.push_back(std::make_unique<Control>(fd, fd, true));
        break;
      }
      case kControl:
        ServeControl(*controls_[i]);
        break;
      case kClient:
      case kServer: {
        Conn& c = *conns_[i];
        if (c.dead) break;
        if (kind == kServer && c.connecting) {
          int err = 0;
          socklen_t len = sizeof(err);
          getsockopt(c.server, SOL_SOCKET, SO_ERROR, &err, &len);
          if (err != 0) {
            ResetConn(c);
            ++stats_.refused;
            --stats_.accepted;
          } else {
            c.connecting = false;
          }
          break;
        }
        // POLLERR, or a hang-up on a side that already sent its FIN: that peer is gone, and
        // what is queued for it cannot be delivered (polling on would spin).
        if ((ev & POLLERR) || ((ev & POLLHUP) && (kind == kClient ? c.up.eof : c.down.eof))) {
          ResetConn(c);
          break;
        }
        if (ev & (POLLIN | POLLHUP)) ReadInto(c, kind == kClient);
        break;
      }
    }
  }
  if (!stalled) {
    for (auto& c : conns_) {
      if (c->dead || c->connecting) continue;
      WriteFrom(*c, true);
      WriteFrom(*c, false);
      FinishDirections(*c);
    }
  }
  conns_.erase(std::remove_if(conns_.begin(), conns_.end(),
                              [](const std::unique_ptr<Conn>& c) { return c->dead; }),
               conns_.end());
  controls_.erase(std::remove_if(controls_.begin(), controls_.end(),
                                 [](const std::unique_ptr<Control>& c) { return c->closed && c->owned; }),
                  controls_.end());
  return !quit_;
}

void LinkProxy::Run() {
  while (Step(-1)) {
  }
}

}  // namespace hsbn::linkproxy

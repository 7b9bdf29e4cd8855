// raw_star — the floor a transport can reach: blocking sockets, no framing library, no threads.
//
// One server process accepts --workers connections (Unix or TCP), and per round reads one frame
// from every worker in rank order, sums them element-wise, and writes the sum back to each. With
// one worker this is the classic ping-pong; with N it is the same star shape as a sidecar
// (gather, reduce, fan out) with nothing else in the way. Frames: uint32 byte length, payload.
//
//   raw_star --role=server --listen=unix:PATH|tcp:HOST:PORT --workers=N --ready-file=F
//   raw_star --role=worker --connect=ADDR --rank=R <plan flags, see bench_common.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"

namespace hsbn_bench {
namespace {

bool ReadFull(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void WriteFull(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t r = ::write(fd, p, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      Die(std::string("write: ") + std::strerror(errno));
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void NoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Listens on `addr` and returns the socket; `*bound` is the address clients should dial.
int Listen(const std::string& addr, std::string* bound) {
  if (addr.rfind("unix:", 0) == 0) {
    std::string path = addr.substr(5);
    ::unlink(path.c_str());
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path.c_str());
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) Die("bind " + addr);
    ::listen(fd, 64);
    *bound = addr;
    return fd;
  }
  if (addr.rfind("tcp:", 0) != 0) Die("address must be unix:PATH or tcp:HOST:PORT");
  std::string hp = addr.substr(4);
  auto colon = hp.rfind(':');
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::atoi(hp.substr(colon + 1).c_str())));
  ::inet_pton(AF_INET, hp.substr(0, colon).c_str(), &sa.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) Die("bind " + addr);
  ::listen(fd, 64);
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  *bound = "tcp:" + hp.substr(0, colon) + ":" + std::to_string(ntohs(sa.sin_port));
  return fd;
}

int Connect(const std::string& addr) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    int fd = -1;
    int rc = -1;
    if (addr.rfind("unix:", 0) == 0) {
      fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un sa{};
      sa.sun_family = AF_UNIX;
      std::snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", addr.substr(5).c_str());
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    } else {
      std::string hp = addr.substr(4);
      auto colon = hp.rfind(':');
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(static_cast<uint16_t>(std::atoi(hp.substr(colon + 1).c_str())));
      ::inet_pton(AF_INET, hp.substr(0, colon).c_str(), &sa.sin_addr);
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
      if (rc == 0) NoDelay(fd);
    }
    if (rc == 0) return fd;
    ::close(fd);
    ::usleep(50 * 1000);
  }
  Die("cannot connect to " + addr);
}

int Server(const Args& args) {
  const int n = static_cast<int>(args.Int("workers", 1));
  std::string bound;
  int lfd = Listen(args.Str("listen", "unix:/tmp/hsbn-bench-raw.sock"), &bound);
  if (args.Has("ready-file")) {
    std::string tmp = args.Str("ready-file") + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    std::fprintf(f, "%s\n", bound.c_str());
    std::fclose(f);
    std::rename(tmp.c_str(), args.Str("ready-file").c_str());
  }
  std::vector<int> conns(n, -1);
  for (int i = 0; i < n; ++i) {
    int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) Die("accept");
    if (bound.rfind("tcp:", 0) == 0) NoDelay(fd);
    int32_t rank = -1;
    if (!ReadFull(fd, &rank, sizeof(rank)) || rank < 0 || rank >= n || conns[rank] != -1) {
      Die("bad hello");
    }
    conns[rank] = fd;
  }
  std::vector<double> acc, buf;
  for (;;) {
    uint32_t len = 0;
    for (int r = 0; r < n; ++r) {
      uint32_t l = 0;
      if (!ReadFull(conns[r], &l, sizeof(l))) return 0;  // a worker finished: done
      if (r == 0) {
        len = l;
        acc.resize(len / sizeof(double));
        if (!ReadFull(conns[r], acc.data(), len)) return 0;
      } else {
        if (l != len) Die("frame size mismatch");
        buf.resize(len / sizeof(double));
        if (!ReadFull(conns[r], buf.data(), len)) return 0;
        SumInto(acc.data(), buf.data(), acc.size());
      }
    }
    // Header and payload in one writev: two writes would wake the reader twice.
    for (int r = 0; r < n; ++r) {
      iovec iov[2] = {{&len, sizeof(len)}, {acc.data(), len}};
      ssize_t w = ::writev(conns[r], iov, 2);
      if (w < 0) Die(std::string("writev: ") + std::strerror(errno));
      if (static_cast<size_t>(w) < sizeof(len) + len) {
        // Short write (a full socket buffer): finish it plainly.
        std::vector<char> all(sizeof(len) + len);
        std::memcpy(all.data(), &len, sizeof(len));
        std::memcpy(all.data() + sizeof(len), acc.data(), len);
        WriteFull(conns[r], all.data() + w, all.size() - static_cast<size_t>(w));
      }
    }
  }
}

int Worker(const Args& args) {
  const int rank = static_cast<int>(args.Int("rank", 0));
  Plan plan = Plan::FromArgs(args);
  int fd = Connect(args.Str("connect"));
  int32_t r32 = rank;
  WriteFull(fd, &r32, sizeof(r32));
  std::vector<char> frame;
  RunPlan(plan, rank, [&](int channels, Phase, Scope, const double* in, double* out, uint32_t,
                          uint64_t) {
    const uint32_t len = static_cast<uint32_t>((2 * channels + 1) * sizeof(double));
    frame.resize(sizeof(len) + len);
    std::memcpy(frame.data(), &len, sizeof(len));
    std::memcpy(frame.data() + sizeof(len), in, len);
    WriteFull(fd, frame.data(), frame.size());  // one syscall per frame, as a real client would
    uint32_t back = 0;
    if (!ReadFull(fd, &back, sizeof(back)) || back != len || !ReadFull(fd, out, len)) {
      Die("server closed the connection");
    }
  });
  ::close(fd);
  return 0;
}

}  // namespace
}  // namespace hsbn_bench

int main(int argc, char** argv) {
  hsbn_bench::Args args(argc, argv);
  return args.Str("role") == "server" ? hsbn_bench::Server(args) : hsbn_bench::Worker(args);
}

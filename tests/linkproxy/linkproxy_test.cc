// LinkProxy with real sockets: a proxy loop on its own thread, driven through its control
// socket as hsbn-linkproxy is; a target listener and clients on loopback. Every wait is a
// blocking socket call (an event) with a 30 s receive timeout as a backstop against a hang.
#include "linkproxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace hsbn::linkproxy {
namespace {

void Backstop(int fd) {
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// A listening TCP socket on 127.0.0.1, any port.
int Listen(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(listen(fd, 16), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  Backstop(fd);
  return fd;
}

int Connect(const std::string& hostport) {
  std::string host, port;
  EXPECT_TRUE(SplitHostPort(hostport, &host, &port)) << hostport;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::atoi(port.c_str())));
  inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
  Backstop(fd);
  return fd;
}

int Accept(int listener) {
  const int fd = accept(listener, nullptr, nullptr);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  Backstop(fd);
  return fd;
}

void SendAll(int fd, const std::string& s) {
  ASSERT_EQ(send(fd, s.data(), s.size(), MSG_NOSIGNAL), static_cast<ssize_t>(s.size()));
}

// Reads exactly n bytes (or less at EOF/error).
std::string RecvN(int fd, size_t n) {
  std::string out;
  char buf[4096];
  while (out.size() < n) {
    const ssize_t r = recv(fd, buf, std::min(sizeof(buf), n - out.size()), 0);
    if (r <= 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

// What a recv returns once the connection is over: 0 (FIN) or -errno.
int RecvEnd(int fd) {
  char c;
  const ssize_t r = recv(fd, &c, 1, 0);
  return r < 0 ? -errno : static_cast<int>(r);
}

// A LinkProxy to `target_port` running on its own thread, controlled through its socket.
class ProxyFixture {
 public:
  explicit ProxyFixture(int target_port, int64_t delay_ms = 0) {
    std::string tmpl = std::filesystem::temp_directory_path() / "hsbn-linkproxy-test-XXXXXX";
    dir_ = mkdtemp(tmpl.data());
    Options o;
    o.target = "127.0.0.1:" + std::to_string(target_port);
    o.delay_up_us = o.delay_down_us = delay_ms * 1000;
    std::string error;
    proxy_ = LinkProxy::Create(o, &error);
    EXPECT_TRUE(proxy_) << error;
    EXPECT_TRUE(proxy_->AddControlSocket(dir_ + "/control", &error)) << error;
    thread_ = std::thread([this] { proxy_->Run(); });
    control_ = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, (dir_ + "/control").c_str());
    EXPECT_EQ(connect(control_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    Backstop(control_);
  }
  ~ProxyFixture() {
    Command("quit");
    thread_.join();
    close(control_);
    proxy_.reset();
    rmdir(dir_.c_str());
  }
  std::string address() const { return proxy_->address(); }

  // Sends a command and waits for its answer line.
  std::string Command(const std::string& line) {
    const std::string l = line + "\n";
    EXPECT_EQ(send(control_, l.data(), l.size(), MSG_NOSIGNAL), static_cast<ssize_t>(l.size()));
    std::string answer;
    char c;
    while (recv(control_, &c, 1, 0) == 1 && c != '\n') answer += c;
    return answer;
  }

  std::map<std::string, std::string> Stats() {
    std::istringstream in(Command("stats"));
    std::map<std::string, std::string> kv;
    std::string w;
    in >> w;
    EXPECT_EQ(w, "ok");
    while (in >> w) {
      const size_t eq = w.find('=');
      kv[w.substr(0, eq)] = w.substr(eq + 1);
    }
    return kv;
  }
  int64_t Stat(const std::string& key) { return std::stoll(Stats().at(key)); }

 private:
  std::string dir_;
  std::unique_ptr<LinkProxy> proxy_;
  std::thread thread_;
  int control_ = -1;
};

TEST(LinkProxy, ForwardsBothDirectionsAndPassesTheEndOfStream) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  SendAll(client, "hello root");
  EXPECT_EQ(RecvN(server, 10), "hello root");
  SendAll(server, "hello sidecar");
  EXPECT_EQ(RecvN(client, 13), "hello sidecar");
  shutdown(client, SHUT_WR);
  EXPECT_EQ(RecvEnd(server), 0);  // the FIN reached the target
  SendAll(server, "bye");         // the other direction still works
  EXPECT_EQ(RecvN(client, 3), "bye");
  close(server);
  EXPECT_EQ(RecvEnd(client), 0);
  const auto st = proxy.Stats();
  EXPECT_EQ(st.at("up_bytes"), "10");
  EXPECT_EQ(st.at("down_bytes"), "16");
  EXPECT_EQ(st.at("accepted"), "1");
  close(client);
  close(listener);
}

TEST(LinkProxy, LargeTransfersArriveWholeAndInOrder) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port, /*delay_ms=*/5);
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  std::string data(3 << 20, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 7919) >> 3);
  std::thread writer([&] { SendAll(client, data); });
  EXPECT_TRUE(RecvN(server, data.size()) == data);
  writer.join();
  EXPECT_EQ(proxy.Stat("up_bytes"), static_cast<int64_t>(data.size()));
  close(client);
  close(server);
  close(listener);
}

TEST(LinkProxy, DropResetsOpenConnectionsAndNewOnesUntilResume) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  SendAll(client, "x");
  EXPECT_EQ(RecvN(server, 1), "x");
  EXPECT_EQ(proxy.Command("drop"), "ok drop reset=1");
  EXPECT_EQ(RecvEnd(client), -ECONNRESET);
  EXPECT_EQ(RecvEnd(server), -ECONNRESET);
  close(client);
  close(server);
  // A new connection is accepted by the kernel and reset by the proxy at once.
  const int refused = Connect(proxy.address());
  EXPECT_EQ(RecvEnd(refused), -ECONNRESET);
  close(refused);
  EXPECT_EQ(proxy.Stat("refused"), 1);
  EXPECT_EQ(proxy.Stats().at("mode"), "drop");
  EXPECT_EQ(proxy.Command("resume"), "ok forward");
  const int again = Connect(proxy.address());
  const int server2 = Accept(listener);
  SendAll(again, "back");
  EXPECT_EQ(RecvN(server2, 4), "back");
  EXPECT_EQ(proxy.Stat("reset"), 1);
  close(again);
  close(server2);
  close(listener);
}

TEST(LinkProxy, ResetCutsOpenConnectionsButForwardsNewOnes) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  EXPECT_EQ(proxy.Command("reset"), "ok reset reset=1");
  EXPECT_EQ(RecvEnd(client), -ECONNRESET);
  close(client);
  close(server);
  const int again = Connect(proxy.address());
  const int server2 = Accept(listener);
  SendAll(again, "new");
  EXPECT_EQ(RecvN(server2, 3), "new");
  close(again);
  close(server2);
  close(listener);
}

TEST(LinkProxy, StallHoldsDataOnOpenConnectionsUntilResume) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  EXPECT_EQ(proxy.Command("stall"), "ok stall");
  SendAll(client, "held");
  // On loopback the bytes are in the proxy's socket when send returns; two control round trips
  // are two full loop iterations in which a forwarding proxy would have passed them on.
  proxy.Command("stats");
  const auto st = proxy.Stats();
  EXPECT_EQ(st.at("up_chunks"), "0");
  EXPECT_EQ(st.at("open"), "1");
  char c;
  EXPECT_EQ(recv(server, &c, 1, MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EAGAIN);
  EXPECT_EQ(proxy.Command("resume"), "ok forward");
  EXPECT_EQ(RecvN(server, 4), "held");  // the same connection, nothing lost
  SendAll(server, "ok");
  EXPECT_EQ(RecvN(client, 2), "ok");
  close(client);
  close(server);
  close(listener);
}

TEST(LinkProxy, DelayHoldsEveryChunkAtLeastTheDelayInEachDirection) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  EXPECT_EQ(proxy.Command("delay 40 25"), "ok delay up=40 down=25");
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  std::string up, down;
  for (int i = 0; i < 20; ++i) {
    const std::string m = "m" + std::to_string(i % 10);
    SendAll(client, m);
    up += m;
    SendAll(server, m);
    down += m;
  }
  EXPECT_EQ(RecvN(server, up.size()), up);  // in order
  EXPECT_EQ(RecvN(client, down.size()), down);
  const auto st = proxy.Stats();
  EXPECT_GE(std::stoll(st.at("up_chunks")), 1);
  EXPECT_GE(std::stoll(st.at("up_held_min_us")), 40000);
  EXPECT_GE(std::stoll(st.at("down_held_min_us")), 25000);
  EXPECT_EQ(st.at("delay_up_ms"), "40");
  EXPECT_EQ(st.at("delay_up_us"), "40000");
  EXPECT_EQ(st.at("delay_down_us"), "25000");
  // stats-reset zeroes traffic, keeps the delay.
  EXPECT_EQ(proxy.Command("stats-reset"), "ok stats-reset");
  EXPECT_EQ(proxy.Stats().at("up_held_min_us"), "-1");
  EXPECT_EQ(proxy.Stats().at("delay_down_ms"), "25");
  close(client);
  close(server);
  close(listener);
}

// delay-us takes microseconds. A lower bound only (the machine may be loaded): every round trip
// through a proxy holding each chunk 2000 us each way takes at least 4 ms. That a 100 us delay
// is ~100 us and not a whole millisecond (the loop's ppoll() timeout is a timespec) is a ratio
// over many round trips, for a benchmark, not a test; the wait arithmetic is tested below.
TEST(LinkProxy, DelayUsHoldsEveryChunkItsMicrosecondsEachWay) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  EXPECT_EQ(proxy.Command("delay-us 2000"), "ok delay-us up=2000 down=2000");
  const int client = Connect(proxy.address());
  const int server = Accept(listener);
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    SendAll(client, "ping");
    EXPECT_EQ(RecvN(server, 4), "ping");
    SendAll(server, "pong");
    EXPECT_EQ(RecvN(client, 4), "pong");
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(std::chrono::duration_cast<std::chrono::microseconds>(took).count(), 4000) << i;
  }
  auto st = proxy.Stats();
  EXPECT_EQ(st.at("delay_up_us"), "2000");
  EXPECT_EQ(st.at("delay_down_us"), "2000");
  EXPECT_EQ(st.at("delay_up_ms"), "2");  // whole ms, rounded down, for older readers
  EXPECT_GE(std::stoll(st.at("up_held_min_us")), 2000);
  EXPECT_GE(std::stoll(st.at("down_held_min_us")), 2000);
  // A sub-millisecond delay, different per direction, is applied, not rounded down to 0.
  EXPECT_EQ(proxy.Command("delay-us 300 700"), "ok delay-us up=300 down=700");
  EXPECT_EQ(proxy.Command("stats-reset"), "ok stats-reset");
  for (int i = 0; i < 5; ++i) {
    SendAll(client, "p");
    EXPECT_EQ(RecvN(server, 1), "p");
    SendAll(server, "q");
    EXPECT_EQ(RecvN(client, 1), "q");
  }
  st = proxy.Stats();
  EXPECT_EQ(st.at("delay_up_ms"), "0");
  EXPECT_EQ(st.at("delay_down_us"), "700");
  EXPECT_EQ(st.at("up_chunks"), "5");
  EXPECT_GE(std::stoll(st.at("up_held_min_us")), 300);
  EXPECT_GE(std::stoll(st.at("down_held_min_us")), 700);
  // `delay` keeps meaning milliseconds.
  EXPECT_EQ(proxy.Command("delay 3"), "ok delay up=3 down=3");
  EXPECT_EQ(proxy.Stats().at("delay_down_us"), "3000");
  close(client);
  close(server);
  close(listener);
}

TEST(LinkProxy, DueTimesAndWaitsAreInMicroseconds) {
  EXPECT_EQ(DueUs(1000, 100, 0), 1100);
  EXPECT_EQ(DueUs(1000, 0, 0), 1000);
  EXPECT_EQ(DueUs(1000, 100, 5000), 5000);  // never before the chunk read before it
  EXPECT_EQ(DueUs(1000, kMaxDelayUs, 0), 1000 + kMaxDelayUs);
  // Nothing held: wait for the caller's timeout, or forever.
  EXPECT_EQ(WaitUs(1000, -1, -1), -1);
  EXPECT_EQ(WaitUs(1000, -1, 5), 5000);
  EXPECT_EQ(WaitUs(1000, -1, 0), 0);
  // A chunk due in 100 us: wait 100 us, not a whole millisecond.
  EXPECT_EQ(WaitUs(1000, 1100, -1), 100);
  EXPECT_EQ(WaitUs(1000, 1100, 5), 100);
  EXPECT_EQ(WaitUs(1000, 1001, -1), 1);
  EXPECT_EQ(WaitUs(1000, 1000, -1), 0);  // due now, or overdue: do not wait
  EXPECT_EQ(WaitUs(1000, 900, 5), 0);
  EXPECT_EQ(WaitUs(1000, 11000, 2), 2000);  // the caller's timeout comes first
  timespec ts{};
  EXPECT_EQ(WaitTimespec(-1, &ts), nullptr);
  ASSERT_EQ(WaitTimespec(100, &ts), &ts);
  EXPECT_EQ(ts.tv_sec, 0);
  EXPECT_EQ(ts.tv_nsec, 100000);
  WaitTimespec(2500001, &ts);
  EXPECT_EQ(ts.tv_sec, 2);
  EXPECT_EQ(ts.tv_nsec, 500001000);
  WaitTimespec(0, &ts);
  EXPECT_EQ(ts.tv_sec, 0);
  EXPECT_EQ(ts.tv_nsec, 0);
}

// hsbn-linkproxy's flags (main.cc parses them with ParseFlags).
Flags Parse(std::vector<std::string> args) {
  Flags f;
  std::string e;
  args.insert(args.begin(), "--target=127.0.0.1:9");
  EXPECT_TRUE(ParseFlags(args, &f, &e)) << e;
  return f;
}

std::string ParseError(const std::vector<std::string>& args) {
  Flags f;
  std::string e;
  EXPECT_FALSE(ParseFlags(args, &f, &e));
  return e;
}

TEST(LinkProxyFlags, DelaysInMillisecondsOrMicroseconds) {
  Flags f = Parse({});
  EXPECT_EQ(f.options.target, "127.0.0.1:9");
  EXPECT_EQ(f.options.delay_up_us, 0);
  EXPECT_EQ(f.control, "-");
  f = Parse({"--delay-ms=5"});
  EXPECT_EQ(f.options.delay_up_us, 5000);
  EXPECT_EQ(f.options.delay_down_us, 5000);
  f = Parse({"--delay-up-ms=3", "--delay-down-ms=600000"});
  EXPECT_EQ(f.options.delay_up_us, 3000);
  EXPECT_EQ(f.options.delay_down_us, kMaxDelayUs);
  f = Parse({"--delay-ms=5", "--delay-up-ms=3"});  // one unit: the later flag wins, as before
  EXPECT_EQ(f.options.delay_up_us, 3000);
  EXPECT_EQ(f.options.delay_down_us, 5000);
  f = Parse({"--delay-us=100"});
  EXPECT_EQ(f.options.delay_up_us, 100);
  EXPECT_EQ(f.options.delay_down_us, 100);
  f = Parse({"--delay-up-us=100", "--delay-down-us=600000000"});
  EXPECT_EQ(f.options.delay_up_us, 100);
  EXPECT_EQ(f.options.delay_down_us, 600000000);
  // Different units for different directions are fine.
  f = Parse({"--delay-up-us=100", "--delay-down-ms=1"});
  EXPECT_EQ(f.options.delay_up_us, 100);
  EXPECT_EQ(f.options.delay_down_us, 1000);
  f = Parse({"--listen=127.0.0.1:0", "--control=/tmp/x", "--ready-file=/tmp/r"});
  EXPECT_EQ(f.options.listen, "127.0.0.1:0");
  EXPECT_EQ(f.control, "/tmp/x");
  EXPECT_EQ(f.ready, "/tmp/r");
  Flags help;
  std::string e;
  EXPECT_TRUE(ParseFlags({"--help"}, &help, &e));  // no --target needed
  EXPECT_TRUE(help.help);
}

TEST(LinkProxyFlags, BadDelaysAreRefusedNamingTheFlags) {
  const std::string t = "--target=127.0.0.1:9";
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> named;  // the error names each
  };
  const std::vector<Case> cases = {
      {{t, "--delay-ms=-4"}, {"--delay-ms", "600000"}},
      {{t, "--delay-ms=600001"}, {"--delay-ms", "[0, 600000]"}},
      {{t, "--delay-up-ms=1.5"}, {"--delay-up-ms"}},
      {{t, "--delay-down-ms="}, {"--delay-down-ms"}},
      {{t, "--delay-us=600000001"}, {"--delay-us", "[0, 600000000]"}},
      {{t, "--delay-up-us=-1"}, {"--delay-up-us"}},
      {{t, "--delay-down-us=1e3"}, {"--delay-down-us"}},
      {{t, "--delay-down-us=99999999999"}, {"--delay-down-us"}},
      // Both spellings for one direction, in either order.
      {{t, "--delay-ms=1", "--delay-us=100"}, {"--delay-ms", "--delay-us", "up"}},
      {{t, "--delay-up-us=100", "--delay-up-ms=1"}, {"--delay-up-ms", "--delay-up-us", "up"}},
      {{t, "--delay-down-ms=1", "--delay-us=100"}, {"--delay-down-ms", "--delay-us", "down"}},
      {{t, "--delay-ms=1", "--delay-down-us=100"}, {"--delay-ms", "--delay-down-us", "down"}},
      {{"--delay-ms=1"}, {"--target"}},
      {{t, "--delay-seconds=1"}, {"--delay-seconds"}},
      {{t, "--delay-ms"}, {"--delay-ms"}},
  };
  for (const Case& c : cases) {
    std::string args;
    for (const std::string& a : c.args) args += a + " ";
    const std::string e = ParseError(c.args);
    for (const std::string& n : c.named) EXPECT_NE(e.find(n), std::string::npos) << args << e;
  }
}

TEST(LinkProxy, AnUnreachableTargetResetsTheClient) {
  int port = 0;
  const int listener = Listen(&port);
  close(listener);  // nothing listens on `port` now
  ProxyFixture proxy(port);
  const int client = Connect(proxy.address());
  EXPECT_EQ(RecvEnd(client), -ECONNRESET);
  EXPECT_EQ(proxy.Stat("refused"), 1);
  EXPECT_EQ(proxy.Stat("accepted"), 0);
  close(client);
}

TEST(LinkProxy, BadCommandsAreAnsweredWithAnErrorAndChangeNothing) {
  int port = 0;
  const int listener = Listen(&port);
  ProxyFixture proxy(port);
  for (const char* bad : {"delay", "delay -5", "delay 10x", "delay 700000", "delay 600001",
                          "delay 1 2 3", "delay-us", "delay-us -1", "delay-us 600000001",
                          "delay-us 1 2 3", "delay-us 1.5", "delay-ms 1", "stall now", "bogus",
                          ""}) {
    EXPECT_EQ(proxy.Command(bad).rfind("error ", 0), 0u) << bad;
  }
  const auto st = proxy.Stats();
  EXPECT_EQ(st.at("mode"), "forward");
  EXPECT_EQ(st.at("delay_up_ms"), "0");
  EXPECT_EQ(st.at("delay_up_us"), "0");
  // The largest delays are taken.
  EXPECT_EQ(proxy.Command("delay 600000"), "ok delay up=600000 down=600000");
  EXPECT_EQ(proxy.Command("delay-us 600000000 0"), "ok delay-us up=600000000 down=0");
  EXPECT_EQ(proxy.Command("delay-us 0"), "ok delay-us up=0 down=0");
  close(listener);
}

TEST(LinkProxy, CreateRefusesBadOptionsNamingThem) {
  std::string error;
  Options o;
  EXPECT_FALSE(LinkProxy::Create(o, &error));
  EXPECT_NE(error.find("--target"), std::string::npos) << error;
  o.target = "localhost";
  EXPECT_FALSE(LinkProxy::Create(o, &error));
  EXPECT_NE(error.find("host:port"), std::string::npos) << error;
  o.target = "127.0.0.1:1";
  o.delay_up_us = -1;
  EXPECT_FALSE(LinkProxy::Create(o, &error));
  EXPECT_NE(error.find("delay"), std::string::npos) << error;
  o.delay_up_us = 0;
  o.delay_down_us = kMaxDelayUs + 1;
  EXPECT_FALSE(LinkProxy::Create(o, &error));
  EXPECT_NE(error.find("delay"), std::string::npos) << error;
}

}  // namespace
}  // namespace hsbn::linkproxy

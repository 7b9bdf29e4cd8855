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
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <thread>

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
    char tmpl[] = "/tmp/hsbn-linkproxy-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    Options o;
    o.target = "127.0.0.1:" + std::to_string(target_port);
    o.delay_up_ms = o.delay_down_ms = delay_ms;
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
  // stats-reset zeroes traffic, keeps the delay.
  EXPECT_EQ(proxy.Command("stats-reset"), "ok stats-reset");
  EXPECT_EQ(proxy.Stats().at("up_held_min_us"), "-1");
  EXPECT_EQ(proxy.Stats().at("delay_down_ms"), "25");
  close(client);
  close(server);
  close(listener);
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
  for (const char* bad : {"delay", "delay -5", "delay 10x", "delay 700000", "delay 1 2 3",
                          "stall now", "bogus", ""}) {
    EXPECT_EQ(proxy.Command(bad).rfind("error ", 0), 0u) << bad;
  }
  const auto st = proxy.Stats();
  EXPECT_EQ(st.at("mode"), "forward");
  EXPECT_EQ(st.at("delay_up_ms"), "0");
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
  o.delay_up_ms = -1;
  EXPECT_FALSE(LinkProxy::Create(o, &error));
  EXPECT_NE(error.find("delay"), std::string::npos) << error;
}

}  // namespace
}  // namespace hsbn::linkproxy

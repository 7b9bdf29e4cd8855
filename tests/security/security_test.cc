// Security: TLS on the sidecar -> root link (server and mutual), per-job tokens at both levels,
// and the Unix socket's mode. Real hsbn-aggregator processes on loopback, in-process C++
// clients; certificates are made at test time with the openssl command.
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/stat.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "aggregator_process.h"
#include "hsbn/v1/hsbn.pb.h"
#include "gtest/gtest.h"

namespace hsbn {
namespace {

using testing::Aggregator;
using testing::ForwardRound;
using testing::ReadAll;
using testing::RunAggregatorToExit;
using testing::StartAggregator;
using testing::TempDir;
using testing::WorkerOptions;
using testing::WriteFile;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A CA, a root (server) certificate for the names hsbn-root, localhost and 127.0.0.1, a client
// certificate, and a second CA that signed nothing of ours; EC P-256 keys.
class Certs {
 public:
  Certs() {
    const std::string ext =
        "[srv]\nsubjectAltName=DNS:hsbn-root,DNS:localhost,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth\n[cli]\nextendedKeyUsage=clientAuth\n";
    WriteFile(dir_ / "ext.cnf", ext, 0600);
    const std::string cmd = "cd '" + dir_.path() + "' && (" +
        Ca("ca") + " && " + Ca("ca2") + " && " + Leaf("server", "hsbn-root", "ca", "srv") + " && " +
        Leaf("client", "hsbn-node", "ca", "cli") + ") > openssl.log 2>&1";
    ok_ = std::system(cmd.c_str()) == 0;
  }
  bool ok() const { return ok_; }
  std::string log() const { return ReadAll(dir_ / "openssl.log"); }
  std::string operator/(const std::string& name) const { return dir_ / name; }

 private:
  static std::string Key(const std::string& name) {
    return "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out " + name + ".key";
  }
  static std::string Ca(const std::string& name) {
    return Key(name) + " && openssl req -x509 -new -key " + name + ".key -sha256 -days 2 -subj "
           "'/CN=hsbn test " + name + "' -addext basicConstraints=critical,CA:TRUE -addext "
           "keyUsage=critical,keyCertSign,cRLSign -out " + name + ".crt";
  }
  static std::string Leaf(const std::string& name, const std::string& cn, const std::string& ca,
                          const std::string& section) {
    return Key(name) + " && openssl req -new -key " + name + ".key -subj '/CN=" + cn + "' -out " +
           name + ".csr && openssl x509 -req -in " + name + ".csr -CA " + ca + ".crt -CAkey " +
           ca + ".key -CAcreateserial -days 2 -sha256 -extfile ext.cnf -extensions " + section +
           " -out " + name + ".crt";
  }
  TempDir dir_;
  bool ok_ = false;
};

std::vector<std::unique_ptr<Client>> ConnectAll(const std::vector<std::string>& addresses,
                                                const std::string& job, int world, int local,
                                                const std::string& token = "",
                                                int ranks = -1) {
  // Connects ranks 0 .. ranks-1 (all by default); rank r goes to addresses[r / local].
  std::vector<std::unique_ptr<Client>> out;
  for (int rank = 0; rank < (ranks < 0 ? world : ranks); ++rank) {
    auto c = Client::Connect(WorkerOptions(addresses[rank / local], job, rank, world, local, token));
    EXPECT_TRUE(c.ok()) << "rank " << rank << ": " << c.status();
    if (!c.ok()) return {};
    out.push_back(std::move(*c));
  }
  return out;
}

std::vector<Client*> Raw(const std::vector<std::unique_ptr<Client>>& v) {
  std::vector<Client*> out;
  for (auto& c : v) out.push_back(c.get());
  return out;
}

// Checks a global forward round's results: ranks contribute mean rank + c, var 1 + c, 10 each.
void ExpectGlobalResults(const std::vector<testing::RoundOut>& out) {
  const int world = int(out.size());
  for (const auto& r : out) {
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.count, 10 * world);
    for (size_t c = 0; c < r.a.size(); ++c) {
      EXPECT_DOUBLE_EQ(r.a[c], (world - 1) / 2.0 + double(c));
    }
  }
}

Aggregator MustStart(const std::string& dir, const std::string& name,
                     std::vector<std::string> flags) {
  auto a = StartAggregator(dir, name, std::move(flags));
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(*a) : Aggregator{};
}

Aggregator Sidecar(const TempDir& dir, const std::string& name, const std::string& upstream,
                   std::vector<std::string> extra = {}) {
  std::vector<std::string> flags = {"--role=node", "--listen=unix:" + (dir / (name + ".sock")),
                                    "--upstream=" + upstream, "--round-timeout-ms=10000"};
  for (auto& f : extra) flags.push_back(std::move(f));
  return MustStart(dir.path(), name, std::move(flags));
}

TEST(Tls, GlobalRoundsOverTlsAndSidecarsWithoutTheRightCaCannotReachTheRoot) {
  Certs certs;
  ASSERT_TRUE(certs.ok()) << certs.log();
  TempDir dir;
  Aggregator root = MustStart(dir.path(), "root",
                              {"--role=root", "--listen=127.0.0.1:0", "--round-timeout-ms=3000",
                               "--tls-cert=" + (certs / "server.crt"),
                               "--tls-key=" + (certs / "server.key")});
  ASSERT_TRUE(root.process);
  EXPECT_TRUE(Contains(root.log(), "(TCP: TLS)")) << root.log();
  const std::vector<std::string> tls = {"--upstream-ca=" + (certs / "ca.crt"),
                                        "--upstream-tls-name=hsbn-root"};
  Aggregator s0 = Sidecar(dir, "node0", root.address, tls);
  Aggregator s1 = Sidecar(dir, "node1", root.address, tls);
  auto clients = ConnectAll({s0.address, s1.address}, "tls-job", 2, 1);
  ASSERT_EQ(clients.size(), 2u);
  for (int seq = 0; seq < 3; ++seq) ExpectGlobalResults(ForwardRound(Raw(clients), 0, seq, Scope::kGlobal));
  EXPECT_TRUE(Contains(s0.log(), "connected to the root aggregator at " + root.address + " (TLS)"));

  // A sidecar that speaks plaintext to the TLS root, and one that trusts another CA: their
  // global rounds fail with UNAVAILABLE naming the root; their node rounds still work.
  Aggregator plain = Sidecar(dir, "plain", root.address);
  Aggregator wrong = Sidecar(dir, "wrong", root.address,
                             {"--upstream-ca=" + (certs / "ca2.crt"), "--upstream-tls-name=hsbn-root"});
  auto lone_plain = ConnectAll({plain.address}, "plain-job", 2, 1, "", 1);
  auto lone_wrong = ConnectAll({wrong.address}, "wrong-job", 2, 1, "", 1);
  ASSERT_EQ(lone_plain.size(), 1u);  // rank 0 of a 2-node job: node 0 only
  ASSERT_EQ(lone_wrong.size(), 1u);
  std::vector<testing::RoundOut> out_plain, out_wrong;
  std::thread t1([&] { out_plain = ForwardRound({lone_plain[0].get()}, 0, 0, Scope::kGlobal); });
  std::thread t2([&] { out_wrong = ForwardRound({lone_wrong[0].get()}, 0, 0, Scope::kGlobal); });
  t1.join();
  t2.join();
  for (const auto* out : {&out_plain, &out_wrong}) {
    const absl::Status& s = (*out)[0].status;
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(Contains(std::string(s.message()), "root aggregator at " + root.address)) << s;
  }
  EXPECT_TRUE(Contains(std::string(out_plain[0].status.message()), "--upstream-ca"));
  EXPECT_TRUE(Contains(std::string(out_wrong[0].status.message()), "signed the root's certificate"));
  for (auto* c : {lone_plain[0].get(), lone_wrong[0].get()}) {
    auto node = ForwardRound({c}, 1, 0, Scope::kNode);
    EXPECT_TRUE(node[0].status.ok()) << node[0].status;
  }
  // The good sidecars are unaffected.
  ExpectGlobalResults(ForwardRound(Raw(clients), 0, 3, Scope::kGlobal));
}

TEST(Tls, MutualTlsRefusesASidecarWithoutAClientCertificate) {
  Certs certs;
  ASSERT_TRUE(certs.ok()) << certs.log();
  TempDir dir;
  Aggregator root = MustStart(dir.path(), "root",
                              {"--role=root", "--listen=127.0.0.1:0", "--round-timeout-ms=3000",
                               "--tls-cert=" + (certs / "server.crt"),
                               "--tls-key=" + (certs / "server.key"),
                               "--tls-client-ca=" + (certs / "ca.crt")});
  ASSERT_TRUE(root.process);
  EXPECT_TRUE(Contains(root.log(), "(TCP: mutual TLS)")) << root.log();
  const std::vector<std::string> mtls = {"--upstream-ca=" + (certs / "ca.crt"),
                                         "--upstream-cert=" + (certs / "client.crt"),
                                         "--upstream-key=" + (certs / "client.key"),
                                         "--upstream-tls-name=hsbn-root"};
  Aggregator s0 = Sidecar(dir, "node0", root.address, mtls);
  Aggregator s1 = Sidecar(dir, "node1", root.address, mtls);
  auto clients = ConnectAll({s0.address, s1.address}, "mtls-job", 2, 1);
  ASSERT_EQ(clients.size(), 2u);
  for (int seq = 0; seq < 2; ++seq) ExpectGlobalResults(ForwardRound(Raw(clients), 0, seq, Scope::kGlobal));

  Aggregator certless = Sidecar(dir, "certless", root.address,
                                {"--upstream-ca=" + (certs / "ca.crt"), "--upstream-tls-name=hsbn-root"});
  auto lone = ConnectAll({certless.address}, "certless-job", 2, 1, "", 1);
  ASSERT_EQ(lone.size(), 1u);
  auto out = ForwardRound({lone[0].get()}, 0, 0, Scope::kGlobal);
  EXPECT_EQ(out[0].status.code(), absl::StatusCode::kUnavailable) << out[0].status;
  EXPECT_TRUE(Contains(std::string(out[0].status.message()), root.address)) << out[0].status;
  EXPECT_TRUE(Contains(std::string(out[0].status.message()), "--upstream-cert"));
  ExpectGlobalResults(ForwardRound(Raw(clients), 0, 2, Scope::kGlobal));
}

TEST(Tls, InconsistentTlsFlagsAreRefusedAtStart) {
  TempDir dir;
  struct Case {
    std::vector<std::string> flags;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--role=root", "--tls-cert=/nonexistent.crt"}, "--tls-cert and --tls-key go together"},
      {{"--role=root", "--tls-client-ca=/x.crt"}, "--tls-client-ca needs --tls-cert"},
      {{"--role=node", "--upstream-ca=/x.crt"}, "--upstream, which is not set"},
      {{"--role=node", "--upstream=127.0.0.1:1", "--upstream-cert=/x.crt", "--upstream-key=/x.key"},
       "need --upstream-ca"},
      {{"--role=node", "--upstream=127.0.0.1:1", "--upstream-ca=" + (dir / "missing.crt")},
       "cannot be read"},
  };
  for (const auto& c : cases) {
    auto flags = c.flags;
    flags.push_back("--listen=unix:" + (dir / "x.sock"));
    auto [code, log] = RunAggregatorToExit(dir.path(), "bad", flags);
    EXPECT_EQ(code, 2) << log;
    EXPECT_TRUE(Contains(log, c.says)) << log;
  }
}

constexpr char kSideToken[] = "s3cret-side-token-0123456789";
constexpr char kStarToken[] = "star-token-abcdef";
constexpr char kRootToken[] = "root-token-for-rjob-XYZ";

void ExpectNoTokenIn(const std::string& log) {
  for (const char* t : {kSideToken, kStarToken, kRootToken, "wrong-token-123"}) {
    EXPECT_FALSE(Contains(log, t)) << "a token is in the log:\n" << log;
  }
}

TEST(Tokens, TheRightTokenJoinsAWrongOrMissingOneIsRefusedWithoutTouchingTheJob) {
  TempDir dir;
  WriteFile(dir / "tokens", std::string("# job tokens\ntjob ") + kSideToken +
                                "   # this job\n\n*\t" + kStarToken + "\n", 0600);
  Aggregator side = MustStart(dir.path(), "node0",
                              {"--role=node", "--listen=unix:" + (dir / "node0.sock"),
                               "--token-file=" + (dir / "tokens")});
  ASSERT_TRUE(side.process);

  // Missing and wrong tokens: UNAUTHENTICATED, saying what to set; no job is created.
  auto missing = Client::Connect(WorkerOptions(side.address, "tjob", 0, 2, 2));
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated) << missing.status();
  EXPECT_TRUE(Contains(std::string(missing.status().message()), "HSBN_TOKEN"));
  auto wrong = Client::Connect(WorkerOptions(side.address, "tjob", 0, 2, 2, "wrong-token-123"));
  ASSERT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();
  EXPECT_TRUE(Contains(std::string(wrong.status().message()), "HSBN_TOKEN_FILE"));
  // A prefix of the right token is wrong too.
  auto prefix = Client::Connect(
      WorkerOptions(side.address, "tjob", 0, 2, 2, std::string(kSideToken).substr(0, 10)));
  ASSERT_EQ(prefix.status().code(), absl::StatusCode::kUnauthenticated) << prefix.status();

  auto clients = ConnectAll({side.address}, "tjob", 2, 2, kSideToken);
  ASSERT_EQ(clients.size(), 2u);
  auto status = clients[0]->Status(false);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);  // the refused Joins created nothing
  EXPECT_EQ(status->jobs(0).job_id(), "tjob");
  ExpectGlobalResults(ForwardRound(Raw(clients), 0, 0, Scope::kNode));

  // An impostor of rank 1 with a wrong token while rank 1 is live: refused before the job is
  // touched (not ALREADY_EXISTS, and rank 1 is not replaced); the members' rounds go on.
  auto impostor = Client::Connect(WorkerOptions(side.address, "tjob", 1, 2, 2, "wrong-token-123"));
  EXPECT_EQ(impostor.status().code(), absl::StatusCode::kUnauthenticated) << impostor.status();
  for (int seq = 1; seq < 4; ++seq) ExpectGlobalResults(ForwardRound(Raw(clients), 0, seq, Scope::kNode));
  status = clients[0]->Status(false);
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).rounds_failed(), 0);
  for (const auto& m : status->jobs(0).members()) EXPECT_TRUE(m.connected());

  // `*` gives every other job a token.
  auto other = ConnectAll({side.address}, "any-job", 1, 1, kStarToken);
  EXPECT_EQ(other.size(), 1u);
  auto other_wrong = Client::Connect(WorkerOptions(side.address, "any-job2", 0, 1, 1, kSideToken));
  EXPECT_EQ(other_wrong.status().code(), absl::StatusCode::kUnauthenticated);
  clients.clear();
  other.clear();
  ExpectNoTokenIn(side.log());
}

TEST(Tokens, TheSidecarPassesTheTokenOnAndTheRootRefusesAWrongOne) {
  TempDir dir;
  WriteFile(dir / "root-tokens",
            std::string("rjob ") + kRootToken + "\nrjob-wrong another-token-456\n", 0600);
  Aggregator root = MustStart(dir.path(), "root",
                              {"--role=root", "--listen=127.0.0.1:0", "--round-timeout-ms=3000",
                               "--token-file=" + (dir / "root-tokens")});
  ASSERT_TRUE(root.process);
  // Sidecars without a token file of their own: the root's decides.
  Aggregator s0 = Sidecar(dir, "node0", root.address);
  Aggregator s1 = Sidecar(dir, "node1", root.address);
  auto good = ConnectAll({s0.address, s1.address}, "rjob", 2, 1, kRootToken);
  ASSERT_EQ(good.size(), 2u);
  for (int seq = 0; seq < 2; ++seq) ExpectGlobalResults(ForwardRound(Raw(good), 0, seq, Scope::kGlobal));

  // Job "rjob-wrong" under a wrong token: its sidecars are refused at the root, which the
  // workers see as UNAUTHENTICATED global rounds; node rounds still work.
  auto wrong = ConnectAll({s0.address, s1.address}, "rjob-wrong", 2, 1, "wrong-token-123");
  ASSERT_EQ(wrong.size(), 2u);
  auto out = ForwardRound(Raw(wrong), 0, 0, Scope::kGlobal);
  for (const auto& r : out) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kUnauthenticated) << r.status;
    EXPECT_TRUE(Contains(std::string(r.status.message()), "at the root " + root.address)) << r.status;
  }
  EXPECT_TRUE(ForwardRound(Raw(wrong), 1, 0, Scope::kNode)[0].status.ok());
  // The good job is unaffected.
  ExpectGlobalResults(ForwardRound(Raw(good), 0, 2, Scope::kGlobal));
  ExpectNoTokenIn(root.log() + s0.log() + s1.log());
}

TEST(Tokens, TheFileMustNotBeReadableByOthersAndSighupReloadsIt) {
  TempDir dir;
  const std::string file = dir / "tokens";
  for (int mode : {0604, 0644, 0620, 0666}) {
    WriteFile(file, std::string("tjob ") + kSideToken + "\n", mode);
    auto [code, log] = RunAggregatorToExit(
        dir.path(), "refused", {"--role=node", "--listen=unix:" + (dir / "r.sock"),
                                "--token-file=" + file});
    EXPECT_EQ(code, 2) << std::oct << mode << ": " << log;
    EXPECT_TRUE(Contains(log, "chmod 600")) << log;
    EXPECT_TRUE(Contains(log, "--allow-insecure-token-file")) << log;
    ExpectNoTokenIn(log);
  }
  WriteFile(file, "tjob\n", 0600);  // a line without a token
  auto [code, log] = RunAggregatorToExit(
      dir.path(), "malformed", {"--role=node", "--listen=unix:" + (dir / "m.sock"),
                                "--token-file=" + file});
  EXPECT_EQ(code, 2);
  EXPECT_TRUE(Contains(log, "line 1")) << log;

  WriteFile(file, std::string("tjob ") + kSideToken + "\n", 0644);
  Aggregator insecure = MustStart(dir.path(), "insecure",
                                  {"--role=node", "--listen=unix:" + (dir / "i.sock"),
                                   "--token-file=" + file, "--allow-insecure-token-file"});
  EXPECT_TRUE(insecure.process);

  WriteFile(file, std::string("tjob ") + kSideToken + "\n", 0640);  // group may read
  Aggregator side = MustStart(dir.path(), "node0",
                              {"--role=node", "--listen=unix:" + (dir / "node0.sock"),
                               "--token-file=" + file});
  ASSERT_TRUE(side.process);
  EXPECT_EQ(ConnectAll({side.address}, "tjob", 1, 1, kSideToken).size(), 1u);
  // SIGHUP: the new file is in force (the old token is refused, the new one accepted).
  WriteFile(file, std::string("tjob ") + kStarToken + "\n", 0600);
  side.process->Signal(SIGHUP);
  for (int i = 0; i < 500 && !Contains(side.log(), "SIGHUP: reloaded"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto old_token = Client::Connect(WorkerOptions(side.address, "tjob", 0, 1, 1, kSideToken));
  EXPECT_EQ(old_token.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ConnectAll({side.address}, "tjob", 1, 1, kStarToken).size(), 1u);
  // A broken file on SIGHUP keeps the tokens in force.
  WriteFile(file, std::string("tjob ") + kSideToken + "\n", 0666);
  side.process->Signal(SIGHUP);
  for (int i = 0; i < 500 && !Contains(side.log(), "previous tokens stay in force"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(Contains(side.log(), "previous tokens stay in force")) << side.log();
  EXPECT_EQ(ConnectAll({side.address}, "tjob", 1, 1, kStarToken).size(), 1u);
  EXPECT_TRUE(side.process->Running());
  ExpectNoTokenIn(side.log() + insecure.log());
}

TEST(UnixSocket, TheSocketGetsSocketMode) {
  TempDir dir;
  for (const auto& [flag, mode] : std::vector<std::pair<std::string, int>>{
           {"", 0660}, {"--socket-mode=0600", 0600}, {"--socket-mode=0666", 0666}}) {
    const std::string sock = dir / "mode.sock";
    std::vector<std::string> flags = {"--role=node", "--listen=unix:" + sock};
    if (!flag.empty()) flags.push_back(flag);
    Aggregator a = MustStart(dir.path(), "mode", flags);
    ASSERT_TRUE(a.process);
    struct stat st;
    ASSERT_EQ(stat(sock.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, mode_t(mode)) << flag;
    EXPECT_EQ(a.process->Stop(), 0);
  }
}

// The socket never exists with a wider mode than --socket-mode: the test runs the aggregator
// under umask 0 (bind alone would make the socket 0777) and stats the socket the moment
// inotify reports it created, before the aggregator could chmod it. A chmod after bind fails
// this test whenever the stat wins the race; the aggregator sets its umask around bind, so the
// socket is born with its mode and the test passes every time.
TEST(UnixSocket, TheSocketHasSocketModeFromTheMomentItExists) {
  TempDir dir;
  const int watch = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  ASSERT_GE(watch, 0);
  ASSERT_GE(inotify_add_watch(watch, dir.path().c_str(), IN_CREATE | IN_MOVED_TO), 0);
  const std::string sock = dir / "born.sock";
  const mode_t saved = umask(0);
  auto p = cluster::Subprocess::Spawn(
      {cluster::LocalCluster::DefaultAggregatorPath(), "--role=node", "--listen=unix:" + sock,
       "--socket-mode=0600", "--ready-file=" + (dir / "born.ready")},
      {}, dir / "born.log");
  umask(saved);
  ASSERT_TRUE(p.ok()) << p.status();
  bool created = false, ready = false;
  mode_t mode = 0;
  // Waits for the IN_CREATE event of born.sock (the log file is created in the same
  // directory first), then for the ready file to be renamed into place. The 20 s poll timeout
  // is only a backstop.
  while (!ready) {
    pollfd pfd{watch, POLLIN, 0};
    ASSERT_EQ(poll(&pfd, 1, 20000), 1) << "no socket created: " << ReadAll(dir / "born.log");
    alignas(inotify_event) char buf[4096];
    const ssize_t n = read(watch, buf, sizeof buf);
    for (ssize_t off = 0; off < n;) {
      const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
      if (ev->len > 0 && std::string(ev->name) == "born.sock" && !created) {
        struct stat st;
        ASSERT_EQ(lstat(sock.c_str(), &st), 0);
        mode = st.st_mode & 07777;
        created = true;
      }
      if (ev->len > 0 && std::string(ev->name) == "born.ready") ready = true;
      off += ssize_t(sizeof(inotify_event) + ev->len);
    }
  }
  close(watch);
  ASSERT_TRUE(created);
  EXPECT_EQ(mode, mode_t(0600)) << std::oct << mode;
  EXPECT_EQ((*p)->Stop(), 0);
}

TEST(UnixSocket, ASocketModeThatIsNotOctalOrAboveTheFileModeIsRefused) {
  TempDir dir;
  for (const std::string bad : {"banana", "0668", "8", "01777", "1000", "-1", "", "0x1ff"}) {
    const std::string sock = dir / "bad.sock";
    auto [code, log] = RunAggregatorToExit(
        dir.path(), "bad", {"--role=node", "--listen=unix:" + sock, "--socket-mode=" + bad});
    EXPECT_EQ(code, 2) << bad << ": " << log;
    EXPECT_TRUE(Contains(log, "--socket-mode")) << bad << ": " << log;
    EXPECT_TRUE(Contains(log, "octal")) << bad << ": " << log;
    struct stat st;
    EXPECT_NE(stat(sock.c_str(), &st), 0) << bad << ": a socket was created";
  }
  // Three digits without the leading zero are octal too.
  Aggregator a = MustStart(dir.path(), "three", {"--role=node", "--listen=unix:" + (dir / "t.sock"),
                                                 "--socket-mode=640"});
  ASSERT_TRUE(a.process);
  struct stat st;
  ASSERT_EQ(stat((dir / "t.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, mode_t(0640));
  EXPECT_EQ(a.process->Stop(), 0);
}

}  // namespace
}  // namespace hsbn

// A shared aggregator against hostile or buggy clients (issue 11): real hsbn-aggregator
// processes on loopback, spoken to with raw gRPC where the client library would refuse. Each
// test is one class of attack; the aggregator must answer the offender, stay up, keep its
// memory bounded and serve every other job as before.
#include <sys/types.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "aggregator_process.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "wire.h"

namespace hsbn::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Stream = grpc::ClientReaderWriter<v1::ClientFrame, v1::ServerFrame>;

// Resident memory of a process, in bytes (VmRSS).
int64_t Rss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// Polls `done` every 20 ms until it holds; false after a 60 s backstop (an event that never
// came), never a timing bound on a normal run.
template <typename F>
bool WaitFor(F done) {
  const auto backstop = std::chrono::steady_clock::now() + seconds(60);
  while (!done()) {
    if (std::chrono::steady_clock::now() > backstop) return false;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return true;
}

Aggregator MustStart(const std::string& dir, const std::string& name,
                     std::vector<std::string> flags) {
  auto a = StartAggregator(dir, name, std::move(flags));
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(*a) : Aggregator{};
}

struct Raw {
  explicit Raw(const std::string& address)
      : stub(v1::Aggregator::NewStub(grpc::CreateChannel(address,
                                                         grpc::InsecureChannelCredentials()))) {}
  grpc::Status Join(const std::string& job, int rank, int world, int lws, std::string* session,
                    const std::string& token = "", uint32_t version = v1::PROTOCOL_VERSION_2) {
    v1::JoinRequest req;
    req.set_protocol_version(version);
    req.set_job_id(job);
    req.set_kind(v1::MEMBER_KIND_WORKER);
    req.set_rank(rank);
    req.set_world_size(world);
    req.set_local_rank(rank % lws);
    req.set_local_world_size(lws);
    req.set_node_rank(rank / lws);
    req.set_token(token);
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub->Join(&ctx, req, &resp);
    if (session) *session = resp.session();
    return s;
  }
  grpc::Status Status(const std::string& job, const std::string& token, v1::StatusResponse* out) {
    v1::StatusRequest req;
    req.set_job_id(job);
    req.set_token(token);
    grpc::ClientContext ctx;
    return stub->Status(&ctx, req, out);
  }
  std::unique_ptr<v1::Aggregator::Stub> stub;
};

v1::ClientFrame AttachFrame(const std::string& session, const std::string& token = "") {
  v1::ClientFrame f;
  f.mutable_attach()->add_sessions(session);
  f.mutable_attach()->set_token(token);
  return f;
}

v1::ClientFrame Contribution(const std::string& session, uint32_t op, uint64_t seq,
                             int channels, double mean = 1.0) {
  v1::ClientFrame f;
  v1::Contribution* c = f.mutable_contribution();
  c->set_session(session);
  c->set_op(op);
  c->set_seq(seq);
  c->set_phase(v1::PHASE_FORWARD);
  c->set_scope(v1::SCOPE_NODE);
  c->set_channels(uint32_t(channels));
  c->set_count(1);
  std::vector<double> a(channels, mean), b(channels, 0.0);
  wire::PackPayload(a.data(), b.data(), channels, c->mutable_data());
  return f;
}

// A one-worker job that still works: the aggregator serves others after each attack.
void ExpectServes(const std::string& address, const std::string& job) {
  auto c = Client::Connect(WorkerOptions(address, job, 0, 1, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  const double mean = 2.5, m2 = 1.0;
  double out_a = 0, out_b = 0;
  int64_t n = 0;
  absl::Status s = (*c)->Forward(0, 0, Scope::kNode, 1, 4, &mean, &m2, &n, &out_a, &out_b);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(out_a, 2.5);
  EXPECT_EQ(n, 4);
}

// Sessions are 128-bit secrets: distinct, not sequential, not derivable from each other.
TEST(Hardening, SessionsAre16RandomBytes) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock")});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  std::set<std::string> seen;
  for (int i = 0; i < 200; ++i) {
    std::string s;
    ASSERT_TRUE(raw.Join(absl::StrCat("j", i), 0, 1, 1, &s).ok());
    ASSERT_EQ(s.size(), 16u);
    EXPECT_TRUE(seen.insert(s).second);
  }
  // Roughly half the bits differ between consecutive sessions (a counter or a weak generator
  // seeded with 32 bits would show structure here; 200 draws of 128 bits: expect ~64).
  std::vector<std::string> v(seen.begin(), seen.end());
  int min_diff = 128;
  for (size_t i = 1; i < v.size(); ++i) {
    int diff = 0;
    for (int b = 0; b < 16; ++b) diff += __builtin_popcount(uint8_t(v[i][b] ^ v[i - 1][b]));
    min_diff = std::min(min_diff, diff);
  }
  EXPECT_GT(min_diff, 30);
  // Never in the log.
  const std::string log = side.log();
  for (const std::string& s : v) EXPECT_FALSE(absl::StrContains(log, s));
}

TEST(Hardening, AnOlderProtocolVersionIsRefusedNamingBothVersions) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock")});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  grpc::Status s = raw.Join("old", 0, 1, 1, nullptr, "", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "version 1")) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "version 2")) << s.error_message();
}

// With tokens on, a stream that presents job A's token cannot use a session of job B, even
// holding B's secret: its Attach is refused and its contributions are answered NOT_FOUND.
TEST(Hardening, AStreamUsesOnlySessionsOfTheJobWhoseTokenItPresents) {
  TempDir dir;
  WriteFile(dir / "tokens", "a token-of-a-123\nb token-of-b-456\n", 0600);
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--token-file=" + (dir / "tokens")});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  std::string sa, sb;
  ASSERT_TRUE(raw.Join("a", 0, 1, 1, &sa, "token-of-a-123").ok());
  ASSERT_TRUE(raw.Join("b", 0, 2, 2, &sb, "token-of-b-456").ok());
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = raw.stub->Exchange(&ctx);
  ASSERT_TRUE(stream->Write(AttachFrame(sb, "token-of-a-123")));  // B's session, A's token
  ASSERT_TRUE(stream->Write(AttachFrame(sa, "token-of-a-123")));
  ASSERT_TRUE(stream->Write(Contribution(sb, 0, 0, 1)));
  ASSERT_TRUE(stream->Write(Contribution(sa, 0, 0, 1)));
  v1::ServerFrame f;
  ASSERT_TRUE(stream->Read(&f));
  EXPECT_EQ(f.result().code(), int(grpc::StatusCode::NOT_FOUND)) << f.result().message();
  EXPECT_EQ(f.result().session(), sb);
  ASSERT_TRUE(stream->Read(&f));
  EXPECT_EQ(f.result().code(), 0) << f.result().message();  // its own job works
  EXPECT_EQ(f.result().session(), sa);
  // Job b's round was never touched.
  v1::StatusResponse st;
  ASSERT_TRUE(raw.Status("b", "token-of-b-456", &st).ok());
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).open_rounds(), 0);
  EXPECT_EQ(st.jobs(0).members(0).contributions(), 0);
  ctx.TryCancel();
}

TEST(Hardening, StatusWithTokensShowsOnlyTheCallersJob) {
  TempDir dir;
  WriteFile(dir / "tokens", "a token-of-a-123\nb token-of-b-456\n", 0600);
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--token-file=" + (dir / "tokens")});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  ASSERT_TRUE(raw.Join("a", 0, 2, 2, nullptr, "token-of-a-123").ok());
  ASSERT_TRUE(raw.Join("b", 0, 2, 2, nullptr, "token-of-b-456").ok());
  v1::StatusResponse st;
  EXPECT_EQ(raw.Status("", "", &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(raw.Status("a", "token-of-b-456", &st).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  st.Clear();
  ASSERT_TRUE(raw.Status("a", "token-of-a-123", &st).ok());
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).job_id(), "a");
}

// A Join that declares a huge world would make the aggregator allocate per member.
TEST(Hardening, HugeLayoutsAreRefusedWithoutAllocating) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--max-world-size=1024"});
  ASSERT_TRUE(side.process);
  const int64_t rss0 = Rss(side.process->pid());
  Raw raw(side.address);
  for (int i = 0; i < 20; ++i) {
    grpc::Status s = raw.Join(absl::StrCat("huge", i), 0, 2147483600, 2147483600, nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "--max-world-size=1024")) << s.error_message();
  }
  grpc::Status s = raw.Join("lws", 0, 1024, 1024, nullptr);  // at the limit: fine
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(Rss(side.process->pid()) - rss0, 16 << 20);
  ExpectServes(side.address, "after-huge");
}

// A worker that never reads its results: the aggregator stops queueing for it at
// --max-queued-bytes and ends its stream with RESOURCE_EXHAUSTED; memory stays bounded.
TEST(Hardening, AReaderThatDoesNotReadIsDroppedAtTheQueueCap) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--max-queued-bytes=4194304",
                                                "--write-deadline-ms=600000",
                                                "--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  std::string session;
  ASSERT_TRUE(raw.Join("flood", 0, 1, 1, &session).ok());
  const int64_t rss0 = Rss(side.process->pid());
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = raw.stub->Exchange(&ctx);
  ASSERT_TRUE(stream->Write(AttachFrame(session)));
  // 8192 rounds of 2048 channels: 256 MiB of results, none of them read.
  constexpr int kRounds = 8192;
  bool writes_ok = true;
  for (int i = 0; i < kRounds && writes_ok; ++i) {
    writes_ok = stream->Write(Contribution(session, 0, uint64_t(i), 2048));
  }
  // The aggregator has reduced every round (or dropped the stream, which fails later writes).
  stream->WritesDone();
  const int64_t grown = Rss(side.process->pid()) - rss0;
  // Bounded means independent of the flood's length: measured 27-34 MiB here at 8192 rounds
  // as at 4096 (gRPC's buffers and malloc's arenas; 52 MiB once on a CI machine). An
  // unbounded queue would hold the 256 MiB of results, so 96 MiB fails it with room to spare.
  EXPECT_LT(grown, 96 << 20) << "RSS grew by " << grown;
  v1::ServerFrame f;
  int results = 0;
  while (stream->Read(&f)) ++results;
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max-queued-bytes")) << s.error_message();
  EXPECT_LT(results, kRounds);
  auto metrics = HttpGet(side.metrics);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(Sample(*metrics, "hsbn_refused_total", {{"reason", "queue_bytes"}}), 1.0) << *metrics;
  ExpectServes(side.address, "after-flood");
}

// A reader that stops reading while a write is in flight: after --write-deadline-ms the
// aggregator drops its stream (the write can never complete), reports the member gone, and
// the rest of the job and every other job go on.
TEST(Hardening, AWriteStalledPastTheDeadlineDropsTheStream) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--write-deadline-ms=300"});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  std::string session;
  ASSERT_TRUE(raw.Join("stall", 0, 1, 1, &session).ok());
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = raw.stub->Exchange(&ctx);
  ASSERT_TRUE(stream->Write(AttachFrame(session)));
  // 512 rounds of 4096 channels (32 MiB of results) fill every window between the aggregator's
  // writer and this reader, which reads nothing; writes fail once the stream is dropped.
  for (int i = 0; i < 512; ++i) {
    if (!stream->Write(Contribution(session, 0, uint64_t(i), 4096))) break;
  }
  // Event: the aggregator reports rank 0 of the job disconnected.
  ASSERT_TRUE(WaitFor([&] {
    v1::StatusResponse st;
    return raw.Status("stall", "", &st).ok() &&
           (st.jobs_size() == 0 || !st.jobs(0).members(0).connected());
  })) << "the stalled stream was never dropped";
  EXPECT_TRUE(absl::StrContains(side.log(), "--write-deadline-ms")) << side.log();
  ctx.TryCancel();
  ExpectServes(side.address, "after-stall");
}

// A stream that floods frames before any Attach is cut at --max-unbound-bytes.
TEST(Hardening, FramesBeforeAttachAreBounded) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--max-unbound-bytes=65536"});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = raw.stub->Exchange(&ctx);
  v1::ClientFrame batch;
  for (int i = 0; i < 64; ++i) {
    *batch.mutable_batch()->add_frames() = Contribution(std::string(16, 'x'), 0, uint64_t(i), 64);
  }
  for (int i = 0; i < 64 && stream->Write(batch); ++i) {
  }
  stream->WritesDone();
  v1::ServerFrame f;
  while (stream->Read(&f)) {
  }
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max-unbound-bytes")) << s.error_message();
  ExpectServes(side.address, "after-unbound");
}

// Jobs whose members joined and never attached a stream give their --max-jobs slot back.
TEST(Hardening, JobsThatNeverAttachExpire) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--max-jobs=2", "--attach-timeout-ms=300"});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  ASSERT_TRUE(raw.Join("idle1", 0, 2, 2, nullptr).ok());
  ASSERT_TRUE(raw.Join("idle2", 0, 2, 2, nullptr).ok());
  EXPECT_EQ(raw.Join("third", 0, 1, 1, nullptr).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Event: the aggregator drops them (Status shows no job).
  ASSERT_TRUE(WaitFor([&] {
    v1::StatusResponse st;
    return raw.Status("", "", &st).ok() && st.jobs_size() == 0;
  })) << "idle jobs never expired";
  ExpectServes(side.address, "third");
}

// A worker's Abort speaks only for the worker itself (docs/PROTOCOL.md, "A worker that
// aborts"): whatever round it names, it means "this rank is gone", so its round-mates' round
// fails naming the aborting rank, never another; and the aborted session is off its stream.
TEST(Hardening, AWorkersAbortOnlyEverSaysThatItIsGone) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock")});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  std::string s0, s1;
  ASSERT_TRUE(raw.Join("ab", 0, 2, 2, &s0).ok());
  ASSERT_TRUE(raw.Join("ab", 1, 2, 2, &s1).ok());
  grpc::ClientContext c0, c1;
  auto st0 = raw.stub->Exchange(&c0);
  auto st1 = raw.stub->Exchange(&c1);
  ASSERT_TRUE(st0->Write(AttachFrame(s0)) && st1->Write(AttachFrame(s1)));
  ASSERT_TRUE(st0->Write(Contribution(s0, 3, 0, 2)));
  v1::ClientFrame abort;
  abort.mutable_abort()->set_session(s1);
  abort.mutable_abort()->set_op(3);
  abort.mutable_abort()->set_phase(v1::PHASE_FORWARD);
  abort.mutable_abort()->set_code(int(grpc::StatusCode::ABORTED));
  abort.mutable_abort()->set_message("rank 0 is evil");
  ASSERT_TRUE(st1->Write(abort));
  ASSERT_TRUE(st1->Write(Contribution(s1, 3, 0, 2)));
  v1::ServerFrame f;
  ASSERT_TRUE(st0->Read(&f));
  EXPECT_EQ(f.result().code(), int(grpc::StatusCode::ABORTED)) << f.result().message();
  EXPECT_EQ(f.result().reason(), v1::REASON_MEMBER_ABORTED);
  EXPECT_TRUE(absl::StrContains(f.result().message(), "rank 1 (node 0, local rank 1) aborted"))
      << f.result().message();
  ASSERT_TRUE(st1->Read(&f));
  EXPECT_EQ(f.result().code(), int(grpc::StatusCode::NOT_FOUND)) << f.result().message();
  c0.TryCancel();
  c1.TryCancel();
}

TEST(Hardening, JobIdsAreShortPrintableAndNeverForgeALogLine) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock")});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  grpc::Status s = raw.Join(std::string(300, 'j'), 0, 1, 1, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "256")) << s.error_message();
  EXPECT_LT(s.error_message().size(), 1024u);
  const std::string forged = "x\n[hsbn] FAKE root says: all good";
  s = raw.Join(forged, 0, 1, 1, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(absl::StrContains(s.error_message(), "\n")) << s.error_message();
  ExpectServes(side.address, "after-ids");  // its log line comes after the refusals
  EXPECT_FALSE(absl::StrContains(side.log(), "\n[hsbn] FAKE")) << side.log();
}

// Lines of the log that say a round of job `job` failed, and the sum of K over the
// "suppressed K round_failed lines" lines.
std::pair<int64_t, int64_t> FailedRoundLines(const std::string& log, const std::string& job) {
  int64_t logged = 0, suppressed = 0;
  const std::string failed = absl::StrCat("job '", job, "': round ");
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, failed) && absl::StrContains(line, " failed: ")) ++logged;
    const size_t at = line.find("] suppressed ");
    if (at == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(at + 13);
    const size_t space = rest.find(' ');
    int64_t n = 0;
    if (space != absl::string_view::npos &&
        absl::StartsWith(rest.substr(space), " round_failed line") &&
        absl::SimpleAtoi(rest.substr(0, space), &n)) {
      suppressed += n;
    }
  }
  return {logged, suppressed};
}

// A joined worker can fail rounds as fast as it can send (issue 26: 20 000 invalid
// contributions grew a sidecar's log by 3 MiB). Failed rounds are logged through the rate
// limit of --log-lines-per-second, as kind round_failed: at most N lines in any second, and
// every failure accounted for, logged or counted in a "suppressed" line.
TEST(Hardening, AFloodOfFailedRoundsIsLoggedWithinTheRateLimit) {
  TempDir dir;
  constexpr int kRate = 5;
  constexpr int kRounds = 20000;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                absl::StrCat("--log-lines-per-second=", kRate)});
  ASSERT_TRUE(side.process);
  Raw raw(side.address);
  std::string session;
  ASSERT_TRUE(raw.Join("flood", 0, 1, 1, &session).ok());
  grpc::ClientContext ctx;
  auto stream = raw.stub->Exchange(&ctx);
  ASSERT_TRUE(stream->Write(AttachFrame(session)));
  const auto t0 = std::chrono::steady_clock::now();
  // channels = 0 is refused: each contribution fails its own round, answered to the sender.
  std::thread writer([&] {
    for (int seq = 0; seq < kRounds; ++seq) {
      if (!stream->Write(Contribution(session, 1, uint64_t(seq), 0))) break;
    }
  });
  int refused = 0;
  v1::ServerFrame frame;
  while (refused < kRounds && stream->Read(&frame)) {
    if (frame.result().code() != int(grpc::StatusCode::INVALID_ARGUMENT)) {
      ADD_FAILURE() << frame.result().message();
      break;
    }
    ++refused;
  }
  const auto t1 = std::chrono::steady_clock::now();
  writer.join();
  EXPECT_EQ(refused, kRounds);
  EXPECT_TRUE(absl::StrContains(frame.result().message(), "channels")) << frame.result().message();
  // Every failed round's line was logged before its answer was sent, so all were logged (or
  // suppressed) between t0 and t1; the count of the last second comes with the next tick.
  std::pair<int64_t, int64_t> lines;
  EXPECT_TRUE(WaitFor([&] {
    lines = FailedRoundLines(side.log(), "flood");
    return lines.first + lines.second >= kRounds;
  })) << lines.first << " logged, " << lines.second << " suppressed";
  EXPECT_EQ(lines.first + lines.second, kRounds);
  // The limiter's windows are a second long and disjoint, each opened by a line within
  // [t0, t1]: at most floor(t1 - t0) + 1 of them, kRate lines each.
  const int64_t windows = std::chrono::duration_cast<seconds>(t1 - t0).count() + 1;
  EXPECT_LE(lines.first, kRate * windows) << lines.first << " lines in " << windows << " s";
  EXPECT_GT(lines.second, 0);
  ctx.TryCancel();
  ExpectServes(side.address, "after-flood");
}

// NaN and Inf are data (docs/PROTOCOL.md): the round completes for every member, and the
// aggregator counts what it saw.
TEST(Hardening, NonFiniteValuesAreCountedNotRefused) {
  TempDir dir;
  Aggregator side = MustStart(dir.path(), "s", {"--role=node", "--listen=unix:" + (dir / "s.sock"),
                                                "--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(side.process);
  auto c = Client::Connect(WorkerOptions(side.address, "nan", 0, 1, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  const double mean[2] = {std::nan(""), 1.0}, m2[2] = {1.0, INFINITY};
  double a[2], b[2];
  int64_t n = 0;
  absl::Status s = (*c)->Forward(0, 0, Scope::kNode, 2, 4, mean, m2, &n, a, b);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(std::isnan(a[0]));
  EXPECT_TRUE(std::isinf(b[1]));
  auto metrics = HttpGet(side.metrics);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(Sample(*metrics, "hsbn_nonfinite_values_total", {{"phase", "forward"}}), 2.0)
      << *metrics;
}

}  // namespace
}  // namespace hsbn::testing

// A hostile worker of a job on the shared-memory node path (issue 13): it maps its job's segment
// like any worker, then writes garbage into slots, the sidecar's queue and the header. Its own
// job's rounds may fail (that is the trust model within a job, as on the stream), but no
// process crashes or reads outside the segment, errors name the rank, and the sidecar keeps
// serving other jobs. A process that did not join a job cannot obtain its segment.
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "aggregator_process.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "hsbn/client.h"
#include "hsbn/v1/hsbn.grpc.pb.h"
#include "local_cluster.h"
#include "shm_channel.h"

namespace hsbn {
namespace {

using client_internal::ShmChannel;
using client_internal::ShmConfig;

struct Hostile {
  std::unique_ptr<v1::Aggregator::Stub> stub;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream;
  std::shared_ptr<ShmChannel> channel;
};

// Joins `job` as `rank` of a 1-node job of `world` ranks through raw gRPC, attaches a stream
// and fetches the segment with the hand-off, exactly as a client would.
Hostile JoinHostile(const std::string& address, const std::string& job, int rank, int world) {
  Hostile h;
  h.stub = v1::Aggregator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  v1::JoinRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_2);
  req.set_job_id(job);
  req.set_kind(v1::MEMBER_KIND_WORKER);
  req.set_rank(rank);
  req.set_world_size(world);
  req.set_local_rank(rank);
  req.set_local_world_size(world);
  req.set_node_rank(0);
  req.set_shm_offer(true);
  v1::JoinResponse resp;
  grpc::ClientContext jctx;
  grpc::Status s = h.stub->Join(&jctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(resp.shm_socket().empty()) << resp.shm_note();
  h.ctx = std::make_unique<grpc::ClientContext>();
  h.stream = h.stub->Exchange(h.ctx.get());
  v1::ClientFrame attach;
  attach.mutable_attach()->add_sessions(resp.session());
  EXPECT_TRUE(h.stream->Write(attach));
  ShmConfig config;
  config.socket = resp.shm_socket();
  config.session = resp.session();
  config.job_id = job;
  config.local_rank = rank;
  config.local_world_size = world;
  auto ch = ShmChannel::Open(config);
  EXPECT_TRUE(ch.ok()) << ch.status();
  if (ch.ok()) h.channel = *ch;
  return h;
}

ClientOptions Rank0(const cluster::LocalCluster& c, const std::string& job, int world) {
  ClientOptions o;
  o.address = c.sidecar_address(0);
  o.job_id = job;
  o.rank = 0;
  o.world_size = world;
  o.local_rank = 0;
  o.local_world_size = world;
  o.node_rank = 0;
  o.transport = "auto";
  o.round_timeout = std::chrono::milliseconds(3000);
  return o;
}

// The sidecar still serves a fresh job over shared memory.
void ExpectSidecarServes(const cluster::LocalCluster& c, const std::string& job) {
  auto solo = Client::Connect(Rank0(c, job, 1));
  ASSERT_TRUE(solo.ok()) << solo.status();
  double mean[2] = {1, 2}, m2[2] = {0, 0};
  int64_t n = 0;
  absl::Status s = (*solo)->Forward(0, 0, Scope::kNode, 2, 3, mean, m2, &n, mean, m2);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(n, 3);
  EXPECT_EQ((*solo)->Stats().transport, "shm");
}

TEST(ShmHostile, GarbageSlotsFailOnlyTheirJobsRoundsNamingTheRank) {
  cluster::ClusterOptions opts;
  opts.nodes = 1;
  opts.workers_per_node = 2;
  auto c = cluster::LocalCluster::Start(opts);
  ASSERT_TRUE(c.ok()) << c.status();
  auto good = Client::Connect(Rank0(**c, "victim", 2));
  ASSERT_TRUE(good.ok()) << good.status();
  Hostile bad = JoinHostile((*c)->sidecar_address(0), "victim", 1, 2);
  ASSERT_TRUE(bad.channel);
  ASSERT_TRUE(bad.channel->Await(std::chrono::steady_clock::now() + std::chrono::seconds(30)).ok());
  shm::Segment* seg = bad.channel->segment();
  ASSERT_NE(seg, nullptr);
  double a[4] = {1, 2, 3, 4}, b[4] = {1, 1, 1, 1};
  int64_t n = 0;
  double out_a[4], out_b[4];
  struct Case {
    const char* name;
    int64_t channels;
    int64_t count;
    absl::StatusCode code;
    const char* says;
  } cases[] = {
      {"negative count", 4, -7, absl::StatusCode::kInvalidArgument, "'count'"},
      {"channel mismatch", 3, 2, absl::StatusCode::kInvalidArgument, "'channels'"},
      {"a billion channels", int64_t(1) << 30, 2, absl::StatusCode::kResourceExhausted,
       "--max-channels"},
  };
  uint64_t seq = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const shm::Key key{5, seq, int32_t(v1::PHASE_FORWARD)};
    seg->Post(1, 0, key, v1::SCOPE_NODE, k.channels, k.count, a, b);
    absl::Status s = (*good)->Forward(5, seq, Scope::kNode, 4, 2, a, b, &n, out_a, out_b);
    EXPECT_EQ(s.code(), k.code) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 1")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), k.says)) << s;
    // The hostile rank's slot got the same error; it frees it as a worker would.
    absl::Status mine;
    std::vector<double> d;
    EXPECT_TRUE(seg->Take(1, 0, (seg->State(1, 0) & ~0xffu) | shm::kPosted, 4, &mine, &n, &d));
    ++seq;
  }
  // Random bytes over every slot and queue entry (the header stays: it only says who is gone),
  // and the doorbell rung: the sidecar drops the malformed queue entries.
  std::mt19937_64 gen(7);
  char* base = reinterpret_cast<char*>(seg->header());
  for (uint64_t off = shm::kHeaderBytes; off + 8 <= seg->geometry().total_bytes; off += 8) {
    const uint64_t v = gen();
    std::memcpy(base + off, &v, 8);
  }
  for (int32_t j = 0; j < seg->geometry().queue; ++j) {
    seg->entry(j)->state = shm::kReady;  // make the sidecar read every entry
  }
  const uint64_t one = 1;
  ASSERT_EQ(write(bad.channel->doorbell(), &one, sizeof one), ssize_t(sizeof one));
  // Rank 0's round over a segment full of garbage: an error or a (wrong) result, never a
  // crash; then the job's rounds and every other job still work.
  (void)(*good)->Forward(5, 99, Scope::kNode, 4, 2, a, b, &n, out_a, out_b);
  ExpectSidecarServes(**c, "bystander");
  // Everything, header included.
  for (uint64_t off = 0; off + 8 <= seg->geometry().total_bytes; off += 8) {
    const uint64_t v = gen();
    std::memcpy(base + off, &v, 8);
  }
  (void)(*good)->Forward(5, 100, Scope::kNode, 4, 2, a, b, &n, out_a, out_b);
  ExpectSidecarServes(**c, "bystander-2");
}

// The header's metric counters are written by the job's workers, so a hostile one can raise
// its node's counts (like running more rounds), but never make the sidecar's exported counters
// go down or jump by more than 2^32 at once.
TEST(ShmHostile, CountersAWorkerWritesCannotMakeTheSidecarsMetricsGoDownOrJump) {
  cluster::ClusterOptions opts;
  opts.nodes = 1;
  opts.workers_per_node = 2;
  opts.extra_flags = {"--metrics-listen=127.0.0.1:0"};
  auto c = cluster::LocalCluster::Start(opts);
  ASSERT_TRUE(c.ok()) << c.status();
  std::string metrics;
  {
    std::ifstream ready((*c)->dir() + "/node0.ready");
    for (std::string line; std::getline(ready, line);) {
      if (absl::StartsWith(line, "metrics=http://")) metrics = line.substr(15);
    }
  }
  ASSERT_FALSE(metrics.empty());
  auto sample = [&](const char* name, std::map<std::string, std::string> labels) {
    auto body = testing::HttpGet(metrics);
    EXPECT_TRUE(body.ok()) << body.status();
    return body.ok() ? testing::Sample(*body, name, labels) : -1.0;
  };
  const std::map<std::string, std::string> node_ok = {
      {"scope", "node"}, {"phase", "forward"}, {"outcome", "ok"}};
  const std::map<std::string, std::string> fwd = {{"phase", "forward"}};
  auto good = Client::Connect(Rank0(**c, "counted", 2));
  ASSERT_TRUE(good.ok()) << good.status();
  Hostile bad = JoinHostile((*c)->sidecar_address(0), "counted", 1, 2);
  ASSERT_TRUE(bad.channel);
  ASSERT_TRUE(bad.channel->Await(std::chrono::steady_clock::now() + std::chrono::seconds(30)).ok());
  shm::Header* h = bad.channel->segment()->header();
  uint64_t* rounds = &h->rounds[v1::SCOPE_NODE][v1::PHASE_FORWARD][0];
  uint64_t* nonfinite = &h->nonfinite[v1::PHASE_FORWARD];
  EXPECT_EQ(sample("hsbn_rounds_total", node_ok), 0);
  __atomic_store_n(rounds, 1000, __ATOMIC_RELAXED);
  __atomic_store_n(nonfinite, 7, __ATOMIC_RELAXED);
  EXPECT_EQ(sample("hsbn_rounds_total", node_ok), 1000);
  EXPECT_EQ(sample("hsbn_nonfinite_values_total", fwd), 7);
  // Down: taken as the new base, nothing added.
  __atomic_store_n(rounds, 5, __ATOMIC_RELAXED);
  __atomic_store_n(nonfinite, 0, __ATOMIC_RELAXED);
  EXPECT_EQ(sample("hsbn_rounds_total", node_ok), 1000);
  EXPECT_EQ(sample("hsbn_nonfinite_values_total", fwd), 7);
  // A jump to the top: at most 2^32 per step.
  __atomic_store_n(rounds, std::numeric_limits<uint64_t>::max(), __ATOMIC_RELAXED);
  EXPECT_EQ(sample("hsbn_rounds_total", node_ok), 1000 + 4294967296.0);
  ExpectSidecarServes(**c, "bystander");
}

TEST(ShmHostile, ASessionThatDidNotJoinTheJobGetsNoSegment) {
  cluster::ClusterOptions opts;
  opts.nodes = 1;
  opts.workers_per_node = 2;
  auto c = cluster::LocalCluster::Start(opts);
  ASSERT_TRUE(c.ok()) << c.status();
  // A real job exists, so the socket is there and serves it.
  Hostile member = JoinHostile((*c)->sidecar_address(0), "private", 0, 2);
  ASSERT_TRUE(member.channel);
  // A stranger presents a session it made up.
  ShmConfig config;
  config.socket = (*c)->sidecar_address(0).substr(5) + ".shm";
  config.session = std::string(16, '\x5a');
  config.job_id = "private";
  config.local_rank = 1;
  config.local_world_size = 2;
  auto stranger = ShmChannel::Open(config);
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  absl::Status s = (*stranger)->Await(std::chrono::steady_clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "refused")) << s;
  EXPECT_EQ((*stranger)->segment(), nullptr);
}

}  // namespace
}  // namespace hsbn

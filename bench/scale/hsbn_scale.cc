// hsbn_scale — plays many sidecars of one job against a root (or against group aggregators)
// over the real sidecar->parent protocol: per simulated node its own channel (its own TCP
// connection), a Join as an aggregator member (rank -1, member_nodes 1), one Exchange stream,
// an Attach, then one node partial per round and the round's Result back.
//
// Each step is ResNet-50's 106 rounds (53 BN layers forward, then backward in reverse), strictly
// one after another as in training: round r+1 of this process's nodes starts once every one of
// them has round r's result. Steps start on a fixed schedule, step s at T0 + s / rate, so the
// offered load is held at rate * 106 * nodes partials per second whatever the aggregators do;
// a step that ends late starts the next one at once (the run falls behind, and says so).
//
// Protocol: after every node joined and attached, prints "ready" on stdout and reads T0
// (steady-clock nanoseconds, CLOCK_MONOTONIC) from stdin; the driver (run.py) sends every
// process the same T0. Every process runs the same number of steps (rounds must match).
// Writes JSON to --out: per round its first send and last result (steady-clock ns), per-node
// round-trip percentiles of the timed steps, and the failures (a failed round ends the run).
//
//   hsbn_scale --address=A[,A2,...] --job=ID --nodes=N --first-node=F --count=M
//              [--local-world=8] [--group-nodes=K] [--rate=STEPS_PER_S] [--warmup-steps=1]
//              [--steps=3] [--cooldown-steps=1] [--scope=global|group] --out=FILE
// With several addresses, node i talks to address[i / K] (its group's aggregator).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "grpcpp/grpcpp.h"
#include "hsbn/v1/hsbn.grpc.pb.h"

namespace hsbn_bench {
namespace {

namespace v1 = hsbn::v1;

constexpr int64_t kCount = 4096;  // values per channel behind each node partial

struct Node;
struct Tag {
  enum Kind { kStart, kRead, kWrite, kFinish } kind;
  Node* node;
};

struct Node {
  int index = 0;  // node rank in the job
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Aggregator::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::ClientFrame, v1::ServerFrame>> stream;
  std::string session;
  v1::ServerFrame in;
  std::deque<v1::ClientFrame> out;
  bool writing = false;
  bool started = false;
  bool answered = false;
  int64_t sent_ns = 0;
  grpc::Status finish_status;
  Tag start{Tag::kStart, this}, read{Tag::kRead, this}, write{Tag::kWrite, this},
      finish{Tag::kFinish, this};
};

struct RoundRow {
  int step, round;
  int64_t first_send_ns, last_result_ns;
};

void Write(Node* n, v1::ClientFrame f) {
  n->out.push_back(std::move(f));
  if (!n->writing && n->started) {
    n->writing = true;
    n->stream->Write(n->out.front(), &n->write);
  }
}

double Percentile(std::vector<int64_t> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return double(v[std::min(v.size() - 1, size_t(q * double(v.size())))]);
}

int Main(const Args& args) {
  const std::vector<std::string> addresses = args.List("address", "");
  const std::string job = args.Str("job", "scale");
  const int nodes = int(args.Int("nodes", 64));
  const int first = int(args.Int("first-node", 0));
  const int count = int(args.Int("count", nodes));
  const int local_world = int(args.Int("local-world", 8));
  const int group_nodes = int(args.Int("group-nodes", 0));
  const double rate = std::atof(args.Str("rate", "1").c_str());
  const int warmup = int(args.Int("warmup-steps", 1));
  const int steps = int(args.Int("steps", 3));
  const int cooldown = int(args.Int("cooldown-steps", 1));
  const std::string scope_name = args.Str("scope", "global");
  const std::string out_path = args.Str("out");
  if (addresses.empty() || out_path.empty()) Die("--address and --out are required");
  if (nodes < 1 || count < 1 || first < 0 || first + count > nodes || rate <= 0) {
    Die("need 0 <= --first-node, --first-node + --count <= --nodes, --rate > 0");
  }
  if (addresses.size() > 1 && (group_nodes < 1 || size_t((nodes + group_nodes - 1) / group_nodes) !=
                                                      addresses.size())) {
    Die("several --address: one per group of --group-nodes nodes");
  }
  const v1::Scope scope = scope_name == "group" ? v1::SCOPE_GROUP : v1::SCOPE_GLOBAL;
  const int members = scope == v1::SCOPE_GROUP ? group_nodes : nodes;
  if (scope == v1::SCOPE_GROUP && (group_nodes < 1 || nodes % group_nodes != 0)) {
    Die("--scope=group needs --group-nodes dividing --nodes");
  }

  // Many connections: raise the soft fd limit to the hard one.
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }

  const std::vector<int> layers = ResNet50Channels();
  const int num_layers = int(layers.size());
  const int rounds_per_step = 2 * num_layers;
  // One template payload per layer: [mean | m2], mean_c = 0.001 c, variance 1. Channel 0's mean
  // is set per node (0.01 * node) when a partial is built, so that the reduced mean checks that
  // every node's partial was merged.
  std::vector<std::string> fwd(num_layers), bwd(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    const int c = layers[size_t(l)];
    std::vector<double> f(size_t(2 * c)), b(size_t(2 * c));
    for (int i = 0; i < c; ++i) {
      f[size_t(i)] = 0.001 * i;
      f[size_t(c + i)] = double(kCount);
      b[size_t(i)] = 0.5;
      b[size_t(c + i)] = 0.25;
    }
    fwd[size_t(l)].assign(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(double));
    bwd[size_t(l)].assign(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(double));
  }

  // Join every node (aggregator members, as a sidecar joins its parent).
  std::vector<std::unique_ptr<Node>> all;
  for (int k = 0; k < count; ++k) {
    auto n = std::make_unique<Node>();
    n->index = first + k;
    const std::string& address =
        addresses.size() > 1 ? addresses[size_t(n->index / group_nodes)] : addresses[0];
    grpc::ChannelArguments ch_args;
    ch_args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    ch_args.SetMaxReceiveMessageSize(-1);
    n->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), ch_args);
    n->stub = v1::Aggregator::NewStub(n->channel);
    v1::JoinRequest req;
    req.set_protocol_version(v1::PROTOCOL_VERSION_2);
    req.set_job_id(job);
    req.set_kind(v1::MEMBER_KIND_AGGREGATOR);
    req.set_world_size(nodes * local_world);
    req.set_local_world_size(local_world);
    req.set_node_rank(n->index);
    req.set_member_nodes(1);
    req.set_rank(-1);
    req.set_local_rank(-1);
    req.set_group_nodes(group_nodes);
    v1::JoinResponse resp;
    grpc::ClientContext jctx;
    jctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    jctx.set_wait_for_ready(true);
    const grpc::Status s = n->stub->Join(&jctx, req, &resp);
    if (!s.ok()) {
      Die("node " + std::to_string(n->index) + ": Join at " + address + ": " + s.error_message());
    }
    n->session = resp.session();
    all.push_back(std::move(n));
  }

  grpc::CompletionQueue cq;
  for (auto& n : all) {
    n->stream = n->stub->PrepareAsyncExchange(&n->ctx, &cq);
    n->stream->StartCall(&n->start);
    v1::ClientFrame attach;
    attach.mutable_attach()->add_sessions(n->session);
    attach.mutable_attach()->set_accepts_batches(true);
    Write(n.get(), std::move(attach));
  }
  std::string failure;
  int64_t failed_rounds = 0;
  int answered = 0;
  int cur_step = -1, cur_round = -1;
  std::vector<RoundRow> rows;
  std::vector<int64_t> node_rtt;  // timed steps only
  const int total_steps = warmup + steps + cooldown;

  // One completion.
  auto handle = [&](void* tagp, bool ok) {
    Tag* tag = static_cast<Tag*>(tagp);
    Node* n = tag->node;
    switch (tag->kind) {
      case Tag::kStart:
        if (!ok) {
          if (failure.empty()) {
            failure = "node " + std::to_string(n->index) + ": stream did not start";
          }
          return;
        }
        n->started = true;
        n->stream->Read(&n->in, &n->read);
        if (!n->out.empty()) {
          n->writing = true;
          n->stream->Write(n->out.front(), &n->write);
        }
        return;
      case Tag::kWrite:
        n->writing = false;
        if (!ok) return;  // the read fails too and reports it
        n->out.pop_front();
        if (!n->out.empty()) {
          n->writing = true;
          n->stream->Write(n->out.front(), &n->write);
        }
        return;
      case Tag::kFinish:
        return;
      case Tag::kRead: {
        if (!ok) {
          n->stream->Finish(&n->finish_status, &n->finish);
          if (failure.empty()) failure = "node " + std::to_string(n->index) + ": stream ended";
          return;
        }
        const int64_t now = NowNs();
        std::vector<const v1::Result*> results;
        if (n->in.has_result()) results.push_back(&n->in.result());
        for (const v1::Result& r : n->in.batch().results()) results.push_back(&r);
        for (const v1::Result* r : results) {
          if (rows.empty()) {  // nothing was sent yet: no result is due
            if (failure.empty()) {
              failure = "node " + std::to_string(n->index) + ": early result: " + r->message();
            }
            continue;
          }
          const int layer = cur_round < num_layers ? cur_round : rounds_per_step - 1 - cur_round;
          const v1::Phase phase = cur_round < num_layers ? v1::PHASE_FORWARD : v1::PHASE_BACKWARD;
          if (r->op() != uint32_t(layer) || r->seq() != uint64_t(cur_step) || r->phase() != phase ||
              n->answered) {
            if (failure.empty()) {
              failure = "node " + std::to_string(n->index) + ": unexpected result op " +
                        std::to_string(r->op()) + " seq " + std::to_string(r->seq());
            }
            continue;
          }
          if (r->code() != 0) {
            ++failed_rounds;
            if (failure.empty()) failure = "round failed: " + r->message();
          } else if (r->count() != int64_t(members) * kCount) {
            if (failure.empty()) failure = "wrong count " + std::to_string(r->count());
          } else if (phase == v1::PHASE_FORWARD) {
            double mean0 = 0;
            std::memcpy(&mean0, r->data().data(), sizeof mean0);
            const int base = scope == v1::SCOPE_GROUP ? n->index / group_nodes * group_nodes : 0;
            const double want = 0.01 * (base + (members - 1) / 2.0);
            if (std::abs(mean0 - want) > 1e-9 * std::max(1.0, want)) {
              if (failure.empty()) failure = "wrong mean " + std::to_string(mean0);
            }
          }
          n->answered = true;
          ++answered;
          if (cur_step >= warmup && cur_step < warmup + steps) node_rtt.push_back(now - n->sent_ns);
          rows.back().last_result_ns = now;
        }
        n->stream->Read(&n->in, &n->read);
        return;
      }
    }
  };
  auto drain_until = [&](std::function<bool()> done, int64_t deadline_ns) {
    while (!done() && failure.empty()) {
      void* tag = nullptr;
      bool ok = false;
      const auto dl = deadline_ns > 0 ? std::chrono::system_clock::now() +
                                            std::chrono::nanoseconds(deadline_ns - NowNs())
                                      : std::chrono::system_clock::time_point::max();
      const auto st = cq.AsyncNext(&tag, &ok, dl);
      if (st == grpc::CompletionQueue::TIMEOUT) return;
      if (st == grpc::CompletionQueue::SHUTDOWN) return;
      handle(tag, ok);
    }
  };
  {
    int started = 0;
    drain_until([&] {
      started = 0;
      for (auto& n : all) started += n->started && n->out.empty();
      return started == count;
    }, NowNs() + int64_t(60e9));
    if (started != count && failure.empty()) failure = "streams did not start within 60 s";
  }

  std::printf("ready\n");
  std::fflush(stdout);
  long long t0 = 0;
  if (failure.empty() && !(std::cin >> t0)) failure = "no T0 on stdin";
  int64_t behind_max_ns = 0;
  std::vector<std::pair<int64_t, int64_t>> step_times;

  for (int step = 0; step < total_steps && failure.empty(); ++step) {
    const int64_t scheduled = t0 + int64_t(double(step) * 1e9 / rate);
    drain_until([] { return false; }, scheduled);  // idle until the step's start
    const int64_t start = NowNs();
    behind_max_ns = std::max(behind_max_ns, start - scheduled);
    cur_step = step;
    for (int r = 0; r < rounds_per_step && failure.empty(); ++r) {
      cur_round = r;
      const int layer = r < num_layers ? r : rounds_per_step - 1 - r;
      const bool forward = r < num_layers;
      const int c = layers[size_t(layer)];
      answered = 0;
      rows.push_back(RoundRow{step, r, NowNs(), 0});
      for (auto& n : all) {
        v1::ClientFrame f;
        v1::Contribution* p = f.mutable_contribution();
        p->set_session(n->session);
        p->set_op(uint32_t(layer));
        p->set_seq(uint64_t(step));
        p->set_phase(forward ? v1::PHASE_FORWARD : v1::PHASE_BACKWARD);
        p->set_scope(scope);
        p->set_channels(uint32_t(c));
        p->set_count(kCount);
        std::string* data = p->mutable_data();
        *data = forward ? fwd[size_t(layer)] : bwd[size_t(layer)];
        if (forward) {
          const double mean0 = 0.01 * n->index;
          std::memcpy(data->data(), &mean0, sizeof mean0);
        }
        n->answered = false;
        n->sent_ns = NowNs();
        Write(n.get(), std::move(f));
      }
      drain_until([&] { return answered == count; }, 0);
    }
    step_times.emplace_back(start, NowNs());
  }

  // Leave, then end every stream.
  for (auto& n : all) {
    n->ctx.TryCancel();
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }

  std::ofstream out(out_path);
  out << "{\"first_node\": " << first << ", \"count\": " << count << ", \"t0\": " << t0
      << ", \"rate\": " << rate << ", \"warmup_steps\": " << warmup << ", \"steps\": " << steps
      << ", \"behind_max_ms\": " << double(behind_max_ns) / 1e6
      << ", \"failed_rounds\": " << failed_rounds << ", \"failure\": \"";
  for (char ch : failure) out << (ch == '"' || ch == '\\' ? '\'' : ch);
  out << "\", \"node_rtt_p50_us\": " << Percentile(node_rtt, 0.5) / 1e3
      << ", \"node_rtt_p99_us\": " << Percentile(node_rtt, 0.99) / 1e3
      << ", \"node_rtt_samples\": " << node_rtt.size() << ", \"step_times\": [";
  for (size_t i = 0; i < step_times.size(); ++i) {
    out << (i ? ", " : "") << "[" << step_times[i].first << ", " << step_times[i].second << "]";
  }
  out << "], \"rounds\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    out << (i ? ", " : "") << "[" << rows[i].step << ", " << rows[i].round << ", "
        << rows[i].first_send_ns << ", " << rows[i].last_result_ns << "]";
  }
  out << "]}\n";
  out.close();
  if (!failure.empty()) {
    std::fprintf(stderr, "hsbn_scale: %s\n", failure.c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace hsbn_bench

int main(int argc, char** argv) { return hsbn_bench::Main(hsbn_bench::Args(argc, argv)); }

// hsbn_worker — one trainer process of the exchange benchmark, talking to its node's sidecar
// through hsbn's C ABI (hsbn.h), exactly as a framework binding would: one blocking
// hsbn_forward / hsbn_backward call per round.
//
//   hsbn_worker --address=unix:PATH --job=ID --rank=R --world=W --local-rank=L --local-world=LW
//               --node-rank=N <plan flags, see bench_common.h; --phases fwd,bwd --scopes node,global>
#include <string>

#include "bench_common.h"
#include "hsbn/hsbn.h"

int main(int argc, char** argv) {
  using namespace hsbn_bench;
  Args args(argc, argv);
  Plan plan = Plan::FromArgs(args);
  const std::string address = args.Str("address");
  const std::string job = args.Str("job", "bench");
  hsbn_options opt;
  hsbn_options_init(&opt);
  opt.address = address.c_str();
  opt.job_id = job.c_str();
  opt.rank = static_cast<int32_t>(args.Int("rank", 0));
  opt.world_size = static_cast<int32_t>(args.Int("world", 1));
  opt.local_rank = static_cast<int32_t>(args.Int("local-rank", 0));
  opt.local_world_size = static_cast<int32_t>(args.Int("local-world", 1));
  opt.node_rank = static_cast<int32_t>(args.Int("node-rank", 0));
  opt.connect_timeout_ms = 20000;
  hsbn_client* client = nullptr;
  if (hsbn_client_create(&opt, &client) != HSBN_OK) {
    Die(std::string("hsbn_client_create: ") + hsbn_last_error());
  }
  // Every contribution's count is 8 + rank (FillContribution): the reduced count tells whether
  // the round really spanned the scope. A benchmark of a wrong answer is no benchmark.
  int64_t node_count = 0, global_count = 0;
  for (int r = 0; r < opt.world_size; ++r) {
    global_count += 8 + r;
    if (r / opt.local_world_size == opt.node_rank) node_count += 8 + r;
  }
  RunPlan(plan, opt.rank, [&](int channels, Phase phase, Scope scope, const double* in,
                              double* out, uint32_t op, uint64_t seq) {
    const hsbn_scope s = scope == Scope::kGlobal ? HSBN_SCOPE_GLOBAL : HSBN_SCOPE_NODE;
    const int64_t count = static_cast<int64_t>(in[0]);
    int64_t out_count = 0;
    hsbn_result rc =
        phase == Phase::kForward
            ? hsbn_forward(client, op, seq, s, channels, count, in + 1, in + 1 + channels,
                           &out_count, out + 1, out + 1 + channels)
            : hsbn_backward(client, op, seq, s, channels, count, in + 1, in + 1 + channels,
                            &out_count, out + 1, out + 1 + channels);
    if (rc != HSBN_OK) {
      Die(std::string("round failed: ") + hsbn_result_string(rc) + ": " + hsbn_last_error());
    }
    if (out_count != (scope == Scope::kGlobal ? global_count : node_count)) {
      Die("round " + std::to_string(op) + "/" + std::to_string(seq) + ": reduced count " +
          std::to_string(out_count) + " does not match the scope");
    }
    out[0] = static_cast<double>(out_count);
  });
  hsbn_client_destroy(client);
  return 0;
}

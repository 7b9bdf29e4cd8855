// gloo_allreduce — Gloo's allreduce over its TCP transport on loopback, the same 2*C + 1
// doubles per round. --algorithm selects:
//   default  gloo::allreduce() with no algorithm set (what torch.distributed's gloo backend calls)
//   ring     gloo::AllreduceRing (the classic ring algorithm object)
//   hd       gloo::AllreduceHalvingDoubling (latency-optimal for small payloads)
// Rendezvous through a gloo::rendezvous::FileStore in --store-dir.
//
//   gloo_allreduce --rank=R --world=N --store-dir=DIR --algorithm=default <plan flags>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/barrier.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"

namespace hsbn_bench {
namespace {

void SumDoubles(void* c, const void* a, const void* b, size_t n) {
  double* out = static_cast<double*>(c);
  const double* x = static_cast<const double*>(a);
  const double* y = static_cast<const double*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

int Main(const Args& args) {
  const int rank = static_cast<int>(args.Int("rank", 0));
  const int world = static_cast<int>(args.Int("world", 1));
  const std::string algorithm = args.Str("algorithm", "default");
  Plan plan = Plan::FromArgs(args);

  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(args.Str("store-dir"));
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, world);
  context->setTimeout(std::chrono::seconds(60));
  context->connectFullMesh(store, device);

  // The algorithm objects bind their buffer at construction: one object per channel count,
  // built once, as a framework would cache them.
  std::map<int, std::pair<std::vector<double>, std::unique_ptr<gloo::Algorithm>>> cached;
  auto object_for = [&](int channels) -> std::pair<std::vector<double>, std::unique_ptr<gloo::Algorithm>>& {
    auto it = cached.find(channels);
    if (it != cached.end()) return it->second;
    auto& slot = cached[channels];
    slot.first.assign(2 * channels + 1, 0.0);
    std::vector<double*> ptrs = {slot.first.data()};
    if (algorithm == "ring") {
      slot.second.reset(new gloo::AllreduceRing<double>(context, ptrs, slot.first.size()));
    } else {
      slot.second.reset(
          new gloo::AllreduceHalvingDoubling<double>(context, ptrs, slot.first.size()));
    }
    return slot;
  };

  uint32_t tag = 0;
  RunPlan(plan, rank, [&](int channels, Phase, Scope, const double* in, double* out, uint32_t,
                          uint64_t) {
    const size_t n = 2 * channels + 1;
    if (algorithm == "default") {
      gloo::AllreduceOptions opts(context);
      opts.setInput(const_cast<double*>(in), n);
      opts.setOutput(out, n);
      opts.setReduceFunction(&SumDoubles);
      opts.setTag(tag++);
      gloo::allreduce(opts);
      return;
    }
    auto& slot = object_for(channels);
    std::memcpy(slot.first.data(), in, n * sizeof(double));
    slot.second->run();
    std::memcpy(out, slot.first.data(), n * sizeof(double));
  });
  // Some algorithms let a rank finish before its peers have received its last message: wait
  // for everyone before the context (and its connections) goes away.
  gloo::BarrierOptions barrier(context);
  barrier.setTag(tag + 1);
  gloo::barrier(barrier);
  return 0;
}

}  // namespace
}  // namespace hsbn_bench

int main(int argc, char** argv) {
  hsbn_bench::Args args(argc, argv);
  return hsbn_bench::Main(args);
}

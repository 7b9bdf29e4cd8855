// The CUDA reductions' plan (kernels/src/plan.h) depends on the shape alone, so it is tested
// here, without a GPU.
#include "gtest/gtest.h"
#include "hsbn/bn_kernels.h"
#include "plan.h"
#include "test_util.h"

namespace hsbn::kernels {
namespace {

using testing::MakeInput;

TEST(ReducePlan, SpatialSizeOneIsPlannedAsChannelsLastWhateverTheLayout) {
  for (DType dtype : {DType::kF16, DType::kF32, DType::kF64}) {
    const BnInput nchw = MakeInput(Device::kCuda, dtype, Layout::kNchw, 4096, 1024, 1);
    const BnInput cl = MakeInput(Device::kCuda, dtype, Layout::kChannelsLast, 4096, 1024, 1);
    EXPECT_EQ(ReduceLayout(nchw), Layout::kChannelsLast);
    EXPECT_EQ(MakeReducePlan(nchw).splits, MakeReducePlan(cl).splits);
    EXPECT_EQ(WorkspaceBytes(nchw), WorkspaceBytes(cl));
  }
  const BnInput s2 = MakeInput(Device::kCuda, DType::kF32, Layout::kNchw, 4096, 1024, 2);
  EXPECT_EQ(ReduceLayout(s2), Layout::kNchw);
}

TEST(ReducePlan, ManySplitsAreMergedByATreeWithFewPartialsPerThread) {
  // Channels-last with C <= 256 gets up to 1024 splits: above kSerialMergeSplits the final
  // merge is a block per channel, each of its 256 threads folding at most 4 partials.
  const BnInput cl = MakeInput(Device::kCuda, DType::kF32, Layout::kChannelsLast, 32, 64,
                               112 * 112);
  const ReducePlan p = MakeReducePlan(cl);
  EXPECT_GT(p.splits, kSerialMergeSplits);
  EXPECT_LE(p.splits, 1024);
  EXPECT_LE((p.splits + 255) / 256, 4);
  // The small cases the CUDA tests (and compute-sanitizer) run through the tree, both layouts.
  EXPECT_GT(MakeReducePlan(MakeInput(Device::kCuda, DType::kF32, Layout::kNchw, 4, 2, 65536))
                .splits,
            kSerialMergeSplits);
  EXPECT_GT(MakeReducePlan(MakeInput(Device::kCuda, DType::kF32, Layout::kChannelsLast, 8, 32,
                                     1024))
                .splits,
            kSerialMergeSplits);
}

TEST(ReducePlan, DependsOnTheShapeOnly) {
  const BnInput a = MakeInput(Device::kCuda, DType::kBF16, Layout::kNchw, 2, 256, 256 * 256);
  BnInput b = a;
  EXPECT_EQ(MakeReducePlan(a).splits, MakeReducePlan(b).splits);
  EXPECT_EQ(WorkspaceBytes(a), WorkspaceBytes(b));
  b.device = Device::kCpu;
  EXPECT_EQ(WorkspaceBytes(b), 0u);  // the CPU kernels need none
}

}  // namespace
}  // namespace hsbn::kernels

// The node segment's rounds in one process (round/shm_segment.h): two local ranks posting into
// one segment, as two workers would. Per-rank rounds (every rank reduces for itself) must give
// every rank the bits and errors of the one-reducer path, count each round once, free every
// slot once all ranks have read it (also when a rank gives up or is gone), and leave rounds the
// sidecar answers (global on several nodes) to one reducer.
#include "shm_segment.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "hsbn/v1/hsbn.pb.h"

namespace hsbn::shm {
namespace {

constexpr int64_t kC = 5;

struct Rig {
  std::unique_ptr<Segment> seg;
  explicit Rig(int32_t ranks) {
    auto g = Geometry::Make(ranks, 4, 64);
    EXPECT_TRUE(g.ok()) << g.status();
    auto s = Segment::Create(*g, true);
    EXPECT_TRUE(s.ok()) << s.status();
    seg = std::move(*s);
  }
  ReduceOptions Options(int32_t self, int32_t nodes = 1) const {
    ReduceOptions o;
    o.job_id = "j";
    o.self = self;
    o.num_nodes = nodes;
    o.max_channels_limit = 1024;
    o.per_rank_max = 2;
    return o;
  }
};

// Rank r's contribution: count 3 + r, means and M2s that differ per rank and channel.
uint32_t PostRank(Segment& seg, int32_t r, int32_t slot, const Key& key, int32_t scope,
                  int64_t count = -1) {
  std::vector<double> a(kC), b(kC);
  for (int64_t c = 0; c < kC; ++c) {
    a[size_t(c)] = 0.1 * double(c + 1) + 1.7 * double(r) + 1e-9 * double(c * r);
    b[size_t(c)] = 0.3 + double(c) * double(r + 1) / 7.0;
  }
  return seg.Post(r, slot, key, scope, kC, count >= 0 ? count : 3 + r, a.data(), b.data());
}

uint32_t StateOf(const Segment& seg, int32_t r, int32_t i) { return seg.State(r, i) & 0xffu; }

// The reference: the same round through the one-reducer path (three ranks: above per_rank_max),
// with rank 2 contributing nothing (count 0 merges as nothing in both phases).
std::vector<double> Central(const Key& key, int32_t scope, int64_t* count) {
  Rig rig(3);
  const uint32_t p0 = PostRank(*rig.seg, 0, 0, key, scope);
  const uint32_t p1 = PostRank(*rig.seg, 1, 0, key, scope);
  std::vector<double> zeros(kC, 0.0);
  const uint32_t p2 = rig.seg->Post(2, 0, key, scope, kC, 0, zeros.data(), zeros.data());
  EXPECT_TRUE(rig.seg->TryReduce(key, 0, rig.Options(2)));
  absl::Status s;
  std::vector<double> out;
  EXPECT_TRUE(rig.seg->Take(0, 0, p0, kC, &s, count, &out));
  EXPECT_TRUE(s.ok()) << s;
  std::vector<double> other;
  int64_t n = 0;
  EXPECT_TRUE(rig.seg->Take(1, 0, p1, kC, &s, &n, &other));
  EXPECT_TRUE(rig.seg->Take(2, 0, p2, kC, &s, &n, &other));
  EXPECT_EQ(other, out);
  return out;
}

TEST(ShmSegment, PerRankRoundsGiveEveryRankTheOneReducersBitsAndFreeTheSlotsOnceAllRead) {
  for (int32_t phase : {int32_t(v1::PHASE_FORWARD), int32_t(v1::PHASE_BACKWARD)}) {
    SCOPED_TRACE(phase);
    const Key key{7, 11, phase};
    int64_t want_count = 0;
    const std::vector<double> want = Central(key, v1::SCOPE_NODE, &want_count);
    Rig rig(2);
    const uint32_t p0 = PostRank(*rig.seg, 0, 1, key, v1::SCOPE_NODE);
    EXPECT_FALSE(rig.seg->TryReduce(key, 1, rig.Options(0)));  // rank 1 has not posted
    const uint32_t p1 = PostRank(*rig.seg, 1, 2, key, v1::SCOPE_NODE);
    Answer mine;
    ASSERT_TRUE(rig.seg->TryReduce(key, 2, rig.Options(1), &mine));
    ASSERT_TRUE(mine.ready);
    ASSERT_TRUE(mine.status.ok()) << mine.status;
    EXPECT_EQ(mine.count, want_count);
    EXPECT_EQ(0, std::memcmp(mine.data.data(), want.data(), want.size() * sizeof(double)));
    EXPECT_EQ(mine.data.size(), want.size());
    // Nothing was written back: rank 0 reduces for itself; until it has read rank 1's
    // contribution, that slot stays taken.
    EXPECT_EQ(StateOf(*rig.seg, 0, 1), kGathered);
    EXPECT_EQ(StateOf(*rig.seg, 1, 2), kGathered);
    absl::Status s;
    int64_t n = 0;
    std::vector<double> d;
    EXPECT_FALSE(rig.seg->Take(0, 1, p0, kC, &s, &n, &d));
    EXPECT_FALSE(rig.seg->Withdraw(0, 1, p0));
    ASSERT_TRUE(rig.seg->Collect(0, 1, p0, key, rig.Options(0), &s, &n, &d));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(n, want_count);
    EXPECT_EQ(d, want);
    EXPECT_EQ(StateOf(*rig.seg, 0, 1), kFree);
    EXPECT_EQ(StateOf(*rig.seg, 1, 2), kFree);
    EXPECT_FALSE(rig.seg->Collect(0, 1, p0, key, rig.Options(0), &s, &n, &d));
    EXPECT_EQ(rig.seg->header()->completed, 1u);  // counted once, by the claimer
    EXPECT_EQ(rig.seg->header()->failed, 0u);
    (void)p1;
  }
}

TEST(ShmSegment, PerRankRoundsGiveEveryRankTheSameErrorAndCountItOnce) {
  const Key key{3, 1, int32_t(v1::PHASE_FORWARD)};
  Rig rig(2);
  const uint32_t p0 = PostRank(*rig.seg, 0, 0, key, v1::SCOPE_NODE);
  PostRank(*rig.seg, 1, 0, key, v1::SCOPE_NODE, /*count=*/0);
  // Rank 1 writes a negative count after posting: a hostile or broken worker.
  rig.seg->slot(1, 0)->count = -4;
  Answer mine;
  ASSERT_TRUE(rig.seg->TryReduce(key, 0, rig.Options(1), &mine));
  ASSERT_TRUE(mine.ready);
  EXPECT_EQ(mine.status.code(), absl::StatusCode::kInvalidArgument) << mine.status;
  EXPECT_NE(std::string(mine.status.message()).find("rank 1"), std::string::npos);
  absl::Status s;
  int64_t n = 0;
  std::vector<double> d;
  ASSERT_TRUE(rig.seg->Collect(0, 0, p0, key, rig.Options(0), &s, &n, &d));
  EXPECT_EQ(s, mine.status);
  EXPECT_EQ(rig.seg->header()->failed, 1u);
  EXPECT_EQ(rig.seg->header()->completed, 0u);
  EXPECT_EQ(StateOf(*rig.seg, 0, 0), kFree);
  EXPECT_EQ(StateOf(*rig.seg, 1, 0), kFree);
}

TEST(ShmSegment, ARankThatGivesUpOrIsGoneStillFreesTheOthersSlots) {
  const Key key{1, 5, int32_t(v1::PHASE_BACKWARD)};
  {
    SCOPED_TRACE("abandoned: Release");
    Rig rig(2);
    PostRank(*rig.seg, 0, 3, key, v1::SCOPE_NODE);
    PostRank(*rig.seg, 1, 0, key, v1::SCOPE_NODE);
    Answer mine;
    ASSERT_TRUE(rig.seg->TryReduce(key, 0, rig.Options(1), &mine));
    EXPECT_EQ(StateOf(*rig.seg, 1, 0), kGathered);  // rank 0 has not read it
    rig.seg->Release(0, key);
    EXPECT_EQ(StateOf(*rig.seg, 0, 3), kFree);
    EXPECT_EQ(StateOf(*rig.seg, 1, 0), kFree);
  }
  {
    SCOPED_TRACE("gone: MarkGone");
    Rig rig(2);
    PostRank(*rig.seg, 0, 0, key, v1::SCOPE_NODE);
    PostRank(*rig.seg, 1, 1, key, v1::SCOPE_NODE);
    Answer mine;
    ASSERT_TRUE(rig.seg->TryReduce(key, 1, rig.Options(1), &mine));
    rig.seg->MarkGone(0, 1);
    EXPECT_EQ(StateOf(*rig.seg, 1, 1), kFree);
    EXPECT_EQ(StateOf(*rig.seg, 0, 0), kFree);
  }
}

TEST(ShmSegment, GlobalRoundsOfSeveralNodesHaveOneReducerAndRenormOnesGoUpOnce) {
  {
    SCOPED_TRACE("global, 2 nodes: the sidecar answers");
    const Key key{2, 9, int32_t(v1::PHASE_FORWARD)};
    Rig rig(2);
    PostRank(*rig.seg, 0, 0, key, v1::SCOPE_GLOBAL);
    PostRank(*rig.seg, 1, 0, key, v1::SCOPE_GLOBAL);
    Answer mine;
    ASSERT_TRUE(rig.seg->TryReduce(key, 0, rig.Options(1, 2), &mine));
    EXPECT_FALSE(mine.ready);
    EXPECT_EQ(StateOf(*rig.seg, 0, 0), kPosted);  // waits for the root's answer
    int malformed = 0;
    std::vector<QueueEntry> q = rig.seg->TakeQueue(&malformed);
    ASSERT_EQ(q.size(), 1u);
    EXPECT_EQ(q[0].kind, uint32_t(kPartial));
    EXPECT_EQ(q[0].count, 7);
  }
  {
    SCOPED_TRACE("renorm, 2 nodes: per-rank, the node partial queued once");
    const Key key{2, 9, int32_t(v1::PHASE_FORWARD)};
    int64_t want_count = 0;
    const std::vector<double> want = Central(key, v1::SCOPE_NODE, &want_count);
    Rig rig(2);
    const uint32_t p0 = PostRank(*rig.seg, 0, 0, key, v1::SCOPE_RENORM);
    PostRank(*rig.seg, 1, 0, key, v1::SCOPE_RENORM);
    Answer mine;
    ASSERT_TRUE(rig.seg->TryReduce(key, 0, rig.Options(1, 2), &mine));
    ASSERT_TRUE(mine.ready);
    ASSERT_TRUE(mine.status.ok()) << mine.status;
    EXPECT_EQ(mine.data, want);
    absl::Status s;
    int64_t n = 0;
    std::vector<double> d;
    ASSERT_TRUE(rig.seg->Collect(0, 0, p0, key, rig.Options(0, 2), &s, &n, &d));
    EXPECT_EQ(d, want);
    int malformed = 0;
    std::vector<QueueEntry> q = rig.seg->TakeQueue(&malformed);
    ASSERT_EQ(q.size(), 1u);
    EXPECT_EQ(q[0].kind, uint32_t(kPartial));
    EXPECT_EQ(q[0].data, want);
  }
}

}  // namespace
}  // namespace hsbn::shm

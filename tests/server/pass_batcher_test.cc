// PassBatcher (server/pass_batcher.h): when a job's lagged partials leave for the parent.
#include "pass_batcher.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsbn::server {
namespace {

using Clock = PassBatcher::Clock;
constexpr int kFwd = 0;
constexpr int kBwd = 1;

// Plays frames through a batcher the way ParentLink does and records what leaves when:
// each entry of the result is one flush (the frames that leave together, in order); a frame
// sent at once is a flush of its own.
struct Player {
  PassBatcher b;
  std::vector<std::string> held;
  std::vector<std::vector<std::string>> sent;
  Clock::time_point now{};

  void Flush() {
    if (!held.empty()) sent.push_back(held);
    held.clear();
  }
  void Frame(const std::string& name, bool lagged, uint32_t op, int phase) {
    const PassBatcher::Step s = b.Next(lagged, op, phase, now);
    if (s.flush_before) Flush();
    if (s.hold) {
      held.push_back(name);
    } else {
      sent.push_back({name});
    }
    if (s.flush_after) Flush();
    EXPECT_EQ(b.holding(), !held.empty()) << "after " << name;
  }
  // One training step of `layers` lagged layers: forwards 0..L-1, backwards L-1..0.
  void Step(int step, uint32_t layers) {
    for (uint32_t op = 0; op < layers; ++op) {
      Frame("f" + std::to_string(step) + "." + std::to_string(op), true, op, kFwd);
    }
    for (uint32_t op = layers; op-- > 0;) {
      Frame("b" + std::to_string(step) + "." + std::to_string(op), true, op, kBwd);
    }
  }
};

TEST(PassBatcher, FirstStepLeavesAtEachPhaseChangeThenEachPassLeavesWhenComplete) {
  Player p;
  p.Step(0, 3);
  // No previous pass yet: the forwards leave when the first backward comes; the backwards wait.
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0], (std::vector<std::string>{"f0.0", "f0.1", "f0.2"}));
  EXPECT_EQ(p.held, (std::vector<std::string>{"b0.2", "b0.1", "b0.0"}));
  p.Step(1, 3);
  // Step 1's first forward sends step 0's backwards; its passes are complete at their last layer.
  ASSERT_EQ(p.sent.size(), 4u);
  EXPECT_EQ(p.sent[1], (std::vector<std::string>{"b0.2", "b0.1", "b0.0"}));
  EXPECT_EQ(p.sent[2], (std::vector<std::string>{"f1.0", "f1.1", "f1.2"}));
  EXPECT_EQ(p.sent[3], (std::vector<std::string>{"b1.2", "b1.1", "b1.0"}));
  EXPECT_TRUE(p.held.empty());
  p.Step(2, 3);
  EXPECT_EQ(p.sent.size(), 6u);
  EXPECT_TRUE(p.held.empty());
}

TEST(PassBatcher, OtherFramesLeaveAfterTheHeldOnesAndDoNotEndThePass) {
  Player p;
  p.Step(0, 3);
  p.Step(1, 3);
  const size_t before = p.sent.size();
  // Layer 1 runs exact (a global partial) in the middle of the forward pass.
  p.Frame("f2.0", true, 0, kFwd);
  p.Frame("g2.1", false, 1, kFwd);
  ASSERT_EQ(p.sent.size(), before + 2);
  EXPECT_EQ(p.sent[before], (std::vector<std::string>{"f2.0"}));
  EXPECT_EQ(p.sent[before + 1], (std::vector<std::string>{"g2.1"}));
  EXPECT_FALSE(p.b.holding());
  p.Frame("f2.2", true, 2, kFwd);
  // The pass has had every layer of the previous one ({0, 1, 2}, of any scope): f2.2 ends it.
  ASSERT_EQ(p.sent.size(), before + 3);
  EXPECT_EQ(p.sent[before + 2], (std::vector<std::string>{"f2.2"}));
  p.Frame("b2.2", true, 2, kBwd);
  p.Frame("abort", false, 0, -1);  // an abort, layer names: after the held frames
  ASSERT_EQ(p.sent.size(), before + 5);
  EXPECT_EQ(p.sent[before + 3], (std::vector<std::string>{"b2.2"}));
  EXPECT_EQ(p.sent[before + 4], (std::vector<std::string>{"abort"}));
  EXPECT_TRUE(p.held.empty());
}

TEST(PassBatcher, ASecondCallOfAHeldLayerSendsItsFirstCall) {
  Player p;
  // Forward-only calls of one layer (no backward): each call wants its previous call's result.
  p.Frame("f0", true, 7, kFwd);
  EXPECT_TRUE(p.sent.empty());
  p.Frame("f1", true, 7, kFwd);
  ASSERT_EQ(p.sent.size(), 1u);
  EXPECT_EQ(p.sent[0], (std::vector<std::string>{"f0"}));
  EXPECT_EQ(p.held, (std::vector<std::string>{"f1"}));
  // A module called twice per pass: its second call sends the held first one too.
  Player q;
  q.Frame("a0", true, 1, kFwd);
  q.Frame("s0", true, 2, kFwd);
  q.Frame("s1", true, 2, kFwd);
  ASSERT_EQ(q.sent.size(), 1u);
  EXPECT_EQ(q.sent[0], (std::vector<std::string>{"a0", "s0"}));
}

TEST(PassBatcher, HeldFramesAreDueAfterTheHoldFromTheFirstOfThem) {
  PassBatcher b;
  const Clock::time_point t0{};
  EXPECT_FALSE(b.Due(t0 + std::chrono::hours(1), std::chrono::milliseconds(50)));
  ASSERT_TRUE(b.Next(true, 0, kFwd, t0).hold);
  ASSERT_TRUE(b.Next(true, 1, kFwd, t0 + std::chrono::milliseconds(40)).hold);
  EXPECT_FALSE(b.Due(t0 + std::chrono::milliseconds(49), std::chrono::milliseconds(50)));
  EXPECT_TRUE(b.Due(t0 + std::chrono::milliseconds(50), std::chrono::milliseconds(50)));
  b.Flushed();
  EXPECT_FALSE(b.holding());
  EXPECT_FALSE(b.Due(t0 + std::chrono::milliseconds(100), std::chrono::milliseconds(50)));
  // The next held frame starts its own clock.
  const Clock::time_point t1 = t0 + std::chrono::milliseconds(100);
  const PassBatcher::Step s = b.Next(true, 2, kFwd, t1);
  EXPECT_FALSE(s.flush_before);
  EXPECT_TRUE(b.Due(t1 + std::chrono::milliseconds(50), std::chrono::milliseconds(50)));
  EXPECT_FALSE(b.Due(t1 + std::chrono::milliseconds(49), std::chrono::milliseconds(50)));
}

TEST(PassBatcher, ALayerThatStopsRunningEndsPassesAtThePhaseChangeInstead) {
  Player p;
  p.Step(0, 3);
  p.Step(1, 3);
  const size_t before = p.sent.size();
  p.Step(2, 2);  // layer 2 no longer runs (or no longer lagged)
  // Forwards {0, 1} are not the previous {0, 1, 2}: they leave at the first backward; the
  // backward pass {1, 0} likewise waits for the next forward.
  ASSERT_EQ(p.sent.size(), before + 1);
  EXPECT_EQ(p.sent[before], (std::vector<std::string>{"f2.0", "f2.1"}));
  EXPECT_EQ(p.held, (std::vector<std::string>{"b2.1", "b2.0"}));
  p.Step(3, 2);  // from now on the passes are {0, 1}: complete at their last layer again
  EXPECT_EQ(p.sent[before + 1], (std::vector<std::string>{"b2.1", "b2.0"}));
  EXPECT_EQ(p.sent[before + 2], (std::vector<std::string>{"f3.0", "f3.1"}));
  EXPECT_EQ(p.sent[before + 3], (std::vector<std::string>{"b3.1", "b3.0"}));
  EXPECT_TRUE(p.held.empty());
}

}  // namespace
}  // namespace hsbn::server

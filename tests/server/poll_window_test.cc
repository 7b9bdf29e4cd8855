// PollWindow (server/poll_window.h): the sidecar's poll follows how long answers take.
#include "poll_window.h"

#include "gtest/gtest.h"

namespace hsbn::server {
namespace {

constexpr int64_t kUs = 1000;

TEST(PollWindow, PollsForTheCapUntilTheFirstAnswer) {
  PollWindow w(1000 * kUs);
  EXPECT_EQ(w.average_ns(), -1);
  EXPECT_EQ(w.Forwarded(5 * kUs), 1005 * kUs);
}

TEST(PollWindow, PollsTwiceTheAverageAnswerTime) {
  PollWindow w(1000 * kUs);
  EXPECT_EQ(w.Forwarded(0), 1000 * kUs);
  w.Answered(200 * kUs);  // first sample: the average is it
  EXPECT_EQ(w.average_ns(), 200 * kUs);
  EXPECT_EQ(w.Forwarded(1000 * kUs), 1400 * kUs);
  w.Answered(1280 * kUs);  // 280: the average moves an eighth of the way, to 210
  EXPECT_EQ(w.average_ns(), 210 * kUs);
  EXPECT_EQ(w.Forwarded(2000 * kUs), 2420 * kUs);
}

TEST(PollWindow, CapsTheWindowAndStopsPollingWhileAnswersAreSlowerThanTheCap) {
  PollWindow w(300 * kUs);
  w.Forwarded(0);
  w.Answered(200 * kUs);  // average 200: twice is 400, capped at 300
  EXPECT_EQ(w.Forwarded(1000 * kUs), 1300 * kUs);
  // Answers slow to 3 ms (a distant parent): once the average passes the cap, no poll.
  int64_t t = 2000 * kUs;
  int polls = 0;
  for (int i = 0; i < 40; ++i) {
    if (w.Forwarded(t) != 0) ++polls;
    w.Answered(t + 3000 * kUs);
    t += 10000 * kUs;
  }
  EXPECT_GT(w.average_ns(), 300 * kUs);
  EXPECT_EQ(w.Forwarded(t), 0);
  EXPECT_LT(polls, 5);  // the average passed 300 us within a few answers
  // And fast answers bring the poll back.
  for (int i = 0; i < 60; ++i) {
    w.Forwarded(t);
    w.Answered(t + 100 * kUs);
    t += 10000 * kUs;
  }
  EXPECT_LT(w.average_ns(), 150 * kUs);
  EXPECT_GT(w.Forwarded(t), t);
}

TEST(PollWindow, AnAnswerWithoutAForwardIsNoSample) {
  PollWindow w(1000 * kUs);
  w.Answered(50 * kUs);  // nothing forwarded yet
  EXPECT_EQ(w.average_ns(), -1);
  w.Forwarded(100 * kUs);
  w.Answered(150 * kUs);
  w.Answered(900 * kUs);  // a second answer to the same forward (a batch): not a sample
  EXPECT_EQ(w.average_ns(), 50 * kUs);
  w.Forwarded(1000 * kUs);
  w.Answered(990 * kUs);  // before the forward (clock misuse): ignored, no negative sample
  EXPECT_EQ(w.average_ns(), 50 * kUs);
}

}  // namespace
}  // namespace hsbn::server

// StreamWriter (server/stream_writer.h): one write in flight, batches of what queued meanwhile,
// PushAll's items in one frame, and the queue's cap.
#include "stream_writer.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsbn::server {
namespace {

struct Traits {
  using Item = std::string;
  using Frame = std::vector<std::string>;
  static size_t Bytes(const std::string& s) { return s.size(); }
  static void SetOne(Frame* f, std::string&& s) { f->assign(1, std::move(s)); }
  static void AddToBatch(Frame* f, std::string&& s) { f->push_back(std::move(s)); }
};

// Records the frames it is asked to write; the test completes them with WriteDone.
class Recorder final : public StreamWriter<Traits> {
 public:
  explicit Recorder(int64_t cap) : StreamWriter(Limits(cap)) {}
  std::vector<Traits::Frame> written;
  int overflows = 0;

 protected:
  bool StartWriteLocked(const Traits::Frame& frame) override {
    written.push_back(frame);
    return true;
  }
  void OverflowLocked(Overflow) override { ++overflows; }

 private:
  static WriterLimits Limits(int64_t cap) {
    WriterLimits l;
    l.max_queued_bytes = cap;
    return l;
  }
};

TEST(StreamWriter, PushAllSendsItsItemsAsOneBatchFrame) {
  Recorder w(1 << 20);
  w.EnableBatches();
  ASSERT_TRUE(w.PushAll({"a", "b", "c"}));
  ASSERT_EQ(w.written.size(), 1u);
  EXPECT_EQ(w.written[0], (std::vector<std::string>{"a", "b", "c"}));
  // While that write is in flight, more queue and leave together when it completes.
  ASSERT_TRUE(w.Push("d"));
  ASSERT_TRUE(w.PushAll({"e", "f"}));
  EXPECT_EQ(w.written.size(), 1u);
  w.WriteDone(true);
  ASSERT_EQ(w.written.size(), 2u);
  EXPECT_EQ(w.written[1], (std::vector<std::string>{"d", "e", "f"}));
  EXPECT_EQ(w.queued_bytes(), 0);
}

TEST(StreamWriter, WithoutBatchesPushAllsItemsLeaveOneByOne) {
  Recorder w(1 << 20);
  ASSERT_TRUE(w.PushAll({"a", "b"}));
  ASSERT_EQ(w.written.size(), 1u);
  EXPECT_EQ(w.written[0], (std::vector<std::string>{"a"}));
  EXPECT_EQ(w.queued_bytes(), 1);
  w.WriteDone(true);
  ASSERT_EQ(w.written.size(), 2u);
  EXPECT_EQ(w.written[1], (std::vector<std::string>{"b"}));
}

TEST(StreamWriter, ThePushThatPassesTheCapClosesTheWriterAndQueuesNothing) {
  Recorder w(8);
  w.EnableBatches();
  ASSERT_TRUE(w.Push("12345"));  // written at once
  ASSERT_TRUE(w.Push("123"));    // queued: 3 of 8
  EXPECT_FALSE(w.PushAll({"1234", "12"}));  // 3 + 6 > 8: refused, and the writer closes
  EXPECT_EQ(w.overflows, 1);
  EXPECT_EQ(w.queued_bytes(), 0);
  EXPECT_FALSE(w.Push("x"));
  w.WriteDone(true);
  EXPECT_EQ(w.written.size(), 1u);  // what was queued was dropped
}

TEST(StreamWriter, OneItemLargerThanTheCapIsWrittenWhenNothingIsQueued) {
  Recorder w(4);
  ASSERT_TRUE(w.PushAll({"123456789"}));
  ASSERT_EQ(w.written.size(), 1u);
  EXPECT_EQ(w.overflows, 0);
  // Two items of which the first alone would fit are refused as a whole.
  Recorder v(4);
  EXPECT_FALSE(v.PushAll({"12", "345"}));
  EXPECT_EQ(v.overflows, 1);
  EXPECT_TRUE(v.written.empty());
}

}  // namespace
}  // namespace hsbn::server

// tests/fuzz/fuzz_client_results.cc — the client's handling of a buggy or hostile aggregator.
//
// A client with a few rounds in flight (arbitrary keys and channel counts, on the current
// stream or an older one) reads a sequence of ServerFrames, raw bytes or built from arbitrary
// fields: each Result is matched to its round by (op, seq, phase) and stream as
// Client::Impl::Dispatch does (client.cc), its answer taken (client_internal::TakeAnswer) and
// handed to the round's caller (client_internal::DeliverAnswer) into arrays of exactly the
// round's size. The round's deadline comes from client_internal::RoundWait and the
// aggregator's JoinResponse, as in ConnectLocked.
//
// Checked on every input: an OK delivery wrote exactly the answer's count and payload, and
// nothing past the caller's arrays (ASan); a failed one wrote nothing; a Result with a nonzero
// code never gives OK; a Result for a round not in flight on its stream completes nothing; a
// round's deadline is a representable time after now (UBSan: no overflow).
#include <fuzzer/FuzzedDataProvider.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "check.h"
#include "google/protobuf/stubs/logging.h"
#include "result.h"
#include "wire.h"

namespace {

namespace v1 = hsbn::v1;
namespace ci = hsbn::client_internal;
using Key = std::tuple<uint32_t, uint64_t, int>;

struct Round {
  int64_t channels = 0;
  int stream = 0;  // the stream it was sent on (the client's ClientConn)
  bool done = false;
  ci::Answer answer;
};

constexpr double kUntouched = -1234.5;

void Deliver(const Key& key, Round& round, const v1::Result& sent) {
  std::unique_ptr<double[]> a(new double[round.channels]);
  std::unique_ptr<double[]> b(new double[round.channels]);
  for (int64_t i = 0; i < round.channels; ++i) a[i] = b[i] = kUntouched;
  int64_t count = -77;
  const absl::Status s = ci::DeliverAnswer(round.answer, round.channels, &count, a.get(), b.get());
  if (sent.code() != 0) HSBN_FUZZ_CHECK(!s.ok(), "a failed round's Result was delivered as OK");
  if (!s.ok()) {
    HSBN_FUZZ_CHECK(count == -77, "a failed delivery wrote the count");
    for (int64_t i = 0; i < round.channels; ++i) {
      HSBN_FUZZ_CHECK(std::memcmp(&a[i], &kUntouched, 8) == 0 &&
                          std::memcmp(&b[i], &kUntouched, 8) == 0,
                      "a failed delivery wrote the caller's arrays");
    }
    return;
  }
  HSBN_FUZZ_CHECK(int64_t(sent.data().size()) == hsbn::wire::PayloadBytes(round.channels),
                  "OK with a payload of " + std::to_string(sent.data().size()) + " bytes for " +
                      std::to_string(round.channels) + " channels");
  HSBN_FUZZ_CHECK(count == sent.count(), "OK with another count than the aggregator sent");
  HSBN_FUZZ_CHECK(std::memcmp(a.get(), sent.data().data(), 8 * round.channels) == 0 &&
                      std::memcmp(b.get(), sent.data().data() + 8 * round.channels,
                                  8 * round.channels) == 0,
                  "OK with other statistics than the aggregator sent");
  (void)key;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Invalid UTF-8 in a string field fails the parse, as in gRPC; protobuf's log line about it
  // only slows the fuzzer down.
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int,
                                     const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // The JoinResponse's round timeout and the caller's own decide every round's deadline.
  v1::JoinResponse join;
  join.set_round_timeout_ms(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 60000)
                                             : in.ConsumeIntegral<int64_t>());
  const std::chrono::milliseconds configured(
      in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange<int64_t>(-1, 1 << 30));
  const auto wait = ci::RoundWait(configured, join.round_timeout_ms());
  const auto now = std::chrono::steady_clock::now();
  const auto deadline = now + wait;
  HSBN_FUZZ_CHECK(deadline > now, "a round's deadline is not after now");

  std::map<Key, Round> pending;
  const int n = in.ConsumeIntegralInRange<int>(0, 6);
  for (int i = 0; i < n; ++i) {
    Key key{in.ConsumeIntegralInRange<uint32_t>(0, 3), in.ConsumeIntegralInRange<uint64_t>(0, 3),
            in.ConsumeIntegralInRange<int>(1, 2)};
    Round r;
    r.channels = in.ConsumeIntegralInRange<int64_t>(1, 9);
    r.stream = in.ConsumeIntegralInRange<int>(0, 1);
    pending.emplace(key, std::move(r));
  }
  const int current = 1;  // results are read from the current stream
  while (in.remaining_bytes() > 0) {
    v1::ServerFrame frame;
    if (in.ConsumeProbability<float>() < 0.3f) {
      if (!frame.ParseFromString(in.ConsumeRandomLengthString(400))) continue;
    } else {
      const int k = in.ConsumeIntegralInRange<int>(0, 2);
      for (int i = 0; i < k; ++i) {
        v1::Result* r = k == 1 ? frame.mutable_result() : frame.mutable_batch()->add_results();
        r->set_op(in.ConsumeIntegralInRange<uint32_t>(0, 3));
        r->set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 3));
        r->set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
        r->set_scope(v1::Scope(in.ConsumeIntegral<int8_t>()));
        r->set_channels(in.ConsumeIntegral<uint32_t>());
        r->set_count(in.ConsumeIntegral<int64_t>());
        r->set_code(in.ConsumeBool() ? 0 : in.ConsumeIntegral<int32_t>());
        r->set_message(in.ConsumeRandomLengthString(32));
        const size_t bytes = in.ConsumeBool() ? 16 * in.ConsumeIntegralInRange<size_t>(0, 9)
                                              : in.ConsumeIntegralInRange<size_t>(0, 200);
        r->set_data(in.ConsumeBytesAsString(bytes));
      }
    }
    // Client::Impl::Dispatch: only a single result is read (the client never accepts batches).
    if (!frame.has_result()) continue;
    v1::Result* r = frame.mutable_result();
    const v1::Result sent = *r;
    auto it = pending.find(Key{r->op(), r->seq(), int(r->phase())});
    if (it == pending.end() || it->second.stream != current) continue;
    it->second.answer = ci::TakeAnswer(r);
    HSBN_FUZZ_CHECK(it->second.answer.data == sent.data(), "the answer lost its payload");
    Deliver(it->first, it->second, sent);
    pending.erase(it);
  }
  return 0;
}

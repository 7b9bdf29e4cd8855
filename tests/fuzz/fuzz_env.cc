// tests/fuzz/fuzz_env.cc — the client's configuration as a trainer's environment gives it.
//
// Each input sets or unsets the variables hsbn::ClientOptions::FromEnv reads (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, HSBN_JOB_ID, TORCHELASTIC_RUN_ID,
// HSBN_ADDRESS, HSBN_ROUND_TIMEOUT_MS, HSBN_CONNECT_TIMEOUT_MS, HSBN_TOKEN, HSBN_TOKEN_FILE
// (one of two files this harness writes, or a missing one), HSBN_STRICT_FINITE) to arbitrary
// text, then calls FromEnv; calls the C ABI's hsbn_check_layout and wire::CheckWorkerLayout
// with arbitrary int64s; and escapes arbitrary text with wire::Printable.
//
// Checked on every input:
//   - options FromEnv accepts hold exactly the integers their variables spell (no silent
//     truncation to 32 bits), pass Validate, and give deadlines that can be computed without
//     overflow (a connect deadline on the system clock, a round's on the steady clock);
//   - hsbn_check_layout agrees with CheckWorkerLayout, and every refusal names a variable in
//     hsbn_last_error();
//   - a layout that passes is torchrun's: 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, RANK = GROUP_RANK *
//     LOCAL_WORLD_SIZE + LOCAL_RANK < WORLD_SIZE;
//   - Printable's output is printable ASCII without a backslash that does not start \xNN, at
//     most 4 * max + 3 bytes, and decodes back to the input's first `max` bytes.
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "hsbn/client.h"
#include "hsbn/hsbn.h"
#include "check.h"
#include "result.h"
#include "wire.h"

namespace {

const char* kInts[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"};
std::string g_token_files[2];

std::string IntText(FuzzedDataProvider& in, int64_t small) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: return std::to_string(small);
    case 1: return std::to_string(in.ConsumeIntegral<int64_t>());
    case 2: return std::to_string(small + in.ConsumeIntegralInRange<int64_t>(-2, 2) * (int64_t(1) << 32));
    case 3: return "";
    case 4: return " " + std::to_string(small);
    default: return in.ConsumeRandomLengthString(24);
  }
}

void Set(const char* name, const std::string& value, bool set) {
  if (!set) {
    unsetenv(name);
  } else {
    setenv(name, value.c_str(), 1);  // text up to the first NUL, as an environment holds it
  }
}

void CheckPrintable(const std::string& text, size_t max) {
  const std::string out = hsbn::wire::Printable(text, max);
  HSBN_FUZZ_CHECK(out.size() <= 4 * std::min(text.size(), max) + 3,
                  "Printable wrote " + std::to_string(out.size()) + " bytes");
  std::string decoded;
  for (size_t i = 0; i < out.size(); ++i) {
    const unsigned char c = out[i];
    HSBN_FUZZ_CHECK(c >= 0x20 && c < 0x7f, "Printable wrote an unprintable byte");
    if (c == '\\') {
      HSBN_FUZZ_CHECK(i + 3 < out.size() + 0 && out[i + 1] == 'x', "a lone backslash");
      decoded.push_back(char(std::stoi(out.substr(i + 2, 2), nullptr, 16)));
      i += 3;
    } else if (c == '.' && i + 3 == out.size() && text.size() > max && out.substr(i) == "...") {
      break;
    } else {
      decoded.push_back(char(c));
    }
  }
  HSBN_FUZZ_CHECK(decoded == text.substr(0, max), "Printable's output does not decode back");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* contents[2] = {"  token-from-file \n", ""};
  for (int i = 0; i < 2; ++i) {
    char path[] = "/tmp/hsbn-fuzz-token-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0 || write(fd, contents[i], strlen(contents[i])) < 0) std::abort();
    close(fd);
    g_token_files[i] = path;  // left for the process's lifetime; /tmp is cleaned by the OS
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // A layout that is usually torchrun's, with one value bent now and then.
  const int64_t lws = in.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t nodes = in.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t node = in.ConsumeIntegralInRange<int64_t>(0, nodes - 1);
  const int64_t local = in.ConsumeIntegralInRange<int64_t>(0, lws - 1);
  const int64_t small[] = {node * lws + local, nodes * lws, local, lws, node};
  for (int i = 0; i < 5; ++i) Set(kInts[i], IntText(in, small[i]), in.ConsumeProbability<float>() < 0.97f);
  Set("HSBN_JOB_ID", in.ConsumeRandomLengthString(12), in.ConsumeBool());
  Set("TORCHELASTIC_RUN_ID", in.ConsumeBool() ? "none" : in.ConsumeRandomLengthString(8),
      in.ConsumeBool());
  Set("HSBN_ADDRESS", in.ConsumeRandomLengthString(16), in.ConsumeBool());
  Set("HSBN_ROUND_TIMEOUT_MS", IntText(in, 1000), in.ConsumeBool());
  Set("HSBN_CONNECT_TIMEOUT_MS", IntText(in, 500), in.ConsumeBool());
  Set("HSBN_TOKEN", in.ConsumeRandomLengthString(8), in.ConsumeBool());
  const int tf = in.ConsumeIntegralInRange<int>(0, 2);
  Set("HSBN_TOKEN_FILE", tf < 2 ? g_token_files[tf] : "/nonexistent/hsbn-token", in.ConsumeBool());
  Set("HSBN_STRICT_FINITE", IntText(in, in.ConsumeIntegralInRange<int>(0, 1)), in.ConsumeBool());

  absl::StatusOr<hsbn::ClientOptions> o = hsbn::ClientOptions::FromEnv();
  if (o.ok()) {
    HSBN_FUZZ_CHECK(o->Validate().ok(), "FromEnv returned options that Validate refuses");
    const int32_t* fields[] = {&o->rank, &o->world_size, &o->local_rank, &o->local_world_size,
                               &o->node_rank};
    for (int i = 0; i < 5; ++i) {
      int64_t spelled = 0;
      HSBN_FUZZ_CHECK(absl::SimpleAtoi(std::getenv(kInts[i]), &spelled),
                      std::string(kInts[i]) + " is not an integer, yet accepted");
      HSBN_FUZZ_CHECK(spelled == *fields[i], std::string(kInts[i]) + "=" + getenv(kInts[i]) +
                                                 " was taken as " + std::to_string(*fields[i]));
    }
    HSBN_FUZZ_CHECK(!o->job_id.empty() && !o->address.empty(), "an empty job id or address");
    // What the client computes from them (ConnectLocked, Start, WaitResult).
    const auto connect_deadline = std::chrono::system_clock::now() + o->connect_timeout;
    (void)connect_deadline;
    const auto wait = hsbn::client_internal::RoundWait(o->round_timeout, 30000);
    const auto now = std::chrono::steady_clock::now();
    HSBN_FUZZ_CHECK(now + wait > now, "a round's deadline is not after now");
  }

  int64_t v[5];
  for (int64_t& x : v) {
    x = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-2, 9) : in.ConsumeIntegral<int64_t>();
  }
  const hsbn_result c = hsbn_check_layout(v[0], v[1], v[2], v[3], v[4]);
  const absl::Status s = hsbn::wire::CheckWorkerLayout(v[0], v[1], v[2], v[3], v[4]);
  HSBN_FUZZ_CHECK(int(c) == int(s.code()), "hsbn_check_layout and CheckWorkerLayout disagree");
  if (s.ok()) {
    HSBN_FUZZ_CHECK(v[2] >= 0 && v[2] < v[3] && v[0] == v[4] * v[3] + v[2] && v[0] < v[1],
                    "a layout that is not torchrun's passed");
  } else {
    const std::string e = hsbn_last_error();
    HSBN_FUZZ_CHECK(e.find("RANK") != std::string::npos || e.find("WORLD_SIZE") != std::string::npos,
                    "a refusal that names no variable: " + e);
  }

  const size_t max = in.ConsumeIntegralInRange<size_t>(0, 64);
  CheckPrintable(in.ConsumeRemainingBytesAsString(), max);
  return 0;
}

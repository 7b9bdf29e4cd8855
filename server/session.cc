#include "session.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hsbn::server {

SessionId SessionId::Random() {
  for (;;) {
    unsigned char buf[16];
    size_t got = 0;
    while (got < sizeof(buf)) {
      const ssize_t n = getrandom(buf + got, sizeof(buf) - got, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        std::fprintf(stderr, "hsbn-aggregator: getrandom failed (%s); refusing to make "
                             "guessable sessions\n", std::strerror(errno));
        std::abort();
      }
      got += size_t(n);
    }
    SessionId id;
    std::memcpy(&id.hi, buf, 8);
    std::memcpy(&id.lo, buf + 8, 8);
    if (!id.empty()) return id;
  }
}

bool SessionId::FromBytes(absl::string_view bytes, SessionId* out) {
  if (bytes.size() != 16) return false;
  SessionId id;
  std::memcpy(&id.hi, bytes.data(), 8);
  std::memcpy(&id.lo, bytes.data() + 8, 8);
  if (id.empty()) return false;
  *out = id;
  return true;
}

std::string SessionId::Bytes() const {
  std::string s(16, '\0');
  std::memcpy(s.data(), &hi, 8);
  std::memcpy(s.data() + 8, &lo, 8);
  return s;
}

bool MemoryBudget::TryChargeWithin(int64_t bytes, int64_t cap) {
  int64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > 0 && used + bytes > cap) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

}  // namespace hsbn::server

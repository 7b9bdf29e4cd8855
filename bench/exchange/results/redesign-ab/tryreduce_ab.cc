// Times Segment::Post x2 + TryReduce + Take x2 for a 2-rank forward node round, C = 256.
#include <chrono>
#include <cstdio>
#include <vector>
#include "shm_segment.h"
#include "hsbn/v1/hsbn.pb.h"
using namespace hsbn;
int main() {
  auto g = shm::Geometry::Make(2, 8, 1024);
  auto seg = shm::Segment::Create(*g, false);
  std::vector<double> a(256, 1.0), b(256, 2.0), out;
  shm::ReduceOptions o;
  o.max_channels_limit = 65536;
  o.job_id = "j";
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    const int n = 200000;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      shm::Key k{1, uint64_t(rep) * n + i, v1::PHASE_FORWARD};
      uint32_t p0 = (*seg)->Post(0, 0, k, v1::SCOPE_NODE, 256, 4, a.data(), b.data());
      uint32_t p1 = (*seg)->Post(1, 0, k, v1::SCOPE_NODE, 256, 4, a.data(), b.data());
      (*seg)->TryReduce(k, 0, o);
      absl::Status s; int64_t c;
      (*seg)->Take(0, 0, p0, 256, &s, &c, &out);
      (*seg)->Take(1, 0, p1, 256, &s, &c, &out);
    }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
    if (ns < best) best = ns;
  }
  std::printf("%.1f ns per 2-rank round (best of 7)\n", best);
}

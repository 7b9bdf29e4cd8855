#include "synthetic.h"

#include <algorithm>
#include <cmath>

#include "hsbn/moments.h"

namespace hsbn::synthetic {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double Uniform(uint64_t h) { return (double((h >> 11)) + 0.5) * (1.0 / 9007199254740992.0); }

// A standard normal value that depends only on its coordinates.
double Normal(uint64_t seed, uint64_t stream, int rank, uint64_t round, int64_t i, int64_t c) {
  uint64_t h = Mix(seed ^ Mix(stream ^ Mix(uint64_t(rank) ^ Mix(round ^ Mix(uint64_t(i) ^
                                                                              Mix(uint64_t(c)))))));
  const double u1 = Uniform(h), u2 = Uniform(Mix(h));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

std::vector<double> Values(uint64_t seed, uint64_t stream, int rank, uint64_t round,
                           int64_t count, int64_t channels, bool shifted) {
  std::vector<double> x(size_t(count * channels));
  for (int64_t c = 0; c < channels; ++c) {
    const double mu = shifted ? 3.0 * std::sin(0.7 * rank + 0.1 * double(c)) + 0.5 * rank : 0.0;
    const double sigma = shifted ? 0.5 + 0.25 * double((rank + c) % 4) : 1.0;
    for (int64_t i = 0; i < count; ++i) {
      x[size_t(i * channels + c)] = mu + sigma * Normal(seed, stream, rank, round, i, c);
    }
  }
  return x;
}

}  // namespace

std::vector<double> Input(uint64_t seed, int rank, uint64_t round, int64_t count,
                          int64_t channels) {
  return Values(seed, 1, rank, round, count, channels, true);
}

std::vector<double> Grad(uint64_t seed, int rank, uint64_t round, int64_t count,
                         int64_t channels) {
  return Values(seed, 2, rank, round, count, channels, false);
}

Stats LocalMoments(const std::vector<double>& x, int64_t count, int64_t channels) {
  Stats s;
  s.count = count;
  s.a.assign(channels, 0.0);
  s.b.assign(channels, 0.0);
  for (int64_t c = 0; c < channels; ++c) {
    Moments<double> m = EmptyMoments<double>();
    for (int64_t i = 0; i < count; ++i) WelfordAdd(m, x[size_t(i * channels + c)]);
    s.a[c] = m.mean;
    s.b[c] = m.m2;
  }
  return s;
}

Stats LocalBackward(const std::vector<double>& x, const std::vector<double>& dy, int64_t count,
                    int64_t channels, const std::vector<double>& mean) {
  Stats s;
  s.count = count;
  s.a.assign(channels, 0.0);
  s.b.assign(channels, 0.0);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t c = 0; c < channels; ++c) {
      const double g = dy[size_t(i * channels + c)];
      s.a[c] += g;
      s.b[c] += g * (x[size_t(i * channels + c)] - mean[c]);
    }
  }
  return s;
}

Stats ReferenceMoments(const std::vector<std::vector<double>>& parts,
                       const std::vector<int64_t>& counts, int64_t channels) {
  Stats s;
  s.a.assign(channels, 0.0);
  s.b.assign(channels, 0.0);
  for (int64_t n : counts) s.count += n;
  if (s.count == 0) return s;
  for (int64_t c = 0; c < channels; ++c) {
    long double sum = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      for (int64_t i = 0; i < counts[p]; ++i) sum += parts[p][size_t(i * channels + c)];
    }
    const long double mean = sum / (long double)s.count;
    long double m2 = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      for (int64_t i = 0; i < counts[p]; ++i) {
        const long double d = parts[p][size_t(i * channels + c)] - mean;
        m2 += d * d;
      }
    }
    s.a[c] = double(mean);
    s.b[c] = double(m2);
  }
  return s;
}

Stats ReferenceBackward(const std::vector<std::vector<double>>& xs,
                        const std::vector<std::vector<double>>& dys,
                        const std::vector<int64_t>& counts, int64_t channels,
                        const std::vector<double>& mean) {
  Stats s;
  s.a.assign(channels, 0.0);
  s.b.assign(channels, 0.0);
  for (int64_t c = 0; c < channels; ++c) {
    long double sa = 0, sb = 0;
    for (size_t p = 0; p < xs.size(); ++p) {
      for (int64_t i = 0; i < counts[p]; ++i) {
        const long double g = dys[p][size_t(i * channels + c)];
        sa += g;
        sb += g * ((long double)xs[p][size_t(i * channels + c)] - mean[c]);
      }
    }
    s.a[c] = double(sa);
    s.b[c] = double(sb);
  }
  for (int64_t n : counts) s.count += n;
  return s;
}

double MaxRelativeError(const std::vector<double>& got, const std::vector<double>& want,
                        double floor) {
  if (got.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double scale = std::max(std::fabs(want[i]), floor);
    worst = std::max(worst, std::fabs(got[i] - want[i]) / scale);
  }
  return worst;
}

}  // namespace hsbn::synthetic

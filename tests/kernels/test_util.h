// test_util.h — test tensors for the BN kernel tests: a logical (N, C, S) tensor of values,
// stored in any dtype and layout, and a long-double reference of every BN operation on the
// values exactly as stored.
#ifndef HSBN_TESTS_KERNELS_TEST_UTIL_H_
#define HSBN_TESTS_KERNELS_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "convert.h"
#include "hsbn/bn_types.h"

namespace hsbn::kernels::testing {

inline int64_t Offset(const BnInput& in, int64_t n, int64_t c, int64_t s) {
  return in.layout == Layout::kNchw ? (n * in.c + c) * in.s + s : (n * in.s + s) * in.c + c;
}

// Raw storage of one tensor in in.dtype / in.layout.
struct Buffer {
  BnInput in;
  std::vector<unsigned char> bytes;
  explicit Buffer(const BnInput& input)
      : in(input), bytes(static_cast<size_t>(input.numel()) * DTypeSize(input.dtype) + 16) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  void Set(int64_t n, int64_t c, int64_t s, double v) {
    StoreFromDouble(data(), in.dtype, Offset(in, n, c, s), v);
  }
  double Get(int64_t n, int64_t c, int64_t s) const {
    return LoadAsDouble(data(), in.dtype, Offset(in, n, c, s));
  }
};

// Values with per-channel mean (mean_scale * (1 + c % 3)) and spread std.
inline Buffer RandomInput(const BnInput& in, double mean_scale, double std, uint32_t seed) {
  Buffer b(in);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t n = 0; n < in.n; ++n)
    for (int64_t c = 0; c < in.c; ++c)
      for (int64_t s = 0; s < in.s; ++s)
        b.Set(n, c, s, mean_scale * (1 + c % 3) + std * normal(rng));
  return b;
}

struct RefMoments {
  std::vector<long double> mean, m2;
};

inline RefMoments ReferenceMoments(const Buffer& x) {
  const BnInput& in = x.in;
  RefMoments r{std::vector<long double>(in.c, 0.0L), std::vector<long double>(in.c, 0.0L)};
  const long double count = static_cast<long double>(in.count());
  if (count == 0) return r;
  for (int64_t c = 0; c < in.c; ++c) {
    long double sum = 0;
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t s = 0; s < in.s; ++s) sum += x.Get(n, c, s);
    const long double mean = sum / count;
    long double m2 = 0;
    for (int64_t n = 0; n < in.n; ++n)
      for (int64_t s = 0; s < in.s; ++s) {
        const long double d = x.Get(n, c, s) - mean;
        m2 += d * d;
      }
    r.mean[c] = mean;
    r.m2[c] = m2;
  }
  return r;
}

// Unit roundoff of the dtype's significand (2^-p for p stored + implicit bits).
inline double Epsilon(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kF32: return std::ldexp(1.0, -24);
    default: return std::ldexp(1.0, -53);
  }
}

// The spacing of the dtype's subnormals (its smallest positive value): two roundings of one
// value to the dtype can differ by this much however small the value.
inline double SubnormalSpacing(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -24);
    case DType::kBF16: return std::ldexp(1.0, -133);
    case DType::kF32: return std::ldexp(1.0, -149);
    default: return std::ldexp(1.0, -1074);
  }
}

inline std::string Describe(const BnInput& in) {
  static const char* names[] = {"f16", "bf16", "f32", "f64"};
  return std::string(names[static_cast<int>(in.dtype)]) +
         (in.layout == Layout::kNchw ? " NCHW" : " channels-last") + " N=" +
         std::to_string(in.n) + " C=" + std::to_string(in.c) + " S=" + std::to_string(in.s);
}

inline BnInput MakeInput(Device device, DType dtype, Layout layout, int64_t n, int64_t c,
                         int64_t s) {
  BnInput in;
  in.device = device;
  in.dtype = dtype;
  in.layout = layout;
  in.n = n;
  in.c = c;
  in.s = s;
  return in;
}

}  // namespace hsbn::kernels::testing

#endif  // HSBN_TESTS_KERNELS_TEST_UTIL_H_

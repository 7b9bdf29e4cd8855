// fast_divmod.h — unsigned 32-bit division by a run-time constant with one multiply-high,
// for index arithmetic in kernels (n / S and n % S for every element would otherwise cost a
// full integer division).
//
// For a divisor d >= 1 let l = ceil(log2 d) and M = floor(2^(32+l) / d) + 1 = 2^32 + m. Then
// for every n < 2^32, floor(n / d) = (mulhi(m, n) + n) >> l: the error of n * M / 2^(32+l)
// against n / d is below n / 2^(32+l) < 2^-l <= 1 / d, too small to cross an integer.
#ifndef HSBN_KERNELS_FAST_DIVMOD_H_
#define HSBN_KERNELS_FAST_DIVMOD_H_

#include <cstdint>

#include "hsbn/moments.h"

namespace hsbn::kernels {

struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
    multiplier = static_cast<uint32_t>(m);
  }

  HSBN_HOST_DEVICE uint32_t Div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(multiplier, n);
#else
    const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(multiplier) * n) >> 32);
#endif
    return static_cast<uint32_t>((static_cast<uint64_t>(t) + n) >> shift);
  }
  HSBN_HOST_DEVICE void DivMod(uint32_t n, uint32_t* q, uint32_t* r) const {
    *q = Div(n);
    *r = n - *q * divisor;
  }
};

}  // namespace hsbn::kernels

#endif  // HSBN_KERNELS_FAST_DIVMOD_H_

// convert.h — bit-exact fp16 / bf16 <-> fp32 conversion and the per-channel value loads shared
// by the CPU kernels and (for per-channel parameters) the CUDA kernels.
//
// fp16 and bf16 are stored as uint16_t; conversions to them round to nearest even, as
// __float2half_rn / __float2bfloat16_rn do on the GPU, so both devices produce the same bits
// from the same fp32 value.
#ifndef HSBN_KERNELS_CONVERT_H_
#define HSBN_KERNELS_CONVERT_H_

#include <cstdint>
#include <cstring>

#include "hsbn/bn_types.h"
#include "hsbn/moments.h"

namespace hsbn::kernels {

template <typename To, typename From>
HSBN_HOST_DEVICE To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From), "BitCast needs equal sizes");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}

HSBN_HOST_DEVICE float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in fp32.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return BitCast<float>(sign | 0x7f800000u | (mant << 13));
  return BitCast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

HSBN_HOST_DEVICE uint16_t FloatToHalfBits(float f) {
  uint32_t x = BitCast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (x < 0x38800000u) {
    // Below the smallest normal (2^-14): adding 0.5 rounds to a multiple of 2^-24 (nearest
    // even, in the FPU) and leaves the half's bits in the low mantissa; 0x400 is the smallest
    // normal, which is the right encoding when it rounds up.
    const float r = BitCast<float>(x) + 0.5f;
    return static_cast<uint16_t>(sign | (BitCast<uint32_t>(r) - 0x3f000000u));
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias the exponent by -112 and round the dropped 13 bits
  return static_cast<uint16_t>(sign | (x >> 13));
}

HSBN_HOST_DEVICE float Bf16BitsToFloat(uint16_t b) {
  return BitCast<float>(static_cast<uint32_t>(b) << 16);
}

HSBN_HOST_DEVICE uint16_t FloatToBf16Bits(float f) {
  const uint32_t x = BitCast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Element i of a per-channel array of `dtype`, as double.
HSBN_HOST_DEVICE double LoadAsDouble(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF16: return HalfBitsToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kBF16: return Bf16BitsToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kF32: return static_cast<const float*>(p)[i];
    default: return static_cast<const double*>(p)[i];
  }
}

HSBN_HOST_DEVICE void StoreFromDouble(void* p, DType dtype, int64_t i, double v) {
  switch (dtype) {
    case DType::kF16:
      static_cast<uint16_t*>(p)[i] = FloatToHalfBits(static_cast<float>(v));
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = FloatToBf16Bits(static_cast<float>(v));
      break;
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    default: static_cast<double*>(p)[i] = v; break;
  }
}

}  // namespace hsbn::kernels

#endif  // HSBN_KERNELS_CONVERT_H_

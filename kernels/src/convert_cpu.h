// convert_cpu.h — branchless fp16 / bf16 <-> fp32 conversions for the CPU kernels' inner loops.
//
// They return exactly the bits of the scalar conversions in convert.h (HalfBitsToFloat,
// FloatToHalfBits, Bf16BitsToFloat, FloatToBf16Bits) for every input, including NaN, Inf,
// subnormals and rounding ties (tests/kernels/convert_test.cc checks every fp16 / bf16 bit
// pattern and a dense sweep of fp32 patterns), but have no branches, tables or
// data-dependent control flow: every lane computes each case and selects, so GCC and Clang
// vectorize the loops that call them with baseline SSE2 (and whatever a wider target offers).
// CPU only; the CUDA kernels use convert.h.
#ifndef HSBN_KERNELS_CONVERT_CPU_H_
#define HSBN_KERNELS_CONVERT_CPU_H_

#include <cstdint>
#include <cstring>

namespace hsbn::kernels {

inline float AsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t AsBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// cond ? a : b as mask arithmetic. Written as a ternary, GCC turns some selects back into
// branches around the floating-point operation feeding them, and then will not vectorize
// (with -ftrapping-math it may not speculate that operation).
inline uint32_t Select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(cond);
  return (a & m) | (b & ~m);
}

// fp16 -> fp32, exact. Shifting the exponent and mantissa into place and rebiasing the exponent
// by 112 is right for normal halves; Inf / NaN get another +112 (exponent 255, payload kept);
// zero / subnormal halves are built as 2^-14 * (1 + mant/1024) and 2^-14 subtracted, which is
// mant * 2^-24 exactly (fp32 normals only, so FTZ/DAZ do not change it).
inline float HalfBitsToFloatFast(uint16_t h) {
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = em & 0x0f800000u;
  const uint32_t normal = em + 0x38000000u;
  const uint32_t special = normal + 0x38000000u;
  const uint32_t tiny = AsBits(AsFloat(normal + 0x00800000u) - AsFloat(0x38800000u));
  uint32_t r = Select(exp == 0x0f800000u, special, normal);
  r = Select(exp == 0, tiny, r);
  return AsFloat(r | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

// fp32 -> fp16, round to nearest even; NaN becomes the quiet NaN 0x7e00 with the sign kept, as
// FloatToHalfBits does. The three regimes (subnormal result, normal result, overflow / Inf /
// NaN) are all computed, then selected; comparisons are on the non-negative magnitude as int32.
inline uint16_t FloatToHalfBitsFast(float f) {
  const uint32_t u = AsBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t x = u & 0x7fffffffu;
  const int32_t xs = static_cast<int32_t>(x);
  // Below 2^-14: adding 0.5 rounds to a multiple of 2^-24 (nearest even, in the FPU) and leaves
  // the half's bits in the low mantissa (0x400 when it rounds up to the smallest normal).
  const uint32_t tiny = AsBits(AsFloat(x) + 0.5f) - 0x3f000000u;
  // Rebias the exponent by -112 and round the dropped 13 bits to nearest even.
  const uint32_t normal = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
  uint32_t r = Select(xs < 0x38800000, tiny, normal);
  r = Select(xs >= 0x477ff000, 0x7c00u, r);  // >= 65520 rounds to Inf; Inf stays Inf
  r = Select(xs > 0x7f800000, 0x7e00u, r);   // NaN
  return static_cast<uint16_t>((r | sign) & 0xffffu);
}

inline float Bf16BitsToFloatFast(uint16_t b) { return AsFloat(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest even; NaN keeps its top bits and is made quiet.
inline uint16_t FloatToBf16BitsFast(float f) {
  const uint32_t u = AsBits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  const uint32_t r = Select(static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000, nan, rounded);
  return static_cast<uint16_t>(r & 0xffffu);
}

// Block conversions (convert_cpu.cc): the same functions as loops, compiled once for baseline
// x86-64 (SSE2) / the target's default and, on x86-64 with GCC or Clang, once more for AVX2 +
// F16C (twice the lanes; the hardware fp16 conversions with their NaN results patched), chosen
// at run time by CPUID. Every version produces the bits above.
struct BlockConverters {
  const char* name;
  void (*half_to_float)(const uint16_t* in, int64_t n, float* out);
  void (*float_to_half)(const float* in, int64_t n, uint16_t* out);
  void (*bf16_to_float)(const uint16_t* in, int64_t n, float* out);
  void (*float_to_bf16)(const float* in, int64_t n, uint16_t* out);
};

// The build's baseline version; always available.
const BlockConverters& BaselineConverters();
// The AVX2 + F16C version, or null when it is not built (not x86-64) or this CPU lacks either.
const BlockConverters* Avx2Converters();
// The fastest version this CPU runs (chosen once; HSBN_KERNELS_CONVERT=baseline forces the
// baseline version).
const BlockConverters& Converters();

}  // namespace hsbn::kernels

#endif  // HSBN_KERNELS_CONVERT_CPU_H_

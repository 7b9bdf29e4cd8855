// Block fp16 / bf16 <-> fp32 conversions: the branchless functions of convert_cpu.h as loops,
// compiled for the baseline target and, on x86-64, also for AVX2 + F16C (selected at run time, so
// the binary still runs on any x86-64). The loops are integer operations plus one exact fp32 add
// or subtract per value, and the F16C instructions convert exactly with their NaNs patched, so
// every version returns the same bits (tests/kernels/convert_test.cc checks each one).
#include "convert_cpu.h"

#include <cstdlib>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HSBN_CONVERT_AVX2 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace hsbn::kernels {
namespace {

#define HSBN_DEFINE_HALF_CONVERTERS(SUFFIX, ATTR)                                        \
  ATTR void HalfToFloat##SUFFIX(const uint16_t* in, int64_t n, float* out) {             \
    for (int64_t i = 0; i < n; ++i) out[i] = HalfBitsToFloatFast(in[i]);                 \
  }                                                                                      \
  ATTR void FloatToHalf##SUFFIX(const float* in, int64_t n, uint16_t* out) {             \
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalfBitsFast(in[i]);                 \
  }
#define HSBN_DEFINE_BF16_CONVERTERS(SUFFIX, ATTR)                                        \
  ATTR void Bf16ToFloat##SUFFIX(const uint16_t* in, int64_t n, float* out) {             \
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16BitsToFloatFast(in[i]);                 \
  }                                                                                      \
  ATTR void FloatToBf16##SUFFIX(const float* in, int64_t n, uint16_t* out) {             \
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16BitsFast(in[i]);                 \
  }

HSBN_DEFINE_HALF_CONVERTERS(Baseline, )
HSBN_DEFINE_BF16_CONVERTERS(Baseline, )
#if HSBN_CONVERT_AVX2
#define HSBN_AVX2 __attribute__((target("avx2,f16c")))
// bf16: AVX2 (no FMA), the same operations on 8 lanes. fp16: the F16C instructions, which
// convert exactly and round to nearest even (rounding given in the instruction, not MXCSR);
// only their NaN results differ from convert.h, and are patched: vcvtph2ps quiets a signaling
// NaN (the scalar keeps the bits), vcvtps2ph keeps part of the payload (the scalar returns
// 0x7e00 with the sign).
HSBN_DEFINE_BF16_CONVERTERS(Avx2, HSBN_AVX2)

HSBN_AVX2 void HalfToFloatF16c(const uint16_t* in, int64_t n, float* out) {
  const __m256i mag_mask = _mm256_set1_epi32(0x7fff);
  const __m256i inf = _mm256_set1_epi32(0x7c00);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h));
    const __m256i h32 = _mm256_cvtepu16_epi32(h);
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(h32, mag_mask), inf);
    // The fp32 quiet bit must equal the half's (bit 9, shifted by 13): clear it where it was 0.
    const __m256i clear = _mm256_andnot_si256(_mm256_slli_epi32(h32, 13), quiet);
    const __m256i r = _mm256_andnot_si256(_mm256_and_si256(is_nan, clear), f);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), r);
  }
  for (; i < n; ++i) out[i] = HalfBitsToFloatFast(in[i]);
}

HSBN_AVX2 void FloatToHalfF16c(const float* in, int64_t n, uint16_t* out) {
  const __m256i sign_mask = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i qnan = _mm256_set1_epi32(0x7e00);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(in + i);
    const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i nan = _mm256_or_si256(
        qnan, _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(f), sign_mask), 16));
    const __m256i r = _mm256_blendv_epi8(h, nan, is_nan);
    // Pack the 8 32-bit values (all < 2^16) to 16 bits: packus works per 128-bit lane.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = FloatToHalfBitsFast(in[i]);
}
#undef HSBN_AVX2
#endif

#undef HSBN_DEFINE_HALF_CONVERTERS
#undef HSBN_DEFINE_BF16_CONVERTERS

}  // namespace

const BlockConverters& BaselineConverters() {
  static const BlockConverters kBaseline = {"baseline", HalfToFloatBaseline, FloatToHalfBaseline,
                                            Bf16ToFloatBaseline, FloatToBf16Baseline};
  return kBaseline;
}

const BlockConverters* Avx2Converters() {
#if HSBN_CONVERT_AVX2
  static const BlockConverters kAvx2 = {"avx2+f16c", HalfToFloatF16c, FloatToHalfF16c,
                                        Bf16ToFloatAvx2, FloatToBf16Avx2};
  static const bool supported = [] {
    __builtin_cpu_init();  // may run before the constructors that otherwise do this
    // AVX2 as the compiler checks it (CPU and OS support for the YMM state); F16C from CPUID
    // leaf 1, ECX bit 29 (older Clang has no "f16c" for __builtin_cpu_supports).
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return supported ? &kAvx2 : nullptr;
#else
  return nullptr;
#endif
}

const BlockConverters& Converters() {
  // HSBN_KERNELS_CONVERT=baseline keeps the baseline version (to measure or rule it out).
  static const BlockConverters& best = [&]() -> const BlockConverters& {
    const char* force = std::getenv("HSBN_KERNELS_CONVERT");
    if (force && std::strcmp(force, "baseline") == 0) return BaselineConverters();
    return Avx2Converters() ? *Avx2Converters() : BaselineConverters();
  }();
  return best;
}

}  // namespace hsbn::kernels

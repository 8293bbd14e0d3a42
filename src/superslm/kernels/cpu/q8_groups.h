// x's rows as int8 per group of 32 with a float32 step (llama.cpp's Q8_0 rounding, dx = max|x| / 127), the
// activation side of the kernels that take llama.cpp's one-part int8 arithmetic: iq4.cpp (IQ4_NL / IQ4_XS) and
// q80.cpp (Q8_0). quant/iq4.py quantize_groups is its twin.
#pragma once
#include "aten_ops.h"

#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace superslm_q8 {

// x's one row (bf16) as int8 per group of 32, laid out for iq4.cpp gemv_rows' two groups a step (G rounded up to
// even, the last group zero where G is odd): per pair of groups g, g + 1, 64 bytes [g 0..15 | g+1 0..15 | g 16..31 |
// g+1 16..31] of q in xq and of |q| (maddubs' unsigned operand) in aq; dx [G] (an all-zero group, or one whose
// max|x| / 127 underflows to 0, gets q = 0). False where x holds a NaN or an inf.
inline bool quantize_groups(const at::BFloat16* xp, int64_t K, int8_t* xq, uint8_t* aq, float* dx) {
  // in registers, 32 values at a time: a scalar division per element took ~20 us of a [896, 4864] call (~140)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 4; ++i) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xp + g * 32 + 8 * i));
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16 -> float, exact
      const __m256 a = _mm256_and_ps(v[i], absmask);
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for a NaN or an inf
      amax = _mm256_max_ps(amax, a);
    }
    if (_mm256_movemask_ps(ok) != 0xff) return false;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.f;
    dx[g] = d;
    // x / d, not x * (1 / d), rounded to nearest even: the twin divides and rounds the same way (the same bits)
    const __m256 dv = _mm256_set1_ps(d > 0.f ? d : 1.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = d > 0.f ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)) : _mm256_setzero_si256();
    }
    const __m256i h01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);  // values 0..15, int16
    const __m256i h23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);  // 16..31
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(h01, h23), 0xD8);      // 0..31, int8
    const __m256i ab = _mm256_abs_epi8(b);
    const int64_t at = (g / 2) * 64 + (g % 2) * 16;  // values 0..15 of the pair's half, 16..31 32 bytes on
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at), _mm256_castsi256_si128(b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at + 32), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(aq + at), _mm256_castsi256_si128(ab));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(aq + at + 32), _mm256_extracti128_si256(ab, 1));
  }
  return true;
}

}  // namespace superslm_q8
#endif

// Q5_0's fifth bits (quant/int5.py) read by the AVX2 kernels (avx2.cpp, avx2_rows.cpp): the masks are laid out
// for the VNNI kernels' lanes (vnni.h add_bits), and these turn them into bytes beside AVX2's code bytes.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace superslm_int5 {

// Q5_0's fifth bits (quant/int5.py; vnni.h add_bits: per block of 64 rows and quad of k, four 64-bit masks in
// the VNNI lanes' row order) as 16s over the code bytes of a chunk of 32 rows as the AVX2 kernels unpack them
// (per accumulator a, rows +0..7: byte 2 i + s of row i at k s of the low 128 bits, 2 + s of the high ones,
// s = 0, 1; avx2.cpp quad_sums, avx2_rows.cpp unpack_quad). For the chunk of rows 16 p.. (p = `part`) the
// code byte of row i (0..7) of accumulator a at k kk sits in mask a at bit 4 lane + kk, lane = (i & 3) +
// 8 (i >> 2) + 4 p (vnni.h lane_row): byte lane / 2 of the mask, bit 4 (i & 1) + kk. `shuf` picks that byte
// from the masks broadcast to both 128-bit halves (masks 0, 1 for a < 2; 2, 3 else), `sel` its bit.
struct FifthBits {
  __m256i shuf[2], sel, sixteen;
  explicit FifthBits(int64_t part) {
    alignas(32) uint8_t sh[2][32], se[32];
    for (int j = 0; j < 32; ++j) {
      const int i = (j % 16) / 2, kk = j / 16 + 2 * (j & 1);  // low half: (k0, k2) of row i; high: (k1, k3)
      const int lane = (i & 3) + 8 * (i >> 2) + 4 * static_cast<int>(part);
      for (int odd = 0; odd < 2; ++odd) sh[odd][j] = static_cast<uint8_t>(8 * odd + lane / 2);
      se[j] = static_cast<uint8_t>(1 << (4 * (i & 1) + kk));
    }
    for (int odd = 0; odd < 2; ++odd) shuf[odd] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sh[odd]));
    sel = _mm256_load_si256(reinterpret_cast<const __m256i*>(se));
    sixteen = _mm256_set1_epi8(16);
  }
  // the codes c of accumulator a (0..3) with 16 added where the fifth bit is set; m01 / m23: masks 0, 1 / 2, 3
  // of the quad broadcast to both halves
  inline __m256i add(__m256i c, int a, __m256i m01, __m256i m23) const {
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(a < 2 ? m01 : m23, shuf[a & 1]), sel);
    return _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(b, sel), sixteen));
  }
};

// one quad's four masks (uint64 [4]) broadcast as (masks 0, 1) and (masks 2, 3) to both 128-bit halves
inline void load_masks(const uint64_t* m, __m256i& m01, __m256i& m23) {
  m01 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
  m23 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 2)));
}

}  // namespace superslm_int5
#endif

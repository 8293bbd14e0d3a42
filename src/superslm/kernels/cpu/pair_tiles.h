// The row-pair tile of the AVX2 integer kernels for several activation rows (avx2_rows.cpp: int4 and Q5_0 rows
// with the GEMV's bits; pair_rows.cpp: prompt chunks of weights whose values are int8): two rows of x as int16
// words x16 = 254 hi + lo (vnni.h split_groups' two int8 parts joined), 32 outputs of int32 `vpmaddwd` sums a
// group, then the float epilogue into the rows' sums.
#pragma once
#include "aten_ops.h"

#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace superslm_pairs {

// x [R, K] rounded to bf16 and back, as torch's kernels and the GEMVs see it
inline std::vector<float> bf16_rows(const at::Tensor& x) {
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const at::BFloat16* p = xb.data_ptr<at::BFloat16>();
  std::vector<float> out(xb.numel());
  for (size_t k = 0; k < out.size(); ++k) out[k] = static_cast<float>(p[k]);
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)

// One group of two activation rows (t0, t1: their tables at the group's first quad) against a 32-row chunk's
// `nq` unpacked quads (`buf`, unpack_quad's vectors): the int32 sums 254 H + L of each row and accumulator,
// then avx2.cpp int4_chunk's epilogue into the rows' float sums y0, y1 (8 floats per accumulator, 32 each;
// s, z: the chunk's scales for the group). The loop body is written out in assembly: with 8 accumulators, 4
// activation words and 4 temporaries it needs all 16 ymm registers, and GCC 12 spilled three accumulators
// to the stack (a store-to-load chain on every quad). vpmaddwd runs two a cycle here, vpaddd four: 32
// products per 2 vpmaddwd and 2 vpaddd, about 1.6x the products per cycle of float32 FMAs.
// ZP: int4's zero points (y += s (sl acc - 8 sum) + z sum); without them (IQ4's table values) y += s (sl acc).
template <bool ZP>
inline void pair_group(const __m256i* buf, int64_t nq, const uint32_t* t0, const uint32_t* t1, const float sum[2],
                       const float sl[2], const __m256* s, const __m256* z, float* y0, float* y1) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t q = 0; q < nq; ++q, buf += 8) {
    __m256i x0, x1, u0, u1, c, d, m1, m2;
    __asm__("vpbroadcastd (%[t0]), %[x0]\n\t"
            "vpbroadcastd 4(%[t0]), %[x1]\n\t"
            "vpbroadcastd (%[t1]), %[u0]\n\t"
            "vpbroadcastd 4(%[t1]), %[u1]\n\t"
            "vmovdqu 0(%[p]), %[c]\n\t"
            "vmovdqu 32(%[p]), %[d]\n\t"
            "vpmaddwd %[c], %[x0], %[m1]\n\t"
            "vpmaddwd %[d], %[x1], %[m2]\n\t"
            "vpaddd %[m1], %[a0], %[a0]\n\t"
            "vpaddd %[m2], %[a0], %[a0]\n\t"
            "vpmaddwd %[c], %[u0], %[c]\n\t"
            "vpmaddwd %[d], %[u1], %[d]\n\t"
            "vpaddd %[c], %[b0], %[b0]\n\t"
            "vpaddd %[d], %[b0], %[b0]\n\t"
            "vmovdqu 64(%[p]), %[c]\n\t"
            "vmovdqu 96(%[p]), %[d]\n\t"
            "vpmaddwd %[c], %[x0], %[m1]\n\t"
            "vpmaddwd %[d], %[x1], %[m2]\n\t"
            "vpaddd %[m1], %[a1], %[a1]\n\t"
            "vpaddd %[m2], %[a1], %[a1]\n\t"
            "vpmaddwd %[c], %[u0], %[c]\n\t"
            "vpmaddwd %[d], %[u1], %[d]\n\t"
            "vpaddd %[c], %[b1], %[b1]\n\t"
            "vpaddd %[d], %[b1], %[b1]\n\t"
            "vmovdqu 128(%[p]), %[c]\n\t"
            "vmovdqu 160(%[p]), %[d]\n\t"
            "vpmaddwd %[c], %[x0], %[m1]\n\t"
            "vpmaddwd %[d], %[x1], %[m2]\n\t"
            "vpaddd %[m1], %[a2], %[a2]\n\t"
            "vpaddd %[m2], %[a2], %[a2]\n\t"
            "vpmaddwd %[c], %[u0], %[c]\n\t"
            "vpmaddwd %[d], %[u1], %[d]\n\t"
            "vpaddd %[c], %[b2], %[b2]\n\t"
            "vpaddd %[d], %[b2], %[b2]\n\t"
            "vmovdqu 192(%[p]), %[c]\n\t"
            "vmovdqu 224(%[p]), %[d]\n\t"
            "vpmaddwd %[c], %[x0], %[m1]\n\t"
            "vpmaddwd %[d], %[x1], %[m2]\n\t"
            "vpaddd %[m1], %[a3], %[a3]\n\t"
            "vpaddd %[m2], %[a3], %[a3]\n\t"
            "vpmaddwd %[c], %[u0], %[c]\n\t"
            "vpmaddwd %[d], %[u1], %[d]\n\t"
            "vpaddd %[c], %[b3], %[b3]\n\t"
            "vpaddd %[d], %[b3], %[b3]\n\t"
            : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [b0] "+x"(b0), [b1] "+x"(b1),
              [b2] "+x"(b2), [b3] "+x"(b3), [x0] "=&x"(x0), [x1] "=&x"(x1), [u0] "=&x"(u0), [u1] "=&x"(u1),
              [c] "=&x"(c), [d] "=&x"(d), [m1] "=&x"(m1), [m2] "=&x"(m2)
            : [p] "r"(buf), [t0] "r"(t0 + 2 * q), [t1] "r"(t1 + 2 * q)
            : "memory");
  }
  const __m256i acc[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
  float* const ys[2] = {y0, y1};
  for (int r = 0; r < 2; ++r) {
    const __m256 gs = _mm256_set1_ps(sum[r]), g8 = _mm256_set1_ps(8.f * sum[r]), l = _mm256_set1_ps(sl[r]);
    for (int a = 0; a < 4; ++a) {
      const __m256 c = _mm256_cvtepi32_ps(acc[r][a]);
      const __m256 dd = ZP ? _mm256_fmsub_ps(c, l, g8) : _mm256_mul_ps(c, l);
      __m256 y = _mm256_loadu_ps(ys[r] + 8 * a);
      y = _mm256_fmadd_ps(s[a], dd, y);
      if (ZP) y = _mm256_fmadd_ps(z[a], gs, y);
      _mm256_storeu_ps(ys[r] + 8 * a, y);
    }
  }
}

// unpacked codes per k block: ~16 KiB, so a block stays in L1 while every row pair passes over it
constexpr int64_t INT4_BLOCK_BYTES = 16384;

// The row pairs of `rs` (ng of them) over one k block's groups [g0, g1) of a 32-row chunk: `buf` holds the
// block's unpacked codes (8 vectors a quad of k, unpack_quad's), `sf` its scales (per group 8 vectors: s of
// accumulators 0..3, then z); the sums into y (32 floats a row, ng + 1 rows: an odd row pairs with itself, its
// twin landing in the spare row). ZP: pair_group's.
template <bool ZP>
inline void chunk_block(const __m256i* buf, const __m256* sf, int64_t g0, int64_t g1, int64_t G, int64_t nq,
                        const int64_t* rs, int64_t ng, const uint32_t* tab, const float* gsum, const float* gsl,
                        float* y) {
  for (int64_t i = 0; i < ng; i += 2) {
    const int64_t r0 = rs[i], r1 = i + 1 < ng ? rs[i + 1] : r0;
    float* y1 = y + (i + 1) * 32;  // the spare row for an odd row's twin
    for (int64_t g = g0; g < g1; ++g) {
      const float sum[2] = {gsum[r0 * G + g], gsum[r1 * G + g]}, sl[2] = {gsl[r0 * G + g], gsl[r1 * G + g]};
      pair_group<ZP>(buf + (g - g0) * nq * 8, nq, tab + (r0 * G + g) * 2 * nq, tab + (r1 * G + g) * 2 * nq, sum, sl,
                 sf + (g - g0) * 8, sf + (g - g0) * 8 + 4, y + i * 32, y1);
    }
  }
}

#endif

}  // namespace superslm_pairs

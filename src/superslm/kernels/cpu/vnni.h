// Pieces shared by the VNNI GEMV (gemv.cpp) and GEMM (gemm.cpp) kernels: the two-part int8 split of an
// activation row, bf16 loads, and the row order of torch's packed int4 lanes.
#pragma once

#include "aten_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SUPERSLM_VNNI 1
#endif

namespace superslm_vnni {

// The two int8 parts of x[0:n): x ~= sh * hi + sl * lo with sh = max|x| / 127, sl = sh / 254. False when
// the split would not be within bf16 rounding of every element that matters: a NaN or inf, all zeros
// (callers answer those with torch's kernel), a denormal scale, or one element over 64x the others' rms
// (the parts' error is relative to the largest element, so small elements would lose bits).
inline bool split_int8(const float* x, int64_t n, int8_t* hi, int8_t* lo, float* sh_out, float* sl_out) {
  float amax = 0.f;
  double ss = 0.0;
  bool finite = true;
  for (int64_t k = 0; k < n; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
    ss += static_cast<double>(x[k]) * x[k];
  }
  if (!finite || amax < 1e-30f) return false;
  // the other elements' rms: one outlier among n cannot hide in an rms that includes it
  const double rest = n > 1 ? std::max(0.0, ss - static_cast<double>(amax) * amax) / static_cast<double>(n - 1) : ss;
  if (rest > 0.0 && static_cast<double>(amax) * amax > 4096.0 * rest) return false;  // (one nonzero: exact)
  const float sh = amax / 127.f, sl = sh / 254.f;
  for (int64_t k = 0; k < n; ++k) {
    const float qh = std::max(-127.f, std::min(127.f, std::nearbyint(x[k] / sh)));
    // x - qh * sh rounded once (the compiler contracted it so; split_parts8 computes it the same way)
    const float ql = std::max(-127.f, std::min(127.f, std::nearbyint(std::fma(-qh, sh, x[k]) / sl)));
    hi[k] = static_cast<int8_t>(qh);
    lo[k] = static_cast<int8_t>(ql);
  }
  *sh_out = sh;
  *sl_out = sl;
  return true;
}

// split_int8 with both parts offset by +128, as the int8 kernels feed them (VNNI multiplies unsigned
// activation bytes by signed codes; they correct with 128 * each row's code sum)
inline bool split_uint8(const float* x, int64_t n, uint8_t* hi, uint8_t* lo, float* sh, float* sl) {
  std::vector<int8_t> hs(n), ls(n);
  if (!split_int8(x, n, hs.data(), ls.data(), sh, sl)) return false;
  for (int64_t k = 0; k < n; ++k) {
    hi[k] = static_cast<uint8_t>(hs[k] + 128);
    lo[k] = static_cast<uint8_t>(ls[k] + 128);
  }
  return true;
}

#if defined(__AVX2__) && defined(__FMA__)
// split_int8's element pass (after its checks) on 8 floats at a time, n % 8 == 0: the same operations on each
// element (the division, nearbyint in the current rounding mode, the clamps, x - qh * sh as one fma)
inline void split_parts8(const float* x, int64_t n, float sh, float sl, int8_t* hi, int8_t* lo) {
  const __m256 vsh = _mm256_set1_ps(sh), vsl = _mm256_set1_ps(sl);
  const __m256 top = _mm256_set1_ps(127.f), bot = _mm256_set1_ps(-127.f);
  constexpr int nearest = _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC;  // std::nearbyint
  auto store8 = [](int8_t* p, __m256 q) {  // 8 integral floats in -127..127 -> 8 bytes
    const __m256i i = _mm256_cvtps_epi32(q);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  };
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    // min(r, 127) and max(r, -127) as std::min(127, r) and std::max(-127, r) choose (r is never NaN here)
    const __m256 qh = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps(_mm256_div_ps(v, vsh), nearest), top), bot);
    const __m256 r = _mm256_div_ps(_mm256_fnmadd_ps(qh, vsh, v), vsl);
    const __m256 ql = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps(r, nearest), top), bot);
    store8(hi + k, qh);
    store8(lo + k, ql);
  }
}

// an 8 x 8 float transpose in registers
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// split_groups for 8 groups from g on (group % 8 == 0), lane j of each vector for group g + j: each group's
// sum, maximum and sum of squares in its own order (split_int8's and split_groups' operations, lane by lane:
// the same bits, and the same rows declined), its checks, then the element pass
inline bool split_groups8(const float* x, int64_t group, int64_t g, int8_t* hi, int8_t* lo, float* gsum, float* gsl) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  __m256 sum = _mm256_setzero_ps(), amax = sum, nonzero = sum, finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256d ss0 = _mm256_setzero_pd(), ss1 = ss0;
  const float* xg = x + g * group;
  for (int64_t k0 = 0; k0 < group; k0 += 8) {
    __m256 t[8];  // the 8 groups' elements k0..k0 + 7, transposed: t[i] lane j = group j's element k0 + i
    for (int j = 0; j < 8; ++j) t[j] = _mm256_loadu_ps(xg + j * group + k0);
    transpose8(t);
    for (int i = 0; i < 8; ++i) {
      const __m256 v = t[i];
      sum = _mm256_add_ps(sum, v);
      nonzero = _mm256_or_ps(nonzero, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ));
      const __m256 a = _mm256_andnot_ps(sign, v);
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
      amax = _mm256_max_ps(a, amax);  // std::max(amax, |v|): amax where |v| is not larger (or NaN)
      const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      ss0 = _mm256_fmadd_pd(d0, d0, ss0);  // the products are exact in double: as a multiply and an add
      ss1 = _mm256_fmadd_pd(d1, d1, ss1);
    }
  }
  alignas(32) float s[8], m[8];
  alignas(32) double q[8];
  _mm256_store_ps(s, sum);
  _mm256_store_ps(m, amax);
  _mm256_store_pd(q, ss0);
  _mm256_store_pd(q + 4, ss1);
  const int nz = _mm256_movemask_ps(nonzero), fin = _mm256_movemask_ps(finite);
  for (int j = 0; j < 8; ++j) {
    const int64_t o = (g + j) * group;
    gsum[g + j] = s[j];
    if (!((nz >> j) & 1)) {
      std::fill(hi + o, hi + o + group, int8_t(0));
      std::fill(lo + o, lo + o + group, int8_t(0));
      gsl[g + j] = 0.f;
      continue;
    }
    if (!((fin >> j) & 1) || m[j] < 1e-30f) return false;
    const double a2 = static_cast<double>(m[j]) * m[j];
    const double rest = std::max(0.0, q[j] - a2) / static_cast<double>(group - 1);
    if (rest > 0.0 && a2 > 4096.0 * rest) return false;
    const float sh = m[j] / 127.f, sl = sh / 254.f;
    split_parts8(x + o, group, sh, sl, hi + o, lo + o);
    gsl[g + j] = sl;
  }
  return true;
}
#endif

// One row's int4 activation parts, per group: an all-zero group gets zero parts and scales; false when
// a group cannot be split (the row then goes to torch's kernel). With AVX2, eight groups at a time where the
// group is a multiple of 8 (the same bits: split_groups8); a prompt's rows spent ~2.2 ns an element here,
// as long as a 64-column GEMM.
inline bool split_groups(const float* x, int64_t K, int64_t group, int8_t* hi, int8_t* lo, float* gsum, float* gsl) {
  int64_t g = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (group % 8 == 0)
    for (; g + 8 <= K / group; g += 8)
      if (!split_groups8(x, group, g, hi, lo, gsum, gsl)) return false;
#endif
  for (; g < K / group; ++g) {
    const float* xg = x + g * group;
    bool zero = true;
    gsum[g] = 0.f;
    for (int64_t k = 0; k < group; ++k) {
      gsum[g] += xg[k];
      zero = zero && xg[k] == 0.f;
    }
    if (zero) {
      std::fill(hi + g * group, hi + (g + 1) * group, int8_t(0));
      std::fill(lo + g * group, lo + (g + 1) * group, int8_t(0));
      gsl[g] = 0.f;
    } else {
      float sh;  // the kernels use sl alone (sh = 254 sl, group_epilogue)
      if (!split_int8(xg, group, hi + g * group, lo + g * group, &sh, &gsl[g])) return false;
    }
  }
  return true;
}

// one int8 output, scale * (sh * H + sl * L) from the exact integer sums H and L of the codes times each
// part (the GEMV and the GEMM both call this, so a row's bits do not depend on its batch)
inline float int8_out(float scale, float sh, float sl, int64_t h, int64_t l) {
  return scale * std::fma(sh, static_cast<float>(h), sl * static_cast<float>(l));
}

// the arguments of the int4/int5 kernels, checked before any raw pointer is read: x [M, K] and packed
// codes uint8 [N, K / 2] on the CPU, N % 64 == 0, the group 4..256 dividing K, torch's scales_zeros
// bf16 [K / group, N, 2]
inline void check_int4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                       const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && qweight.dim() == 2 && qweight.device().is_cpu() &&
                  qweight.scalar_type() == at::kByte && qweight.is_contiguous() && qweight.size(1) * 2 == x.size(1),
              name, ": rows of K against packed codes uint8 [N, K / 2] on the CPU");
  TORCH_CHECK(group >= 4 && group <= 256 && group % 4 == 0 && x.size(1) > 0 && x.size(1) % group == 0 &&
                  qweight.size(0) % 64 == 0,
              name, ": K a positive multiple of the group (4..256, a multiple of 4), N of 64");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.device().is_cpu() && sz.dim() == 3 &&
                  sz.size(0) == x.size(1) / group && sz.size(1) == qweight.size(0) && sz.size(2) == 2,
              name, ": scales_zeros bf16 [K / group, N, 2]");
}

// the row (within a block of 64) held by lane i of the four accumulators (lo nibbles q01, q23; hi q01, q23)
inline int lane_row(int acc, int lane) {
  static const int base01[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  const int r = base01[lane] + ((acc & 1) ? 8 : 0);
  return r + ((acc & 2) ? 32 : 0);
}

#ifdef SUPERSLM_VNNI
// acc[4i + j] = the VNNI products of activation bytes x[j] (unsigned, K of them) with code row w[i] (signed),
// 16 lanes each, K % 64 == 0: a tile of 4 code rows x 4 activation rows, every code load used 4 times
inline void dot_tile4x4(const uint8_t* const x[4], const int8_t* const w[4], int64_t K, __m512i acc[16]) {
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    __m512i xv[4], wv[4];
    for (int j = 0; j < 4; ++j) xv[j] = _mm512_loadu_si512(x[j] + k);
    for (int i = 0; i < 4; ++i) wv[i] = _mm512_loadu_si512(w[i] + k);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc[i * 4 + j] = _mm512_dpbusd_epi32(acc[i * 4 + j], xv[j], wv[i]);
  }
}

// the 16 lane sums of v[0..15] in one vector (integer sums: exact in any order); lane 4q + r holds the
// sum of v[4r + q]
inline __m512i reduce16(const __m512i v[16]) {
  __m512i w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: 8 partials of v[2i], 8-15: of v[2i + 1]
    w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter q: 4 partials of v[4i + q]
    x[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter q, lanes (0, 2): v[8i + q], lanes (1, 3): v[8i + 4 + q], 2 partials each
    y[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(y[0], y[1]), _mm512_unpackhi_epi64(y[0], y[1]));
}

// four k of torch's packed int4 block (32 bytes each, at p) -> the four accumulators' code vectors:
// 16 rows x 4 k per vector, codes 0..15 as unsigned bytes
inline void unpack_quad(const uint8_t* p, __m512i c[4]) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m256i B0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i B1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  const __m256i B2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));
  const __m256i B3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 96));
  const __m256i t01l = _mm256_unpacklo_epi8(B0, B1), t01h = _mm256_unpackhi_epi8(B0, B1);
  const __m256i t23l = _mm256_unpacklo_epi8(B2, B3), t23h = _mm256_unpackhi_epi8(B2, B3);
  const __m512i q01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(t01l, t23l)),
                                         _mm256_unpackhi_epi16(t01l, t23l), 1);
  const __m512i q23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(t01h, t23h)),
                                         _mm256_unpackhi_epi16(t01h, t23h), 1);
  c[0] = _mm512_and_si512(q01, nib);
  c[1] = _mm512_and_si512(q23, nib);
  c[2] = _mm512_and_si512(_mm512_srli_epi16(q01, 4), nib);
  c[3] = _mm512_and_si512(_mm512_srli_epi16(q23, 4), nib);
}

// a group's scales and zeros for one block of 64 rows, read from torch's [groups, N, 2] bf16 layout
// (p: the 64 (s, z) pairs of rows b * 64.., as 32-bit words) into float vectors in the lanes' row order
inline void group_scales(const uint32_t* p, __m512 sf[4], __m512 zf[4]) {
  // lane i of accumulator a holds row lane_row(a, i): rows 0-3, 16-19, 4-7, 20-23 (+8 for odd a, +32 for a >= 2)
  const __m512i even = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(8));
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int half = 0; half < 2; ++half) {
    const __m512i lo = _mm512_loadu_si512(p + half * 32), hi = _mm512_loadu_si512(p + half * 32 + 16);
    for (int j = 0; j < 2; ++j) {
      const __m512i pairs = _mm512_permutex2var_epi32(lo, j ? odd : even, hi);  // s | z << 16
      sf[half * 2 + j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      zf[half * 2 + j] = _mm512_castsi512_ps(_mm512_and_si512(pairs, hi16));
    }
  }
}

// Q5_0's fifth bits over nibble codes: per (block of 64 rows, quad of 4 k) four 64-bit masks; bit
// 4 * lane + kk of mask a is the fifth bit of row lane_row(a, lane) at k = 4 * quad + kk (the byte
// that unpack_quad puts there), added to the code as 16
inline void add_bits(const uint64_t* m, __m512i c[4]) {
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int a = 0; a < 4; ++a) c[a] = _mm512_mask_add_epi8(c[a], _cvtu64_mask64(m[a]), c[a], sixteen);
}

// y[a] += one group's contribution, from the integer sums of its two parts (the GEMV and the GEMM run
// these same operations in this order, so a row's result does not depend on its batch).
// sum c x = sl * sum c (254 hi + lo): one exact integer and one conversion to float (exact below 2^24:
// 4-bit codes in groups <= 32; 5-bit codes reach ~3.2e7 and round there, the same in GEMV and GEMM).
inline void group_epilogue(const __m512i ah[4], const __m512i al[4], const __m512 sf[4], const __m512 zf[4],
                           float gsum, float gsl, __m512 y[4]) {
  const __m512 gs = _mm512_set1_ps(gsum), g8 = _mm512_set1_ps(8.f * gsum), sl = _mm512_set1_ps(gsl);
  for (int a = 0; a < 4; ++a) {
    const __m512i comb = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(ah[a], 8), _mm512_slli_epi32(ah[a], 1)), al[a]);
    // sum (c - 8) x = sum c x - 8 sum x; then y += s * that + z * sum x
    const __m512 d = _mm512_fmsub_ps(_mm512_cvtepi32_ps(comb), sl, g8);
    y[a] = _mm512_fmadd_ps(sf[a], d, y[a]);
    y[a] = _mm512_fmadd_ps(zf[a], gs, y[a]);
  }
}
#endif

}  // namespace superslm_vnni

// 8-lane AVX2 versions of rowops.h's attention and gated activation, for CPUs without AVX-512 (an
// AVX2-only AMD EPYC spent ~12% of a 600-token decode in the scalar attention, one std::exp per score).
// Same contract as the 16-lane ones: every row alone, in an order fixed by its own length.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "rowbase.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define SUPERSLM_ROWS_AVX2 1

namespace superslm_rows {

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <>
inline __m256 load8<int8_t>(const int8_t* p) {  // 8 int8 codes as floats (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// e^x as rowops.h exp16 (the same Cephes polynomial), 2^n put into the exponent bits; x is clamped to
// [-87.3, 88.37] so that 2^n stays a normal number (exp16 reaches 2^-127, a denormal, below -87.3)
inline __m256 exp8(__m256 x) {
  // constants first: min/max return their second operand for a NaN, so a NaN stays a NaN
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// act(g) for act 0 (silu) and 1 (gelu_tanh), as rowops.h act16; 2 (erf gelu) has no vector form here
inline __m256 act8(int64_t act, __m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  if (act == 0) return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  const __m256 e = exp8(_mm256_add_ps(u, u));
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
}

// out[b, j] = rnd(act(gate[b, j])) * up[b, j] for one row's [gate | up], 8 values at a time from j = 0;
// returns where the scalar tail starts
template <typename T>
inline int64_t act_row8(const T* gp, T* ap, int64_t inter, int64_t act) {
  if (act == 2) return 0;
  int64_t j = 0;
  alignas(32) float v[8];
  for (; j + 8 <= inter; j += 8) {
    _mm256_store_ps(v, act8(act, load8<T>(gp + j)));
    for (int i = 0; i < 8; ++i) ap[j + i] = static_cast<T>(rnd<T>(v[i]) * ld(gp + inter + j + i));
  }
  return j;
}

// the sums of the 8 lanes of t[j] for j < 8 (t: 8 rows of 8 floats), in a fixed order
inline __m256 hsum8x8(const float* t) {
  __m256 x[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 a = _mm256_load_ps(t + 16 * j), b = _mm256_load_ps(t + 16 * j + 8);
    x[j] = _mm256_hadd_ps(a, b);  // per 128-bit half: a01 a23 b01 b23
  }
  const __m256 y0 = _mm256_hadd_ps(x[0], x[1]), y1 = _mm256_hadd_ps(x[2], x[3]);  // rows 0-3 / 4-7, both halves
  const __m256 lo = _mm256_permute2f128_ps(y0, y1, 0x20), hi = _mm256_permute2f128_ps(y0, y1, 0x31);
  return _mm256_add_ps(lo, hi);
}

// 16 elements of a 4-bit row (8 bytes) as two vectors: the low nibbles (elements 2i) and the high ones (2i + 1),
// codes - 8 (exact), as rowops.h load_q4x16 in 8 lanes
inline void load_q4x8(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i eight = _mm256_set1_epi32(8);
  lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
  hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}

// Value sums of vectors v0 .. v0 + VN - 1 of gn <= GN query heads from g0 on, over the keys i0 .. i1 - 1: each
// lane of acc (float [G][D], row stride D) plus, key by key in order, the head's weight times the value (quantized
// rows: a row's scale is in its weights). acc is read and written exactly, so running the keys in tiles gives each
// (head, lane) the same sum in the same order as one pass. 4-bit rows: VN 2 (load_q4x8's pair).
template <int64_t GN, int64_t VN, typename VC>
inline void value_block(const float* scores, const VC* vc, const int64_t* slots, int64_t first, int64_t n,
                        int64_t i0, int64_t i1, int64_t vrow, int64_t voff, int64_t g0, int64_t gn, int64_t v0,
                        int64_t D, float* acc_out) {
  __m256 acc[GN][VN];
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t v = 0; v < VN; ++v)
      acc[g][v] = g < gn ? _mm256_load_ps(acc_out + (g0 + g) * D + (v0 + v) * 8) : _mm256_setzero_ps();
  for (int64_t i = i0; i < i1; ++i) {
    const VC* vr = vc + slots[first + i] * vrow + voff + kv_offset<VC>(v0 * 8);
    __m256 vv[VN];
    if constexpr (is_q4<VC>) {
      static_assert(VN == 2, "4-bit value rows load two vectors at a time");
      load_q4x8(vr, vv[0], vv[1]);
    } else {
      for (int64_t v = 0; v < VN; ++v) vv[v] = load8<VC>(vr + v * 8);
    }
    for (int64_t g = 0; g < GN; ++g) {
      if (g >= gn) break;
      const __m256 p = _mm256_set1_ps(scores[(g0 + g) * n + i]);
      for (int64_t v = 0; v < VN; ++v) acc[g][v] = _mm256_fmadd_ps(p, vv[v], acc[g][v]);
    }
  }
  for (int64_t g = 0; g < gn; ++g)
    for (int64_t v = 0; v < VN; ++v) _mm256_store_ps(acc_out + (g0 + g) * D + (v0 + v) * 8, acc[g][v]);
}

// value_block<GN, rest> for 1 <= rest <= R: a block's last `rest` vectors in one pass over the keys
template <int64_t GN, int64_t R, typename VC>
inline void value_rest(int64_t rest, const float* scores, const VC* vc, const int64_t* slots, int64_t first,
                       int64_t n, int64_t i0, int64_t i1, int64_t vrow, int64_t voff, int64_t g0, int64_t gn,
                       int64_t v0, int64_t D, float* acc_out) {
  if constexpr (R > 0) {
    if (rest == R) {
      value_block<GN, R, VC>(scores, vc, slots, first, n, i0, i1, vrow, voff, g0, gn, v0, D, acc_out);
      return;
    }
    value_rest<GN, R - 1, VC>(rest, scores, vc, slots, first, n, i0, i1, vrow, voff, g0, gn, v0, D, acc_out);
  }
}

// NK keys' partial dot products with GN query heads: acc[i][g] += q[g, v*8 .. v*8+7] * key i's lanes, v in order.
// Each head's FMA chain is a dependency chain D/8 long, so one key and a few heads leave the FMA units waiting on
// its latency; two keys give twice the chains in flight. Each (head, key) sum is the same operations in the same
// order whatever NK.
template <int64_t GN, int NK, typename KC>
inline void key_dots(const float* q, const KC* const (&k)[NK], int64_t D, __m256 (&acc)[NK][GN]) {
  const int64_t V = D / 8;
  if constexpr (is_q4<KC>) {
    for (int64_t v = 0; v < V; v += 2) {
      __m256 lo[NK], hi[NK];
      for (int i = 0; i < NK; ++i) load_q4x8(k[i] + v * 4, lo[i], hi[i]);
      for (int64_t g = 0; g < GN; ++g) {
        const float* qg = q + g * D + v * 8;
        const __m256 qa = _mm256_loadu_ps(qg), qb = _mm256_loadu_ps(qg + 8);
        for (int i = 0; i < NK; ++i) acc[i][g] = _mm256_fmadd_ps(qa, lo[i], acc[i][g]);
        for (int i = 0; i < NK; ++i) acc[i][g] = _mm256_fmadd_ps(qb, hi[i], acc[i][g]);
      }
    }
  } else {
    for (int64_t v = 0; v < V; ++v) {
      __m256 kv[NK];
      for (int i = 0; i < NK; ++i) kv[i] = load8<KC>(k[i] + v * 8);
      for (int64_t g = 0; g < GN; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + v * 8);
        for (int i = 0; i < NK; ++i) acc[i][g] = _mm256_fmadd_ps(qv, kv[i], acc[i][g]);
      }
    }
  }
}

// The scaled scores [GN, n] of GN query heads q [GN, D] against the keys key_slots[first:first + n] (row stride
// krow, this kv head at koff), in blocks of 8 keys: each key's 8-lane partial sums, then hsum8x8 per head.
template <int64_t GN, typename KC>
inline void score_block(const float* q, const KC* kc, const int64_t* slots, int64_t first, int64_t n, int64_t krow,
                        int64_t koff, int64_t D, float scale, float* scores) {
  alignas(32) float part[GN][8][8];  // [query head, key, lane] partial dot products of one block of keys
  alignas(32) float kscale[8];       // quantized rows: the block's key scales
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t jn = std::min<int64_t>(8, n - j0);
    int64_t j = 0;
    // keys two at a time, then an odd one: each key's lanes into part, its scale into kscale
    auto keys = [&](auto nk_c) {
      constexpr int NK = decltype(nk_c)::value;
      const KC* k[NK];
      __m256 acc[NK][GN];
      for (int i = 0; i < NK; ++i) {
        k[i] = kc + slots[first + j0 + j + i] * krow + koff;
        for (int64_t g = 0; g < GN; ++g) acc[i][g] = _mm256_setzero_ps();
      }
      key_dots<GN, NK, KC>(q, k, D, acc);
      for (int i = 0; i < NK; ++i) {
        if constexpr (is_quant<KC>) kscale[j + i] = kv_scale(k[i], D);
        for (int64_t g = 0; g < GN; ++g) _mm256_store_ps(part[g][j + i], acc[i][g]);
      }
      j += NK;
    };
    while (j + 2 <= jn) keys(std::integral_constant<int, 2>());
    if (j < jn) keys(std::integral_constant<int, 1>());
    for (; j < 8; ++j) {  // the zero lanes past the last key of the last block
      if constexpr (is_quant<KC>) kscale[j] = 0.f;
      for (int64_t g = 0; g < GN; ++g) _mm256_store_ps(part[g][j], _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < GN; ++g) {
      alignas(32) float s[8];
      __m256 dot = hsum8x8(&part[g][0][0]);
      if constexpr (is_quant<KC>) dot = _mm256_mul_ps(dot, _mm256_load_ps(kscale));
      _mm256_store_ps(s, _mm256_mul_ps(dot, sv));
      std::memcpy(scores + g * n + j0, s, jn * sizeof(float));
    }
  }
}

// rowops.h attend_group16 in 8 lanes: the query heads q [G, D] (float) of one kv head against its keys
// key_slots[first:len], D % 8 == 0, D <= 256, G <= 64; each key row loaded once per 4 query heads (value rows:
// value_block's blocks; 4-bit ones once per 4 heads and 16 values). scores: G * (len - first) floats. KC, VC: float
// rows of T, int8 or 4-bit rows (a key's dot product and a value's weight multiplied by its row's scale); 4-bit
// rows (D % 16 == 0) in 8-lane order (load_q4x8), q in it
// where the keys are 4-bit, out (O = float) where the values are.
template <typename O, typename KC, typename VC>
void attend_group8(const float* q, int64_t G, const KC* kc, const VC* vc, const int64_t* slots, int64_t first,
                   int64_t len, int64_t kvh, int64_t kv_heads, int64_t D, float scale, float* scores, O* out,
                   int64_t out_stride) {
  const int64_t kw = kv_width<KC>(D), krow = kv_heads * kw, vw = kv_width<VC>(D), vrow = kv_heads * vw;
  const int64_t n = len - first, V = D / 8;
  // scores in blocks of 4 query heads, then the 1-3 left (score_block: two keys at a time)
  const int64_t koff = kvh * kw, g4 = G - G % 4;
  for (int64_t g0 = 0; g0 < g4; g0 += 4)
    score_block<4, KC>(q + g0 * D, kc, slots, first, n, krow, koff, D, scale, scores + g0 * n);
  const float* qr = q + g4 * D;
  float* sr = scores + g4 * n;
  if (G % 4 == 3) score_block<3, KC>(qr, kc, slots, first, n, krow, koff, D, scale, sr);
  if (G % 4 == 2) score_block<2, KC>(qr, kc, slots, first, n, krow, koff, D, scale, sr);
  if (G % 4 == 1) score_block<1, KC>(qr, kc, slots, first, n, krow, koff, D, scale, sr);
  float total[64];  // G <= 64 (the caller checks)
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
    const __m256 m = _mm256_set1_ps(mx);
    __m256 tot = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
      _mm256_storeu_ps(sc + j, e);
      tot = _mm256_add_ps(tot, e);
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, tot);
    float s = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    if (j < n) {  // the tail through the same exp8 (its padding lanes are not used)
      alignas(32) float tail[8];
      for (int i = 0; i < 8; ++i) tail[i] = j + i < n ? sc[j + i] : mx;
      _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), m)));
      for (int64_t i = 0; i < n - j; ++i) {
        sc[j + i] = tail[i];
        s += tail[i];
      }
    }
    total[g] = s;
  }
  if constexpr (is_quant<VC>) {  // each value row's scale into its weights: once per row and query head
    for (int64_t i = 0; i < n; ++i) {
      const float vs = kv_scale(vc + slots[first + i] * vrow + kvh * vw, D);
      for (int64_t g = 0; g < G; ++g) scores[g * n + i] *= vs;
    }
  }
  // value sums in blocks of GN query heads x VN value vectors (value_block), as many as fit AVX2's 16 registers
  // for this G: the fewer passes over the keys' value rows, the less they are read again (one head of 32 vectors
  // took 16 passes in blocks of 4 x 2); 4-bit rows 4 x 2 (load_q4x8 gives two vectors; V is even). The keys go
  // in tiles of ~64 KB of value rows, every block's pass over one tile before the next: the passes read the tile
  // from L2 where the whole of a long context's rows would come from L3 or memory each pass.
  static thread_local std::vector<float> acc_buf;
  if (static_cast<int64_t>(acc_buf.size()) < G * D + 8) acc_buf.resize(G * D + 8);
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc_buf.data()) + 31) & ~uintptr_t(31));
  std::fill(acc, acc + G * D, 0.f);
  const int64_t tile = std::max<int64_t>(64, 65536 / static_cast<int64_t>(vw * sizeof(VC)));
  auto blocks = [&](auto gn_c, auto vn_c) {
    constexpr int64_t GN = decltype(gn_c)::value, VN = decltype(vn_c)::value;
    for (int64_t i0 = 0; i0 < n; i0 += tile) {
      const int64_t i1 = std::min(n, i0 + tile);
      for (int64_t g0 = 0; g0 < G; g0 += GN) {
        const int64_t gn = std::min<int64_t>(GN, G - g0);
        int64_t v0 = 0;
        for (; v0 + VN <= V; v0 += VN)
          value_block<GN, VN, VC>(scores, vc, slots, first, n, i0, i1, vrow, kvh * vw, g0, gn, v0, D, acc);
        if constexpr (!is_q4<VC>)
          if (v0 < V)  // the fewer than VN vectors left: one more pass
            value_rest<GN, VN - 1, VC>(V - v0, scores, vc, slots, first, n, i0, i1, vrow, kvh * vw, g0, gn, v0, D,
                                       acc);
      }
    }
  };
  using std::integral_constant;
  if constexpr (is_q4<VC>)
    blocks(integral_constant<int64_t, 4>(), integral_constant<int64_t, 2>());
  else if (G >= 4)
    blocks(integral_constant<int64_t, 4>(), integral_constant<int64_t, 2>());
  else if (G == 3)
    blocks(integral_constant<int64_t, 3>(), integral_constant<int64_t, 3>());
  else if (G == 2)
    blocks(integral_constant<int64_t, 2>(), integral_constant<int64_t, 4>());
  else
    blocks(integral_constant<int64_t, 1>(), integral_constant<int64_t, 6>());
  for (int64_t g = 0; g < G; ++g) {  // each head's sums over its total
    const __m256 inv = _mm256_set1_ps(total[g]);
    alignas(32) float o[8];
    for (int64_t v = 0; v < V; ++v) {
      _mm256_store_ps(o, _mm256_div_ps(_mm256_load_ps(acc + g * D + v * 8), inv));
      O* dst = out + g * out_stride + v * 8;
      for (int j = 0; j < 8; ++j) dst[j] = static_cast<O>(o[j]);
    }
  }
}

}  // namespace superslm_rows
#endif

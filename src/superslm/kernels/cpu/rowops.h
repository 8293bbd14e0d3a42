// Per-row pieces of the decode layers (decode_layers.cpp): rounding helpers, the attention of one query
// group over its keys, and the gated activation; each in plain C++ and, where the CPU has AVX-512, in
// 16-lane vectors. Every row is computed alone, in an order fixed by its own length, so a row's bits
// never depend on the rows beside it (deterministic mode relies on that).
#pragma once

#include "aten_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "rowbase.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SUPERSLM_AVX512 1
#endif

#include "rowops_avx2.h"  // 8-lane versions where there is no AVX-512

namespace superslm_rows {

// one query row against its keys key_slots[first:len]: scores, softmax and the value sum in float32, into out
// (O: the model dtype, or float for the caller to rotate back). KC, VC: the key and value rows, T (float rows of
// the model dtype), int8_t or uint8_t (codes times their row's scale, rowbase.h; 4-bit rows in their rotated
// basis, q rotated as the keys are, the sum left in the values' basis), in element order
template <typename O, typename KC, typename VC>
void attend(const float* q, const KC* kc, const VC* vc, const int64_t* slots, int64_t first, int64_t len, int64_t kvh,
            int64_t kv_heads, int64_t head_dim, float scale, float* scores, float* acc, O* out) {
  const int64_t kw = kv_width<KC>(head_dim), krow = kv_heads * kw;
  const int64_t vw = kv_width<VC>(head_dim), vrow = kv_heads * vw;
  float mx = -INFINITY;
  for (int64_t j = first; j < len; ++j) {
    const KC* k = kc + slots[j] * krow + kvh * kw;
    // 16 lanes summed in a fixed order: vectorizes without reassociating, the same bits every run
    float lane[16] = {0.f};
    int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16)
      for (int i = 0; i < 16; ++i) lane[i] += q[d + i] * kv_elem(k, d + i);
    for (; d < head_dim; ++d) lane[d % 16] += q[d] * kv_elem(k, d);
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += lane[i];
    if constexpr (is_quant<KC>) s *= kv_scale(k, head_dim);
    s *= scale;
    scores[j - first] = s;
    mx = s > mx ? s : mx;
  }
  float total = 0.f;
  for (int64_t j = 0; j < len - first; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    total += scores[j];
  }
  for (int64_t d = 0; d < head_dim; ++d) acc[d] = 0.f;
  for (int64_t j = first; j < len; ++j) {
    const VC* v = vc + slots[j] * vrow + kvh * vw;
    float p = scores[j - first];
    if constexpr (is_quant<VC>) p *= kv_scale(v, head_dim);  // sum of p * scale * code
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * kv_elem(v, d);
  }
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<O>(acc[d] / total);
}

inline float act_fn(int64_t act, float g) {
  if (act == 0) return g / (1.f + std::exp(-g));
  if (act == 1) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + std::tanh(k * (g + 0.044715f * g * g * g)));
  }
  return 0.5f * g * (1.f + std::erf(g * 0.7071067811865476f));
}

// ---- norms and rope, row by row ----

// out[r] = rms_norm(x[r]) * w over n values, statistics in float32 (kernels/norm.py)
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, int64_t stride_in, int64_t stride_out,
                   double eps, bool w_float) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride_in;
    T* orow = out + r * stride_out;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      float v = ld(xr + i);
      ss += v * v;
    }
    float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) {
      float y = ld(xr + i) * inv;
      orow[i] = static_cast<T>(w_float ? y * ld(w + i) : rnd<T>(y) * ld(w + i));
    }
  }
}

// NeoX rope on the first `rot` dims of each head, rounding each product as the torch reference does
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t head_dim, int64_t rot,
               int64_t row_stride) {
  const int64_t half = rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * rot;
    const T* s = sin + r * rot;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * row_stride + h * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        float x1 = ld(v + j), x2 = ld(v + j + half);
        float a = rnd<T>(rnd<T>(x1 * ld(c + j)) + rnd<T>(-x2 * ld(s + j)));
        float b = rnd<T>(rnd<T>(x2 * ld(c + j + half)) + rnd<T>(x1 * ld(s + j + half)));
        v[j] = static_cast<T>(a);
        v[j + half] = static_cast<T>(b);
      }
    }
  }
}

#ifdef SUPERSLM_AVX512
// ---- 16-lane versions -------------------------------------------------------------------------------

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <>
inline __m512 load16<int8_t>(const int8_t* p) {  // 16 int8 codes as floats (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// round to bf16 (nearest even, NaN kept a NaN) and back, as bf16_round does for one value
inline __m512 bf16_round16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7f800000)),
                                                    _mm512_set1_epi32(0x7f800000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, special, u));
}

template <typename T>
inline __m512 rnd16(__m512 x);
template <>
inline __m512 rnd16<float>(__m512 x) { return x; }
template <>
inline __m512 rnd16<at::BFloat16>(__m512 x) { return bf16_round16(x); }

template <typename T>
inline void store16(T* p, __m512 x);
template <>
inline void store16<float>(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
template <>
inline void store16<at::BFloat16>(at::BFloat16* p, __m512 x) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(bf16_round16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// e^x (Cephes expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), within ~2 ulp of expf
inline __m512 exp16(__m512 x) {
  // constants first: min/max return their second operand for a NaN, so a NaN stays a NaN
  x = _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f), _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// act(g) for act 0 (silu) and 1 (gelu_tanh); 2 (erf gelu) has no vector form here
inline __m512 act16(int64_t act, __m512 g) {
  const __m512 one = _mm512_set1_ps(1.f);
  if (act == 0) return _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  // tanh(u) = 1 - 2 / (e^(2u) + 1)
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
  const __m512 e = exp16(_mm512_add_ps(u, u));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t));
}

// the cache lines of one key or value row, a few keys ahead: slots are scattered pages, which the hardware
// prefetcher does not follow, and 16 streams' caches outgrow L3
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// r[j] = sum of the 16 lanes of t[j], j < 16 (t: 16 rows of 16 floats): a transposing tree of 45 shuffles
// and adds where 16 separate reductions cost ~130; the same order every call
inline __m512 hsum16x16(const float* t) {
  __m512 x[8], z[4];
  for (int j = 0; j < 8; ++j) {
    const __m512 a = _mm512_load_ps(t + 32 * j), b = _mm512_load_ps(t + 32 * j + 16);
    x[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // lane: a, b, a, b partials
  }
  for (int m = 0; m < 4; ++m)  // lane: keys 4m..4m+3, each the sum of that 128-bit lane
    z[m] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 32 elements of a 4-bit row (16 bytes) as two vectors: the low nibbles (elements 2i) and the high ones
// (2i + 1), codes - 8 (exact); the query and the value sums are in that lane order (rowbase.h lane_index)
inline void load_q4x16(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i eight = _mm512_set1_epi32(8);
  lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), eight));
  hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
}

// the query heads q [G, D] (float) of one kv head against its keys key_slots[first:len], D % 16 == 0 and
// D <= 256, G <= 64: each key and value row is loaded once per 4 query heads (once per 16 value lanes). Scores go 16
// keys at a time through hsum16x16; the value sums keep up to 16 accumulators in flight, not 4 (FMA
// latency bound). scores: G * (len - first) floats. KC, VC: float rows of T, int8 or 4-bit rows (a key's dot
// product and a value's weight are multiplied by its row's scale, one product per row). 4-bit rows (D % 32 == 0)
// are read in 16-lane order (load_q4x16): q in it where the keys are 4-bit, out (O = float) where the values are.
template <typename O, typename KC, typename VC>
void attend_group16(const float* q, int64_t G, const KC* kc, const VC* vc, const int64_t* slots, int64_t first,
                    int64_t len, int64_t kvh, int64_t kv_heads, int64_t D, float scale, float* scores, O* out,
                    int64_t out_stride) {
  const int64_t kw = kv_width<KC>(D), krow = kv_heads * kw, vw = kv_width<VC>(D), vrow = kv_heads * vw;
  const int64_t n = len - first, V = D / 16;
  alignas(64) float part[4][16][16];  // [query head, key, lane] partial dot products of one block of keys
  alignas(64) float kscale[16];       // quantized rows: the block's key scales
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t jn = std::min<int64_t>(16, n - j0);
      for (int64_t j = 0; j < jn; ++j) {
        const KC* k = kc + slots[first + j0 + j] * krow + kvh * kw;
        if (j0 + j + 8 < n) prefetch_row(kc + slots[first + j0 + j + 8] * krow + kvh * kw, kw * sizeof(KC));
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        if constexpr (is_q4<KC>) {
          for (int64_t v = 0; v < V; v += 2) {
            __m512 lo, hi;
            load_q4x16(k + v * 8, lo, hi);
            for (int64_t g = 0; g < gn; ++g) {
              const float* qg = q + (g0 + g) * D + v * 16;
              acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qg), lo, acc[g]);
              acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), hi, acc[g]);
            }
          }
        } else {
          for (int64_t v = 0; v < V; ++v) {
            const __m512 kv = load16<KC>(k + v * 16);
            for (int64_t g = 0; g < gn; ++g)
              acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g0 + g) * D + v * 16), kv, acc[g]);
          }
        }
        for (int64_t g = 0; g < gn; ++g) _mm512_store_ps(part[g][j], acc[g]);
        if constexpr (is_quant<KC>) kscale[j] = kv_scale(k, D);
      }
      const __mmask16 mk = jn == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << jn) - 1u);
      for (int64_t g = 0; g < gn; ++g) {
        __m512 dot = hsum16x16(&part[g][0][0]);
        if constexpr (is_quant<KC>) dot = _mm512_mul_ps(dot, _mm512_maskz_load_ps(mk, kscale));
        _mm512_mask_storeu_ps(scores + (g0 + g) * n + j0, mk, _mm512_mul_ps(dot, sv));
      }
    }
  }
  float total[64];  // G <= 64 (the caller checks)
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
    __m512 tot = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mx);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), m));
      _mm512_storeu_ps(sc + j, e);
      tot = _mm512_add_ps(tot, e);
    }
    if (j < n) {
      const __mmask16 mk = static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + j), m));
      _mm512_mask_storeu_ps(sc + j, mk, e);
      tot = _mm512_add_ps(tot, _mm512_maskz_mov_ps(mk, e));
    }
    total[g] = _mm512_reduce_add_ps(tot);
  }
  if constexpr (is_quant<VC>) {  // each value row's scale into its weights: once per row and query head
    for (int64_t i = 0; i < n; ++i) {
      const float vs = kv_scale(vc + slots[first + i] * vrow + kvh * vw, D);
      for (int64_t g = 0; g < G; ++g) scores[g * n + i] *= vs;
    }
  }
  // value sums: 4 query heads x 4 value vectors at a time, each value row loaded once per 4 heads
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    for (int64_t v0 = 0; v0 < V; v0 += 4) {
      const int64_t vn = std::min<int64_t>(4, V - v0);  // 4-bit rows: 2 or 4 (V is even)
      __m512 acc[4][4];
      for (int64_t g = 0; g < 4; ++g)
        for (int64_t v = 0; v < 4; ++v) acc[g][v] = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const VC* vr = vc + slots[first + i] * vrow + kvh * vw + kv_offset<VC>(v0 * 16);
        if (i + 8 < n)
          prefetch_row(vc + slots[first + i + 8] * vrow + kvh * vw + kv_offset<VC>(v0 * 16),
                       kv_offset<VC>(vn * 16) * sizeof(VC));
        __m512 vv[4];
        if constexpr (is_q4<VC>) {
          for (int64_t v = 0; v < vn; v += 2) load_q4x16(vr + v * 8, vv[v], vv[v + 1]);
        } else {
          for (int64_t v = 0; v < vn; ++v) vv[v] = load16<VC>(vr + v * 16);
        }
        for (int64_t g = 0; g < gn; ++g) {
          const float w = scores[(g0 + g) * n + i];  // quantized rows: times the row's scale (above)
          const __m512 p = _mm512_set1_ps(w);
          for (int64_t v = 0; v < vn; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
        }
      }
      for (int64_t g = 0; g < gn; ++g) {
        const __m512 inv = _mm512_set1_ps(total[g0 + g]);
        for (int64_t v = 0; v < vn; ++v)
          store16<O>(out + (g0 + g) * out_stride + (v0 + v) * 16, _mm512_div_ps(acc[g][v], inv));
      }
    }
  }
}
#endif

// out[b, j] = rnd(act(gate[b, j])) * up[b, j] for gu [B, 2 * inter] = [gate | up]
template <typename T>
void act_rows(const T* gu, T* out, int64_t B, int64_t inter, int64_t act) {
  for (int64_t b = 0; b < B; ++b) {
    const T* gp = gu + b * 2 * inter;
    T* ap = out + b * inter;
    int64_t j = 0;
#ifdef SUPERSLM_AVX512
    if (act != 2)
      for (; j + 16 <= inter; j += 16)
        store16<T>(ap + j, _mm512_mul_ps(rnd16<T>(act16(act, load16<T>(gp + j))), load16<T>(gp + inter + j)));
#elif defined(SUPERSLM_ROWS_AVX2)
    j = act_row8<T>(gp, ap, inter, act);
#endif
    for (; j < inter; ++j) ap[j] = static_cast<T>(rnd<T>(act_fn(act, ld(gp + j))) * ld(gp + inter + j));
  }
}

// ---- the block Hadamard rotation of a linear's input (kernels/hadamard.py Rotation) ----

// x [rows, in] (float or bf16) -> out [rows, kpad] of out's dtype: zero-padded past `in`, times
// signs_f (float [kpad], +-1), then the orthonormal Walsh-Hadamard transform of each run of `block`
// values (Sylvester order, as hadamard.py fwht), in float with one rounding at the end. Each row alone:
// its bits never depend on the other rows. (Torch's form, a bf16 matmul with a bf16 table, costs five
// calls per linear; the two agree within a bf16 rounding.)
template <typename T, typename O>
void rotate_rows(const T* x, int64_t rows, int64_t in, const float* signs_f, int64_t block, int64_t kpad, O* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(block));
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(kpad);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * in;
      for (int64_t k = 0; k < in; ++k) buf[k] = static_cast<float>(xr[k]) * signs_f[k];
      for (int64_t k = in; k < kpad; ++k) buf[k] = 0.0f;
      fwht_runs(buf.data(), kpad, block);
      O* o = out + r * kpad;
      for (int64_t k = 0; k < kpad; ++k) o[k] = static_cast<O>(buf[k] * scale);
    }
  });
}

}  // namespace superslm_rows

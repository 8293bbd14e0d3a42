// GGUF IQ4_NL / IQ4_XS weights as they are stored (quant/iq4.py): 4-bit codes into a 16-value table, one
// float32 scale per 32 values, weight = scale * table[code].
//
// Layout: qweight uint8 [N, K / 2], per group of 32 values of a row 16 bytes whose byte j holds code j (low
// nibble) and code j + 16 (high): the file's own `qs` bytes. Scales per group of 32 (iq4_scales.h): IQ4_NL's f16 d
// as float32 [N, K / 32], or IQ4_XS's d * (ls - 32) from its packed d and ls, both exact in float32 (and
// d * ls * table[code] too: 11 + 6 + 7 significant bits).
//
// The GEMV (decode rows) needs AVX2 only (on AVX-512 machines too), and takes llama.cpp's arithmetic
// (ggml_vec_dot_iq4_nl_q8_0): x rounded to bf16, then int8 per group of 32 once a call (dx = max|x| / 127,
// q = nearbyint(x / dx), |q| <= 127: Q8_0's rounding with a float32 dx); per row and group the table values t
// (a byte shuffle of the codes, 32 at a time) times q through `maddubs(|q|, t with q's sign)`: both at most 127,
// so an int16 pair is at most 2 * 127 * 127 = 32,258 (never saturates), `madd` with ones sums 4 products an int32
// lane, two groups side by side in a register's 8 lanes (gemv_rows), then acc = fma(lane, scale * dx, acc) (4 rows
// sharing each load of q), the lanes reduced at the end. x's rounding (at most dx / 2 an element) is what
// moves a result: 0.6-1.1% of the outputs' rms, 0.7-1.2x the error of the int8 re-quantized weights this format
// replaced (docs/quantization.md); two int8 parts of x would be bf16-exact but cost 1.4-1.55x the time here.
// Several rows of x (decode steps of many sequences, prompt chunks up to iq4_gemv_rows) take rows_kernel: the codes
// of an output row unpacked once per pair of groups for 6 rows of x at a time (each x row quantized once a call, as
// the GEMV quantizes it), each row's lanes and float steps exactly the GEMV's, so a row gets the bits it gets
// alone, whatever the rows beside it and the threads (deterministic mode takes it at every row count); where R
// GEMVs read and unpack the weight R times. quant/iq4.py iq4_gemv is its twin (one row or many), bit for bit.
#include "aten_ops.h"
#include "decoded_gemm.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dynamic_for.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUPERSLM_IQ4_AVX2 1
#endif

#include "q8_groups.h"
#include "iq4_scales.h"

using superslm_iq4::check_iq4;
using superslm_iq4::Scales;

// whether iq4_gemv runs its SIMD kernel here (else it computes through iq4_gemm: correct, not fast)
bool iq4_available() {
#ifdef SUPERSLM_IQ4_AVX2
  return true;
#else
  return false;
#endif
}

namespace {

// rows [n0, n1) of the weight as float32 into w [n1 - n0, K]: scale * table[code], one product each (exact)
void decode_rows(const uint8_t* q, const Scales& s, const int8_t* table, int64_t K, int64_t n0, int64_t n1, float* w) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = q + n * (K / 2) + g * 16;
      const float d = s.at(n, g);
      float* o = w + (n - n0) * K + g * 32;
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(table[b[j] & 15]);
        o[j + 16] = d * static_cast<float>(table[b[j] >> 4]);
      }
    }
  }
}

#ifdef SUPERSLM_IQ4_AVX2
using superslm_q8::quantize_groups;

constexpr int TILE = 4;  // rows sharing each load of x (8 measured slower: 8 streams of codes)

// TILE rows' (or fewer: nr) dot products with x over all groups -> out (bf16); sd: scratch float [TILE * Gp],
// Gp = G rounded up to even.
// Two groups a step: their 32 code bytes masked give [g codes 0..15 | g+1 codes 0..15], shifted by 4
// [g 16..31 | g+1 16..31]; lanes 0-3 of a row's accumulator take the even groups, 4-7 the odd ones, lane l
// the products of values 4l..4l+3 and 16+4l..16+4l+3 (|sum| <= 8 * 127 * 127 < 2^24: exact in float).
void gemv_rows(const uint8_t* q, const Scales& s, const __m256i tbl, const uint8_t* aq, const int8_t* xq,
               const float* dx, int64_t K, int64_t n, int nr, float* sd, at::BFloat16* out) {
  const int64_t G = K / 32, Gp = (G + 1) / 2 * 2, half = K / 2;
  const uint8_t* rows[TILE];
  for (int r = 0; r < TILE; ++r) {
    const int64_t row = n + std::min(r, nr - 1);  // a short tile repeats its last row (its result unused)
    rows[r] = q + row * half;
    s.times(row, dx, sd + r * Gp);  // the weight's scale times x's, rounded once
    if (Gp != G) sd[r * Gp + G] = 0.f;
  }
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[TILE];
  for (int r = 0; r < TILE; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g += 2) {
    const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + g * 32));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
    const __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + g * 32 + 32));
    const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 32));
    // the next tile's codes, a line of each row every 4 groups: in a model the weights stream from DRAM, and
    // the hardware prefetcher alone left this 20-35% slower there (hints are dropped past the matrix's end)
    if ((g & 3) == 0)
      for (int r = 0; r < TILE; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + g * 16 + TILE * half), _MM_HINT_T0);
    const bool last = g + 1 == G;  // an odd G's last group alone: 16 bytes, never past the row
    for (int r = 0; r < TILE; ++r) {
      const __m256i v = last ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + g * 16)))
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + g * 16));
      const __m256i w1 = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, nib));
      const __m256i w2 = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(w1, x1)), ones),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(a2, _mm256_sign_epi8(w2, x2)), ones));
      const float* sg = sd + r * Gp + g;
      const __m256 sv = _mm256_set_m128(_mm_set1_ps(sg[1]), _mm_set1_ps(sg[0]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc[r]);
    }
  }
  float res[TILE];  // every accumulator reduced with a constant index: a dynamic one would keep acc in memory
  for (int r = 0; r < TILE; ++r) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    res[r] = _mm_cvtss_f32(v);
  }
  for (int r = 0; r < nr; ++r) out[r] = static_cast<at::BFloat16>(res[r]);
}

// Several rows of x against one output row: rows_dot<MR> runs MR rows of x over the pairs of groups [p0, p1) of
// one code row `w` (scales `sc`), the code bytes unpacked to table values once a pair for all MR rows. A row's x
// (xr[r]) is 160 bytes a pair: quantize_groups' |q| (64 bytes) and q (64), then its dx spread as gemv_rows' scale
// vector [dx_g x4 | dx_g+1 x4] (32). Each row's 8 float lanes in acc (carried between spans of pairs) take
// gemv_rows' steps exactly: the same integer lanes, scale * dx rounded once (here a vector product, there a
// scalar one: the same float), one fma a pair in the same order. So a row's bits are the one-row GEMV's, whatever
// MR, the span or the thread that ran it.
constexpr int64_t XR = 160;  // bytes of a row's x a pair of groups

template <int MR>
inline void rows_dot(const uint8_t* w, const float* sc, int64_t G, int64_t p0, int64_t p1, const __m256i tbl,
                     const uint8_t* const* xr, __m256* acc) {
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 a[MR];
  for (int r = 0; r < MR; ++r) a[r] = acc[r];
  const int64_t pe = std::min(p1, G / 2);  // whole pairs; an odd G's last group after the loop
  auto step = [&](const __m256i v, const __m256 sv, int64_t p) {
    const __m256i w1 = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, nib));
    const __m256i w2 = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    for (int r = 0; r < MR; ++r) {
      const uint8_t* x = xr[r] + p * XR;
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64));
      const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 96));
      const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(w1, x1)), ones),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(a2, _mm256_sign_epi8(w2, x2)), ones));
      const __m256 d = _mm256_mul_ps(sv, _mm256_loadu_ps(reinterpret_cast<const float*>(x + 128)));
      a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, a[r]);
    }
  };
  for (int64_t p = p0; p < pe; ++p)
    step(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)),
         _mm256_set_m128(_mm_set1_ps(sc[2 * p + 1]), _mm_set1_ps(sc[2 * p])), p);
  if (pe < p1)  // an odd G's last group alone: 16 bytes, its twin's scale 0 (gemv_rows' pad)
    step(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + pe * 32))),
         _mm256_set_m128(_mm_setzero_ps(), _mm_set1_ps(sc[2 * pe])), pe);
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

// rows_dot<mr> for 1 <= mr <= MR
template <int MR>
inline void rows_dot_n(int mr, const uint8_t* w, const float* sc, int64_t G, int64_t p0, int64_t p1, const __m256i tbl,
                       const uint8_t* const* xr, __m256* acc) {
  if constexpr (MR > 1)
    if (mr < MR) return rows_dot_n<MR - 1>(mr, w, sc, G, p0, p1, tbl, xr, acc);
  rows_dot<MR>(w, sc, G, p0, p1, tbl, xr, acc);
}

// gemv_rows' reduction of a row's 8 lanes
inline float lanes_sum(__m256 acc) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// rows of x sharing each unpacked pair of groups: 6 accumulators, the 2 unpacked vectors, the scales, the table
// and 2 constants leave 4 of the 16 ymm registers for a row's temporaries (GCC keeps all in registers; 6 ran
// 5-15% faster than 4 on an AVX2-only EPYC, 2 slower still)
constexpr int ROWS_MR = 6;
// A span of pairs of ROWS_MR rows' x stays in L1 while a task's output rows pass over it, with the task's codes
// and scales for it (40 bytes a pair and output row)
constexpr int64_t ROWS_SPAN_BYTES = 24 << 10;
constexpr int64_t ROWS_TASK = 16;  // output rows a task (their accumulators: ROWS_TASK * R * 32 bytes)

// the ng rows of x at xr (XR bytes a pair, P pairs a row) times the weight -> out [*, N] at rows rs; chunks of
// ROWS_TASK output rows taken in turn by the threads
template <int MR>
void rows_kernel(const uint8_t* q, const Scales& s, const __m256i tbl, const uint8_t* xr, int64_t K, int64_t N,
                 const std::vector<int64_t>& rs, at::BFloat16* out) {
  const int64_t G = K / 32, P = (G + 1) / 2, ng = static_cast<int64_t>(rs.size());
  const int64_t most = std::max<int64_t>(1, ROWS_SPAN_BYTES / (MR * XR + ROWS_TASK * 40));
  const int64_t span = (P + (P + most - 1) / most - 1) / ((P + most - 1) / most);  // P in equal spans
  // dynamic_for runs the whole range at once on one thread: tasks of ROWS_TASK rows within it all the same
  superslm_dyn::dynamic_for(N, ROWS_TASK, [&](int64_t c0, int64_t c1) {
    std::vector<__m256> acc(ROWS_TASK * ng);
    std::vector<float> buf(ROWS_TASK * G);
    const float* sc[ROWS_TASK];
    for (int64_t n0 = c0; n0 < c1; n0 += ROWS_TASK) {
      const int64_t n1 = std::min(c1, n0 + ROWS_TASK);
      for (int64_t n = n0; n < n1; ++n) sc[n - n0] = s.row(n, buf.data() + (n - n0) * G);  // the task's rows' scales
      std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
      for (int64_t p0 = 0; p0 < P; p0 += span) {
        const int64_t p1 = std::min(P, p0 + span);
        for (int64_t i = 0; i < ng; i += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, ng - i));
          const uint8_t* x[MR];
          for (int r = 0; r < mr; ++r) x[r] = xr + (i + r) * P * XR;
          for (int64_t n = n0; n < n1; ++n)
            rows_dot_n<MR>(mr, q + n * (K / 2), sc[n - n0], G, p0, p1, tbl, x, acc.data() + (n - n0) * ng + i);
        }
      }
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t i = 0; i < ng; ++i)
          out[rs[i] * N + n] = static_cast<at::BFloat16>(lanes_sum(acc[(n - n0) * ng + i]));
    }
  });
}
#endif

}  // namespace

// the weight [N, K] as float32 (exactly the file's values)
at::Tensor iq4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  const Scales s = check_iq4(at::empty({0, K}), qweight, scales, table, "iq4_dequantize");
  at::Tensor w = at::empty({N, K}, qweight.options().dtype(at::kFloat));
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const int8_t* t = table.data_ptr<int8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { decode_rows(q, s, t, K, n0, n1, wp + n0 * K); });
  return w;
}

// x [M, K] -> [M, N] bf16: x rounded to bf16, times the exact weight in float32, blocks of rows of the weight
// decoded at a time (never the whole matrix). `rows16`: every product takes 16 rows of x (x padded with zero
// rows), so a row's bits do not depend on how many rows came with it (deterministic mode; kernels/row_blocks.py).
at::Tensor iq4_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table,
                    bool rows16) {
  const Scales s = check_iq4(x, qweight, scales, table, "iq4_gemm");
  const int64_t K = x.size(1);
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const int8_t* t = table.data_ptr<int8_t>();
  return superslm_decoded::decoded_gemm(x, qweight.size(0), rows16,
                                        [&](int64_t n0, int64_t n1, float* w) { decode_rows(q, s, t, K, n0, n1, w); });
}

// Rows of x up to which iq4_gemv (the integer rows kernel) is the default mode's choice for a weight [N, K], past
// them iq4_gemm (decoded blocks, an sgemm). Measured on an AVX2-only EPYC (Zen 3, one thread, A/B in one process,
// 2026-12-07, a loaded machine) at Qwen2.5-1.5B's and Llama-3.2-1B's shapes [K -> N] = [896 -> 896], [1536 -> 1536],
// [1536 -> 8960], [8960 -> 1536], [2048 -> 8192], [8192 -> 2048]: iq4_gemm's time over the kernel's 2.0-4.4x at 16
// rows, 1.0-2.1x at 64, 0.98-1.30x at 128, 0.87-1.03x at 192, 0.82-1.09x at 256: the same crossover, 128-192
// rows, at every shape, so one limit for all (docs/quantization.md)
int64_t iq4_gemv_rows(int64_t K, int64_t N) {
  (void)K;
  (void)N;
  return 128;
}

// avx2_rows.cpp (undefined without AVX2); gemv.cpp
at::Tensor iq4_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& table);
bool vnni_available();

// x [R, K] -> [R, N] bf16 (see the top of the file): one row through gemv_rows, several through rows_kernel, each
// row the bits it gets alone; a row holding a NaN or an inf takes iq4_gemm's float32 product alone, and so does
// every row where the table holds a -128 or the SIMD kernel is not built
at::Tensor iq4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table) {
  const Scales s = check_iq4(x, qweight, scales, table, "iq4_gemv");
  const int64_t R = x.size(0), K = x.size(1), N = qweight.size(0), G = K / 32;
  auto alone = [&](int64_t r) { return iq4_gemm(x.narrow(0, r, 1), qweight, scales, table, false); };
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kBFloat16));
  const int8_t* tp = table.data_ptr<int8_t>();
  // a table value of -128 would overflow the sign trick (-(-128)); ggml's table is -127 .. 113
  bool simd = std::find(tp, tp + 16, int8_t(-128)) == tp + 16;
#ifndef SUPERSLM_IQ4_AVX2
  simd = false;
#endif
  if (!simd || R == 0) {
    for (int64_t r = 0; r < R; ++r) out.narrow(0, r, 1).copy_(alone(r));
    return out;
  }
#ifdef SUPERSLM_IQ4_AVX2
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  const int64_t P = (G + 1) / 2, Kp = P * 64;  // x's bytes a row for an even number of groups
  std::vector<int8_t> xq(R * Kp, 0);
  std::vector<uint8_t> aq(R * Kp, 0);
  std::vector<float> dx(R * 2 * P, 0.f);
  std::vector<uint8_t> ok(R);
  // a prompt's rows: each quantized once a call, on both threads from ~8K values (avx2_rows.cpp rows_kernel)
  at::parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ok[r] = quantize_groups(xp + r * K, K, xq.data() + r * Kp, aq.data() + r * Kp, dx.data() + r * 2 * P);
  });
  std::vector<int64_t> good;
  for (int64_t r = 0; r < R; ++r)
    if (ok[r]) good.push_back(r);
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tp)));
  if (R == 1 && !good.empty()) {
    // ~128 KiB of codes per task, whole tiles
    const int64_t grain = std::max<int64_t>(TILE, ((int64_t(1) << 18) / K) / TILE * TILE);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      std::vector<float> sd(TILE * (G + 1));
      for (int64_t n = n0; n < n1; n += TILE)
        gemv_rows(q, s, tbl, aq.data(), xq.data(), dx.data(), K, n, static_cast<int>(std::min<int64_t>(TILE, n1 - n)),
                  sd.data(), op + n);
    });
  } else if (!good.empty()) {
    // the good rows' x side by side, a pair of groups 160 bytes: |q|, q, then dx as [dx_g x4 | dx_g+1 x4]
    const int64_t ng = static_cast<int64_t>(good.size());
    std::vector<uint8_t> xr(ng * P * XR);
    at::parallel_for(0, ng, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t p = 0; p < P; ++p) {
          const int64_t r = good[i];
          uint8_t* o = xr.data() + (i * P + p) * XR;
          std::memcpy(o, aq.data() + r * Kp + p * 64, 64);
          std::memcpy(o + 64, xq.data() + r * Kp + p * 64, 64);
          float* d = reinterpret_cast<float*>(o + 128);
          for (int j = 0; j < 8; ++j) d[j] = dx[r * 2 * P + 2 * p + j / 4];
        }
    });
    rows_kernel<ROWS_MR>(q, s, tbl, xr.data(), K, N, good, op);
  }
  for (int64_t r = 0; r < R; ++r)
    if (!ok[r]) out.narrow(0, r, 1).copy_(alone(r));
  return out;
#endif
}

// x [R, K] -> [R, N] bf16 through the kernel for R rows, the one choice of the module (quant/iq4.py) and the C++
// plan: iq4_gemv (each row the bits it gets alone) up to iq4_gemv_rows and in deterministic mode at every row
// count; past them, on CPUs without VNNI, the AVX2 two-part integer kernel (avx2_rows.cpp iq4_gemm_avx2: 1.3-1.5x
// the decoded blocks' sgemm at 512-row prompt chunks on an AVX2-only EPYC), else iq4_gemm
at::Tensor iq4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table,
                      bool deterministic) {
  check_iq4(x, qweight, scales, table, "iq4_linear");
  if (deterministic || x.size(0) <= iq4_gemv_rows(x.size(1), qweight.size(0))) return iq4_gemv(x, qweight, scales, table);
  at::Tensor y;
  if (!vnni_available()) y = iq4_gemm_avx2(x, qweight, scales, table);
  return y.defined() ? y : iq4_gemm(x, qweight, scales, table, false);
}

// GGUF Q6_K weights as they are stored (quant/q6k.py): the file's 210-byte blocks of 256 values, each
// ql (128 bytes: low 4 bits), qh (64 bytes: high 2 bits), 16 int8 scales (one per 16 values) and an f16 d;
// weight = (d * scale) * (q - 32), q in 0..63 (exact in float32: 11 + 8 + 6 significant bits).
//
// Layout: blocks uint8 [N, K / 256 * 210], a row's blocks in order, each byte for byte the file's.
// Value l of a block (h = l / 128, q4 = (l % 128) / 32, i = l % 32): low bits from ql[64 h + 32 (q4 & 1) + i]
// (the low nibble for q4 < 2, the high one after), high bits (qh[32 h + i] >> 2 q4) & 3, scale l / 16.
// So 32 consecutive values come from one 32-byte load of ql and one of qh: no shuffle of x is needed.
//
// The GEMV (decode rows, 1 to 64 of them: quant/q6k.py GEMV_ROWS) needs AVX2 only and takes llama.cpp's arithmetic
// (ggml_vec_dot_q6_K_q8_K) with a finer step for x: x rounded to bf16, then int8 per block of 256 as Q8_K
// (dx = max|x| / 127 over the block) but each 32 values with its own step dx * m / 16, m = ceil(16 max|x_g| /
// max|x|) in 1..16, q = nearbyint(x / step), |q| <= 127, and the sums of q per 16 times m (bsm). Per weight block
// the unsigned codes (0..63) times q through one maddubs per 32 codes (a pair at most 2 * 63 * 127: never
// saturates), madd with the two scales of those 32 values times m (at most 128 * 16: int16), the -32 offset once
// per block from the bsm (32 * sum scale * bsm), all integers, then one fma of the 8 lanes into float with
// d * dx / 16. Why a block of 256 with integer steps per 32, not 32 with float scales as giq4: one float operation
// per 256 codes instead of 8, and on this AVX2-only machine the GEMV is compute-bound (the int8 GEMV it replaces
// read 19.5 GB/s where memory gives 38); the integer m costs one int16 multiply a vector and brings x's error
// from Q8_K's (2.3-2.9% of the output's rms with RMSNorm-like outlier channels, 1.5% after SwiGLU) to near a
// float step per 32's (1.06-1.12%, 0.95%; docs/quantization.md). Several rows of x (decode steps of many
// sequences) share each unpacked block: up to 4 at a time, each row's lanes exactly as alone, so a row gets the
// same bits whatever rows came with it. quant/q6k.py q6k_gemv is its twin, bit for bit.
// Prompts (many rows) take a float32 GEMM over blocks of decoded rows (q6k_gemm; q6k_matmul its twin).
#include "aten_ops.h"
#include "decoded_gemm.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dynamic_for.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SUPERSLM_Q6K_AVX2 1
#endif

// whether q6k_gemv runs its SIMD kernel here (else it computes through q6k_gemm: correct, not fast)
bool q6k_available() {
#ifdef SUPERSLM_Q6K_AVX2
  return true;
#else
  return false;
#endif
}

namespace {

constexpr int64_t QK = 256, BB = 210;  // values and bytes a block

void check_q6k(const at::Tensor& x, const at::Tensor& blocks, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) % QK == 0, name,
              ": rows of K (a multiple of 256) on the CPU");
  TORCH_CHECK(blocks.dim() == 2 && blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous() && blocks.size(1) == x.size(1) / QK * BB,
              name, ": blocks uint8 [N, K / 256 * 210]");
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// rows [n0, n1) of the weight as float32 into w [n1 - n0, K]: (d * scale) * (q - 32), exact (the products are the
// same with AVX2, 8 at a time: a scalar loop took ~9 ns a value, a prompt's GEMM spent most of its time here)
void decode_rows(const uint8_t* blocks, int64_t K, int64_t n0, int64_t n1, float* w) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = blocks + (n * nb + b) * BB;
      const uint8_t *ql = blk, *qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = f16(blk + 208);
      float ds[16];
      for (int j = 0; j < 16; ++j) ds[j] = d * static_cast<float>(sc[j]);
      float* o = w + (n - n0) * K + b * QK;
#ifdef SUPERSLM_Q6K_AVX2
      const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
        __m256i v[4];
        v[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30));
        v[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30));
        v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(hv, m30));
        v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30));
        for (int q4 = 0; q4 < 4; ++q4) {
          const __m256i c = _mm256_sub_epi8(v[q4], c32);  // -32..31
          const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
          const int t = 4 * h + q4;
          float* ot = o + 32 * t;
          const __m256 sa = _mm256_set1_ps(ds[2 * t]), sb = _mm256_set1_ps(ds[2 * t + 1]);
          _mm256_storeu_ps(ot, _mm256_mul_ps(sa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
          _mm256_storeu_ps(ot + 8, _mm256_mul_ps(sa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
          _mm256_storeu_ps(ot + 16, _mm256_mul_ps(sb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
          _mm256_storeu_ps(ot + 24, _mm256_mul_ps(sb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
        }
      }
#else
      for (int h = 0; h < 2; ++h)
        for (int q4 = 0; q4 < 4; ++q4)
          for (int i = 0; i < 32; ++i) {
            const uint8_t lo = ql[64 * h + 32 * (q4 & 1) + i];
            const int q = ((q4 < 2 ? lo & 15 : lo >> 4) | (((qh[32 * h + i] >> (2 * q4)) & 3) << 4)) - 32;
            const int l = 128 * h + 32 * q4 + i;
            o[l] = ds[l / 16] * static_cast<float>(q);
          }
#endif
    }
  }
}

#ifdef SUPERSLM_Q6K_AVX2
// One row of x (bf16, K values) as int8 per block of 256 with a step per 32: block b's coarsest step
// dx = max|x| / 127 over the block, group g's m = ceil(16 max|x_g| / max|x|) in 1..16, its step dx * m / 16,
// q = nearbyint(x / step), |q| <= 127. Out: q [K]; bsm int16 [K / 16], the sums of q per 16 times their group's m
// (at most 16 * 16 * 127 = 32,512); mv int16 [K / 128 * 16], per block and half h (values 128 h ..) the m of each
// of its 8 scales, twice: [m_4h, m_4h, m_4h+1, m_4h+1, .., m_4h+3 | the same] (a register's worth, lined up with
// dot_rows' scales 8 h .. 8 h + 7 in each 128-bit lane); dxs [K / 256] = dx / 16. An all-zero block (or one whose dx underflows to 0) gets q = 0, m = 16. False where x holds
// a NaN or an inf.
bool quantize_row(const at::BFloat16* xp, int64_t K, int8_t* xq, int16_t* bsm, int16_t* mv, float* dxs) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < K / QK; ++b) {
    const at::BFloat16* xb = xp + b * QK;
    float gmax[8];
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int s = 0; s < 8; ++s) {
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 32 * s + 8 * i));
        const __m256 a = _mm256_and_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)), absmask);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for a NaN or an inf
        amax = _mm256_max_ps(amax, a);
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      gmax[s] = _mm_cvtss_f32(m);
    }
    if (_mm256_movemask_ps(ok) != 0xff) return false;
    float bmax = 0.f;
    for (int s = 0; s < 8; ++s) bmax = std::max(bmax, gmax[s]);
    const float d = bmax / 127.f;
    dxs[b] = d * 0.0625f;
    for (int s = 0; s < 8; ++s) {  // group s: 32 values
      // the twin computes m and the step with the same float operations (a division, times 16 exact, one product)
      const int mg = d > 0.f ? std::min(16, std::max(1, static_cast<int>(std::ceil(gmax[s] / bmax * 16.f)))) : 16;
      const float step = d * (static_cast<float>(mg) * 0.0625f);
      // x / step, not x * (1 / step), rounded to nearest even: the twin divides and rounds the same way
      const __m256 dv = _mm256_set1_ps(d > 0.f ? step : 1.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 32 * s + 8 * i));
        const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = d > 0.f ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)) : _mm256_setzero_si256();
      }
      const __m256i h01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);  // values 0..15, int16
      const __m256i h23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);  // 16..31
      const __m256i bq = _mm256_permute4x64_epi64(_mm256_packs_epi16(h01, h23), 0xD8);     // 0..31, int8
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK + 32 * s), bq);
      int16_t* mh = mv + (b * 2 + s / 4) * 16 + 2 * (s % 4);  // scales 2s, 2s + 1: group s's m, in both lanes
      mh[0] = mh[1] = mh[8] = mh[9] = static_cast<int16_t>(mg);
      // the sums of 16: int16 values 0..15 and 16..31 added pairwise, then within the register
      const __m256i s01 = _mm256_madd_epi16(h01, ones), s23 = _mm256_madd_epi16(h23, ones);  // 8 int32 each
      const __m256i t = _mm256_hadd_epi32(s01, s23);  // [s01 0+1, 2+3, s23 0+1, 2+3 | s01 4+5, 6+7, s23 4+5, 6+7]
      const __m256i u = _mm256_hadd_epi32(t, t);      // [s01 0..3, s23 0..3, .. | s01 4..7, s23 4..7, ..]
      const int32_t a0 = _mm256_extract_epi32(u, 0) + _mm256_extract_epi32(u, 4);
      const int32_t a1 = _mm256_extract_epi32(u, 1) + _mm256_extract_epi32(u, 5);
      bsm[b * 16 + 2 * s] = static_cast<int16_t>(a0 * mg);
      bsm[b * 16 + 2 * s + 1] = static_cast<int16_t>(a1 * mg);
    }
  }
  return true;
}

// The R rows of x (R <= 4) against one weight row's blocks -> res[R] (float). Per block: 8 vectors of 32 codes
// (t = 4 h + q4), each maddubs'd with x's 32 values and madd'd with [scale 2t x 8 | scale 2t + 1 x 8] times x's
// m of group t (the products scale * m formed once per row and half block, one int16 multiply for 8 scales, then
// shuffled out: integer multiplies are what this loop is short of) into 8 int32 lanes (lane j < 4: values 4j..4j+3 of each vector, times scale 2t; j >= 4:
// 16 + 4(j - 4).., times 2t + 1); minus 32 * (bsm 2j * scale 2j + bsm 2j+1 * scale 2j+1) in lane j (an int32 lane
// at most ~2^30: scale * m <= 2,048); then acc = fma(float(lanes), d * dx / 16, acc); the lanes reduced pairwise
// at the end.
template <int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const int8_t* const* xq, const int16_t* const* bs,
                     const int16_t* const* mv, const float* const* dx, float* res) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
  // per vector t the int16 scale indices (mod 8) for the low and the high 128-bit lane, as byte pairs
  alignas(32) static const uint8_t kShuf[4][32] = {
      {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
      {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
      {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
      {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
       14, 15, 14, 15}};
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    uint16_t dh;
    std::memcpy(&dh, blk + 208, 2);
    const float d = _cvtsh_ss(dh);
    // scales 0..7 (h = 0) or 8..15 (h = 1) in both 128-bit lanes
    const __m256i sch2[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00), _mm256_permute2x128_si256(sc16, sc16, 0x11)};
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      __m256i scm[R];  // scales 8 h .. 8 h + 7 in both lanes, each times its group's m of row r (at most 2,048)
      for (int r = 0; r < R; ++r)
        scm[r] = _mm256_mullo_epi16(sch2[h], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mv[r] + (b * 2 + h) * 16)));
      __m256i v[4];
      v[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      v[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
      v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      for (int q4 = 0; q4 < 4; ++q4) {
        const __m256i shuf = _mm256_load_si256(reinterpret_cast<const __m256i*>(kShuf[q4]));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * QK + 128 * h + 32 * q4));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(v[q4], xv),
                                                                _mm256_shuffle_epi8(scm[r], shuf)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs[r] + b * 16));
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(bsv, sc16), 5);
      const __m256 sd = _mm256_set1_ps(d * dx[r][b]);  // the weight's d times x's dx / 16, rounded once
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)), sd, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    res[r] = _mm_cvtss_f32(v);
  }
}
#endif

}  // namespace

// the weight [N, K] as float32 (exactly the file's values)
at::Tensor q6k_dequantize(const at::Tensor& blocks) {
  const int64_t N = blocks.size(0), K = blocks.size(1) / BB * QK;
  TORCH_CHECK(blocks.size(1) % BB == 0, "q6k_dequantize: blocks uint8 [N, K / 256 * 210]");
  check_q6k(at::empty({0, K}), blocks, "q6k_dequantize");
  at::Tensor w = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* q = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { decode_rows(q, K, n0, n1, wp + n0 * K); });
  return w;
}

// x [M, K] -> [M, N] bf16: x rounded to bf16, times the exact weight in float32, blocks of rows of the weight
// decoded at a time (never the whole matrix). `rows16`: every product takes 16 rows of x (x padded with zero
// rows), so a row's bits do not depend on how many rows came with it (deterministic mode; kernels/row_blocks.py).
at::Tensor q6k_gemm(const at::Tensor& x, const at::Tensor& blocks, bool rows16) {
  check_q6k(x, blocks, "q6k_gemm");
  const int64_t K = x.size(1);
  const uint8_t* q = blocks.data_ptr<uint8_t>();
  return superslm_decoded::decoded_gemm(x, blocks.size(0), rows16,
                                        [&](int64_t n0, int64_t n1, float* w) { decode_rows(q, K, n0, n1, w); });
}

// x [M, K] -> [M, N] bf16 through the integer kernel (see the top of the file), each row's bits those it gets
// alone; a row holding a NaN or an inf takes q6k_gemm's float32 product, and so does every row where the SIMD
// kernel is not built
at::Tensor q6k_gemv(const at::Tensor& x, const at::Tensor& blocks) {
  check_q6k(x, blocks, "q6k_gemv");
#ifdef SUPERSLM_Q6K_AVX2
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / QK;
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  std::vector<int8_t> xq(M * K);
  std::vector<int16_t> bs(M * K / 16), mv(M * K / 8);
  std::vector<float> dx(M * nb);
  std::vector<int64_t> good, bad;
  for (int64_t m = 0; m < M; ++m) {
    const bool ok = quantize_row(xb.data_ptr<at::BFloat16>() + m * K, K, xq.data() + m * K, bs.data() + m * K / 16,
                                 mv.data() + m * K / 8, dx.data() + m * nb);
    (ok ? good : bad).push_back(m);
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  const uint8_t* q = blocks.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t G = static_cast<int64_t>(good.size()), rowb = nb * BB;
  // chunks taken in turn (dynamic_for.h): at least ~128 KiB of blocks and ~1/16 of a thread's share, at most half
  // of it
  const int64_t chunk =
      superslm_dyn::shared_chunk(N, std::max((int64_t(1) << 17) / rowb, N / (16 * at::get_num_threads())));
  if (G > 0) {
    superslm_dyn::dynamic_for(N, chunk, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = q + n * rowb;
        for (int64_t a = 0; a < G; a += 4) {
          const int r = static_cast<int>(std::min<int64_t>(4, G - a));
          const int8_t* xs[4];
          const int16_t* bss[4];
          const int16_t* mvs[4];
          const float* dxs[4];
          for (int i = 0; i < r; ++i) {
            const int64_t m = good[a + i];
            xs[i] = xq.data() + m * K;
            bss[i] = bs.data() + m * K / 16;
            mvs[i] = mv.data() + m * K / 8;
            dxs[i] = dx.data() + m * nb;
          }
          float res[4];
          switch (r) {
            case 1: dot_rows<1>(w, nb, xs, bss, mvs, dxs, res); break;
            case 2: dot_rows<2>(w, nb, xs, bss, mvs, dxs, res); break;
            case 3: dot_rows<3>(w, nb, xs, bss, mvs, dxs, res); break;
            default: dot_rows<4>(w, nb, xs, bss, mvs, dxs, res); break;
          }
          for (int i = 0; i < r; ++i) op[good[a + i] * N + n] = static_cast<at::BFloat16>(res[i]);
        }
      }
    });
  }
  if (!bad.empty()) {
    const at::Tensor idx = at::tensor(bad, at::TensorOptions().dtype(at::kLong));
    out.index_copy_(0, idx, q6k_gemm(x.index_select(0, idx), blocks, false));
  }
  return out;
#else
  return q6k_gemm(x, blocks, false);
#endif
}

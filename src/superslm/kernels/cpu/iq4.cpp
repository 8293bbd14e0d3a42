// GGUF IQ4_NL / IQ4_XS weights as they are stored (quant/iq4.py): 4-bit codes into a 16-value table, one
// float32 scale per 32 values, weight = scale * table[code].
//
// Layout: qweight uint8 [N, K / 2], per group of 32 values of a row 16 bytes whose byte j holds code j (low
// nibble) and code j + 16 (high): the file's own `qs` bytes. scales float32 [N, K / 32]: IQ4_NL's f16 d, or
// IQ4_XS's d * (ls - 32), both exact in float32 (and d * ls * table[code] too: 11 + 6 + 7 significant bits).
//
// The GEMV (decode rows) needs AVX2 only (on AVX-512 machines too): x rounded to bf16, split per group into
// two int8 parts as the int4 kernels split it (vnni.h split_groups), joined into one int16 x16 = 254 hi + lo
// (|x16| <= 32,385), so sum t x = sl * sum t x16 with t = table[code] in -128..127. The 16-bit products go
// through `madd_epi16` (int16 x int16 -> int32 pairs, no saturation, unlike the unsigned x signed bytes of
// maddubs / VNNI, where t + 128 times a part reaches 2 * 241 * 127 > 2^15). Each int32 lane of a group holds
// 4 products, |sum| <= 4 * 128 * 32,385 < 2^24: exact in float, then y += (scale * sl) * that, per lane.
// The GEMM (prompts) decodes blocks of rows to float32 (exact) and multiplies with BLAS in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "vnni.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUPERSLM_IQ4_AVX2 1
#endif

// whether iq4_gemv runs its SIMD kernel here (else it computes through iq4_gemm: correct, not fast)
bool iq4_available() {
#ifdef SUPERSLM_IQ4_AVX2
  return true;
#else
  return false;
#endif
}

namespace {

void check_iq4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table,
               const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && qweight.dim() == 2 && qweight.device().is_cpu() &&
                  qweight.scalar_type() == at::kByte && qweight.is_contiguous() && qweight.size(1) * 2 == x.size(1) &&
                  x.size(1) % 32 == 0,
              name, ": rows of K (a multiple of 32) against codes uint8 [N, K / 2] on the CPU");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.device().is_cpu() &&
                  scales.dim() == 2 && scales.size(0) == qweight.size(0) && scales.size(1) == x.size(1) / 32,
              name, ": scales float32 [N, K / 32]");
  TORCH_CHECK(table.scalar_type() == at::kChar && table.is_contiguous() && table.numel() == 16, name,
              ": a table of 16 int8 values");
}

// rows [n0, n1) of the weight as float32 into w [n1 - n0, K]: scale * table[code], one product each (exact)
void decode_rows(const uint8_t* q, const float* s, const int8_t* table, int64_t K, int64_t n0, int64_t n1, float* w) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = q + n * (K / 2) + g * 16;
      const float d = s[n * G + g];
      float* o = w + (n - n0) * K + g * 32;
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(table[b[j] & 15]);
        o[j + 16] = d * static_cast<float>(table[b[j] >> 4]);
      }
    }
  }
}

// rows of the decoded weight per BLAS call: ~2 MiB of float32, a multiple of 16
int64_t chunk_rows(int64_t K, int64_t N) {
  const int64_t rows = std::max<int64_t>(16, ((int64_t(1) << 21) / (4 * K)) & ~int64_t(15));
  return std::min(rows, N);
}

#ifdef SUPERSLM_IQ4_AVX2
// four rows' (or fewer: nr) dot products with x16 over all groups -> out; scales * sl per group
void gemv_rows(const uint8_t* q, const float* s, const __m128i tbl, const int16_t* x16, const float* gsl, int64_t K,
               int64_t n, int nr, float* out) {
  const int64_t G = K / 32;
  const __m128i nib = _mm_set1_epi8(0x0f);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const uint8_t* rows[4];
  const float* sc[4];
  for (int r = 0; r < 4; ++r) {
    const int64_t row = n + std::min(r, nr - 1);  // a short tile repeats its last row (its result unused)
    rows[r] = q + row * (K / 2);
    sc[r] = s + row * G;
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + g * 32));
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + g * 32 + 16));
    const float sl = gsl[g];
    for (int r = 0; r < 4; ++r) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + g * 16));
      const __m128i lo = _mm_shuffle_epi8(tbl, _mm_and_si128(b, nib));                    // codes 0..15 -> t
      const __m128i hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(b, 4), nib));  // codes 16..31
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(lo), xa),
                                         _mm256_madd_epi16(_mm256_cvtepi8_epi16(hi), xb));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc[r][g] * sl), acc[r]);
    }
  }
  float res[4];  // every accumulator reduced with a constant index: a dynamic one would keep acc in memory
  for (int r = 0; r < 4; ++r) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    res[r] = _mm_cvtss_f32(v);
  }
  for (int r = 0; r < nr; ++r) out[r] = res[r];
}
#endif

}  // namespace

// the weight [N, K] as float32 (exactly the file's values)
at::Tensor iq4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check_iq4(at::empty({0, K}), qweight, scales, table, "iq4_dequantize");
  at::Tensor w = at::empty({N, K}, qweight.options().dtype(at::kFloat));
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
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
  check_iq4(x, qweight, scales, table, "iq4_gemm");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  if (rows16 && M % 16) xf = at::constant_pad_nd(xf, {0, 0, 0, 16 - M % 16});
  at::Tensor out = at::empty({xf.size(0), N}, x.options().dtype(at::kFloat));
  const int64_t C = chunk_rows(K, N);
  at::Tensor w = at::empty({C, K}, xf.options());
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int8_t* t = table.data_ptr<int8_t>();
  for (int64_t n0 = 0; n0 < N; n0 += C) {
    const int64_t c = std::min(C, N - n0);
    float* wp = w.data_ptr<float>();
    at::parallel_for(0, c, 16, [&](int64_t a, int64_t b) { decode_rows(q, s, t, K, n0 + a, n0 + b, wp + a * K); });
    const at::Tensor wc = w.narrow(0, 0, c);
    if (rows16) {
      for (int64_t r = 0; r < xf.size(0); r += 16) out.narrow(0, r, 16).narrow(1, n0, c).copy_(at::mm(xf.narrow(0, r, 16), wc.t()));
    } else {
      out.narrow(1, n0, c).copy_(at::mm(xf, wc.t()));
    }
  }
  if (out.size(0) != M) out = out.narrow(0, 0, M);
  return out.to(at::kBFloat16);
}

// x [1, K] -> [1, N] bf16 (see the top of the file); where x cannot be split (a NaN, an inf, an outlier) or
// the SIMD kernel is not built, iq4_gemm's float32 product instead
at::Tensor iq4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table) {
  check_iq4(x, qweight, scales, table, "iq4_gemv");
  TORCH_CHECK(x.size(0) == 1, "iq4_gemv: one row");
#ifdef SUPERSLM_IQ4_AVX2
  const int64_t K = x.size(1), N = qweight.size(0), G = K / 32;
  at::Tensor xb = x.to(at::kBFloat16).contiguous();
  std::vector<float> xf(K);
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xp[k]);
  std::vector<int8_t> hi(K), lo(K);
  std::vector<float> gsum(G), gsl(G);
  if (!superslm_vnni::split_groups(xf.data(), K, 32, hi.data(), lo.data(), gsum.data(), gsl.data()))
    return iq4_gemm(x, qweight, scales, table, false);
  std::vector<int16_t> x16(K);
  for (int64_t k = 0; k < K; ++k) x16[k] = static_cast<int16_t>(254 * hi[k] + lo[k]);
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kFloat));
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m128i tbl = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table.data_ptr<int8_t>()));
  // ~128 KiB of codes per task, whole tiles of 4 rows
  const int64_t grain = std::max<int64_t>(4, ((int64_t(1) << 18) / K) & ~int64_t(3));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 4)
      gemv_rows(q, s, tbl, x16.data(), gsl.data(), K, n, static_cast<int>(std::min<int64_t>(4, n1 - n)), op + n);
  });
  return out.to(at::kBFloat16);
#else
  return iq4_gemm(x, qweight, scales, table, false);
#endif
}

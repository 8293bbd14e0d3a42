// int4 and int8 kernels for several activation rows on CPUs with AVX2 and FMA but no AVX-512 VNNI.
//
// For 2+ rows the decode plan took torch's kernels here (~81 GFLOP/s on an AVX2-only EPYC at any row count),
// and R one-row GEMVs (avx2.cpp) read and unpack the weights R times. These kernels read and unpack each
// chunk of weights once and multiply it against every row, and give every row the one-row GEMV's bits: the
// same split of the row into two int8 parts, the same exact integer sums (integers: any order gives them),
// the same float epilogue in the same order. So a row's bits do not depend on the other rows.
//
// int4: per group, the GEMV forms 254 H + L from its two sums H (codes times the high part) and L (the low
// one). Here the parts are joined first, x16 = 254 hi + lo (|x16| <= 32,385: an int16), and `madd` sums
// codes (0..15, as int16) times x16 in int32: the same integer 254 H + L per group. Prompt chunks of any
// length take it too (kernels/cpu_prompt.py): it is tiled for them (int4_rows_chunk). int8: the epilogue takes
// H and L apart (they round to float apart), so each is summed with `madd` of the codes and the part as int16.
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "vnni.h"
#include "int5_avx2.h"
#include "pair_tiles.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUPERSLM_AVX2_ROWS 1
#endif

// avx2.cpp
bool avx2_available();
int64_t torch_int4_block();

namespace {

using superslm_pairs::bf16_rows;

#ifdef SUPERSLM_AVX2_ROWS

using superslm_pairs::chunk_block;
using superslm_pairs::INT4_BLOCK_BYTES;

// One row's int4 activation table: per quad of k, the 32-bit words (x0 | x2 << 16) and (x1 | x3 << 16) of
// x16 = 254 hi + lo, which `unpack_quad` pairs with each row's codes at (k0, k2) and (k1, k3).
void int4_table(const int8_t* hi, const int8_t* lo, int64_t K, uint32_t* t) {
  auto v = [&](int64_t k) {
    return static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(254 * hi[k] + lo[k])));
  };
  for (int64_t q = 0; q < K / 4; ++q) {
    t[2 * q] = v(4 * q) | (v(4 * q + 2) << 16);
    t[2 * q + 1] = v(4 * q + 1) | (v(4 * q + 3) << 16);
  }
}

// One quad of k of a 32-row chunk of torch's layout (16 bytes a k, `stride` bytes apart; byte j holds row
// rows[0] + j in its low nibble, rows[2] + j in its high one, as avx2.cpp quad_sums reads it) -> 8 vectors:
// for accumulator a (rows[a] + 0..7), out[2a] the codes at (k0, k2) as int16 pairs, out[2a + 1] at (k1, k3).
// With `fb`: Q5_0's codes, the fifth bits from the quad's four masks `m` (int5_avx2.h).
inline void unpack_quad(const uint8_t* p, int64_t stride, __m256i* out, const uint64_t* m = nullptr,
                        const superslm_int5::FifthBits* fb = nullptr) {
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i v01 = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + stride),
                                          reinterpret_cast<const __m128i*>(p));
  const __m256i v23 = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 3 * stride),
                                          reinterpret_cast<const __m128i*>(p + 2 * stride));
  const __m256i a = _mm256_unpacklo_epi8(v01, v23), b = _mm256_unpackhi_epi8(v01, v23);
  __m256i c[4] = {_mm256_and_si256(a, nib), _mm256_and_si256(b, nib),
                  _mm256_and_si256(_mm256_srli_epi16(a, 4), nib), _mm256_and_si256(_mm256_srli_epi16(b, 4), nib)};
  if (fb) {
    __m256i m01, m23;
    superslm_int5::load_masks(m, m01, m23);
    for (int i = 0; i < 4; ++i) c[i] = fb->add(c[i], i, m01, m23);
  }
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c[i]));
    out[2 * i + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c[i], 1));
  }
}

// 8 rows' (s, z) pairs of one group (torch's [groups, N, 2] bf16, as 32-bit words s | z << 16) -> floats
inline void scales8(const uint32_t* p, __m256& s, __m256& z) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One 32-row chunk of the weight (codes: its bytes of k = 0, `stride` bytes a k; rows[a] + 0..7: accumulator
// a's rows) against the rows `rs`: per k block, the chunk's codes unpacked once into `buf` and its scales into
// `sf`, then chunk_block. With `masks` and `fb`: Q5_0's 5-bit codes (the chunk's block's fifth-bit masks, four
// a quad of k; the exact int32 sums hold them too).
void int4_rows_chunk(const uint8_t* codes, int64_t stride, const uint32_t* sz, int64_t N, int64_t K, int64_t group,
                     const int64_t rows[4], const int64_t* rs, int64_t ng, const uint32_t* tab, const float* gsum,
                     const float* gsl, __m256i* buf, __m256* sf, float* y, const uint64_t* masks = nullptr,
                     const superslm_int5::FifthBits* fb = nullptr) {
  const int64_t G = K / group, nq = group / 4, per = std::max<int64_t>(1, INT4_BLOCK_BYTES / (group * 64));
  std::fill(y, y + (ng + 1) * 32, 0.f);
  for (int64_t g0 = 0; g0 < G; g0 += per) {
    const int64_t g1 = std::min(G, g0 + per);
    for (int64_t q = g0 * nq; q < g1 * nq; ++q)
      unpack_quad(codes + 4 * q * stride, stride, buf + 8 * (q - g0 * nq), masks ? masks + 4 * q : nullptr, fb);
    for (int64_t g = g0; g < g1; ++g)
      for (int a = 0; a < 4; ++a) scales8(sz + g * N + rows[a], sf[(g - g0) * 8 + a], sf[(g - g0) * 8 + 4 + a]);
    chunk_block<true>(buf, sf, g0, g1, G, nq, rs, ng, tab, gsum, gsl, y);
  }
}

// NO code rows (n, n + 1, ...) times NR rows' two parts (int16, K of each), K % 16 == 0: the exact sums H, L
template <int NO, int NR>
inline void int8_tile(const int8_t* c, int64_t K, const int16_t* const xh[NR], const int16_t* const xl[NR],
                      bool prefetch, int32_t H[NO][NR], int32_t L[NO][NR]) {
  __m256i h[NO][NR], l[NO][NR];
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < NR; ++r) h[o][r] = l[o][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 16) {
    __m256i w[NO];
    for (int o = 0; o < NO; ++o) {
      w[o] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + o * K + k)));
      // the code rows 16 rows ahead: one core's misses in flight are what limits a streamed head
      if (prefetch && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(c + (16 + o) * K + k), _MM_HINT_T0);
    }
    for (int r = 0; r < NR; ++r) {
      const __m256i vh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xh[r] + k));
      const __m256i vl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xl[r] + k));
      for (int o = 0; o < NO; ++o) {
        h[o][r] = _mm256_add_epi32(h[o][r], _mm256_madd_epi16(w[o], vh));
        l[o][r] = _mm256_add_epi32(l[o][r], _mm256_madd_epi16(w[o], vl));
      }
    }
  }
  auto hsum8 = [](__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
  };
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < NR; ++r) H[o][r] = hsum8(h[o][r]), L[o][r] = hsum8(l[o][r]);
}

template <int NO, int NR>
inline void int8_block(const int8_t* codes, int64_t K, int64_t n, const int64_t* rs, const std::vector<int16_t>& x16,
                       const float* sh, const float* sl, const at::BFloat16* scale, at::BFloat16* out, int64_t N,
                       bool prefetch) {
  const int16_t *xh[NR], *xl[NR];
  for (int r = 0; r < NR; ++r) xh[r] = x16.data() + rs[r] * 2 * K, xl[r] = xh[r] + K;
  int32_t H[NO][NR], L[NO][NR];
  int8_tile<NO, NR>(codes + n * K, K, xh, xl, prefetch, H, L);
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < NR; ++r)
      out[rs[r] * N + n + o] = static_cast<at::BFloat16>(
          superslm_vnni::int8_out(static_cast<float>(scale[n + o]), sh[rs[r]], sl[rs[r]], H[o][r], L[o][r]));
}

#endif  // SUPERSLM_AVX2_ROWS

}  // namespace

// Rows up to which the decode plan and kernels/cpu_decode.py rows_linear take these kernels (from 64 rows,
// kernels/cpu_prompt.py: int4 prompt chunks take int4_gemm_avx2 at any row count, int8 ones decoded blocks and
// float32 GEMMs, faster than int8_gemm_avx2 there)
int64_t avx2_gemm_rows() { return 63; }

// gemm.cpp: the fifth-bit masks' check, and the plain float32 reference of the 5-bit codes
const uint64_t* int5_bits(const at::Tensor& bits, int64_t N, int64_t K);
at::Tensor int5_reference(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);

namespace {

// int4_gemm_avx2 (bits null) and int5_gemm_avx2 (Q5_0's fifth-bit masks, blocks of 64 rows, groups of 32): every
// row the one-row GEMV's bits; the rows it declines to `declined` (all of them in one call: their rows of x, bf16)
// or, where that is empty, undefined. B: rows per block of the layout.
at::Tensor rows_kernel(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group, int64_t B,
                       const uint64_t* bits, const std::function<at::Tensor(const at::Tensor&)>& declined) {
#ifdef SUPERSLM_AVX2_ROWS
  const int64_t R = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group;
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();  // rounded to bf16, as torch's kernels and the GEMV see x
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  std::vector<uint32_t> tab(R * K / 2);  // per row, per quad: two words
  std::vector<float> gsum(R * G), gsl(R * G);
  std::vector<uint8_t> split(R);
  // the rows split on both threads from ~8K values (16 decode rows of K 576: 4% of the step left to one)
  at::parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<int8_t> hi(K), lo(K);
    std::vector<float> xf(K);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xp[r * K + k]);
      split[r] = superslm_vnni::split_groups(xf.data(), K, group, hi.data(), lo.data(), gsum.data() + r * G,
                                             gsl.data() + r * G);
      if (split[r]) int4_table(hi.data(), lo.data(), K, tab.data() + r * K / 2);
    }
  });
  std::vector<int64_t> good, bad;
  for (int64_t r = 0; r < R; ++r) (split[r] ? good : bad).push_back(r);
  if (!bad.empty() && !declined) return at::Tensor();
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kBFloat16));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const uint32_t* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t nq = group / 4, per_block = B / 32, stride = B / 2, ng = static_cast<int64_t>(good.size());
  const int64_t per_k = std::max<int64_t>(1, INT4_BLOCK_BYTES / (group * 64)) * group / 4 * 8;  // buf's vectors
  const superslm_int5::FifthBits fb[2] = {superslm_int5::FifthBits(0), superslm_int5::FifthBits(1)};
  if (ng)
    at::parallel_for(0, N / 32, 1, [&](int64_t c0, int64_t c1) {
      // scratch: the unpacked codes and scales of a k block, the rows' float sums
      std::vector<__m256i> buf(per_k), sf(per_k / nq);
      std::vector<__m256> y((ng + 1) * 4);
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t b = ch / per_block, part = ch % per_block;  // bytes 16 part .. 16 part + 15 of each k
        const int64_t r0 = b * B + 16 * part, r1 = r0 + B / 2;
        const int64_t rows[4] = {r0, r0 + 8, r1, r1 + 8};
        float* yf = reinterpret_cast<float*>(y.data());
        const uint64_t* masks = bits ? bits + b * K : nullptr;  // the block's: four a quad of k
        int4_rows_chunk(wp + b * B * K / 2 + 16 * part, stride, szp, N, K, group, rows, good.data(), ng, tab.data(),
                        gsum.data(), gsl.data(), buf.data(), reinterpret_cast<__m256*>(sf.data()), yf, masks,
                        bits ? &fb[part] : nullptr);
        for (int64_t i = 0; i < ng; ++i)
          for (int a = 0; a < 4; ++a)
            for (int j = 0; j < 8; ++j)
              op[good[i] * N + rows[a] + j] = static_cast<at::BFloat16>(yf[i * 32 + 8 * a + j]);
      }
    });
  if (!bad.empty()) {  // the rows the GEMV declines, all in one call of the caller's fallback
    const at::Tensor idx = at::tensor(bad, at::kLong);
    out.index_copy_(0, idx, declined(x.index_select(0, idx).to(at::kBFloat16)).to(at::kBFloat16));
  }
  return out;
#else
  return at::Tensor();
#endif
}

}  // namespace

// x [R, K] -> [R, N] bf16 for int4 weights packed in blocks of `block` rows (0: torch's layout here): row r
// gets int4_gemv_avx2(x[r:r+1])'s bits, or where the GEMV declines that row (a NaN, an inf, an outlier)
// torch's kernel on that row alone, as the plan then computes it. Undefined where it does not apply (no AVX2,
// an unknown layout, a declined row in a layout torch's kernel does not read): the caller takes torch's kernel.
at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                          int64_t block) {
  superslm_vnni::check_int4(x, qweight, sz, group, "int4_gemm_avx2");
  TORCH_CHECK(block == 0 || block == 32 || block == 64, "int4_gemm_avx2: blocks of 32 or 64 rows (0: torch's)");
  const int64_t B = block ? block : torch_int4_block();
  if (!avx2_available() || B < 32 || qweight.size(0) % B) return at::Tensor();
  std::function<at::Tensor(const at::Tensor&)> torch_rows;  // torch's kernel reads its own layout only
  // all the declined rows in one call: torch's kernel gives a row the bits it gives that row alone (each output
  // one sum over k in order; tests/test_cpu_avx2_rows.py holds it to that), where the plan computes it alone
  if (block == 0 || block == torch_int4_block())
    torch_rows = [&](const at::Tensor& rows) { return at::_weight_int4pack_mm_for_cpu(rows, qweight, group, sz); };
  return rows_kernel(x, qweight, sz, group, B, nullptr, torch_rows);
}

// x [R, K] -> [R, N] bf16 for int4 weights in torch's packed layout, prompt chunks of the default mode without VNNI:
// the rows the row kernel takes (each the GEMV's bits, as int4_gemm_avx2), the rows it declines (activations with
// outliers) through one call of torch's kernel, not one a row (10% of a Gemma-3 prefill). Not decoded blocks +
// sgemm: MKL's bits for a few rows changed with the thread count (K 1536, 5 rows), torch's kernel's do not.
// Undefined where int4_gemm_avx2 does not apply (the caller takes torch's kernel).
at::Tensor int4_prompt_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group) {
  superslm_vnni::check_int4(x, qweight, sz, group, "int4_prompt_avx2");
  const int64_t B = torch_int4_block();
  if (!avx2_available() || B < 32 || qweight.size(0) % B) return at::Tensor();
  return rows_kernel(x, qweight, sz, group, B, nullptr,
                     [&](const at::Tensor& rows) { return at::_weight_int4pack_mm_for_cpu(rows, qweight, group, sz); });
}

// x [R, K] -> [R, N] bf16 for Q5_0 weights (quant/int5.py, avx2.cpp int5_gemv_avx2's layout): row r gets
// int5_gemv_avx2(x[r:r+1])'s bits (so the VNNI kernels' too), or where the GEMV declines that row gemm.cpp
// int5_reference on that row alone, as int5_gemv then computes it. Any row count (a row's bits never depend
// on the others); undefined without AVX2.
at::Tensor int5_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits) {
  superslm_vnni::check_int4(x, qweight, sz, 32, "int5_gemm_avx2");
  const uint64_t* bp = int5_bits(bits, qweight.size(0), x.size(1));
  if (!avx2_available()) return at::Tensor();
  // int5_reference's rows never depend on each other: the declined rows in one call decode the weight once
  return rows_kernel(x, qweight, sz, 32, 64, bp,
                     [&](const at::Tensor& rows) { return int5_reference(rows, qweight, sz, bits); });
}

// x [R, K] (K % 64 == 0), codes int8 [N, K], scale bf16 [N] -> [R, N] bf16: row r gets
// int8_gemv_avx2(x[r:r+1])'s bits, or where the GEMV declines that row torch's kernel on that row alone;
// undefined without AVX2 (the caller takes torch's kernel)
at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && x.device().is_cpu() &&
                  codes.device().is_cpu() && scale.device().is_cpu(),
              "int8_gemm_avx2: rows of K against codes [N, K] on the CPU");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && scale.scalar_type() == at::kBFloat16 &&
                  scale.numel() == codes.size(0),
              "int8_gemm_avx2: codes int8 [N, K], scale bf16 [N]");
  const int64_t R = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0, "int8_gemm_avx2: K must be a positive multiple of 64");
  if (!avx2_available()) return at::Tensor();
#ifdef SUPERSLM_AVX2_ROWS
  const std::vector<float> xf = bf16_rows(x);
  std::vector<int16_t> x16(R * 2 * K);  // per row: the high part, then the low one
  std::vector<float> sh(R), sl(R);
  std::vector<int64_t> good, bad;
  {
    std::vector<int8_t> hi(K), lo(K);
    for (int64_t r = 0; r < R; ++r) {
      if (superslm_vnni::split_int8(xf.data() + r * K, K, hi.data(), lo.data(), &sh[r], &sl[r])) {
        for (int64_t k = 0; k < K; ++k) x16[r * 2 * K + k] = hi[k], x16[r * 2 * K + K + k] = lo[k];
        good.push_back(r);
      } else {
        bad.push_back(r);
      }
    }
  }
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kBFloat16));
  at::Tensor sc = scale.contiguous();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ng = static_cast<int64_t>(good.size());
  const int64_t grain = std::max<int64_t>(4, (262144 / K) & ~int64_t(3));  // ~256 KiB of weights a task
  if (ng)
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      const int64_t* rs = good.data();
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) {
        const bool pf = n + 2 + 16 <= n1;
        int64_t i = 0;
        for (; i + 2 <= ng; i += 2)
          int8_block<2, 2>(cp, K, n, rs + i, x16, sh.data(), sl.data(), sp, op, N, pf && i == 0);
        if (i < ng) int8_block<2, 1>(cp, K, n, rs + i, x16, sh.data(), sl.data(), sp, op, N, pf && i == 0);
      }
      for (; n < n1; ++n) {
        int64_t i = 0;
        for (; i + 2 <= ng; i += 2) int8_block<1, 2>(cp, K, n, rs + i, x16, sh.data(), sl.data(), sp, op, N, false);
        if (i < ng) int8_block<1, 1>(cp, K, n, rs + i, x16, sh.data(), sl.data(), sp, op, N, false);
      }
    });
  if (!bad.empty()) {  // torch's kernel on those rows in one call: each row's bits as alone (int4_gemm_avx2)
    const at::Tensor idx = at::tensor(bad, at::kLong);
    out.index_copy_(0, idx, at::_weight_int8pack_mm(x.index_select(0, idx).to(at::kBFloat16), codes, scale));
  }
  return out;
#else
  return at::Tensor();
#endif
}

// Prompt chunks of weights whose values are int8 (GGUF IQ4_NL / IQ4_XS table values, int8 codes) on CPUs without
// AVX-512 VNNI: rows of x split per group of 32 into two int8 parts and the row-pair tile of pair_tiles.h, where
// they took the weight decoded to float32 for an sgemm (IQ4) or torch's int8 kernel.
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "vnni.h"
#include "pair_tiles.h"
#include "iq4_scales.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUPERSLM_PAIR_ROWS 1
#endif

// avx2.cpp
bool avx2_available();

namespace {

#ifdef SUPERSLM_PAIR_ROWS
using superslm_pairs::bf16_rows;
using superslm_pairs::chunk_block;
using superslm_pairs::INT4_BLOCK_BYTES;

// Weights whose values are int8 (IQ4's table values, int8 codes) against the rows' pair tables (pair_table):
// the same row pairs and int32 `vpmaddwd` sums as int4, with the k of a pair (j, j + 16) of a group of 32 where
// int4 pairs (k0, k2) of a quad, so the group's two halves of 16 values interleave into its 16 pair words (two
// int16 values each), and no zero points. `w.halves(n, g, lo, hi)` gives row n's values of group g (k 0..15,
// 16..31) as int8, `w.scale(n, g)` their float scale. Rows n0..n0 + 31 (past N: the last row again, its outputs
// dropped).
template <class W>
void pair_rows_chunk(const W& w, int64_t N, int64_t K, int64_t n0, const int64_t* rs, int64_t ng, const uint32_t* tab,
                     const float* gsl, __m256i* buf, __m256* sf, float* y) {
  const int64_t G = K / 32, per = INT4_BLOCK_BYTES / (32 * 64);
  std::fill(y, y + (ng + 1) * 32, 0.f);
  for (int64_t g0 = 0; g0 < G; g0 += per) {
    const int64_t g1 = std::min(G, g0 + per);
    for (int a = 0; a < 4; ++a) {
      int64_t n[8];
      for (int j = 0; j < 8; ++j) n[j] = std::min(n0 + 8 * a + j, N - 1);
      for (int64_t g = g0; g < g1; ++g) {
        __m256 lo[8], hi[8];  // row j's pair words 0..7 and 8..15, then (transposed) pair p of the 8 rows
        for (int j = 0; j < 8; ++j) {
          __m128i vl, vh;
          w.halves(n[j], g, vl, vh);
          lo[j] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(vl, vh)));
          hi[j] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(vl, vh)));
        }
        superslm_vnni::transpose8(lo);
        superslm_vnni::transpose8(hi);
        __m256i* b = buf + (g - g0) * 64;  // 8 quads of 8 vectors: pair p with quad p / 2's word p % 2
        for (int p = 0; p < 8; ++p) {
          b[8 * (p / 2) + 2 * a + (p & 1)] = _mm256_castps_si256(lo[p]);
          b[8 * (4 + p / 2) + 2 * a + (p & 1)] = _mm256_castps_si256(hi[p]);
        }
        float sv[8];
        for (int j = 0; j < 8; ++j) sv[j] = w.scale(n[j], g);
        sf[(g - g0) * 8 + a] = _mm256_loadu_ps(sv);
      }
    }
    chunk_block<false>(buf, sf, g0, g1, G, 8, rs, ng, tab, gsl, gsl, y);
  }
}

// IQ4 (iq4.cpp's layout: per output row and group of 32, 16 bytes, byte j = codes j and j + 16, a float scale)
struct IQ4Values {
  const uint8_t* q;
  superslm_iq4::Scales s;
  __m128i tbl;
  int64_t K;
  void halves(int64_t n, int64_t g, __m128i& lo, __m128i& hi) const {
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + g * 16));
    lo = _mm_shuffle_epi8(tbl, _mm_and_si128(v, nib));
    hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(v, 4), nib));
  }
  float scale(int64_t n, int64_t g) const { return s.at(n, g); }
};

// int8 codes [N, K] with a bf16 scale per output row
struct Int8Values {
  const int8_t* c;
  const at::BFloat16* s;
  int64_t K;
  void halves(int64_t n, int64_t g, __m128i& lo, __m128i& hi) const {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + n * K + g * 32));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + n * K + g * 32 + 16));
  }
  float scale(int64_t n, int64_t) const { return static_cast<float>(s[n]); }
};

// x [R, K] (K % 32 == 0) times N rows of int8 values `w` -> [R, N] bf16: each row rounded to bf16 and split per
// group of 32 into two int8 parts (vnni.h split_groups: x ~ sl (254 hi + lo), ~15 bits), the exact int32 sums of
// the values times 254 hi + lo, then per group y = fma(scale, sum * sl, y) (quant/split_rows.py pair_rows_reference
// is the twin, bit for bit). Rows the split declines (a NaN, an inf, an outlier) are left to `declined` (their
// rows of x, bf16), all in one call. A row's bits do not depend on the other rows.
template <class W>
at::Tensor pair_rows(const at::Tensor& x, const W& w, int64_t N,
                     const std::function<at::Tensor(const at::Tensor&)>& declined) {
  const int64_t R = x.size(0), K = x.size(1), G = K / 32;
  const std::vector<float> xf = bf16_rows(x);
  std::vector<uint32_t> tab(R * K / 2);  // per row and group: the 16 pair words x16[j] | x16[j + 16] << 16
  std::vector<float> gsum(R * G), gsl(R * G);
  std::vector<uint8_t> split(R);
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int8_t> hi(K), lo(K);
    for (int64_t r = r0; r < r1; ++r) {
      split[r] = superslm_vnni::split_groups(xf.data() + r * K, K, 32, hi.data(), lo.data(), gsum.data() + r * G,
                                             gsl.data() + r * G);
      if (!split[r]) continue;
      auto v = [&](int64_t k) {
        return static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(254 * hi[k] + lo[k])));
      };
      uint32_t* t = tab.data() + r * K / 2;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < 16; ++j) t[g * 16 + j] = v(g * 32 + j) | (v(g * 32 + j + 16) << 16);
    }
  });
  std::vector<int64_t> good, bad;
  for (int64_t r = 0; r < R; ++r) (split[r] ? good : bad).push_back(r);
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ng = static_cast<int64_t>(good.size()), per = INT4_BLOCK_BYTES / (32 * 64);
  if (ng)
    at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t c0, int64_t c1) {
      std::vector<__m256i> buf(per * 64);
      std::vector<__m256> sf(per * 8), y((ng + 1) * 4);
      float* yf = reinterpret_cast<float*>(y.data());
      for (int64_t ch = c0; ch < c1; ++ch) {
        pair_rows_chunk(w, N, K, ch * 32, good.data(), ng, tab.data(), gsl.data(), buf.data(), sf.data(), yf);
        const int64_t cols = std::min<int64_t>(32, N - ch * 32);
        for (int64_t i = 0; i < ng; ++i)
          for (int64_t j = 0; j < cols; ++j) op[good[i] * N + ch * 32 + j] = static_cast<at::BFloat16>(yf[i * 32 + j]);
      }
    });
  if (!bad.empty()) {
    const at::Tensor idx = at::tensor(bad, at::kLong);
    out.index_copy_(0, idx, declined(x.index_select(0, idx).to(at::kBFloat16)));
  }
  return out;
}

#endif  // SUPERSLM_PAIR_ROWS

}  // namespace

// iq4.cpp
at::Tensor iq4_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table,
                    bool rows16);

// x [R, K] -> [R, N] bf16 for IQ4 weights (qweight uint8 [N, K / 2], scales float32 [N, K / 32], table int8 [16]:
// iq4.cpp's layout; or the packed IQ4_XS scales of iq4_scales.h): prompt chunks of the default mode on CPUs without VNNI, pair_rows on the table values
// (quant/iq4.py iq4_split_reference is the twin); rows the split declines take iq4_gemm together. Undefined
// without AVX2 (the caller takes iq4_gemm). Not the GEMV's bits (llama.cpp's one-part int8 x): x keeps ~15 bits
// here, not 8.
at::Tensor iq4_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& table) {
  const superslm_iq4::Scales sc = superslm_iq4::check_iq4(x, qweight, scales, table, "iq4_gemm_avx2");
  if (!avx2_available()) return at::Tensor();
#ifdef SUPERSLM_PAIR_ROWS
  const IQ4Values w{qweight.data_ptr<uint8_t>(), sc,
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(table.data_ptr<int8_t>())), x.size(1)};
  return pair_rows(x, w, qweight.size(0),
                   [&](const at::Tensor& rows) { return iq4_gemm(rows, qweight, scales, table, false); });
#else
  return at::Tensor();
#endif
}

// x [R, K] (K % 32 == 0) -> [R, N] bf16 for int8 codes [N, K] with a bf16 scale [N]: prompt chunks of the default
// mode on CPUs without VNNI, pair_rows on the codes (quant/split_rows.py pair_rows_reference the twin); rows the
// split declines take torch's int8 kernel together. Undefined without AVX2 or where K % 32 != 0.
at::Tensor int8_prompt_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && x.device().is_cpu() &&
                  codes.device().is_cpu() && scale.device().is_cpu() && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous() && scale.scalar_type() == at::kBFloat16 && scale.numel() == codes.size(0),
              "int8_prompt_avx2: rows of K against codes int8 [N, K] and a bf16 scale [N] on the CPU");
  if (!avx2_available() || x.size(1) % 32) return at::Tensor();
#ifdef SUPERSLM_PAIR_ROWS
  const at::Tensor sc = scale.contiguous();
  const Int8Values w{codes.data_ptr<int8_t>(), sc.data_ptr<at::BFloat16>(), x.size(1)};
  return pair_rows(x, w, codes.size(0),
                   [&](const at::Tensor& rows) { return at::_weight_int8pack_mm(rows, codes, sc); });
#else
  return at::Tensor();
#endif
}


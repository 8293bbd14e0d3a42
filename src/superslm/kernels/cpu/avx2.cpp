// int4 and int8 GEMVs for one activation row on CPUs with AVX2 and FMA but no AVX-512 VNNI.
//
// On such a CPU (an AVX2-only AMD EPYC, 2026-12-01) torch's `_weight_int4pack_mm_for_cpu` read SmolLM2's
// int4 layers at ~6 GB/s and `_weight_int8pack_mm` its int8 head at ~12: decode ran at 0.56x llama.cpp.
// These kernels compute what gemv.cpp's VNNI kernels compute, with the same arithmetic: x rounded to bf16,
// split into two int8 parts per group (vnni.h split_groups / split_int8), the exact integer sums of the
// codes times each part, then the same float epilogue in the same order, so a row gets the same bits here
// as from the VNNI kernels. AVX2 has no byte dot product: `maddubs` multiplies unsigned by signed bytes
// into saturating int16 pairs, so the operands are chosen to stay below 2^15 (see each kernel).
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "dynamic_for.h"
#include "vnni.h"
#include "int5_avx2.h"
#include "pair_tiles.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUPERSLM_AVX2 1
#endif

static bool g_avx2 = true;

// off: torch's kernels (benchmarks and tests compare the two in one process)
void set_avx2(bool on) { g_avx2 = on; }

bool avx2_available() {
#ifdef SUPERSLM_AVX2
  return g_avx2;
#else
  return false;
#endif
}

// Rows per block of torch's packed int4 CPU layout here (64 with AVX-512, 32 with AVX2), found once by
// packing a pattern with torch and matching it against each candidate; 0 when none matches (no kernel).
int64_t torch_int4_block() {
  static const int64_t block = [] {
    const int64_t N = 128, K = 8;
    at::Tensor codes = at::empty({N, K}, at::kInt);
    int32_t* c = codes.data_ptr<int32_t>();
    for (int64_t i = 0; i < N * K; ++i) c[i] = static_cast<int32_t>((i * 7 + i / 13) % 16);
    at::Tensor packed = at::_convert_weight_to_int4pack_for_cpu(codes, 1).contiguous();
    if (packed.scalar_type() != at::kByte || packed.numel() != N * K / 2) return int64_t(0);
    const uint8_t* p = packed.data_ptr<uint8_t>();
    for (int64_t B : {64, 32, 16}) {
      bool same = true;  // per block of B rows and per k, byte j holds row j (low nibble) and row j + B / 2
      for (int64_t b = 0; b < N / B && same; ++b)
        for (int64_t k = 0; k < K && same; ++k)
          for (int64_t j = 0; j < B / 2 && same; ++j) {
            const int lo = c[(b * B + j) * K + k], hi = c[(b * B + j + B / 2) * K + k];
            same = p[(b * K + k) * (B / 2) + j] == static_cast<uint8_t>(lo | (hi << 4));
          }
      if (same) return B;
    }
    return int64_t(0);
  }();
  return block;
}

#ifdef SUPERSLM_AVX2
namespace {

using superslm_int5::FifthBits;
using superslm_int5::load_masks;

// The int16 sums of `nq` quads of k (at most 8; with fifth bits at most 4) for 32 rows: torch's layout holds,
// per k, 16 bytes whose byte j has one row in its low nibble and the row B / 2 later in its high one (the k
// STRIDE = B / 2 bytes apart). A byte unpack of [k0 | k1] with [k2 | k3] puts each row's codes in one 16-bit
// lane, (k0, k2) in the low 128 bits and (k1, k3) in the high, which quad_table's activation layout matches.
// h[0] / l[0]: rows 0-7, [1] 8-15 (low nibbles), [2] 16-23, [3] 24-31 (high nibbles). Named accumulators and
// this order keep the live values close to AVX2's 16 ymm registers (GCC 12 still spills one accumulator).
// FIVE: Q5_0's codes (0..31), the fifth bits from `masks` (4 per quad, FifthBits).
template <int STRIDE, bool FIVE = false>
inline void quad_sums(const uint8_t* p, const __m256i* xh, const __m256i* xl, int64_t nq, __m256i h[4], __m256i l[4],
                      const uint64_t* masks = nullptr, const FifthBits* fb = nullptr) {
  const __m256i nib = _mm256_set1_epi8(0x0f);
  __m256i h0 = _mm256_setzero_si256(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
  for (int64_t q = 0; q < nq; ++q, p += 4 * STRIDE) {
    __m256i v01, v23;  // [k0 | k1], [k2 | k3]
    if (STRIDE == 16) {  // blocks of 32 rows: the four k are 64 contiguous bytes
      v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      v23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    } else {
      v01 = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + STRIDE), reinterpret_cast<const __m128i*>(p));
      v23 = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 3 * STRIDE),
                                reinterpret_cast<const __m128i*>(p + 2 * STRIDE));
    }
    __m256i m01, m23;
    if (FIVE) load_masks(masks + 4 * q, m01, m23);
    auto code = [&](__m256i c, int a) { return FIVE ? fb->add(c, a, m01, m23) : c; };
    const __m256i vh = xh[q], vl = xl[q];
    const __m256i r07 = _mm256_unpacklo_epi8(v01, v23);
    __m256i c = code(_mm256_and_si256(r07, nib), 0);
    h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(c, vh));
    l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(c, vl));
    c = code(_mm256_and_si256(_mm256_srli_epi16(r07, 4), nib), 2);
    h2 = _mm256_add_epi16(h2, _mm256_maddubs_epi16(c, vh));
    l2 = _mm256_add_epi16(l2, _mm256_maddubs_epi16(c, vl));
    const __m256i r815 = _mm256_unpackhi_epi8(v01, v23);
    c = code(_mm256_and_si256(r815, nib), 1);
    h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(c, vh));
    l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(c, vl));
    c = code(_mm256_and_si256(_mm256_srli_epi16(r815, 4), nib), 3);
    h3 = _mm256_add_epi16(h3, _mm256_maddubs_epi16(c, vh));
    l3 = _mm256_add_epi16(l3, _mm256_maddubs_epi16(c, vl));
  }
  h[0] = h0, h[1] = h1, h[2] = h2, h[3] = h3;
  l[0] = l0, l[1] = l1, l[2] = l2, l[3] = l3;
}

// An int8 part of x laid out for quad_sums' codes: per quad of k, 32 bytes whose low 128 bits repeat
// (x0, x2) and high 128 bits (x1, x3), so maddubs pairs each row's codes with their own k.
std::vector<__m256i> quad_table(const int8_t* x, int64_t K) {
  std::vector<__m256i> t(K / 4);
  for (int64_t q = 0; q < K / 4; ++q) {
    const int8_t* v = x + 4 * q;
    const __m128i e = _mm_set1_epi16(static_cast<int16_t>(static_cast<uint8_t>(v[0]) | (static_cast<uint8_t>(v[2]) << 8)));
    const __m128i o = _mm_set1_epi16(static_cast<int16_t>(static_cast<uint8_t>(v[1]) | (static_cast<uint8_t>(v[3]) << 8)));
    t[q] = _mm256_set_m128i(o, e);
  }
  return t;
}

// int16 [rows (k0, k2) | rows (k1, k3)] partial sums -> int32 per row (8 rows)
inline __m256i widen_rows(__m256i v) {
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

// 8 rows' (s, z) pairs of one group (torch's [groups, N, 2] bf16, as 32-bit words s | z << 16) -> floats
inline void scales8(const uint32_t* p, __m256& s, __m256& z) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One chunk of 32 rows over all K: rows[a] + 0..7 are the rows of accumulator a (torch's layout puts
// rows r and r + B / 2 in one byte). The int4 sums of codes (0..15, unsigned) times the int8 parts of x
// (xh, xl: quad_table): maddubs' int16 sums of two products are at most 2 * 15 * 127 = 3,810, so eight
// of them (32 k) add up in int16 before they widen. Per group: y += s * (sum c x - 8 sum x) + z * sum x,
// as vnni.h group_epilogue. FIVE: Q5_0's codes (0..31, blocks of 64 rows), their fifth bits from `masks` (the
// block's, 4 per quad of k): the int16 sums reach 2 * 31 * 127 = 7,874 a quad, so four quads (16 k) at a time.
template <bool FIVE = false>
void int4_chunk(const uint8_t* codes, int64_t stride, const uint32_t* sz, int64_t N, int64_t K, int64_t group,
                const int64_t rows[4], const __m256i* xh, const __m256i* xl, const float* gsum, const float* gsl,
                __m256 y[4], const uint64_t* masks = nullptr, const FifthBits* fb = nullptr) {
  constexpr int64_t step = FIVE ? 16 : 32;
  for (int a = 0; a < 4; ++a) y[a] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / group; ++g) {
    __m256i hs[4], ls[4];  // the integer sums of the codes times each part, per row
    for (int a = 0; a < 4; ++a) hs[a] = ls[a] = _mm256_setzero_si256();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += step) {
      __m256i h16[4], l16[4];
      const int64_t k1 = std::min(k0 + step, (g + 1) * group);
      if (FIVE)
        quad_sums<32, true>(codes + k0 * 32, xh + k0 / 4, xl + k0 / 4, (k1 - k0) / 4, h16, l16, masks + k0, fb);
      else if (stride == 16)
        quad_sums<16>(codes + k0 * 16, xh + k0 / 4, xl + k0 / 4, (k1 - k0) / 4, h16, l16);
      else
        quad_sums<32>(codes + k0 * 32, xh + k0 / 4, xl + k0 / 4, (k1 - k0) / 4, h16, l16);
      for (int a = 0; a < 4; ++a) {
        hs[a] = _mm256_add_epi32(hs[a], widen_rows(h16[a]));
        ls[a] = _mm256_add_epi32(ls[a], widen_rows(l16[a]));
      }
    }
    const __m256 gs = _mm256_set1_ps(gsum[g]), g8 = _mm256_set1_ps(8.f * gsum[g]), sl = _mm256_set1_ps(gsl[g]);
    for (int a = 0; a < 4; ++a) {
      // 254 * H + L: the integer the VNNI epilogue forms from its two sums, the same bits from here on
      const __m256i comb = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hs[a], 8), _mm256_slli_epi32(hs[a], 1)), ls[a]);
      __m256 s, z;
      scales8(sz + g * N + rows[a], s, z);
      const __m256 d = _mm256_fmsub_ps(_mm256_cvtepi32_ps(comb), sl, g8);
      y[a] = _mm256_fmadd_ps(s, d, y[a]);
      y[a] = _mm256_fmadd_ps(z, gs, y[a]);
    }
  }
}

// One row's int8 sums over 32 k: sum w x for signed codes w and a signed part x (|x| <= 127), as
// maddubs(|w|, x with w's sign): |w| <= 128 as an unsigned byte, int16 pairs at most 2 * 128 * 127 = 32,512.
inline __m256i int8_dot32(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// bytes the prefetches run ahead of the rows being read
constexpr int64_t PF_BYTES = 4096;

void int8_rows(const int8_t* hi, const int8_t* lo, const int8_t* codes, const at::BFloat16* scale, float sh,
               float sl, at::BFloat16* out, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {  // four rows share each load of the activation parts
    __m256i h[4], l[4];
    for (int r = 0; r < 4; ++r) h[r] = l[r] = _mm256_setzero_si256();
    const int8_t* c = codes + n * K;
    // one core's misses in flight are what limits a streamed head: the tiles of four rows lie one after another,
    // so each step (32 bytes of each row) asks for the two lines PF_BYTES ahead on that run, each line once, the
    // prefetches walking 128 bytes a step as the tiles do (a prefetch per row and 32 bytes, 16 rows ahead, read
    // Gemma-3's [262144, 640] head at 16-17 GB/s on 2 AVX2 cores, this at 19-23)
    int64_t ahead = n * K + PF_BYTES;
    const int64_t last = n1 * K - 128;
    for (int64_t k = 0; k < K; k += 32, ahead += 128) {
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + k));
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + k));
      if (ahead <= last) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(codes + ahead + 64), _MM_HINT_T0);
      }
      for (int r = 0; r < 4; ++r) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * K + k));
        h[r] = _mm256_add_epi32(h[r], int8_dot32(w, xh));
        l[r] = _mm256_add_epi32(l[r], int8_dot32(w, xl));
      }
    }
    for (int r = 0; r < 4; ++r)
      out[n + r] = static_cast<at::BFloat16>(
          superslm_vnni::int8_out(static_cast<float>(scale[n + r]), sh, sl, hsum8(h[r]), hsum8(l[r])));
  }
  for (; n < n1; ++n) {
    __m256i h = _mm256_setzero_si256(), l = h;
    const int8_t* c = codes + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k));
      h = _mm256_add_epi32(h, int8_dot32(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + k))));
      l = _mm256_add_epi32(l, int8_dot32(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + k))));
    }
    out[n] = static_cast<at::BFloat16>(superslm_vnni::int8_out(static_cast<float>(scale[n]), sh, sl, hsum8(h), hsum8(l)));
  }
}

}  // namespace
#endif

namespace {

// int4_gemv_avx2 (FIVE false, bits null) and int5_gemv_avx2 (Q5_0: the fifth-bit masks `bits`, blocks of 64 rows,
// groups of 32): x split into its two int8 parts per group, then each 32-row chunk's sums, chunks taken in turn by
// the threads; undefined where x cannot be split. B: rows per block of the layout.
template <bool FIVE>
at::Tensor gemv_kernel(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group, int64_t B,
                       const uint64_t* bits) {
#ifdef SUPERSLM_AVX2
  const int64_t K = x.size(1), N = qweight.size(0), G = K / group;
  // x rounded to bf16 first, as torch's kernel and the VNNI kernels see it
  const std::vector<float> xf = superslm_pairs::bf16_rows(x);
  std::vector<int8_t> hi(K), lo(K);
  std::vector<float> gsum(G), gsl(G);
  if (!superslm_vnni::split_groups(xf.data(), K, group, hi.data(), lo.data(), gsum.data(), gsl.data()))
    return at::Tensor();
  const std::vector<__m256i> xh = quad_table(hi.data(), K), xl = quad_table(lo.data(), K);
  [[maybe_unused]] const FifthBits fb[2] = {FifthBits(0), FifthBits(1)};
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kBFloat16));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const uint32_t* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t per_block = B / 32, stride = B / 2;  // chunks of 32 rows per block; bytes per k of a block
  // taken in turn (dynamic_for.h): at least ~128 KiB of codes and ~1/16 of a thread's share, at most half of it
  const int64_t grain = superslm_dyn::shared_chunk(
      N / 32, std::max<int64_t>((int64_t(1) << 17) / (16 * K), N / 32 / (16 * at::get_num_threads())));
  superslm_dyn::dynamic_for(N / 32, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      const int64_t b = ch / per_block, part = ch % per_block;  // bytes 16 part .. 16 part + 15 of each k
      const int64_t r0 = b * B + 16 * part, r1 = r0 + B / 2;
      const int64_t rows[4] = {r0, r0 + 8, r1, r1 + 8};
      __m256 y[4];
      if constexpr (FIVE)
        int4_chunk<true>(wp + b * B * K / 2 + 16 * part, stride, szp, N, K, group, rows, xh.data(), xl.data(),
                         gsum.data(), gsl.data(), y, bits + b * K, &fb[part]);
      else
        int4_chunk(wp + b * B * K / 2 + 16 * part, stride, szp, N, K, group, rows, xh.data(), xl.data(), gsum.data(),
                   gsl.data(), y);
      for (int a = 0; a < 4; ++a) {
        alignas(32) float v[8];
        _mm256_store_ps(v, y[a]);
        for (int i = 0; i < 8; ++i) op[rows[a] + i] = static_cast<at::BFloat16>(v[i]);
      }
    }
  });
  return out;
#else
  return at::Tensor();
#endif
}

}  // namespace

// x [1, K] -> [1, N] bf16 for int4 weights packed in blocks of `block` rows (0: torch's layout here), as
// gemv.cpp int4_gemv computes it (the same bits); undefined where it does not apply (no AVX2, an unknown
// layout, x that cannot be split: a NaN, an inf, an outlier): the caller takes torch's kernel.
at::Tensor int4_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                          int64_t block) {
  superslm_vnni::check_int4(x, qweight, sz, group, "int4_gemv_avx2");
  TORCH_CHECK(x.size(0) == 1, "int4_gemv_avx2: one row");
  TORCH_CHECK(block == 0 || block == 32 || block == 64, "int4_gemv_avx2: blocks of 32 or 64 rows (0: torch's)");
  const int64_t B = block ? block : torch_int4_block();
  if (!avx2_available() || B < 32 || qweight.size(0) % B) return at::Tensor();
  return gemv_kernel<false>(x, qweight, sz, group, B, nullptr);
}

// x [1, K] (K % 64 == 0), codes int8 [N, K], scale bf16 [N] -> [1, N] bf16, as gemv.cpp int8_gemv (the
// same bits); undefined without AVX2 or where x cannot be split (the caller takes torch's kernel)
at::Tensor int8_gemv_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && codes.dim() == 2 && x.size(1) == codes.size(1) &&
                  x.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu(),
              "int8_gemv_avx2: one row of K against codes [N, K] on the CPU");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && scale.scalar_type() == at::kBFloat16 &&
                  scale.numel() == codes.size(0),
              "int8_gemv_avx2: codes int8 [N, K], scale bf16 [N]");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0, "int8_gemv_avx2: K must be a positive multiple of 64");
  if (!avx2_available()) return at::Tensor();
#ifdef SUPERSLM_AVX2
  const std::vector<float> xf = superslm_pairs::bf16_rows(x);
  std::vector<int8_t> hi(K), lo(K);
  float sh = 0.f, sl = 0.f;
  if (!superslm_vnni::split_int8(xf.data(), K, hi.data(), lo.data(), &sh, &sl)) return at::Tensor();
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kBFloat16));
  at::Tensor sc = scale.contiguous();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t grain = std::max<int64_t>(4, (262144 / K) & ~int64_t(3));  // ~256 KiB of weights a task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int8_rows(hi.data(), lo.data(), cp, sp, sh, sl, op, K, n0, n1);
  });
  return out;
#else
  return at::Tensor();
#endif
}

// gemm.cpp: the fifth-bit masks' check, and the plain float32 reference of the 5-bit codes
const uint64_t* int5_bits(const at::Tensor& bits, int64_t N, int64_t K);

// x [1, K] -> [1, N] bf16 for Q5_0 weights (quant/int5.py: nibbles in blocks of 64 rows of torch's packed int4
// layout, the fifth bits as masks [N / 64, K / 4, 4], (d, -8 d) per group of 32), as gemv.cpp int5_gemv computes
// it with VNNI (the same bits: the same split, exact integer sums, the same epilogue); undefined without AVX2 or
// where x cannot be split (a NaN, an inf, an outlier: the caller takes gemm.cpp int5_reference).
at::Tensor int5_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits) {
  superslm_vnni::check_int4(x, qweight, sz, 32, "int5_gemv_avx2");
  TORCH_CHECK(x.size(0) == 1, "int5_gemv_avx2: one row");
  const uint64_t* bp = int5_bits(bits, qweight.size(0), x.size(1));
  if (!avx2_available()) return at::Tensor();
  return gemv_kernel<true>(x, qweight, sz, 32, 64, bp);
}

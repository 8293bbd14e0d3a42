// int8-weight GEMV for one activation row with AVX-512 VNNI, at bf16-or-better precision.
//
// torch's `_weight_int8pack_mm` converts every weight to float: on this machine it reads a large head at
// ~16 GB/s where memory gives ~29. VNNI multiplies bytes directly (64 per instruction), so the row x is
// split into two int8 parts, x ~= sh * hi + sl * lo (sh = max|x| / 127, sl = sh / 254): the error is at
// most max|x| / 64516, below the bf16 rounding x already carries (2^-9 of each element's magnitude
// for the elements that matter). y[n] = scale[n] * (sh * sum c hi + sl * sum c lo), the integer sums exact.
// VNNI takes unsigned activations: hi + 128 and lo + 128, corrected with 128 * sum_k c[n, k] (rowsum).
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "vnni.h"

static bool g_vnni = true;

// off: torch's kernel for every int8 linear (benchmarks compare the two in one process)
void set_vnni(bool on) { g_vnni = on; }

bool vnni_available() {
#ifdef SUPERSLM_VNNI
  return g_vnni;
#else
  return false;
#endif
}

// The default mode's kernel for 2+ rows. torch's packed int4/int8 kernels take bf16 activations through
// AVX512-BF16 dot products where the CPU has them: on such AMD EPYCs (2026-12-04, 2 threads) our int4 GEMM
// was 1.05-1.64x faster at 16 rows on every shape measured (SmolLM2's, Gemma-3's, Qwen2.5-0.5B/1.5B's),
// 0.82-1.5x at 8 rows, so ours from 16 int4 rows; torch's int8 kernel stays (ours 0.7x at 256 outputs).
// Without AVX512-BF16 (an Intel Xeon, 2026-12-01) ours were 1.2-2x faster at 4-32 rows (int4) and 2-32 rows
// (int8): ours from 2 rows. A fixed rule per machine, not a timing, so the default mode stays the same from
// run to run.
int64_t gemm_rows(bool int8) {
#if defined(SUPERSLM_VNNI) && !defined(__AVX512BF16__)
  (void)int8;
  return 2;
#else
  return int8 ? INT64_MAX : 16;
#endif
}

// codes int8 [N, K] -> sum over k of each row (int32 [N]): the correction for the +128 offset
// (a loop: torch's sum with an int32 result would first copy the whole matrix to int32)
at::Tensor int8_rowsum(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "int8_rowsum: codes int8 [N, K]");
  at::Tensor c = codes.contiguous();
  const int64_t N = c.size(0), K = c.size(1);
  at::Tensor out = at::empty({N}, c.options().dtype(at::kInt));
  const int8_t* cp = c.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    int32_t total = 0;
    for (int64_t k = 0; k < K; ++k) total += cp[n * K + k];
    op[n] = total;
  }
  return out;
}

#ifdef SUPERSLM_VNNI
namespace {

inline int32_t hsum(__m512i v) { return _mm512_reduce_add_epi32(v); }

void rows_vnni(const uint8_t* hi, const uint8_t* lo, const int8_t* codes, const int32_t* rowsum,
               const at::BFloat16* scale, float sh, float sl, at::BFloat16* out, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
    const int8_t* c = codes + n * K;
    for (int64_t k = 0; k < K; k += 64) {
      const __m512i xh = _mm512_loadu_si512(hi + k), xl = _mm512_loadu_si512(lo + k);
      const __m512i w0 = _mm512_loadu_si512(c + k), w1 = _mm512_loadu_si512(c + K + k);
      const __m512i w2 = _mm512_loadu_si512(c + 2 * K + k), w3 = _mm512_loadu_si512(c + 3 * K + k);
      h0 = _mm512_dpbusd_epi32(h0, xh, w0);
      l0 = _mm512_dpbusd_epi32(l0, xl, w0);
      h1 = _mm512_dpbusd_epi32(h1, xh, w1);
      l1 = _mm512_dpbusd_epi32(l1, xl, w1);
      h2 = _mm512_dpbusd_epi32(h2, xh, w2);
      l2 = _mm512_dpbusd_epi32(l2, xl, w2);
      h3 = _mm512_dpbusd_epi32(h3, xh, w3);
      l3 = _mm512_dpbusd_epi32(l3, xl, w3);
    }
    const __m512i hs[4] = {h0, h1, h2, h3}, ls[4] = {l0, l1, l2, l3};
    for (int r = 0; r < 4; ++r) {
      const int64_t off = 128LL * rowsum[n + r];
      out[n + r] = static_cast<at::BFloat16>(
          superslm_vnni::int8_out(static_cast<float>(scale[n + r]), sh, sl, hsum(hs[r]) - off, hsum(ls[r]) - off));
    }
  }
  for (; n < n1; ++n) {
    __m512i h = _mm512_setzero_si512(), l = h;
    const int8_t* c = codes + n * K;
    for (int64_t k = 0; k < K; k += 64) {
      const __m512i w = _mm512_loadu_si512(c + k);
      h = _mm512_dpbusd_epi32(h, _mm512_loadu_si512(hi + k), w);
      l = _mm512_dpbusd_epi32(l, _mm512_loadu_si512(lo + k), w);
    }
    const int64_t off = 128LL * rowsum[n];
    out[n] = static_cast<at::BFloat16>(
        superslm_vnni::int8_out(static_cast<float>(scale[n]), sh, sl, hsum(h) - off, hsum(l) - off));
  }
}

}  // namespace
#endif

// x [1, K] (K % 64 == 0), codes int8 [N, K], scale bf16 [N], rowsum int32 [N] -> [1, N] bf16
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& rowsum) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && codes.dim() == 2 && x.size(1) == codes.size(1) &&
                  x.device().is_cpu() && codes.device().is_cpu(), "int8_gemv: one row of K against codes [N, K] on the CPU");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && scale.scalar_type() == at::kBFloat16 &&
                  rowsum.scalar_type() == at::kInt && scale.numel() == codes.size(0) && rowsum.numel() == codes.size(0),
              "int8_gemv: codes int8 [N, K], scale bf16 [N], rowsum int32 [N]");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0, "int8_gemv: K must be a positive multiple of 64");
#ifdef SUPERSLM_VNNI
  // x rounded to bf16 first, as the GEMM and torch's kernel see it (a row's bits must not depend on M)
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<uint8_t> hi(K), lo(K);
  float sh = 0.f, sl = 0.f;
  if (!superslm_vnni::split_uint8(xp, K, hi.data(), lo.data(), &sh, &sl))
    return at::_weight_int8pack_mm(x.to(at::kBFloat16), codes, scale.contiguous());
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kBFloat16));
  at::Tensor sc = scale.contiguous(), rs = rowsum.contiguous();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const int32_t* rp = rs.data_ptr<int32_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // ~256 KiB of weights per task: enough to pay for waking a thread
  const int64_t grain = std::max<int64_t>(4, (262144 / K) & ~int64_t(3));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_vnni(hi.data(), lo.data(), cp, rp, sp, sh, sl, op, K, n0, n1);
  });
  return out;
#else
  (void)rowsum;
  return at::_weight_int8pack_mm(x.to(at::kBFloat16), codes, scale);
#endif
}

// ---- int4 (torch's packed CPU layout, groups of 32..256) -------------------------------------------
//
// qweight [N, K / 2] as `_convert_weight_to_int4pack_for_cpu` lays it out: per block of 64 rows and per
// k, 32 bytes; byte j holds row j (low nibble) and row j + 32 (high). Four k of one row become one
// 32-bit VNNI lane by byte/word unpacks, so each dpbusd multiplies 16 rows x 4 k of codes (0..15,
// unsigned) by the int8 parts of x. Per group: y += s * (sum c x - 8 sum x) + z * sum x, with s and
// z permuted from torch's own [groups, N, 2] into the lanes' row order (vnni.h group_scales).

using superslm_vnni::lane_row;

// x [1, K] -> [1, N] bf16 for int4 weights in torch's packed layout (K % group == 0, group % 4 == 0);
// with `bits` (Q5_0's fifth bits, vnni.h add_bits) the codes are 5-bit. Undefined when x cannot be split.
static at::Tensor gemv4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                        const uint64_t* bits) {
  superslm_vnni::check_int4(x, qweight, sz, group, "int4_gemv");
  TORCH_CHECK(x.size(0) == 1, "int4_gemv: one row");
  const int64_t K = x.size(1), N = qweight.size(0), G = K / group;
  // x rounded to bf16 first, as the GEMM and torch's kernel see it (a row's bits must not depend on M)
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  if (!vnni_available()) return at::Tensor();  // the caller falls back to torch's kernel
#ifdef SUPERSLM_VNNI
  // each group has its own two int8 parts (its accumulators restart per group anyway), so an outlier
  // only coarsens its own group; a group that cannot be split sends the whole row to torch's kernel
  std::vector<int8_t> hi(K), lo(K);
  std::vector<float> gsum(G), gsl(G);
  if (!superslm_vnni::split_groups(xp, K, group, hi.data(), lo.data(), gsum.data(), gsl.data()))
    return at::Tensor();
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kBFloat16));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const uint32_t* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / 64, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = wp + b * K * 32;  // [K][32] bytes of this block
      __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t g = 0; g < G; ++g) {
        __m512i ah[4], al[4];
        for (int a = 0; a < 4; ++a) ah[a] = al[a] = _mm512_setzero_si512();
        for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
          __m512i c[4];
          superslm_vnni::unpack_quad(blk + k * 32, c);
          if (bits) superslm_vnni::add_bits(bits + (b * (K / 4) + k / 4) * 4, c);
          int32_t h4, l4;  // four activation bytes, broadcast to every lane
          std::memcpy(&h4, hi.data() + k, 4);
          std::memcpy(&l4, lo.data() + k, 4);
          const __m512i xh = _mm512_set1_epi32(h4), xl = _mm512_set1_epi32(l4);
          for (int a = 0; a < 4; ++a) {
            ah[a] = _mm512_dpbusd_epi32(ah[a], c[a], xh);
            al[a] = _mm512_dpbusd_epi32(al[a], c[a], xl);
          }
        }
        __m512 sf[4], zf[4];
        // a block's groups sit N rows apart in torch's layout: fetch the next group's 256 bytes early
        if (g + 2 < G)
          for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(szp + (g + 2) * N + b * 64 + line * 16), _MM_HINT_T0);
        superslm_vnni::group_scales(szp + g * N + b * 64, sf, zf);
        superslm_vnni::group_epilogue(ah, al, sf, zf, gsum[g], gsl[g], y);
      }
      for (int a = 0; a < 4; ++a) {
        alignas(64) float v[16];
        _mm512_store_ps(v, y[a]);
        for (int lane = 0; lane < 16; ++lane) op[b * 64 + lane_row(a, lane)] = static_cast<at::BFloat16>(v[lane]);
      }
    }
  });
  return out;
#else
  return at::Tensor();
#endif
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group) {
  return gemv4(x, qweight, sz, group, nullptr);
}

// gemm.cpp: the plain float32 reference of the 5-bit codes, for rows the VNNI kernels cannot split
at::Tensor int5_reference(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);
const uint64_t* int5_bits(const at::Tensor& bits, int64_t N, int64_t K);
// avx2.cpp
at::Tensor int5_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);

// x [1, K] -> [1, N] bf16 for Q5_0 weights: nibbles in torch's packed int4 layout, the fifth bits as
// masks [N / 64, K / 4, 4], scales_zeros (d, -8 d) per group of 32: (code - 16) * d
// (without VNNI: the AVX2 GEMV, avx2.cpp int5_gemv_avx2, the same bits)
at::Tensor int5_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && qweight.dim() == 2 && qweight.size(1) * 2 == x.size(1),
              "int5_gemv: one row of K against packed codes [N, K / 2]");
  at::Tensor y = gemv4(x, qweight, sz, 32, int5_bits(bits, qweight.size(0), x.size(1)));
  if (!y.defined() && !vnni_available()) y = int5_gemv_avx2(x, qweight, sz, bits);
  return y.defined() ? y : int5_reference(x, qweight, sz, bits);
}

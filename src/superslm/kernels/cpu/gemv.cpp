// int8-weight GEMV for one activation row with AVX-512 VNNI, at bf16-or-better precision.
//
// torch's `_weight_int8pack_mm` converts every weight to float: on this machine it reads a large head at
// ~16 GB/s where memory gives ~29. VNNI multiplies bytes directly (64 per instruction), so the row x is
// split into two int8 parts, x ~= sh * hi + sl * lo (sh = max|x| / 127, sl = sh / 254): the error is at
// most max|x| / 64516, below the bf16 rounding x already carries (2^-9 of each element's magnitude
// for the elements that matter). y[n] = scale[n] * (sh * sum c hi + sl * sum c lo), the integer sums exact.
// VNNI takes unsigned activations: hi + 128 and lo + 128, corrected with 128 * sum_k c[n, k] (rowsum).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SUPERSLM_VNNI 1
#endif

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

// The two int8 parts of x[0:n): x ~= sh * hi + sl * lo with sh = max|x| / 127, sl = sh / 254. False when
// the split would not be within bf16 rounding of every element that matters: a NaN or inf, all zeros
// (callers answer those with torch's kernel), a denormal scale, or one element over 64x the others' rms
// (the parts' error is relative to the largest element, so small elements would lose bits).
static bool split_int8(const float* x, int64_t n, int8_t* hi, int8_t* lo, float* sh_out, float* sl_out) {
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
  if (static_cast<double>(amax) * amax > 4096.0 * rest) return false;
  const float sh = amax / 127.f, sl = sh / 254.f;
  for (int64_t k = 0; k < n; ++k) {
    const float qh = std::max(-127.f, std::min(127.f, std::nearbyint(x[k] / sh)));
    const float ql = std::max(-127.f, std::min(127.f, std::nearbyint((x[k] - qh * sh) / sl)));
    hi[k] = static_cast<int8_t>(qh);
    lo[k] = static_cast<int8_t>(ql);
  }
  *sh_out = sh;
  *sl_out = sl;
  return true;
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
      const double dh = static_cast<double>(hsum(hs[r]) - off), dl = static_cast<double>(hsum(ls[r]) - off);
      out[n + r] = static_cast<at::BFloat16>(static_cast<float>(scale[n + r]) * static_cast<float>(sh * dh + sl * dl));
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
    const double dh = static_cast<double>(hsum(h) - off), dl = static_cast<double>(hsum(l) - off);
    out[n] = static_cast<at::BFloat16>(static_cast<float>(scale[n]) * static_cast<float>(sh * dh + sl * dl));
  }
}

}  // namespace
#endif

// x [1, K] (K % 64 == 0), codes int8 [N, K], scale bf16 [N], rowsum int32 [N] -> [1, N] bf16
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& rowsum) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && codes.dim() == 2 && x.size(1) == codes.size(1),
              "int8_gemv: one row of K against codes [N, K]");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && scale.scalar_type() == at::kBFloat16 &&
                  rowsum.scalar_type() == at::kInt, "int8_gemv: codes int8, scale bf16, rowsum int32");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 64 == 0, "int8_gemv: K must be a multiple of 64");
#ifdef SUPERSLM_VNNI
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<int8_t> hs(K), ls(K);
  float sh = 0.f, sl = 0.f;
  if (!split_int8(xp, K, hs.data(), ls.data(), &sh, &sl)) return at::_weight_int8pack_mm(x.to(at::kBFloat16), codes, scale);
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kBFloat16));
  // VNNI multiplies unsigned by signed bytes: the activation parts go in with +128
  std::vector<uint8_t> hi(K), lo(K);
  for (int64_t k = 0; k < K; ++k) {
    hi[k] = static_cast<uint8_t>(hs[k] + 128);
    lo[k] = static_cast<uint8_t>(ls[k] + 128);
  }
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
// z repacked once per linear into the lanes' row order (`int4_repack_scales`).

namespace {
#ifdef SUPERSLM_VNNI
// 16 bf16 -> 16 float32 (a bf16 is the top half of a float)
inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// the row (within a block of 64) held by lane i of the four accumulators (lo nibbles q01, q23; hi q01, q23)
int lane_row(int acc, int lane) {
  static const int base01[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  const int r = base01[lane] + ((acc & 1) ? 8 : 0);
  return r + ((acc & 2) ? 32 : 0);
}
}  // namespace

// scales_zeros [G, N, 2] bf16 (N % 64 == 0) -> bf16 [N / 64, G, 2, 64]: s and z in the lanes' row order
// (bf16 as given: the kernel reads as many scale bytes as torch's does, and rounds nothing new)
at::Tensor int4_repack_scales(const at::Tensor& scales_zeros) {
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(2) == 2 && scales_zeros.size(1) % 64 == 0 &&
                  scales_zeros.scalar_type() == at::kBFloat16, "int4_repack_scales: bf16 [groups, N, 2], N % 64 == 0");
  at::Tensor sz = scales_zeros.contiguous();
  const int64_t G = sz.size(0), N = sz.size(1);
  at::Tensor out = at::empty({N / 64, G, 2, 64}, sz.options());
  const at::BFloat16* sp = sz.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < N / 64; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int acc = 0; acc < 4; ++acc)
        for (int lane = 0; lane < 16; ++lane) {
          const int64_t n = b * 64 + lane_row(acc, lane);
          at::BFloat16* dst = op + ((b * G + g) * 2) * 64 + acc * 16 + lane;
          dst[0] = sp[(g * N + n) * 2];
          dst[64] = sp[(g * N + n) * 2 + 1];
        }
  return out;
}

// x [1, K] -> [1, N] bf16 for int4 weights in torch's packed layout (K % group == 0, group % 4 == 0)
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sm, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && qweight.dim() == 2 && qweight.size(1) * 2 == x.size(1),
              "int4_gemv: one row of K against packed codes [N, K / 2]");
  const int64_t K = x.size(1), N = qweight.size(0), G = K / group;
  TORCH_CHECK(N % 64 == 0 && K % group == 0 && group % 4 == 0 && sm.size(0) == N / 64 && sm.size(1) == G,
              "int4_gemv: shapes of the packed codes and repacked scales do not match");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  if (!vnni_available()) return at::Tensor();  // the caller falls back to torch's kernel
#ifdef SUPERSLM_VNNI
  // each group has its own two int8 parts (its accumulators restart per group anyway), so an outlier
  // only coarsens its own group; a group that cannot be split sends the whole row to torch's kernel
  std::vector<int8_t> hi(K), lo(K);
  std::vector<float> gsum(G, 0.f), gsh(G), gsl(G);
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = xp + g * group;
    bool zero = true;
    for (int64_t k = 0; k < group; ++k) {
      gsum[g] += xg[k];
      zero = zero && xg[k] == 0.f;
    }
    if (zero) {
      std::fill(hi.begin() + g * group, hi.begin() + (g + 1) * group, 0);
      std::fill(lo.begin() + g * group, lo.begin() + (g + 1) * group, 0);
      gsh[g] = gsl[g] = 0.f;
    } else if (!split_int8(xg, group, hi.data() + g * group, lo.data() + g * group, &gsh[g], &gsl[g])) {
      return at::Tensor();
    }
  }
  at::Tensor out = at::empty({1, N}, x.options().dtype(at::kBFloat16));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  TORCH_CHECK(sm.scalar_type() == at::kBFloat16, "int4_gemv: repacked scales are bf16");
  const uint16_t* smp = reinterpret_cast<const uint16_t*>(sm.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const __m512i nib = _mm512_set1_epi8(0x0f);
  at::parallel_for(0, N / 64, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = wp + b * K * 32;  // [K][32] bytes of this block
      __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t g = 0; g < G; ++g) {
        __m512i ah[4], al[4];
        for (int a = 0; a < 4; ++a) ah[a] = al[a] = _mm512_setzero_si512();
        for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
          const __m256i B0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * 32));
          const __m256i B1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (k + 1) * 32));
          const __m256i B2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (k + 2) * 32));
          const __m256i B3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (k + 3) * 32));
          const __m256i t01l = _mm256_unpacklo_epi8(B0, B1), t01h = _mm256_unpackhi_epi8(B0, B1);
          const __m256i t23l = _mm256_unpacklo_epi8(B2, B3), t23h = _mm256_unpackhi_epi8(B2, B3);
          const __m512i q01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(t01l, t23l)),
                                                 _mm256_unpackhi_epi16(t01l, t23l), 1);
          const __m512i q23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(t01h, t23h)),
                                                 _mm256_unpackhi_epi16(t01h, t23h), 1);
          const __m512i c[4] = {_mm512_and_si512(q01, nib), _mm512_and_si512(q23, nib),
                                _mm512_and_si512(_mm512_srli_epi16(q01, 4), nib),
                                _mm512_and_si512(_mm512_srli_epi16(q23, 4), nib)};
          int32_t h4, l4;  // four activation bytes, broadcast to every lane
          std::memcpy(&h4, hi.data() + k, 4);
          std::memcpy(&l4, lo.data() + k, 4);
          const __m512i xh = _mm512_set1_epi32(h4), xl = _mm512_set1_epi32(l4);
          for (int a = 0; a < 4; ++a) {
            ah[a] = _mm512_dpbusd_epi32(ah[a], c[a], xh);
            al[a] = _mm512_dpbusd_epi32(al[a], c[a], xl);
          }
        }
        const uint16_t* s = smp + ((b * G + g) * 2) * 64;
        const __m512 gs = _mm512_set1_ps(gsum[g]), g8 = _mm512_set1_ps(8.f * gsum[g]);
        for (int a = 0; a < 4; ++a) {
          // sum (c - 8) x = sum c x - 8 sum x; then y += s * that + z * sum x
          const __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ah[a]), _mm512_set1_ps(gsh[g]),
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(al[a]), _mm512_set1_ps(gsl[g])));
          y[a] = _mm512_fmadd_ps(bf16x16(s + a * 16), _mm512_sub_ps(d, g8), y[a]);
          y[a] = _mm512_fmadd_ps(bf16x16(s + 64 + a * 16), gs, y[a]);
        }
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

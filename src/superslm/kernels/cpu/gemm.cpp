// int4-weight GEMM for several activation rows with AVX-512 VNNI, each row computed exactly as the
// single-row GEMV (gemv.cpp) computes it, so a row's bits do not depend on the rows beside it.
//
// torch's `_weight_int4pack_mm_for_cpu` turns every code into a float and multiplies in bf16/fp32 FMAs:
// at 16 decode rows it is compute-bound. Here a block of 64 output rows x one group of k is unpacked
// to bytes once (into L1), then every activation row multiplies it with VNNI (64 byte products per
// instruction, two int8 parts per row as in gemv.cpp), two rows at a time to reuse each code load.
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vnni.h"

bool vnni_available();
// avx2_rows.cpp
at::Tensor int5_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);

namespace {

#ifdef SUPERSLM_VNNI
struct RowParts {
  std::vector<int8_t> hi, lo;      // [M, K]
  std::vector<float> gsum, gsl;  // [M, G]
};

// rows r0, r1 (r1 may equal r0: one row) of one group against the unpacked codes cg[group / 4][4]
template <bool TWO>
inline void rows_group(const __m512i* cg, int64_t group, const int8_t* h0, const int8_t* l0, const int8_t* h1,
                       const int8_t* l1, __m512i ah0[4], __m512i al0[4], __m512i ah1[4], __m512i al1[4]) {
  for (int a = 0; a < 4; ++a) ah0[a] = al0[a] = ah1[a] = al1[a] = _mm512_setzero_si512();
  for (int64_t q = 0; q < group / 4; ++q) {
    const __m512i* c = cg + q * 4;
    int32_t v;  // four activation bytes, broadcast to every lane
    std::memcpy(&v, h0 + q * 4, 4);
    const __m512i xh0 = _mm512_set1_epi32(v);
    std::memcpy(&v, l0 + q * 4, 4);
    const __m512i xl0 = _mm512_set1_epi32(v);
    for (int a = 0; a < 4; ++a) {
      const __m512i ca = _mm512_load_si512(c + a);
      ah0[a] = _mm512_dpbusd_epi32(ah0[a], ca, xh0);
      al0[a] = _mm512_dpbusd_epi32(al0[a], ca, xl0);
    }
    if (TWO) {
      std::memcpy(&v, h1 + q * 4, 4);
      const __m512i xh1 = _mm512_set1_epi32(v);
      std::memcpy(&v, l1 + q * 4, 4);
      const __m512i xl1 = _mm512_set1_epi32(v);
      for (int a = 0; a < 4; ++a) {
        const __m512i ca = _mm512_load_si512(c + a);
        ah1[a] = _mm512_dpbusd_epi32(ah1[a], ca, xh1);
        al1[a] = _mm512_dpbusd_epi32(al1[a], ca, xl1);
      }
    }
  }
}

// output block b (64 rows of N) for activation rows [m0, m1): the unpacked group is reused by every row
void block_rows(const uint8_t* wp, const uint32_t* szp, const uint64_t* bits, const RowParts& xp,
                const std::vector<int64_t>& rows, int64_t K, int64_t G, int64_t group, int64_t N, int64_t b, int64_t m0,
                int64_t m1, at::BFloat16* op) {
  constexpr int64_t kMaxRows = 32;
  alignas(64) __m512i cg[256];  // one group's codes, [group / 4][4] vectors (group <= 256)
  alignas(64) float y[kMaxRows][64];
  __m512 acc[4];
  const uint8_t* blk = wp + b * K * 32;  // [K][32] bytes of this block
  for (int64_t t0 = m0; t0 < m1; t0 += kMaxRows) {
    const int64_t t1 = std::min(m1, t0 + kMaxRows);
    for (int64_t m = t0; m < t1; ++m) std::memset(y[m - t0], 0, sizeof(y[0]));
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t q = 0; q < group / 4; ++q) {
        superslm_vnni::unpack_quad(blk + (g * group + q * 4) * 32, cg + q * 4);
        if (bits) superslm_vnni::add_bits(bits + (b * (K / 4) + g * group / 4 + q) * 4, cg + q * 4);
      }
      __m512 sf[4], zf[4];
      if (g + 1 < G)  // the block's next group sits N rows further in torch's layout
        for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(szp + (g + 1) * N + b * 64 + line * 16), _MM_HINT_T0);
      superslm_vnni::group_scales(szp + g * N + b * 64, sf, zf);
      int64_t m = t0;
      __m512i ah0[4], al0[4], ah1[4], al1[4];
      for (; m + 2 <= t1; m += 2) {
        const int64_t r0 = rows[m] * K + g * group, r1 = rows[m + 1] * K + g * group;
        rows_group<true>(cg, group, xp.hi.data() + r0, xp.lo.data() + r0, xp.hi.data() + r1, xp.lo.data() + r1, ah0,
                         al0, ah1, al1);
        for (int j = 0; j < 2; ++j) {
          const int64_t i = rows[m + j] * G + g;
          for (int a = 0; a < 4; ++a) acc[a] = _mm512_load_ps(y[m + j - t0] + a * 16);
          superslm_vnni::group_epilogue(j ? ah1 : ah0, j ? al1 : al0, sf, zf, xp.gsum[i], xp.gsl[i], acc);
          for (int a = 0; a < 4; ++a) _mm512_store_ps(y[m + j - t0] + a * 16, acc[a]);
        }
      }
      if (m < t1) {
        const int64_t r0 = rows[m] * K + g * group;
        rows_group<false>(cg, group, xp.hi.data() + r0, xp.lo.data() + r0, nullptr, nullptr, ah0, al0, ah1, al1);
        const int64_t i = rows[m] * G + g;
        for (int a = 0; a < 4; ++a) acc[a] = _mm512_load_ps(y[m - t0] + a * 16);
        superslm_vnni::group_epilogue(ah0, al0, sf, zf, xp.gsum[i], xp.gsl[i], acc);
        for (int a = 0; a < 4; ++a) _mm512_store_ps(y[m - t0] + a * 16, acc[a]);
      }
    }
    for (int64_t m = t0; m < t1; ++m)
      for (int a = 0; a < 4; ++a)
        for (int lane = 0; lane < 16; ++lane)
          op[rows[m] * N + b * 64 + superslm_vnni::lane_row(a, lane)] = static_cast<at::BFloat16>(y[m - t0][a * 16 + lane]);
  }
}

// output rows [n0, n1) for every activation row: 4 output rows x 2 activation rows x 2 parts per pass,
// the 4 weight rows (4 K bytes) staying in L1 while the activation rows stream past them
void int8_rows(const uint8_t* hi, const uint8_t* lo, const std::vector<int64_t>& rows, const float* sh,
               const float* sl, const int8_t* codes, const int32_t* rowsum, const at::BFloat16* scale, int64_t K,
               int64_t N, int64_t n0, int64_t n1, at::BFloat16* out) {
  const int64_t R = static_cast<int64_t>(rows.size());
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t nn = std::min<int64_t>(4, n1 - n);
    const int8_t* w[4];
    for (int i = 0; i < 4; ++i) w[i] = codes + (n + std::min<int64_t>(i, nn - 1)) * K;  // a short tile repeats its last row
    for (int64_t m = 0; m < R; m += 2) {
      const int64_t m1 = std::min(m + 1, R - 1);  // an odd last row pairs with itself
      const uint8_t* x[4] = {hi + rows[m] * K, lo + rows[m] * K, hi + rows[m1] * K, lo + rows[m1] * K};
      __m512i acc[16];  // [n][m][part]
      superslm_vnni::dot_tile4x4(x, w, K, acc);
      alignas(64) int32_t sum[16];
      _mm512_store_si512(sum, superslm_vnni::reduce16(acc));
      // acc index 4i + j sits in lane 4j + i (reduce16): j = 2 * (row pair index) + part
      for (int i = 0; i < nn; ++i) {
        const int64_t off = 128LL * rowsum[n + i];
        const float s = static_cast<float>(scale[n + i]);
        for (int r = 0; r < (m1 > m ? 2 : 1); ++r) {
          const int64_t row = rows[m + r];
          const int64_t h = sum[4 * (2 * r) + i] - off, l = sum[4 * (2 * r + 1) + i] - off;
          out[row * N + n + i] = static_cast<at::BFloat16>(superslm_vnni::int8_out(s, sh[row], sl[row], h, l));
        }
      }
    }
  }
}
#endif

}  // namespace

// the fifth-bit masks of a Q5_0 weight [N, K], checked: int64 [N / 64, K / 4, 4]
const uint64_t* int5_bits(const at::Tensor& bits, int64_t N, int64_t K) {
  TORCH_CHECK(bits.scalar_type() == at::kLong && bits.is_contiguous() && bits.dim() == 3 && bits.size(0) == N / 64 &&
                  bits.size(1) == K / 4 && bits.size(2) == 4 && N % 64 == 0 && K % 32 == 0,
              "int5: fifth-bit masks int64 [N / 64, K / 4, 4] for codes [N, K]");
  return reinterpret_cast<const uint64_t*>(bits.data_ptr<int64_t>());
}

// x [M, K] -> [M, N] float32 rounded to bf16: the 5-bit weights decoded, (code - 8) * s + z, and summed in float32
// over k in order (for rows whose int8 parts cannot carry x: NaN, inf, an outlier). A block of 64 weight rows at a
// time, k by k: one k's 32 bytes hold the block's 64 codes, so the decode and the sums run across the rows (loops the
// compiler vectorizes) where row-by-row decoding read one byte of every 32. Each output is its own sum over k: a row
// of x gets the same bits whatever the other rows.
at::Tensor int5_reference(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits) {
  superslm_vnni::check_int4(x, qweight, sz, 32, "int5_reference");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const uint64_t* bp = int5_bits(bits, N, K);
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();  // as the VNNI kernels see x
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const at::BFloat16* szp = sz.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  int lane_of[64], acc_of[64];  // row within a block -> (accumulator, lane) of its fifth bit
  for (int a = 0; a < 4; ++a)
    for (int lane = 0; lane < 16; ++lane) {
      acc_of[superslm_vnni::lane_row(a, lane)] = a;
      lane_of[superslm_vnni::lane_row(a, lane)] = lane;
    }
  at::parallel_for(0, N / 64, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * 64);
    alignas(32) float s[64], z[64], w[64], fifth[4][64];
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < K; ++k) {
        if (k % 32 == 0)  // the group's (s, z) of the block's rows
          for (int r = 0; r < 64; ++r) {
            const int64_t at = ((k / 32) * N + b * 64 + r) * 2;
            s[r] = static_cast<float>(szp[at]);
            z[r] = static_cast<float>(szp[at + 1]);
          }
        if (k % 4 == 0)  // the fifth bits of the quad k .. k + 3 (four masks, a bit per row and k)
          for (int r = 0; r < 64; ++r) {
            const uint64_t mask = bp[(b * (K / 4) + k / 4) * 4 + acc_of[r]] >> (4 * lane_of[r]);
            for (int q = 0; q < 4; ++q) fifth[q][r] = static_cast<float>(16 * ((mask >> q) & 1));
          }
        const uint8_t* p = wp + (b * K + k) * 32;  // rows j (low nibbles) and 32 + j (high)
        const float* f = fifth[k % 4];
        for (int j = 0; j < 32; ++j) {
          w[j] = (static_cast<float>(p[j] & 15) + f[j] - 8.f) * s[j] + z[j];
          w[32 + j] = (static_cast<float>(p[j] >> 4) + f[32 + j] - 8.f) * s[32 + j] + z[32 + j];
        }
        for (int64_t m = 0; m < M; ++m) {
          const float xv = xp[m * K + k];
          float* am = acc.data() + m * 64;
          for (int r = 0; r < 64; ++r) am[r] += w[r] * xv;
        }
      }
      for (int64_t m = 0; m < M; ++m) std::copy(acc.begin() + m * 64, acc.begin() + (m + 1) * 64, op + m * N + b * 64);
    }
  });
  return out.to(at::kBFloat16);
}

// x [M, K] -> [M, N] bf16 for int4 weights in torch's packed layout: each row as `int4_gemv` computes it
// alone; rows whose parts cannot be split (NaN, inf, an outlier) go to torch's kernel, which is
// row-invariant too. scales_zeros: torch's [G, N, 2] bf16, read by both. With `bits`: Q5_0's 5-bit
// codes (int5_gemm), those rows to `int5_reference`.
static at::Tensor gemm4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros, int64_t group,
                        const at::Tensor* bits) {
  superslm_vnni::check_int4(x, qweight, scales_zeros, group, bits ? "int5_gemm" : "int4_gemm");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group;
  at::Tensor xb = x.to(at::kBFloat16);
  // the rows the VNNI kernel cannot take: torch's int4 kernel, or the 5-bit reference
  auto others = [&](const at::Tensor& xs) {
    return bits ? int5_reference(xs, qweight, scales_zeros, *bits)
                : at::_weight_int4pack_mm_for_cpu(xs, qweight, group, scales_zeros);
  };
  const uint64_t* bp = bits ? int5_bits(*bits, N, K) : nullptr;
  if (!vnni_available() || M == 0) return others(xb);
#ifdef SUPERSLM_VNNI
  // the kernel's input is x in bf16, as torch's kernel sees it
  at::Tensor xf = xb.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  RowParts parts;
  parts.hi.resize(M * K);
  parts.lo.resize(M * K);
  parts.gsum.resize(M * G);
  parts.gsl.resize(M * G);
  std::vector<char> ok(M);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ok[r] = superslm_vnni::split_groups(xp + r * K, K, group, parts.hi.data() + r * K, parts.lo.data() + r * K,
                                          parts.gsum.data() + r * G, parts.gsl.data() + r * G);
  });
  std::vector<int64_t> rows, bad;
  for (int64_t r = 0; r < M; ++r) (ok[r] ? rows : bad).push_back(r);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const uint32_t* szp = reinterpret_cast<const uint32_t*>(scales_zeros.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t R = static_cast<int64_t>(rows.size()), blocks = N / 64;
  // tasks: (block, a tile of rows); when the blocks do not divide evenly among the threads, the rows are
  // split too, so no thread waits a whole block for another (9 blocks on 2 threads: 18 tasks, not 5 + 4)
  if (R > 0) {
    const int64_t threads = at::get_num_threads();
    int64_t tiles = (R + 31) / 32;
    if ((blocks * tiles) % threads != 0 && R >= 2 * threads) tiles = std::max(tiles, threads);
    const int64_t tile = (R + tiles - 1) / tiles;
    at::parallel_for(0, blocks * tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / tiles, m0 = (t % tiles) * tile;
        block_rows(wp, szp, bp, parts, rows, K, G, group, N, b, m0, std::min(R, m0 + tile), op);
      }
    });
  }
  if (!bad.empty()) {
    at::Tensor idx = at::tensor(bad, at::kLong);
    out.index_copy_(0, idx, others(xb.index_select(0, idx)));
  }
  return out;
#else
  (void)bp;
  return others(xb);
#endif
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros, int64_t group) {
  return gemm4(x, qweight, scales_zeros, group, nullptr);
}

// x [M, K] -> [M, N] bf16 for Q5_0 weights (int5_gemv's layout), each row as int5_gemv computes it alone
// (without VNNI: avx2_rows.cpp int5_gemm_avx2, the same bits)
at::Tensor int5_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros,
                     const at::Tensor& bits) {
  if (!vnni_available() && x.dim() == 2 && x.size(0) > 0) {
    at::Tensor y = int5_gemm_avx2(x, qweight, scales_zeros, bits);
    if (y.defined()) return y;
  }
  return gemm4(x, qweight, scales_zeros, 32, &bits);
}

// x [M, K] (K % 64 == 0) -> [M, N] bf16 for int8 codes [N, K] with per-row scales: each row as `int8_gemv`
// computes it alone; rows that cannot be split go to torch's kernel (row-invariant too)
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& rowsum) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && codes.scalar_type() == at::kChar &&
                  x.device().is_cpu() && codes.device().is_cpu() &&
                  codes.is_contiguous() && scale.scalar_type() == at::kBFloat16 && rowsum.scalar_type() == at::kInt &&
                  scale.numel() == codes.size(0) && rowsum.numel() == codes.size(0),
              "int8_gemm: rows of K against codes int8 [N, K], scale bf16 [N], rowsum int32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0, "int8_gemm: K must be a positive multiple of 64");
  at::Tensor xb = x.to(at::kBFloat16);
  if (!vnni_available() || M == 0) return at::_weight_int8pack_mm(xb, codes, scale);
#ifdef SUPERSLM_VNNI
  at::Tensor xf = xb.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<uint8_t> hi(M * K), lo(M * K);
  std::vector<float> sh(M), sl(M);
  std::vector<char> ok(M);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ok[r] = superslm_vnni::split_uint8(xp + r * K, K, hi.data() + r * K, lo.data() + r * K, &sh[r], &sl[r]);
  });
  std::vector<int64_t> rows, bad;
  for (int64_t r = 0; r < M; ++r) (ok[r] ? rows : bad).push_back(r);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  at::Tensor sc = scale.contiguous(), rs = rowsum.contiguous();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const int32_t* rp = rs.data_ptr<int32_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  if (!rows.empty()) {
    // tasks of 4 output rows, ~64 KiB of weights each
    const int64_t grain = std::max<int64_t>(1, 65536 / (4 * K));
    at::parallel_for(0, (N + 3) / 4, grain, [&](int64_t t0, int64_t t1) {
      int8_rows(hi.data(), lo.data(), rows, sh.data(), sl.data(), cp, rp, sp, K, N, t0 * 4, std::min(N, t1 * 4), op);
    });
  }
  if (!bad.empty()) {
    at::Tensor idx = at::tensor(bad, at::kLong);
    out.index_copy_(0, idx, at::_weight_int8pack_mm(xb.index_select(0, idx), codes, scale));
  }
  return out;
#else
  (void)rowsum;
  return at::_weight_int8pack_mm(xb, codes, scale);
#endif
}

// Certified greedy tokens from an int8 head: which tokens can be a row's argmax, found at half the cost.
//
// At 16 decode rows an int8 head is compute-bound: the exact kernels (int8_gemv / int8_gemm) multiply each
// code by both int8 parts of the activation. Here only the first part runs (x ~ sh * hi), and every
// approximate logit carries a rigorous error bound:
//   |exact - approx| <= scale_n * |sum_k (x_k - sh hi_k) c_nk| + the second part's rounding + bf16 output
//                    <= (||r||_2 + sl sqrt(K) / 2) * w2_n * 1.001 + 2^-8 (|approx| + that)
// (Cauchy-Schwarz, r = x - sh hi, w2_n = ||c_n||_2 * scale_n). A token whose upper bound is below the best
// lower bound cannot be the argmax, so the candidates of each row hold every token that can be, ties
// included; the caller computes the exact logits of the candidates alone (the exact kernels give each
// output from exact integer sums, so a gathered row has the bits it has in the full head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "vnni.h"

bool vnni_available();

// x [M, K] (rounded to bf16, as the exact kernels see it), codes int8 [N, K], scale bf16 [N], rowsum int32
// [N] (int8_rowsum), w2 float32 [N] (||codes_n||_2 * scale_n, rounded up) -> (candidates int64 [T], offsets
// int64 [M + 1]): row m's candidate tokens, ascending, are candidates[offsets[m]:offsets[m + 1]]. Offsets
// come back empty when a row cannot be split into int8 parts (NaN, inf, an outlier): the caller computes
// the whole head then.
std::tuple<at::Tensor, at::Tensor> int8_greedy_candidates(const at::Tensor& x, const at::Tensor& codes,
                                                          const at::Tensor& scale, const at::Tensor& rowsum,
                                                          const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && codes.scalar_type() == at::kChar &&
                  x.device().is_cpu() && codes.device().is_cpu() && codes.is_contiguous() &&
                  scale.scalar_type() == at::kBFloat16 && rowsum.scalar_type() == at::kInt &&
                  w2.scalar_type() == at::kFloat && scale.numel() == codes.size(0) &&
                  rowsum.numel() == codes.size(0) && w2.numel() == codes.size(0),
              "int8_greedy_candidates: rows of K against codes int8 [N, K], scale bf16 [N], rowsum int32 [N], "
              "w2 float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 64 == 0, "int8_greedy_candidates: K must be a multiple of 64");
  const at::Tensor none = at::empty({0}, at::kLong);
  if (!vnni_available() || M == 0 || N == 0) return {none, none};
#ifdef SUPERSLM_VNNI
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<uint8_t> hi(M * K);
  std::vector<int8_t> hs(K), ls(K);
  std::vector<float> sh(M), err(M);  // err: ||r||_2 + sl sqrt(K) / 2, rounded up
  for (int64_t m = 0; m < M; ++m) {
    float sl;
    if (!superslm_vnni::split_int8(xp + m * K, K, hs.data(), ls.data(), &sh[m], &sl)) return {none, none};
    double rr = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double r = static_cast<double>(xp[m * K + k]) - static_cast<double>(sh[m]) * hs[k];
      rr += r * r;
      hi[m * K + k] = static_cast<uint8_t>(hs[k] + 128);
    }
    err[m] = static_cast<float>((std::sqrt(rr) + 0.5 * sl * std::sqrt(static_cast<double>(K))) * 1.001);
  }
  at::Tensor sc = scale.contiguous(), rs = rowsum.contiguous(), wc = w2.contiguous();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const int32_t* rp = rs.data_ptr<int32_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  const float* wp = wc.data_ptr<float>();
  std::vector<float> approx(M * N);
  const int threads = at::get_num_threads();
  std::vector<float> lower(threads * M, -std::numeric_limits<float>::infinity());  // per thread: best lower bound
  auto bound = [&](int64_t m, int64_t n, float a) {
    const float e = err[m] * wp[n];
    return 1.001f * e + 0.00390625f * (std::fabs(a) + e);
  };
  // pass 1: approximate logits, 4 outputs x 4 rows per tile (one part: half the exact kernels' products);
  // the epilogue in vectors, lane 4j + i = output i of row j (reduce16's order)
  const __m512i row_of = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 c1 = _mm512_set1_ps(1.001f), c2 = _mm512_set1_ps(0.00390625f);
  auto bound16 = [&](__m512 a, __m512 e) {  // the bound of `bound`, 16 lanes
    return _mm512_fmadd_ps(c1, e, _mm512_mul_ps(c2, _mm512_add_ps(_mm512_abs_ps(a), e)));
  };
  const int64_t grain = std::max<int64_t>(1, 65536 / (4 * K));
  at::parallel_for(0, (N + 3) / 4, grain, [&](int64_t t0, int64_t t1) {
    float* low = lower.data() + at::get_thread_num() * M;
    for (int64_t n = t0 * 4; n < std::min(N, t1 * 4); n += 4) {
      const int64_t nn = std::min<int64_t>(4, N - n);
      const int8_t* w[4];
      float s4[4], o4[4], w4[4];  // per output: scale, 128 * rowsum, w2 (a short tile repeats its last)
      for (int i = 0; i < 4; ++i) {
        const int64_t r = n + std::min<int64_t>(i, nn - 1);
        w[i] = cp + r * K;
        s4[i] = static_cast<float>(sp[r]);
        o4[i] = 128.f * static_cast<float>(rp[r]);
        w4[i] = wp[r];
      }
      const __m512 sv = _mm512_broadcast_f32x4(_mm_loadu_ps(s4)), ov = _mm512_broadcast_f32x4(_mm_loadu_ps(o4));
      const __m512 wv2 = _mm512_broadcast_f32x4(_mm_loadu_ps(w4));
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t mm = std::min<int64_t>(4, M - m);
        const uint8_t* xr[4];
        float h4[4], e4[4];
        for (int j = 0; j < 4; ++j) {
          const int64_t r = m + std::min<int64_t>(j, mm - 1);
          xr[j] = hi.data() + r * K;
          h4[j] = sh[r];
          e4[j] = err[r];
        }
        __m512i acc[16];  // [output i][row j]
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
        for (int64_t k = 0; k < K; k += 64) {
          __m512i xv[4], wv[4];
          for (int j = 0; j < 4; ++j) xv[j] = _mm512_loadu_si512(xr[j] + k);
          for (int i = 0; i < 4; ++i) wv[i] = _mm512_loadu_si512(w[i] + k);
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) acc[i * 4 + j] = _mm512_dpbusd_epi32(acc[i * 4 + j], xv[j], wv[i]);
        }
        // |sum - 128 rowsum| < 2^24 for K <= 1024 (255 * 128 * K): exact in float32
        const __m512 sum = _mm512_sub_ps(_mm512_cvtepi32_ps(superslm_vnni::reduce16(acc)), ov);
        const __m512 hv = _mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(h4)));
        const __m512 ev = _mm512_mul_ps(_mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(e4))), wv2);
        const __m512 a = _mm512_mul_ps(sv, _mm512_mul_ps(hv, sum));
        alignas(64) float av[16], lv[16];
        _mm512_store_ps(av, a);
        _mm512_store_ps(lv, _mm512_sub_ps(a, bound16(a, ev)));
        for (int j = 0; j < mm; ++j) {
          float* dst = approx.data() + (m + j) * N + n;
          for (int i = 0; i < nn; ++i) {
            dst[i] = av[4 * j + i];
            low[m + j] = std::max(low[m + j], lv[4 * j + i]);
          }
        }
      }
    }
  });
  // pass 2: per row, every token whose upper bound reaches the best lower bound (16 at a time)
  std::vector<std::vector<int64_t>> found(M);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float best = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < threads; ++t) best = std::max(best, lower[t * M + m]);
      const float* am = approx.data() + m * N;
      const __m512 bv = _mm512_set1_ps(best), em = _mm512_set1_ps(err[m]);
      int64_t n = 0;
      for (; n + 16 <= N; n += 16) {
        const __m512 a = _mm512_loadu_ps(am + n);
        const __m512 up = _mm512_add_ps(a, bound16(a, _mm512_mul_ps(em, _mm512_loadu_ps(wp + n))));
        for (uint32_t k = _mm512_cmp_ps_mask(up, bv, _CMP_GE_OQ); k; k &= k - 1) found[m].push_back(n + __builtin_ctz(k));
      }
      for (; n < N; ++n)
        if (am[n] + bound(m, n, am[n]) >= best) found[m].push_back(n);
    }
  });
  at::Tensor offsets = at::empty({M + 1}, at::kLong);
  int64_t* op = offsets.data_ptr<int64_t>();
  op[0] = 0;
  for (int64_t m = 0; m < M; ++m) op[m + 1] = op[m] + static_cast<int64_t>(found[m].size());
  at::Tensor cands = at::empty({op[M]}, at::kLong);
  int64_t* cpo = cands.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) std::copy(found[m].begin(), found[m].end(), cpo + op[m]);
  return {cands, offsets};
#else
  (void)w2;
  return {none, none};
#endif
}

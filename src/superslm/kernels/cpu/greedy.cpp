// Certified greedy tokens from an int8 head: which tokens can be a row's argmax, found at half the cost.
//
// At 16 decode rows an int8 head is compute-bound: the exact kernels (int8_gemv / int8_gemm) multiply each
// code by both int8 parts of the activation. Here only the first part runs (x ~ sh * hi), and every
// approximate logit carries a rigorous error bound. Each row's largest channels (the set O) are multiplied
// exactly in float; the rest, x', is one int8 part x' ~ sh hi:
//   approx = scale_n (sh sum_k hi_k c_nk + sum_{o in O} x_o c_no)
//   |exact - approx| <= scale_n |sum_k (x'_k - sh hi_k) c_nk|   the dropped part
//                     + scale_n (sl / 2) sqrt(K) ||c_n||_2      the exact kernels' own second-part rounding
//                                                               (sl of the full row's split, as they use)
//                     + 2^-8 |exact|                            their bf16 output, float32 sums
//                     + scale_n 2^-9 sum_O |x_o|                 the float sum over O (|c| <= 128, 2^-24 each)
//   so b = 1.001 (||r||_2 + sl sqrt(K) / 2) w2_n + 2^-8 (|approx| + that) + that last term, with
// Cauchy-Schwarz, r = x' - sh hi, w2_n = ||c_n||_2 * scale_n. A token whose upper bound is below the best
// lower bound cannot be the argmax, so the candidates hold every token that can be a row's argmax, ties
// included; the caller computes the exact logits of the candidates alone (the exact kernels give each
// output from exact integer sums, so a gathered row has the bits it has in the full head).
//
// Two passes compute the approximate logits: AVX-512 VNNI tiles of 4 outputs x 4 rows (the part as unsigned
// bytes, hi + 128, and 128 * rowsum taken off), and on AVX2 without VNNI 8 outputs a row, the byte products
// through maddubs with the codes' magnitudes and the part carrying their signs (|c| <= 128, |hi| <= 127: a pair
// at most 32,512, never saturating). The AVX2 exact kernels multiply each code by both parts in int16
// (avx2.cpp, avx2_rows.cpp), so here too one part is half their products.
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "vnni.h"

#if defined(__AVX2__) && defined(__FMA__)
#define SUPERSLM_GREEDY_AVX2 1
#endif

bool vnni_available();
bool avx2_available();

#ifdef SUPERSLM_GREEDY_AVX2
namespace {

// lane o: the int32 sum of the 8 lanes of acc[o]
inline __m256i reduce8(const __m256i acc[8]) {
  const __m256i t0 = _mm256_hadd_epi32(acc[0], acc[1]), t1 = _mm256_hadd_epi32(acc[2], acc[3]);
  const __m256i t2 = _mm256_hadd_epi32(acc[4], acc[5]), t3 = _mm256_hadd_epi32(acc[6], acc[7]);
  // u0: [acc 0..3's sums of lanes 0-3 | of lanes 4-7], u1 the same for acc 4..7
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// code rows ahead of the ones multiplied that `dot8` asks the cache for: a streamed head is bound by one
// core's misses in flight (avx2.cpp's exact GEMV does the same)
constexpr int64_t PF_ROWS = 16;

// the exact int32 sums over k of hs[k] * w[o][k] for 8 code rows w[o] (K % 32 == 0, each K apart): lane o;
// `prefetch`: the rows PF_ROWS ahead too
inline __m256i dot8(const int8_t* const w[8], const int8_t* hs, int64_t K, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[8];
  for (int o = 0; o < 8; ++o) acc[o] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hs + k));
    if (prefetch && (k & 63) == 0)
      for (int o = 0; o < 8; ++o) _mm_prefetch(reinterpret_cast<const char*>(w[o] + PF_ROWS * K + k), _MM_HINT_T0);
    for (int o = 0; o < 8; ++o) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[o] + k));
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c));
      acc[o] = _mm256_add_epi32(acc[o], _mm256_madd_epi16(p, ones));
    }
  }
  return reduce8(acc);
}

}  // namespace
#endif

// w2 float32 [N] for codes int8 [N, K] and scale bf16 [N]: ||codes_n||_2 * scale_n from the exact integer sum of
// squares, rounded up by 2^-20 (the bound must not be an ulp short); no temporaries beside the output
at::Tensor int8_rownorm(const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && scale.scalar_type() == at::kBFloat16 &&
                  scale.numel() == codes.size(0) && codes.device().is_cpu() && scale.device().is_cpu(),
              "int8_rownorm: codes int8 [N, K] and scale bf16 [N]");
  at::Tensor c = codes.contiguous(), sc = scale.contiguous();
  const int64_t N = c.size(0), K = c.size(1);
  at::Tensor out = at::empty({N}, c.options().dtype(at::kFloat));
  const int8_t* cp = c.data_ptr<int8_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    int64_t total = 0;
    for (int64_t k = 0; k < K; ++k) total += static_cast<int64_t>(cp[n * K + k]) * cp[n * K + k];
    op[n] = static_cast<float>(std::sqrt(static_cast<double>(total)) * static_cast<double>(static_cast<float>(sp[n])) *
                               (1.0 + 1.0 / 1048576.0));
  }
  return out;
}

// x [M, K] (rounded to bf16, as the exact kernels see it), codes int8 [N, K], scale bf16 [N], rowsum int32
// [N] (int8_rowsum), w2 float32 [N] (||codes_n||_2 * scale_n, rounded up) -> (candidates int64 [U], ok): the
// union over the rows of the tokens that can be a row's argmax, ascending. ok is false (and the union empty)
// when a row cannot be split into the exact kernels' two int8 parts (NaN, inf, an outlier past them) or the
// union would exceed `limit`: the caller computes the whole head then.
std::tuple<at::Tensor, bool> int8_greedy_candidates(const at::Tensor& x, const at::Tensor& codes,
                                                    const at::Tensor& scale, const at::Tensor& rowsum,
                                                    const at::Tensor& w2, int64_t limit) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && codes.scalar_type() == at::kChar &&
                  x.device().is_cpu() && codes.device().is_cpu() && codes.is_contiguous() &&
                  scale.scalar_type() == at::kBFloat16 && rowsum.scalar_type() == at::kInt &&
                  w2.scalar_type() == at::kFloat && scale.numel() == codes.size(0) &&
                  rowsum.numel() == codes.size(0) && w2.numel() == codes.size(0),
              "int8_greedy_candidates: rows of K against codes int8 [N, K], scale bf16 [N], rowsum int32 [N], "
              "w2 float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0 && K <= 1024,
              "int8_greedy_candidates: K must be a positive multiple of 64, at most 1024");
  TORCH_CHECK(N < (int64_t{1} << 31) && M < (int64_t{1} << 31), "int8_greedy_candidates: too many rows");
  const at::Tensor none = at::empty({0}, at::kLong);
  const bool vnni = vnni_available();
  if (M == 0 || N == 0 || !(vnni || avx2_available())) return {none, false};
#if defined(SUPERSLM_VNNI) || defined(SUPERSLM_GREEDY_AVX2)
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  // outlier channels (each row's 4 largest |x|, shared by all rows, at most 16) are multiplied exactly in
  // float: one channel at 17x the rms (SmolLM2's) would otherwise set every int8 step and loosen the bound
  std::vector<int64_t> outl;
  for (int64_t m = 0; m < M; ++m) {
    std::vector<int64_t> idx(K);
    for (int64_t k = 0; k < K; ++k) idx[k] = k;
    std::partial_sort(idx.begin(), idx.begin() + std::min<int64_t>(4, K), idx.end(), [&](int64_t a, int64_t b) {
      return std::fabs(xp[m * K + a]) > std::fabs(xp[m * K + b]);
    });
    for (int64_t t = 0; t < std::min<int64_t>(4, K); ++t)
      if (std::find(outl.begin(), outl.end(), idx[t]) == outl.end() && outl.size() < 16) outl.push_back(idx[t]);
  }
  const int64_t T = static_cast<int64_t>(outl.size());
  std::vector<uint8_t> hi(vnni ? M * K : 0);   // the part as the VNNI pass reads it: hs + 128
  std::vector<int8_t> hsr(vnni ? 0 : M * K);   // as the AVX2 pass reads it: hs
  std::vector<int8_t> hs(K), ls(K);
  std::vector<float> rest(K), sh(M), err(M), xo(M), xt(M * T);  // xt [M, T]: the outliers' values
  for (int64_t m = 0; m < M; ++m) {
    std::copy(xp + m * K, xp + (m + 1) * K, rest.begin());
    double ao = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      xt[m * T + t] = rest[outl[t]];
      ao += std::fabs(rest[outl[t]]);
      rest[outl[t]] = 0.f;
    }
    // the exact kernels split the whole row: a row they send to torch's kernel (NaN, inf, an outlier past
    // what two parts carry) is not certified here, and their second part's step sl is the full row's
    float sl, sh_full, sl_rest;
    if (!superslm_vnni::split_int8(xp + m * K, K, hs.data(), ls.data(), &sh_full, &sl)) return {none, false};
    if (!superslm_vnni::split_int8(rest.data(), K, hs.data(), ls.data(), &sh[m], &sl_rest)) return {none, false};
    double rr = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double r = static_cast<double>(rest[k]) - static_cast<double>(sh[m]) * hs[k];
      rr += r * r;
      if (vnni)
        hi[m * K + k] = static_cast<uint8_t>(hs[k] + 128);
      else
        hsr[m * K + k] = hs[k];
    }
    err[m] = static_cast<float>((std::sqrt(rr) + 0.5 * sl * std::sqrt(static_cast<double>(K))) * 1.001);
    // the float sum over the outlier channels, |x_o c| <= 128 |x_o| each: its rounding (2^-24 relative a
    // step), with room to spare
    xo[m] = static_cast<float>(ao * 128.0 / 65536.0);
  }
  at::Tensor sc = scale.contiguous(), rs = rowsum.contiguous(), wc = w2.contiguous();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const int32_t* rp = rs.data_ptr<int32_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  const float* wp = wc.data_ptr<float>();
  // per task: each row's best lower bound so far, and the (row, token, upper bound) that reached it then;
  // no [M, N] buffer (a 16 MB allocation a step fragments the heap): the list stays short, as a token is
  // kept only while its upper bound beats the running best
  struct Kept {
    int32_t m, n;
    float up;
  };
  // a loose bound keeps most of the vocabulary: past this many entries a task gives up (the caller then
  // computes the whole head), so a hopeless call costs neither memory nor the time of its list
  const size_t max_kept = static_cast<size_t>(std::max<int64_t>(limit, 1)) * 16 + 4096;
  std::atomic<bool> gave_up{false};
  // one task of either pass: each row's best lower bound so far, and what it kept
  struct Task {
    std::vector<float> low;
    std::vector<Kept> kept;
    // row m's bounds lo[i], up[i] of tokens n + i, i < nn: the best lower bound first, then every token whose
    // upper bound reaches it
    void take(int64_t m, int64_t n, const float* lo, const float* up, int64_t nn) {
      for (int64_t i = 0; i < nn; ++i) low[m] = std::max(low[m], lo[i]);
      for (int64_t i = 0; i < nn; ++i)
        if (up[i] >= low[m]) kept.push_back({static_cast<int32_t>(m), static_cast<int32_t>(n + i), up[i]});
    }
  };
  std::vector<Task> done;
  std::mutex merge;
  auto start = [&] { return Task{std::vector<float>(M, -std::numeric_limits<float>::infinity()), {}}; };
  auto finish = [&](Task& task) {
    std::lock_guard<std::mutex> lock(merge);
    done.push_back(std::move(task));
  };
  if (vnni) {
#ifdef SUPERSLM_VNNI
  // one pass: approximate logits, 4 outputs x 4 rows per tile (one part: half the exact kernels' products);
  // the epilogue in vectors, lane 4j + i = output i of row j (reduce16's order)
  const __m512i row_of = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 c1 = _mm512_set1_ps(1.001f), c2 = _mm512_set1_ps(0.00390625f);
  auto bound16 = [&](__m512 a, __m512 e) {  // the bound above, given e = err_m * w2_n, 16 lanes
    return _mm512_fmadd_ps(c1, e, _mm512_mul_ps(c2, _mm512_add_ps(_mm512_abs_ps(a), e)));
  };
  const int64_t grain = std::max<int64_t>(1, 65536 / (4 * K));
  at::parallel_for(0, (N + 3) / 4, grain, [&](int64_t t0, int64_t t1) {
    Task task = start();
    for (int64_t n = t0 * 4; n < std::min(N, t1 * 4) && !gave_up.load(std::memory_order_relaxed); n += 4) {
      const int64_t nn = std::min<int64_t>(4, N - n);
      const int8_t* w[4];
      float s4[4], w4[4];  // per output: scale, w2 (a short tile repeats its last)
      int32_t o4[4];       // 128 * rowsum
      for (int i = 0; i < 4; ++i) {
        const int64_t r = n + std::min<int64_t>(i, nn - 1);
        w[i] = cp + r * K;
        s4[i] = static_cast<float>(sp[r]);
        o4[i] = 128 * rp[r];
        w4[i] = wp[r];
      }
      const __m512 sv = _mm512_broadcast_f32x4(_mm_loadu_ps(s4));
      const __m512i ov = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o4)));
      const __m512 wv2 = _mm512_broadcast_f32x4(_mm_loadu_ps(w4));
      __m512 cw[16];  // per outlier channel: lane 4j + i = codes[n + i][channel]
      for (int64_t t = 0; t < T; ++t) {
        float c4[4];
        for (int i = 0; i < 4; ++i) c4[i] = static_cast<float>(w[i][outl[t]]);
        cw[t] = _mm512_broadcast_f32x4(_mm_loadu_ps(c4));
      }
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t mm = std::min<int64_t>(4, M - m);
        const uint8_t* xr[4];
        float h4[4], e4[4], f4[4];
        __m512 outv = _mm512_setzero_ps();  // lane 4j + i: sum over outlier channels of x[row j] * codes[n + i]
        for (int j = 0; j < 4; ++j) {
          const int64_t r = m + std::min<int64_t>(j, mm - 1);
          xr[j] = hi.data() + r * K;
          h4[j] = sh[r];
          e4[j] = err[r];
          f4[j] = xo[r];
        }
        for (int64_t t = 0; t < T; ++t) {
          float x4[4];
          for (int j = 0; j < 4; ++j) x4[j] = xt[(m + std::min<int64_t>(j, mm - 1)) * T + t];
          outv = _mm512_fmadd_ps(_mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(x4))), cw[t], outv);
        }
        __m512i acc[16];  // [output i][row j]
        superslm_vnni::dot_tile4x4(xr, w, K, acc);
        // the offset removed in int32: |sum hi c| <= 127 * 128 * K < 2^24 for K <= 1032, exact in float32
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(superslm_vnni::reduce16(acc), ov));
        const __m512 hv = _mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(h4)));
        const __m512 ev = _mm512_mul_ps(_mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(e4))), wv2);
        const __m512 a = _mm512_mul_ps(sv, _mm512_fmadd_ps(hv, sum, outv));
        const __m512 fv = _mm512_mul_ps(sv, _mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(f4))));
        const __m512 b = _mm512_add_ps(bound16(a, ev), fv);
        alignas(64) float lo16[16], up16[16];
        _mm512_store_ps(lo16, _mm512_sub_ps(a, b));
        _mm512_store_ps(up16, _mm512_add_ps(a, b));
        for (int j = 0; j < mm; ++j) task.take(m + j, n, lo16 + 4 * j, up16 + 4 * j, nn);
        if (task.kept.size() > max_kept) gave_up = true;
      }
    }
    finish(task);
  });
#endif
  } else {
#ifdef SUPERSLM_GREEDY_AVX2
  // one pass: per 8 outputs, each row's approximate logits in one vector (lane i: output n + i), the bound
  // as the VNNI pass forms it
  const __m256 c1 = _mm256_set1_ps(1.001f), c2 = _mm256_set1_ps(0.00390625f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const int64_t grain = std::max<int64_t>(1, 65536 / (8 * K));
  (void)rp;  // the VNNI pass's offset
  at::parallel_for(0, (N + 7) / 8, grain, [&](int64_t t0, int64_t t1) {
    Task task = start();
    for (int64_t n = t0 * 8; n < std::min(N, t1 * 8) && !gave_up.load(std::memory_order_relaxed); n += 8) {
      const int64_t nn = std::min<int64_t>(8, N - n);
      const int8_t* w[8];
      alignas(32) float s8[8], w8[8];  // per output: scale, w2 (a short tile repeats its last)
      for (int i = 0; i < 8; ++i) {
        const int64_t r = n + std::min<int64_t>(i, nn - 1);
        w[i] = cp + r * K;
        s8[i] = static_cast<float>(sp[r]);
        w8[i] = wp[r];
      }
      const __m256 sv = _mm256_load_ps(s8), wv2 = _mm256_load_ps(w8);
      __m256 cw[16];  // per outlier channel: lane i = codes[n + i][channel]
      for (int64_t t = 0; t < T; ++t) {
        alignas(32) float c8[8];
        for (int i = 0; i < 8; ++i) c8[i] = static_cast<float>(w[i][outl[t]]);
        cw[t] = _mm256_load_ps(c8);
      }
      for (int64_t m = 0; m < M; ++m) {
        __m256 outv = _mm256_setzero_ps();  // lane i: sum over outlier channels of x[m] * codes[n + i]
        for (int64_t t = 0; t < T; ++t) outv = _mm256_fmadd_ps(_mm256_set1_ps(xt[m * T + t]), cw[t], outv);
        // |sum hs c| <= 127 * 128 * K < 2^24 for K <= 1032: exact in float32
        const bool pf = m == 0 && nn == 8 && n + 8 + PF_ROWS <= t1 * 8 && n + 8 + PF_ROWS <= N;
        const __m256 sum = _mm256_cvtepi32_ps(dot8(w, hsr.data() + m * K, K, pf));
        const __m256 a = _mm256_mul_ps(sv, _mm256_fmadd_ps(_mm256_set1_ps(sh[m]), sum, outv));
        const __m256 e = _mm256_mul_ps(_mm256_set1_ps(err[m]), wv2);
        const __m256 b = _mm256_add_ps(_mm256_fmadd_ps(c1, e, _mm256_mul_ps(c2, _mm256_add_ps(_mm256_and_ps(a, absmask), e))),
                                       _mm256_mul_ps(sv, _mm256_set1_ps(xo[m])));
        alignas(32) float lo8[8], up8[8];
        _mm256_store_ps(lo8, _mm256_sub_ps(a, b));
        _mm256_store_ps(up8, _mm256_add_ps(a, b));
        task.take(m, n, lo8, up8, nn);
        if (task.kept.size() > max_kept) gave_up = true;
      }
    }
    finish(task);
  });
#endif
  }
  if (gave_up) return {none, false};
  // every token whose upper bound reaches its row's best lower bound (over all tasks), marked so the
  // union comes out sorted
  std::vector<float> best(M, -std::numeric_limits<float>::infinity());
  for (const Task& t : done)
    for (int64_t m = 0; m < M; ++m) best[m] = std::max(best[m], t.low[m]);
  std::vector<uint8_t> mark(N, 0);
  for (const Task& t : done)
    for (const Kept& k : t.kept)
      if (k.up >= best[k.m]) mark[k.n] = 1;
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) count += mark[n];
  if (count > limit) return {none, false};
  at::Tensor cands = at::empty({count}, at::kLong);
  int64_t* cpo = cands.data_ptr<int64_t>();
  for (int64_t n = 0, i = 0; n < N; ++n)
    if (mark[n]) cpo[i++] = n;
  return {cands, true};
#else
  (void)w2;
  (void)limit;
  return {none, false};
#endif
}

// GGUF Q8_0 weights as they are stored (quant/q80.py): per 32 values an f16 d and 32 int8 codes, weight = d * code
// (exact in float32: 11 + 8 significant bits).
//
// Layout: codes int8 [N, K], a row's codes in the file's order; d float16 [N, K / 32], the file's d of each block
// (the same 34 bytes a block as the file, split in two arrays so each group's 32 codes are one aligned-size load).
//
// The GEMV (decode rows, 1 to 64 of them: quant/q80.py GEMV_ROWS) needs AVX2 (and F16C) only and takes llama.cpp's
// arithmetic (ggml_vec_dot_q8_0_q8_0) with a float32 dx: x rounded to bf16, then int8 per group of 32 once a call
// (q8_groups.h quantize_groups, as iq4.cpp: dx = max|x| / 127, q = nearbyint(x / dx), |q| <= 127); per weight row
// and group the 32 codes times q through `maddubs(|code|, q with the code's sign)` as llama.cpp (|code| at most 128,
// |q| at most 127: a pair at most 2 * 128 * 127 = 32,512, never saturates; a code of -128 is taken right, which
// the other order, |q| times the code with q's sign, would not), `madd` with ones sums 4 products an int32 lane
// (lane l: values 4l..4l+3), then acc = fma(lane, d * dx, acc) one group at a time, the 8 lanes added pairwise at
// the end. One multiply per code, where the int8 path
// this replaces (Q8_0 re-quantized per channel) split x in two int8 parts: two, on a GEMV that is compute-bound here.
// Tiles of NW weight rows x R rows of x share each load: every (weight row, x row) pair runs the same operations in
// the same order in any tile, so a row of x gets the same bits whatever rows came with it. quant/q80.py q80_gemv is
// its twin, bit for bit. Prompts (more rows) take a float32 GEMM over blocks of decoded rows (q80_gemm; q80_matmul
// its twin).
#include "aten_ops.h"
#include "decoded_gemm.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "dynamic_for.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SUPERSLM_Q80_AVX2 1
#endif

#include "q8_groups.h"

// whether q80_gemv runs its SIMD kernel here (else it computes through q80_gemm: correct, not fast)
bool q80_available() {
#ifdef SUPERSLM_Q80_AVX2
  return true;
#else
  return false;
#endif
}

namespace {

void check_q80(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) % 32 == 0 && codes.dim() == 2 &&
                  codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) == x.size(1),
              name, ": rows of K (a multiple of 32) against codes int8 [N, K] on the CPU");
  TORCH_CHECK(d.dim() == 2 && d.device().is_cpu() && d.scalar_type() == at::kHalf && d.is_contiguous() &&
                  d.size(0) == codes.size(0) && d.size(1) == x.size(1) / 32,
              name, ": d float16 [N, K / 32]");
}

// rows [n0, n1) of the weight as float32 into w [n1 - n0, K]: d * code, one exact product each
void decode_rows(const int8_t* codes, const at::Half* d, int64_t K, int64_t n0, int64_t n1, float* w) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* c = codes + n * K + g * 32;
      const float s = static_cast<float>(d[n * G + g]);
      float* o = w + (n - n0) * K + g * 32;
#ifdef SUPERSLM_Q80_AVX2
      const __m256 sv = _mm256_set1_ps(s);
      for (int i = 0; i < 4; ++i) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i));
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
      }
#else
      for (int j = 0; j < 32; ++j) o[j] = s * static_cast<float>(c[j]);
#endif
    }
  }
}

#ifdef SUPERSLM_Q80_AVX2
// quantize_groups' pair layout ([g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31] per pair of groups) -> each group's
// 32 bytes in order, in place (once a call: K bytes)
void unpair(uint8_t* p, int64_t G) {
  for (int64_t g = 0; g + 1 < G; g += 2) {
    uint8_t t[16];
    std::memcpy(t, p + g * 32 + 16, 16);           // g+1 0..15
    std::memcpy(p + g * 32 + 16, p + g * 32 + 32, 16);  // g 16..31
    std::memcpy(p + g * 32 + 32, t, 16);
  }
  // an odd G's last group: [g 0..15 | zeros | g 16..31 | zeros] -> [g 0..15 | g 16..31]
  if (G % 2) std::memcpy(p + (G - 1) * 32 + 16, p + (G - 1) * 32 + 32, 16);
}

// NW weight rows (from w, row stride K) against R rows of x -> res[i * R + r] (float). sd [NW * R * G]: d * dx per
// (weight row i, x row r, group g), rounded once. A row's prefetch runs `ahead` bytes on (the next tile's codes).
template <int NW, int R>
inline void dot_tile(const int8_t* w, int64_t K, const float* sd, const int8_t* const* xq, int64_t ahead,
                     float* res) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NW * R];
#pragma GCC unroll 16
  for (int j = 0; j < NW * R; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // a line of each row every other group: in a model the weights stream from DRAM (iq4.cpp measured the
    // hardware prefetcher alone 20-35% slower there)
    if ((g & 1) == 0) {
#pragma GCC unroll 16
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + i * K + g * 32 + ahead), _MM_HINT_T0);
    }
    __m256i xs[R];
  #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + g * 32));
  #pragma GCC unroll 16
    for (int i = 0; i < NW; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * K + g * 32));
      const __m256i wa = _mm256_abs_epi8(wv);  // -128 -> 128 as maddubs' unsigned operand
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xs[r], wv)), ones);
        acc[i * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sd + (i * R + r) * G + g),
                                         acc[i * R + r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NW * R; ++j) {  // constant indices after unrolling: the accumulators stay in registers
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    res[j] = _mm_cvtss_f32(v);
  }
}

// d (f16) of a weight row times each x row's dx -> sd [R][G]: exact conversions, one rounded product each
void scale_rows(const at::Half* d, const float* const* dx, int R, int64_t G, float* sd) {
  float df[8];
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t c = std::min<int64_t>(8, G - g0);
    if (c == 8) {
      _mm256_storeu_ps(df, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g0))));
    } else {
      for (int64_t j = 0; j < c; ++j) df[j] = static_cast<float>(d[g0 + j]);
    }
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < c; ++j) sd[r * G + g0 + j] = df[j] * dx[r][g0 + j];
  }
}

// rows [n0, n1) of the output for the x rows `rows` (indices into xq / dx), in tiles of NW weight rows x R
template <int NW, int R>
void tile_rows(const int8_t* codes, const at::Half* d, int64_t K, int64_t N, int64_t n0, int64_t n1,
               const int64_t* rows, const std::vector<int8_t>& xq, const std::vector<float>& dx, float* sd,
               at::BFloat16* out) {
  const int64_t G = K / 32, Kp = (G + 1) / 2 * 64;
  const int8_t* xs[R];
  const float* dxs[R];
  for (int r = 0; r < R; ++r) {
    xs[r] = xq.data() + rows[r] * Kp;
    dxs[r] = dx.data() + rows[r] * G;
  }
  float res[NW * R];
  int64_t n = n0;
  for (; n + NW <= n1; n += NW) {
    for (int i = 0; i < NW; ++i) scale_rows(d + (n + i) * G, dxs, R, G, sd + i * R * G);
    dot_tile<NW, R>(codes + n * K, K, sd, xs, NW * K, res);
    for (int i = 0; i < NW; ++i)
      for (int r = 0; r < R; ++r) out[rows[r] * N + n + i] = static_cast<at::BFloat16>(res[i * R + r]);
  }
  for (; n < n1; ++n) {  // the chunk's last rows, one at a time (the same operations per pair)
    scale_rows(d + n * G, dxs, R, G, sd);
    dot_tile<1, R>(codes + n * K, K, sd, xs, K, res);
    for (int r = 0; r < R; ++r) out[rows[r] * N + n] = static_cast<at::BFloat16>(res[r]);
  }
}
#endif

}  // namespace

// the weight [N, K] as float32 (exactly the file's values)
at::Tensor q80_dequantize(const at::Tensor& codes, const at::Tensor& d) {
  const int64_t N = codes.size(0), K = codes.size(1);
  check_q80(at::empty({0, K}), codes, d, "q80_dequantize");
  at::Tensor w = at::empty({N, K}, d.options().dtype(at::kFloat));
  const int8_t* c = codes.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { decode_rows(c, dp, K, n0, n1, wp + n0 * K); });
  return w;
}

// x [M, K] -> [M, N] bf16: x rounded to bf16, times the exact weight in float32, blocks of rows of the weight
// decoded at a time (never the whole matrix). `rows16`: every product takes 16 rows of x (x padded with zero
// rows), so a row's bits do not depend on how many rows came with it (deterministic mode; kernels/row_blocks.py).
at::Tensor q80_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, bool rows16) {
  check_q80(x, codes, d, "q80_gemm");
  const int64_t K = x.size(1);
  const int8_t* c = codes.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  return superslm_decoded::decoded_gemm(x, codes.size(0), rows16,
                                        [&](int64_t n0, int64_t n1, float* w) { decode_rows(c, dp, K, n0, n1, w); });
}

// x [M, K] -> [M, N] bf16 through the integer kernel (see the top of the file), each row's bits those it gets
// alone; a row holding a NaN or an inf takes q80_gemm's float32 product, and so does every row where the SIMD
// kernel is not built
at::Tensor q80_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  check_q80(x, codes, d, "q80_gemv");
#ifdef SUPERSLM_Q80_AVX2
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / 32, Kp = (G + 1) / 2 * 64;
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  std::vector<int8_t> xq(M * Kp, 0);
  std::vector<uint8_t> aq(Kp);  // |q|, which this kernel does not read (its unsigned operand is the code's)
  std::vector<float> dx(M * G);
  std::vector<int64_t> good, bad;
  for (int64_t m = 0; m < M; ++m) {
    const bool ok = superslm_q8::quantize_groups(xb.data_ptr<at::BFloat16>() + m * K, K, xq.data() + m * Kp,
                                                 aq.data(), dx.data() + m * G);
    if (ok) unpair(reinterpret_cast<uint8_t*>(xq.data() + m * Kp), G);
    (ok ? good : bad).push_back(m);
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  const int8_t* c = codes.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t nr = static_cast<int64_t>(good.size());
  // chunks taken in turn (dynamic_for.h), whole tiles of 4: at least ~128 KiB of codes and ~1/16 of a thread's
  // share, at most half of it
  const int64_t chunk =
      superslm_dyn::shared_chunk(N, std::max((int64_t(1) << 17) / K, N / (16 * at::get_num_threads())), 4);
  if (nr > 0) {
    superslm_dyn::dynamic_for(N, chunk, [&](int64_t n0, int64_t n1) {
      std::vector<float> sd(4 * 4 * G);
      for (int64_t a = 0; a < nr; a += 4) {
        const int64_t* rows = good.data() + a;
        switch (std::min<int64_t>(4, nr - a)) {
          case 1: tile_rows<4, 1>(c, dp, K, N, n0, n1, rows, xq, dx, sd.data(), op); break;
          case 2: tile_rows<2, 2>(c, dp, K, N, n0, n1, rows, xq, dx, sd.data(), op); break;
          case 3: tile_rows<2, 3>(c, dp, K, N, n0, n1, rows, xq, dx, sd.data(), op); break;
          default: tile_rows<2, 4>(c, dp, K, N, n0, n1, rows, xq, dx, sd.data(), op); break;
        }
      }
    });
  }
  if (!bad.empty()) {
    const at::Tensor idx = at::tensor(bad, at::TensorOptions().dtype(at::kLong));
    out.index_copy_(0, idx, q80_gemm(x.index_select(0, idx), codes, d, false));
  }
  return out;
#else
  return q80_gemm(x, codes, d, false);
#endif
}

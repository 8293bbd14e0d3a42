// Weight-only int8 matmul for a few rows (decode), AVX-512 where the CPU has it.
//
// torch's `_weight_int8pack_mm` reads a large int8 head at ~11 GB/s on one core of this machine where
// a plain read reaches ~29 GB/s: its inner loop converts and multiplies one row at a time. Here each
// block of 16 weights is converted once and multiplied into every activation row (up to 16), and
// output channels are split across threads. Same math as torch: y = scale[n] * sum_k code[n, k] x[k]
// accumulated in float32 (only the order of the sum differs), rounded once to bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SUPERSLM_AVX512 1
#endif

namespace {

constexpr int64_t kMaxRows = 16;

#ifdef SUPERSLM_AVX512
// rows xs[B][K] float32 against codes[n0:n1] -> out[B][N] (bf16 after the scale)
template <int B>
void int8_rows(const float* x, const int8_t* codes, const at::BFloat16* scale, at::BFloat16* out, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* c = codes + n * K;
    __m512 acc[B];
    for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k))));
      for (int b = 0; b < B; ++b) acc[b] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + b * K + k), acc[b]);
    }
    const float s = static_cast<float>(scale[n]);
    for (int b = 0; b < B; ++b) {
      float total = _mm512_reduce_add_ps(acc[b]);
      for (int64_t j = k; j < K; ++j) total += static_cast<float>(c[j]) * x[b * K + j];
      out[b * N + n] = static_cast<at::BFloat16>(total * s);
    }
  }
}

// one activation row: four output channels at a time, so four independent FMA chains hide the latency
void int8_row(const float* x, const int8_t* codes, const at::BFloat16* scale, at::BFloat16* out, int64_t K,
              int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1 && K % 16 == 0; n += 4) {
    const int8_t* c = codes + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 xv = _mm512_loadu_ps(x + k);
      auto w = [&](int64_t r) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + r * K + k))));
      };
      a0 = _mm512_fmadd_ps(w(0), xv, a0);
      a1 = _mm512_fmadd_ps(w(1), xv, a1);
      a2 = _mm512_fmadd_ps(w(2), xv, a2);
      a3 = _mm512_fmadd_ps(w(3), xv, a3);
    }
    out[n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(a0) * static_cast<float>(scale[n]));
    out[n + 1] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(a1) * static_cast<float>(scale[n + 1]));
    out[n + 2] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(a2) * static_cast<float>(scale[n + 2]));
    out[n + 3] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(a3) * static_cast<float>(scale[n + 3]));
  }
  if (n < n1) int8_rows<1>(x, codes, scale, out, K, 0, n, n1);
}

template <int B>
void int8_dispatch(const float* x, const int8_t* codes, const at::BFloat16* scale, at::BFloat16* out, int64_t K,
                   int64_t N) {
  // ~64 KiB of weights per task: enough to amortize waking a thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (B == 1) {
      int8_row(x, codes, scale, out, K, n0, n1);
    } else {
      int8_rows<B>(x, codes, scale, out, K, N, n0, n1);
    }
  });
}
#endif

}  // namespace

bool fast_gemv_available() {
#ifdef SUPERSLM_AVX512
  return true;
#else
  return false;
#endif
}

// x [B, K] bf16 (B <= 16), codes int8 [N, K], scale bf16 [N] -> [B, N] bf16: x W^T with W = code * scale
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1), "int8_linear: shapes do not match");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scale.scalar_type() == at::kBFloat16 && codes.is_contiguous(),
              "int8_linear: codes int8 (contiguous), scale bf16");
  TORCH_CHECK(x.size(0) <= kMaxRows, "int8_linear: at most 16 rows");
  const int64_t B = x.size(0), K = x.size(1), N = codes.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, N}, x.options().dtype(at::kBFloat16));
  at::Tensor sc = scale.contiguous();
#ifdef SUPERSLM_AVX512
  const float* xp = xf.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  switch (B) {
#define SUPERSLM_CASE(n) \
  case n:                \
    int8_dispatch<n>(xp, cp, sp, op, K, N); \
    break;
    SUPERSLM_CASE(1) SUPERSLM_CASE(2) SUPERSLM_CASE(3) SUPERSLM_CASE(4) SUPERSLM_CASE(5) SUPERSLM_CASE(6)
    SUPERSLM_CASE(7) SUPERSLM_CASE(8) SUPERSLM_CASE(9) SUPERSLM_CASE(10) SUPERSLM_CASE(11) SUPERSLM_CASE(12)
    SUPERSLM_CASE(13) SUPERSLM_CASE(14) SUPERSLM_CASE(15) SUPERSLM_CASE(16)
#undef SUPERSLM_CASE
    default:
      break;
  }
  return out;
#else
  return at::_weight_int8pack_mm(x.to(at::kBFloat16), codes, sc);
#endif
}

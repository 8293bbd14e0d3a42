// Prompt rows of int4 linears on CPUs without VNNI: the weight decoded to float32, a block of rows at a time,
// for a float32 GEMM (BLAS). On an AVX2-only EPYC torch's int4 kernel ran ~81 GFLOP/s at every row count,
// MKL's sgemm ~160 at 512 rows (2 threads): a prompt chunk's linears in half the time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

int64_t torch_int4_block();

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Rows r0..r0 + B of torch's packed int4 CPU layout (per block of B rows and per k, B / 2 bytes whose byte j
// holds row j in its low nibble and row j + B / 2 in its high one) as s * (c - 8) + z, with (s, z) the row's
// bf16 pair of its group ([groups, N, 2]), written transposed: out[k * nt + r - n0], so a GEMM reads the
// weight as [K, nt]. (c - 8) * s is exact in float32, so the sum rounds once, fused or not.
void dequant_block(const uint8_t* p, const at::BFloat16* sz, int64_t N, int64_t K, int64_t group, int64_t B,
                   int64_t r0, float* out, int64_t n0, int64_t nt) {
  const int64_t half = B / 2;
#if defined(__AVX2__) && defined(__FMA__)
  if (half % 16 == 0) {
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m256i eight = _mm256_set1_epi32(8), hi16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t* g = reinterpret_cast<const uint32_t*>(sz + (k / group) * N * 2);  // (s | z << 16) per row
      const uint8_t* q = p + k * half;
      float* o = out + k * nt + (r0 - n0);
      for (int64_t j = 0; j < half; j += 16) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j));
        const __m128i parts[2] = {_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib)};
        for (int h = 0; h < 2; ++h) {
          const int64_t row = j + h * half;  // the low nibbles' rows, then the high ones'
          for (int e = 0; e < 2; ++e) {
            const __m128i bytes = e ? _mm_srli_si128(parts[h], 8) : parts[h];
            const __m256 c = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight));
            const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + r0 + row + 8 * e));
            const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(pairs, hi16));
            _mm256_storeu_ps(o + row + 8 * e, _mm256_fmadd_ps(s, c, z));
          }
        }
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < K; ++k) {
    const at::BFloat16* g = sz + (k / group) * N * 2;
    const uint8_t* q = p + k * half;
    float* o = out + k * nt + (r0 - n0);
    for (int64_t j = 0; j < half; ++j) {
      const int64_t lo = r0 + j, hi = lo + half;
      o[j] = static_cast<float>(g[2 * lo]) * static_cast<float>((q[j] & 15) - 8) + static_cast<float>(g[2 * lo + 1]);
      o[j + half] = static_cast<float>(g[2 * hi]) * static_cast<float>((q[j] >> 4) - 8) + static_cast<float>(g[2 * hi + 1]);
    }
  }
}

}  // namespace

// qweight uint8 [N, K / 2] in torch's packed CPU layout (blocks of torch_int4_block() rows), sz bf16
// [K / group, N, 2] -> rows n0..n1 (multiples of the block) of the weight, transposed: out's first
// (n1 - n0) * K floats as float32 [K, n1 - n0]. The torch twin: kernels/cpu_prompt.py int4_dequant_rows_reference.
void int4_dequant_rows(const at::Tensor& qweight, const at::Tensor& sz, int64_t group, int64_t n0, int64_t n1,
                       at::Tensor& out) {
  const int64_t B = torch_int4_block();
  TORCH_CHECK(B > 0, "int4_dequant_rows: torch's packed int4 layout is unknown on this CPU");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(0) % B == 0,
              "int4_dequant_rows: qweight uint8 [N, K / 2] in blocks of ", B, " rows");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(group > 0 && K % group == 0 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() &&
                  sz.dim() == 3 && sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
              "int4_dequant_rows: sz bf16 [K / group, N, 2]");
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N && n0 % B == 0 && n1 % B == 0,
              "int4_dequant_rows: rows n0..n1 on block boundaries");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= (n1 - n0) * K,
              "int4_dequant_rows: out float32, contiguous, (n1 - n0) * K floats at least");
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const at::BFloat16* szp = sz.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(n0 / B, n1 / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      dequant_block(wp + b * B * K / 2, szp, N, K, group, B, b * B, op, n0, n1 - n0);
  });
}

void register_prompt(pybind11::module& m) {
  m.def("int4_dequant_rows", &int4_dequant_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
}

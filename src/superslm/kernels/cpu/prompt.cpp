// Prompt rows of int4 linears on CPUs without VNNI: the weight decoded to float32, a block of rows at a time,
// for a float32 GEMM (BLAS). On an AVX2-only EPYC torch's int4 kernel ran ~81 GFLOP/s at every row count,
// MKL's sgemm ~160 at 512 rows (2 threads): a prompt chunk's linears in half the time.
#include "aten_ops.h"
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

// gemm.cpp: the fifth-bit masks' check
const uint64_t* int5_bits(const at::Tensor& bits, int64_t N, int64_t K);

namespace {

// lane_row's inverse for the 32 rows j of one half of a block of 64 (vnni.h lane_row; j + 32 has the same lane)
inline int lane_of(int j) { return (j & 3) + 8 * ((j >> 2) & 1) + 4 * (j >> 4); }

// Q5_0's rows b * 64 .. + 63 (quant/int5.py: nibbles in torch's packed layout, blocks of 64 rows; fifth bits as
// the VNNI lanes' masks, 4 per quad of k) as (c - 8) * s + z with (s, z) = (d, -8 d): (c - 16) d exactly,
// written transposed as dequant_block writes them.
void dequant_block5(const uint8_t* p, const uint64_t* masks, const at::BFloat16* sz, int64_t N, int64_t K, int64_t r0,
                    float* out, int64_t n0, int64_t nt) {
#if defined(__AVX2__) && defined(__FMA__)
  alignas(32) uint8_t shuf_b[32], sel_b[4][32];
  for (int j = 0; j < 32; ++j) {  // byte j: row j (low nibble), row j + 32 (high): mask (j / 8) % 2 (+ 2)
    shuf_b[j] = static_cast<uint8_t>(8 * ((j >> 3) & 1) + lane_of(j) / 2);
    for (int kk = 0; kk < 4; ++kk) sel_b[kk][j] = static_cast<uint8_t>(1 << (4 * (lane_of(j) & 1) + kk));
  }
  const __m256i shuf = _mm256_load_si256(reinterpret_cast<const __m256i*>(shuf_b));
  const __m256i nib = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(16);
  const __m256i eight = _mm256_set1_epi32(8), hi16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K; ++k) {
    const uint64_t* m = masks + (k / 4) * 4;
    const __m256i sel = _mm256_load_si256(reinterpret_cast<const __m256i*>(sel_b[k % 4]));
    const __m256i m01 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
    const __m256i m23 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 2)));
    auto fifth = [&](__m256i src) {
      return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(src, shuf), sel), sel), sixteen);
    };
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * 32));
    const __m256i codes[2] = {_mm256_or_si256(_mm256_and_si256(v, nib), fifth(m01)),
                              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), fifth(m23))};
    const uint32_t* g = reinterpret_cast<const uint32_t*>(sz + (k / 32) * N * 2);  // (s | z << 16) per row
    float* o = out + k * nt + (r0 - n0);
    for (int h = 0; h < 2; ++h) {
      alignas(32) uint8_t cb[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(cb), codes[h]);
      for (int e = 0; e < 4; ++e) {
        const int64_t row = 32 * h + 8 * e;
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 8 * e));
        const __m256 c = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight));
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + r0 + row));
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(pairs, hi16));
        _mm256_storeu_ps(o + row, _mm256_fmadd_ps(s, c, z));
      }
    }
  }
#else
  for (int64_t k = 0; k < K; ++k) {
    const uint64_t* m = masks + (k / 4) * 4;
    const at::BFloat16* g = sz + (k / 32) * N * 2;
    float* o = out + k * nt + (r0 - n0);
    for (int j = 0; j < 32; ++j) {
      const uint8_t byte = p[k * 32 + j];
      for (int h = 0; h < 2; ++h) {
        const int64_t row = r0 + j + 32 * h;
        const int bit = static_cast<int>((m[2 * h + ((j >> 3) & 1)] >> (4 * lane_of(j) + k % 4)) & 1);
        const int c = (h ? byte >> 4 : byte & 15) + 16 * bit;
        o[j + 32 * h] = static_cast<float>(g[2 * row]) * static_cast<float>(c - 8) + static_cast<float>(g[2 * row + 1]);
      }
    }
  }
#endif
}

}  // namespace

// Q5_0 weights (quant/int5.py: qweight uint8 [N, K / 2] in blocks of 64 rows, sz bf16 [K / 32, N, 2], bits int64
// [N / 64, K / 4, 4]) -> rows n0..n1 (multiples of 64) transposed, as int4_dequant_rows: out's first
// (n1 - n0) * K floats as float32 [K, n1 - n0]. The torch twin: quant/int5.py int5_dequant_rows_reference.
void int5_dequant_rows(const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits, int64_t n0, int64_t n1,
                       at::Tensor& out) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(0) % 64 == 0,
              "int5_dequant_rows: qweight uint8 [N, K / 2] in blocks of 64 rows");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == K / 32 && sz.size(1) == N && sz.size(2) == 2,
              "int5_dequant_rows: sz bf16 [K / 32, N, 2]");
  const uint64_t* bp = int5_bits(bits, N, K);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N && n0 % 64 == 0 && n1 % 64 == 0,
              "int5_dequant_rows: rows n0..n1 on block boundaries (64)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= (n1 - n0) * K,
              "int5_dequant_rows: out float32, contiguous, (n1 - n0) * K floats at least");
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const at::BFloat16* szp = sz.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(n0 / 64, n1 / 64, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) dequant_block5(wp + b * 32 * K, bp + b * K, szp, N, K, b * 64, op, n0, n1 - n0);
  });
}

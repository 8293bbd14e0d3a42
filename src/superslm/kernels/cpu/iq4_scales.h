// The group scales of IQ4 weights (quant/iq4.py), in either of the two layouts the format stores:
// - float32 [N, G] (G = K / 32): each group's scale (IQ4_NL's d; folders written before the packed layout);
// - IQ4_XS packed, uint8 [N, G / 2 + G] (G % 8 == 0): per row the G / 8 float32 d (one per 256 values, the file's
//   f16), then the G int8 sub-scales ls - 32; group g's scale is d[g / 8] * (ls[g] - 32), exact in float32
//   (11 + 6 significant bits), so the kernels' bits do not depend on the layout. 0.375 bits a weight, not 1.
#pragma once
#include "aten_ops.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace superslm_iq4 {

struct Scales {
  const float* f = nullptr;    // float32 [N, G], or
  const uint8_t* p = nullptr;  // packed [N, G / 2 + G]
  int64_t G = 0;

  // the layout of `s` for rows of K values, checked (TORCH_CHECK names `name`)
  static Scales of(const at::Tensor& s, int64_t N, int64_t K, const char* name) {
    const int64_t G = K / 32;
    TORCH_CHECK(s.dim() == 2 && s.size(0) == N && s.is_contiguous() && s.device().is_cpu() &&
                    ((s.scalar_type() == at::kFloat && s.size(1) == G) ||
                     (s.scalar_type() == at::kByte && G % 8 == 0 && s.size(1) == G / 2 + G)),
                name, ": scales float32 [N, K / 32] or IQ4_XS's packed uint8 [N, K / 64 + K / 32]");
    Scales out;
    out.G = G;
    if (s.scalar_type() == at::kFloat) out.f = s.data_ptr<float>();
    else out.p = s.data_ptr<uint8_t>();
    return out;
  }

  float at(int64_t n, int64_t g) const {
    if (f) return f[n * G + g];
    const uint8_t* r = p + n * (G / 2 + G);
    float d;
    std::memcpy(&d, r + (g / 8) * 4, 4);
    return d * static_cast<float>(static_cast<int8_t>(r[G / 2 + g]));
  }

  // row n's G scales: where they are stored as floats, or written into `buf` (G floats)
  const float* row(int64_t n, float* buf) const {
    if (f) return f + n * G;
    times(n, nullptr, buf);
    return buf;
  }

  // out[g] = scale(n, g) * dx[g] (dx null: 1) for g < G, each product rounded once as a float product: the
  // packed layout 8 groups at a time (a decode row's GEMV forms these for every output row)
  void times(int64_t n, const float* dx, float* out) const {
    if (f) {
      const float* r = f + n * G;
      for (int64_t g = 0; g < G; ++g) out[g] = dx ? r[g] * dx[g] : r[g];
      return;
    }
    const uint8_t* r = p + n * (G / 2 + G);
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t b = 0; b < G / 8; ++b) {
      float d;
      std::memcpy(&d, r + b * 4, 4);
      const __m128i ls8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + G / 2 + b * 8));
      __m256 v = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ls8)));  // exact
      if (dx) v = _mm256_mul_ps(v, _mm256_loadu_ps(dx + b * 8));
      _mm256_storeu_ps(out + b * 8, v);
    }
#else
    for (int64_t g = 0; g < G; ++g) out[g] = dx ? at(n, g) * dx[g] : at(n, g);
#endif
  }
};

// x [R, K] against IQ4 weights (codes, scales, table), checked for the kernel `name`; returns the scales' reader
inline Scales check_iq4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& table, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && qweight.dim() == 2 && qweight.device().is_cpu() &&
                  qweight.scalar_type() == at::kByte && qweight.is_contiguous() && qweight.size(1) * 2 == x.size(1) &&
                  x.size(1) > 0 && x.size(1) % 32 == 0,
              name, ": rows of K (a positive multiple of 32) against codes uint8 [N, K / 2] on the CPU");
  const Scales s = Scales::of(scales, qweight.size(0), x.size(1), name);
  TORCH_CHECK(table.scalar_type() == at::kChar && table.is_contiguous() && table.numel() == 16, name,
              ": a table of 16 int8 values");
  return s;
}

}  // namespace superslm_iq4

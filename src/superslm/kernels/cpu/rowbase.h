// The scalar rounding and load helpers shared by rowops.h and rowops_avx2.h.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace superslm_rows {

inline float bf16_round(float x) {
  // round-to-nearest-even to bf16 and back, as a bf16 tensor op rounds its float result
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf / nan
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

template <typename T>
inline float rnd(float x);
template <>
inline float rnd<float>(float x) { return x; }
template <>
inline float rnd<at::BFloat16>(float x) { return bf16_round(x); }

template <typename T>
inline float ld(const T* p) { return static_cast<float>(*p); }

// ---- KV rows (cache/kv.py): float rows of head_dim values, or int8 rows of head_dim codes and their float32 scale

template <typename C>
inline constexpr bool is_q8 = std::is_same_v<C, int8_t>;

// elements of C one (slot, kv head) row takes
template <typename C>
inline int64_t kv_width(int64_t head_dim) { return is_q8<C> ? head_dim + 4 : head_dim; }

// the scale an int8 row's codes are multiplied by (1 for float rows)
template <typename C>
inline float kv_scale(const C* row, int64_t head_dim) {
  if constexpr (is_q8<C>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(float));
    return s;
  } else {
    return 1.f;
  }
}

// one key or value x [D] -> D codes round(x / s) in -127..127 and s = max |x| / 127 after them: cache/kv.py
// quantize_rows, the same bits (a NaN makes the scale NaN and the codes 0, as torch's amax and where do)
template <typename T>
inline void quantize_row(const T* x, int64_t D, int8_t* out) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(ld(x + d));
    if (std::isnan(a) || a > amax) amax = a;
  }
  // a NaN scale as the one quiet NaN (0x7fc00000): its payload would otherwise follow the input's
  const float s = std::isnan(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    float q = s > 0.f ? std::nearbyint(ld(x + d) / s) : 0.f;
    if (std::isnan(q)) q = 0.f;
    out[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(out + D, &s, sizeof(float));
}

// a key or value row into its cache row: the values as they are, or quantized
template <typename T, typename C>
inline void store_row(const T* x, int64_t D, C* out) {
  if constexpr (is_q8<C>)
    quantize_row<T>(x, D, out);
  else
    std::memcpy(out, x, D * sizeof(T));
}

}  // namespace superslm_rows

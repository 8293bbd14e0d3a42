// The scalar rounding and load helpers shared by rowops.h and rowops_avx2.h.
#pragma once

#include "aten_ops.h"

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

// ---- KV rows (cache/kv.py): float rows of head_dim values; int8 rows of head_dim codes and their float32 scale;
// 4-bit rows (uint8) of head_dim / 2 bytes (element 2i in byte i's low nibble, code + 8) and their float32 scale,
// the head Hadamard-rotated before it was quantized

template <typename C>
inline constexpr bool is_q8 = std::is_same_v<C, int8_t>;
template <typename C>
inline constexpr bool is_q4 = std::is_same_v<C, uint8_t>;
// rows whose elements are codes times the row's scale
template <typename C>
inline constexpr bool is_quant = is_q8<C> || is_q4<C>;

// elements of C one (slot, kv head) row takes
template <typename C>
inline int64_t kv_width(int64_t head_dim) {
  return is_q8<C> ? head_dim + 4 : is_q4<C> ? head_dim / 2 + 4 : head_dim;
}

// elements of C before element `d` of a row (d even for 4-bit rows)
template <typename C>
inline int64_t kv_offset(int64_t d) { return is_q4<C> ? d / 2 : d; }

// the scale a quantized row's codes are multiplied by (1 for float rows)
template <typename C>
inline float kv_scale(const C* row, int64_t head_dim) {
  if constexpr (is_quant<C>) {
    float s;
    std::memcpy(&s, row + kv_offset<C>(head_dim), sizeof(float));
    return s;
  } else {
    return 1.f;
  }
}

// element d of a row before its scale: the value, the int8 code, or the 4-bit code - 8
template <typename C>
inline float kv_elem(const C* row, int64_t d) {
  if constexpr (is_q4<C>)
    return static_cast<float>(static_cast<int>((row[d >> 1] >> ((d & 1) * 4)) & 15) - 8);
  else
    return ld(row + d);
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

// ---- the rotation of 4-bit rows (cache/kv.py rotate / unrotate: R x = H (signs * x), H the orthonormal
// Walsh-Hadamard transform of each run of `block` values)

// what the plan was given once (cache/kv.py rotation_signs and rotation_block of the head_dim)
struct KVRotation {
  const float* signs = nullptr;  // [head_dim], +-1
  int64_t block = 0;
  float norm = 1.f;  // 1 / sqrt(block) rounded once to float, as torch multiplies by the Python float
};

// the unnormalized butterflies of kv.py _fwht in its order (Sylvester), each run of `block` of x [D] in place
inline void fwht_runs(float* x, int64_t D, int64_t block) {
  for (int64_t b0 = 0; b0 < D; b0 += block)
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t i = b0; i < b0 + block; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], c = x[j + h];
          x[j] = a + c;
          x[j + h] = a - c;
        }
}

// The attention kernels read a 4-bit row's W bytes (2W elements) as two vectors of W lanes: the low nibbles
// (elements 2i) then the high ones (2i + 1). A query rotated for them is laid out that way (`lanes` = W; 0: in
// order), and so are their value sums, so no row is ever shuffled.
inline int64_t lane_index(int64_t d, int64_t lanes) {
  if (lanes == 0) return d;
  const int64_t c = d / (2 * lanes), e = d % (2 * lanes);
  return c * 2 * lanes + (e & 1) * lanes + e / 2;
}

// out = R x for one head x [D] (float), in the kernels' lane order; buf: D floats
inline void rotate_head(const float* x, const KVRotation& rot, int64_t D, int64_t lanes, float* buf, float* out) {
  for (int64_t d = 0; d < D; ++d) buf[d] = x[d] * rot.signs[d];
  fwht_runs(buf, D, rot.block);
  for (int64_t d = 0; d < D; ++d) out[lane_index(d, lanes)] = buf[d] * rot.norm;
}

// out = R^T y for one head's value sum y [D] in the kernels' lane order, rounded once to T; buf: D floats
template <typename T>
inline void unrotate_head(const float* y, const KVRotation& rot, int64_t D, int64_t lanes, float* buf, T* out) {
  for (int64_t d = 0; d < D; ++d) buf[d] = y[lane_index(d, lanes)];
  fwht_runs(buf, D, rot.block);
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(buf[d] * rot.norm * rot.signs[d]);
}

// one key or value x [D] -> a 4-bit row: r = R x in float, D / 2 bytes of codes round(r / s) + 8 (1..15; 8 where
// s is 0 or NaN) and s = max |r| / 7 after them: cache/kv.py quantize_rows4(rotate(x)), the same bits. buf: D floats
template <typename T>
inline void quantize_row4(const T* x, int64_t D, const KVRotation& rot, float* buf, uint8_t* out) {
  for (int64_t d = 0; d < D; ++d) buf[d] = ld(x + d) * rot.signs[d];
  fwht_runs(buf, D, rot.block);
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    buf[d] *= rot.norm;
    const float a = std::fabs(buf[d]);
    if (std::isnan(a) || a > amax) amax = a;
  }
  const float s = std::isnan(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 7.f;
  for (int64_t d = 0; d < D; d += 2) {
    uint8_t code[2];
    for (int k = 0; k < 2; ++k) {
      float q = s > 0.f ? std::nearbyint(buf[d + k] / s) : 0.f;
      if (std::isnan(q)) q = 0.f;
      code[k] = static_cast<uint8_t>(static_cast<int>(std::min(7.f, std::max(-7.f, q))) + 8);
    }
    out[d / 2] = static_cast<uint8_t>(code[0] | (code[1] << 4));
  }
  std::memcpy(out + D / 2, &s, sizeof(float));
}

// a key or value row into its cache row: the values as they are, or quantized (4-bit rows rotated first)
template <typename T, typename C>
inline void store_row(const T* x, int64_t D, C* out, const KVRotation& rot, float* buf) {
  if constexpr (is_q8<C>)
    quantize_row<T>(x, D, out);
  else if constexpr (is_q4<C>)
    quantize_row4<T>(x, D, rot, buf, out);
  else
    std::memcpy(out, x, D * sizeof(T));
}

}  // namespace superslm_rows

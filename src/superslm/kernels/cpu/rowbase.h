// The scalar rounding and load helpers shared by rowops.h and rowops_avx2.h.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

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

}  // namespace superslm_rows

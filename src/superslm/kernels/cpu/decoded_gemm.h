// The float32 product over blocks of decoded weight rows that the stored-block formats (q6k.cpp, iq4.cpp, q80.cpp)
// take for prompt chunks and deterministic steps: ~2 MiB of rows decoded to float32 at a time (the threads share
// the decoding), then BLAS; with rows16 every 16-row block of x multiplied on its own (one shape for every call, so
// a row's bits do not depend on its batch).
#pragma once
#include "aten_ops.h"

#include <algorithm>
#include <cstdint>

namespace superslm_decoded {

// weight rows decoded per block: ~2 MiB of float32, a multiple of 16, at most N
inline int64_t chunk_rows(int64_t K, int64_t N) {
  const int64_t rows = std::max<int64_t>(16, ((int64_t(1) << 21) / (4 * K)) & ~int64_t(15));
  return std::min(rows, N);
}

// x [M, K] (rounded to bf16) times the weight [N, K] that decode(n0, n1, w) writes as float32 rows n0..n1 into w
// -> [M, N] bf16
template <class Decode>
at::Tensor decoded_gemm(const at::Tensor& x, int64_t N, bool rows16, const Decode& decode) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xf = x.to(at::kBFloat16).to(at::kFloat).contiguous();
  if (rows16 && M % 16) xf = at::constant_pad_nd(xf, {0, 0, 0, 16 - M % 16});
  at::Tensor out = at::empty({xf.size(0), N}, x.options().dtype(at::kFloat));
  const int64_t C = chunk_rows(K, N);
  at::Tensor w = at::empty({C, K}, xf.options());
  for (int64_t n0 = 0; n0 < N; n0 += C) {
    const int64_t c = std::min(C, N - n0);
    float* wp = w.data_ptr<float>();
    at::parallel_for(0, c, 16, [&](int64_t a, int64_t b) { decode(n0 + a, n0 + b, wp + a * K); });
    const at::Tensor wc = w.narrow(0, 0, c);
    if (rows16) {
      for (int64_t r = 0; r < xf.size(0); r += 16)
        out.narrow(0, r, 16).narrow(1, n0, c).copy_(at::mm(xf.narrow(0, r, 16), wc.t()));
    } else {
      out.narrow(1, n0, c).copy_(at::mm(xf, wc.t()));
    }
  }
  if (out.size(0) != M) out = out.narrow(0, 0, M);
  return out.to(at::kBFloat16);
}

}  // namespace superslm_decoded

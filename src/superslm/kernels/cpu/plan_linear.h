// One linear of the decode plan (decode_layers.cpp), as quant/base.py LinearFormat.forward and
// transformer.DenseLinear compute it, and the LoRA delta after it; the weight kernels it calls.
#pragma once
#include "aten_ops.h"

#include <optional>
#include <vector>

#include "rowops.h"

// gemv.cpp
bool vnni_available();
void set_vnni(bool on);
int64_t gemm_rows(bool int8);
at::Tensor int8_rowsum(const at::Tensor& codes);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& rowsum);
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group);
at::Tensor int5_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);
at::Tensor int5_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros,
                     const at::Tensor& bits);
at::Tensor int5_reference(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& rowsum);
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros, int64_t group);
at::Tensor int8_rownorm(const at::Tensor& codes, const at::Tensor& scale);
// avx2.cpp
bool avx2_available();
void set_avx2(bool on);
int64_t torch_int4_block();
at::Tensor int4_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                          int64_t block);
at::Tensor int8_gemv_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale);
at::Tensor int5_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);
// avx2_rows.cpp
int64_t avx2_gemm_rows();
at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group,
                          int64_t block);
at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale);
at::Tensor int5_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits);
at::Tensor int4_prompt_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz, int64_t group);
std::tuple<at::Tensor, bool> int8_greedy_candidates(const at::Tensor& x, const at::Tensor& codes,
                                                    const at::Tensor& scale, const at::Tensor& rowsum,
                                                    const at::Tensor& w2, int64_t limit);
// prompt.cpp
// iq4.cpp
bool iq4_available();
at::Tensor iq4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table);
at::Tensor iq4_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table,
                    bool rows16);
at::Tensor iq4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table);
int64_t iq4_gemv_rows(int64_t K, int64_t N);
at::Tensor iq4_gemm_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& table);
at::Tensor int8_prompt_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale);
at::Tensor iq4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& table,
                      bool deterministic);
// q6k.cpp
bool q6k_available();
at::Tensor q6k_gemv(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor q6k_gemm(const at::Tensor& x, const at::Tensor& blocks, bool rows16);
at::Tensor q6k_dequantize(const at::Tensor& blocks);
// q80.cpp
bool q80_available();
at::Tensor q80_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);
at::Tensor q80_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, bool rows16);
at::Tensor q80_dequantize(const at::Tensor& codes, const at::Tensor& d);

namespace superslm_plan {

using namespace superslm_rows;

// x [rows, in] -> [rows, kpad] of type ht (bf16 or float), zero-padded and rotated in one pass
// (rowops.h rotate_rows; signs_f float [kpad])
inline at::Tensor rotate_input(const at::Tensor& x, const at::Tensor& signs_f, int64_t block, int64_t kpad,
                        at::ScalarType ht) {
  TORCH_CHECK(x.device().is_cpu() && signs_f.device().is_cpu(), "hadamard_rows: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= kpad && signs_f.scalar_type() == at::kFloat && signs_f.numel() == kpad &&
                  block > 0 && (block & (block - 1)) == 0 && kpad % block == 0,
              "hadamard_rows: x [rows, in <= kpad], float signs [kpad], a power-of-two block dividing kpad");
  TORCH_CHECK(ht == at::kBFloat16 || ht == at::kFloat, "hadamard_rows: the result is bf16 or float");
  at::Tensor xc = x.contiguous(), sg = signs_f.contiguous();
  at::Tensor h = at::empty({xc.size(0), kpad}, xc.options().dtype(ht));
  const int64_t n = xc.size(0), in = xc.size(1);
  const float* sp = sg.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "rotate_rows", [&] {
    if (ht == at::kBFloat16)
      rotate_rows(xc.data_ptr<scalar_t>(), n, in, sp, block, kpad, h.data_ptr<at::BFloat16>());
    else
      rotate_rows(xc.data_ptr<scalar_t>(), n, in, sp, block, kpad, h.data_ptr<float>());
  });
  return h;
}

// ---- one linear, as quant/base.py LinearFormat.forward and transformer.DenseLinear compute it ----

// CONCAT: parts of different formats (quant/gguf_map.py ConcatLinear, e.g. Q4_K q, k with a Q6_K v)
// INT5: GGUF Q5_0 as it is (quant/int5.py): int4 nibbles, `extra` their fifth bits
// IQ4: GGUF IQ4_NL / IQ4_XS as they are (quant/iq4.py): codes, float scales, `extra` the 16-value table
// Q6K: GGUF Q6_K as it is (quant/q6k.py): `a` the file's blocks
// Q80: GGUF Q8_0 as it is (quant/q80.py): `a` the codes, `b` their f16 d per 32
enum LinKind : int64_t { DENSE_MODULE = 0, INT4 = 1, INT8 = 2, DENSE_FORMAT = 3, CONCAT = 4, INT5 = 5, IQ4 = 6, Q6K = 7, Q80 = 8 };

// rows of x up to which a Q6K linear takes its integer GEMV (quant/q6k.py GEMV_ROWS), the float32 GEMM past them
constexpr int64_t Q6K_GEMV_ROWS = 64;
// likewise for a Q80 linear (quant/q80.py GEMV_ROWS)
constexpr int64_t Q80_GEMV_ROWS = 64;

// MKL picks its kernel, and a dot product's term order, by the matrix shape: on an Intel Xeon a row of a
// 64-row GEMM got other bits than in a 16-row one. One shape for every call: 16 rows (x has a multiple).
// fp32: one batched call of 16-row matrices (twice as fast as a loop there); bf16: a loop (bmm is slow).
static at::Tensor blocks16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const int64_t n = x.size(0), k = x.size(1), o = w.size(0);
  TORCH_CHECK(n % 16 == 0, "DecodePlan: a deterministic dense linear needs a multiple of 16 rows, got ", n);
  at::Tensor y;
  if (x.scalar_type() == at::kFloat) {
    y = at::bmm(x.reshape({n / 16, 16, k}), w.t().unsqueeze(0).expand({n / 16, k, o})).view({n, o});
  } else {
    y = at::empty({n, o}, x.options());
    for (int64_t r = 0; r < n; r += 16) y.narrow(0, r, 16).copy_(at::linear(x.narrow(0, r, 16), w));
  }
  return bias.defined() ? y.add_(bias) : y;
}

struct Lin {
  int64_t kind = 0, group = 0, out = 0, in = 0, kpad = 0;
  at::Tensor a, b, bias;
  // block Hadamard rotation of the input (kernels/hadamard.py Rotation): signs [kpad], H [block, block]
  at::Tensor signs, hadamard, signs_f;  // signs_f: the signs as float, for rotate_rows
  // INT5: the fifth-bit masks (int64 [N / 64, K / 4, 4]); IQ4: the table (int8 [16])
  at::Tensor extra;
  // int8: sum of each output row's codes, for the VNNI GEMV's offset correction
  at::Tensor rowsum;
  // int4: the C++ kernels take its shape (groups a multiple of 4, N of 64, contiguous scales), and the
  // VNNI ones run here (AVX-512 VNNI); otherwise the AVX2 GEMV where it can
  bool fits4 = false, vnni4 = false;
  // CONCAT: its parts, each run on the same input, outputs side by side
  std::vector<Lin> parts;

  // (a, b, bias, signs, hadamard, extra) at t[off..off+6), (kind, group, out, in, kpad) at ints[ioff..ioff+5)
  static Lin make(const std::vector<std::optional<at::Tensor>>& t, size_t off, const std::vector<int64_t>& ints,
                  size_t ioff) {
    auto get = [&](size_t i) { return t[off + i].has_value() ? *t[off + i] : at::Tensor(); };
    Lin l;
    l.a = get(0);
    l.b = get(1);
    l.bias = get(2);
    l.signs = get(3);
    l.hadamard = get(4);
    l.extra = get(5);
    l.kind = ints[ioff];
    l.group = ints[ioff + 1];
    l.out = ints[ioff + 2];
    l.in = ints[ioff + 3];
    l.kpad = ints[ioff + 4];
    if (l.signs.defined()) {
      TORCH_CHECK(l.hadamard.defined() && l.signs.numel() == l.kpad && l.kpad % l.hadamard.size(0) == 0,
                  "DecodePlan: a rotation that does not fit the linear's input");
      l.signs_f = l.signs.to(at::kFloat).contiguous();
    }
    TORCH_CHECK(l.kind >= DENSE_MODULE && l.kind <= Q80, "DecodePlan: unknown linear kind ", l.kind);
    TORCH_CHECK(l.kind != Q80 || l.b.defined(), "DecodePlan: a q80 linear without its d");
    TORCH_CHECK(l.kind != INT5 || (l.extra.defined() && l.b.defined()), "DecodePlan: an int5 linear without its bits");
    TORCH_CHECK(l.kind != IQ4 || (l.extra.defined() && l.b.defined()), "DecodePlan: an iq4 linear without its table");
    TORCH_CHECK(l.kind == CONCAT || l.a.defined(), "DecodePlan: a linear without its weight");
    if (l.kind == INT8) l.rowsum = int8_rowsum(l.a);
    l.fits4 = l.kind == INT4 && l.group % 4 == 0 && l.a.size(0) % 64 == 0 && l.b.is_contiguous();
    l.vnni4 = l.fits4 && vnni_available();
    return l;
  }

  at::Tensor rotated(const at::Tensor& x, at::ScalarType ht) const {
    TORCH_CHECK(x.size(1) == in, "DecodePlan: a linear's input has ", x.size(1), " features, not ", in);
    return rotate_input(x, signs_f, hadamard.size(0), kpad, ht);
  }

  // deterministic: every row gets the same bits whatever the other rows (dense GEMMs take 16 rows at a
  // time, `blocks16`; the rotation and the VNNI kernels work row by row)
  at::Tensor operator()(const at::Tensor& x, bool deterministic) const {
    if (kind == CONCAT) {
      TORCH_CHECK(!parts.empty(), "DecodePlan: a concatenated linear without parts");
      std::vector<at::Tensor> ys;
      for (const Lin& part : parts) ys.push_back(part(x, deterministic));
      at::Tensor y = at::cat(ys, 1);
      TORCH_CHECK(y.size(1) == out, "DecodePlan: a concatenated linear's parts give ", y.size(1), " outputs, not ", out);
      return y;
    }
    const int64_t rows = x.size(0);
    const bool pad = deterministic && rows % 16 && (kind == DENSE_MODULE || kind == DENSE_FORMAT);
    at::Tensor xin = pad ? at::constant_pad_nd(x, {0, 0, 0, 16 - rows % 16}) : x;
    if (kind == DENSE_MODULE) {
      const at::Tensor xa = xin.to(a.scalar_type());
      at::Tensor y = (deterministic ? blocks16(xa, a, bias) : at::linear(xa, a, bias)).to(x.scalar_type());
      return pad ? y.narrow(0, 0, rows).contiguous() : y;
    }
    const at::ScalarType ht = kind == DENSE_FORMAT ? a.scalar_type() : at::kBFloat16;
    at::Tensor h;
    if (signs.defined()) {
      h = rotated(xin, ht);
    } else {
      h = xin.to(ht);
      if (kpad != in) h = at::constant_pad_nd(h, {0, kpad - in});
    }
    at::Tensor y;
    if (kind == INT4) {
      // the VNNI kernels give a row the same bits alone or in a batch (gemm.cpp), so deterministic steps
      // use them at every row count; otherwise from gemm_rows (gemv.cpp: torch's kernel below, where faster)
      const int64_t rows_h = h.size(0);
      if (vnni4 && rows_h == 1) y = int4_gemv(h, a, b, group);
      else if (vnni4 && (deterministic || rows_h >= gemm_rows(false))) y = int4_gemm(h, a, b, group);
      // AVX2: the GEMV for one row, the tiled row kernel (each row the GEMV's bits) for more, prompt chunks too
      // (2.2-2.6x torch's kernel at 512 rows; the rows it declines through torch's, in one call); deterministic
      // steps keep torch's kernel at every row count
      else if (fits4 && !vnni4 && !deterministic && rows_h == 1) y = int4_gemv_avx2(h, a, b, group, 0);
      else if (fits4 && !vnni4 && !deterministic && rows_h <= avx2_gemm_rows()) y = int4_gemm_avx2(h, a, b, group, 0);
      else if (fits4 && !vnni4 && !deterministic) y = int4_prompt_avx2(h, a, b, group);
      if (!y.defined()) y = at::_weight_int4pack_mm_for_cpu(h, a, group, b);
      if (y.size(1) != out) y = y.narrow(1, 0, out);
    } else if (kind == INT5) {
      // no torch kernel for 5-bit codes: the VNNI kernels at every row count, without VNNI the AVX2 ones (the same
      // bits; their rows batch-invariant too), prompt chunks included: the tiled row kernel ran 1.26-1.33x the
      // decoded blocks + sgemm at 512 rows of Gemma-3's shapes
      y = h.size(0) == 1 ? int5_gemv(h, a, b, extra) : int5_gemm(h, a, b, extra);
      if (y.size(1) != out) y = y.narrow(1, 0, out);
    } else if (kind == IQ4) {
      y = iq4_linear(h, a, b, extra, deterministic);  // the module's choice of kernel for these rows
      if (y.size(1) != out) y = y.narrow(1, 0, out);
    } else if (kind == Q6K) {
      // the integer GEMV for decode rows of the default mode (each row's bits those it gets alone); deterministic
      // steps take the 16-row float32 GEMM at every row count, as the module's forward_row_blocks does
      y = h.size(0) <= Q6K_GEMV_ROWS && !deterministic ? q6k_gemv(h, a) : q6k_gemm(h, a, deterministic);
      if (y.size(1) != out) y = y.narrow(1, 0, out);
    } else if (kind == Q80) {
      // as Q6K: the integer GEMV for default-mode decode rows, the 16-row float32 GEMM in deterministic steps
      y = h.size(0) <= Q80_GEMV_ROWS && !deterministic ? q80_gemv(h, a, b) : q80_gemm(h, a, b, deterministic);
      if (y.size(1) != out) y = y.narrow(1, 0, out);
    } else if (kind == INT8) {
      // as int4: the VNNI kernels for one row, for every row count in deterministic steps, else from gemm_rows
      const bool vnni = kpad % 64 == 0 && rowsum.defined() && vnni_available();
      if (vnni && h.size(0) == 1) y = int8_gemv(h, a, b, rowsum);
      else if (vnni && (deterministic || h.size(0) >= gemm_rows(true))) y = int8_gemm(h, a, b, rowsum);
      else if (!vnni && !deterministic && h.size(0) == 1 && kpad % 64 == 0) y = int8_gemv_avx2(h, a, b);
      else if (!vnni && !deterministic && h.size(0) <= avx2_gemm_rows() && kpad % 64 == 0) y = int8_gemm_avx2(h, a, b);
      // prompt rows of the default mode: the two-part integer kernel (faster than torch's and decoded blocks)
      else if (!vnni_available() && !deterministic && h.size(0) > avx2_gemm_rows()) y = int8_prompt_avx2(h, a, b);
      if (!y.defined()) y = at::_weight_int8pack_mm(h, a, b);
    } else {
      y = deterministic ? blocks16(h, a, at::Tensor()) : at::linear(h, a);
      if (pad) y = y.narrow(0, 0, rows);
    }
    if (bias.defined()) y = y.to(at::kFloat) + bias;
    return y.to(x.scalar_type()).contiguous();
  }
};

// a LoRA delta (x A^T) B^T as adapters/lora.py _LowRank computes it; deterministic: 16 rows at a time, the last
// block zero-padded (kernels/row_blocks.py by_row_blocks), so a row's bits do not depend on its group's size
static at::Tensor low_rank(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, bool det) {
  if (!det) return at::matmul(at::matmul(x, a.t()), b.t());
  const int64_t n = x.size(0);
  at::Tensor xp = n % 16 ? at::constant_pad_nd(x, {0, 0, 0, 16 - n % 16}) : x;
  std::vector<at::Tensor> out;
  for (int64_t r = 0; r < xp.size(0); r += 16) out.push_back(at::matmul(at::matmul(xp.narrow(0, r, 16), a.t()), b.t()));
  return (out.size() == 1 ? out[0] : at::cat(out)).narrow(0, 0, n);
}

}  // namespace superslm_plan

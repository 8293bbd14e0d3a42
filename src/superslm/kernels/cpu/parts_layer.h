// The pieces of a parts layer (models/layers.py PartsLayer: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE) that the
// decode plan (decode_layers.cpp) runs between its linears: norms whose weights are float32 (the x * (1 + w) norms
// of Recipe.float32), the gated attention's query / gate split and its sigmoid gate, and a gated delta-rule
// layer's glue around delta_step.cpp's decode step (beta, the log decay g, fresh rows zeroed). Each rounds where
// the layer's torch forward rounds; the plan's torch twin is kernels/cpu_hybrid.py `parts_layer_reference`.
#pragma once
#include "aten_ops.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "rowops.h"

// delta_step.cpp: a gated delta-rule layer's decode glue (conv, q/k norms, the delta rule, the gated norm)
at::Tensor delta_decode_step(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& g,
                             const at::Tensor& beta, const at::Tensor& conv_weight, at::Tensor conv_state,
                             at::Tensor ssm_state, const at::Tensor& slots, const at::Tensor& norm_weight,
                             double eps, int64_t k_heads, int64_t k_dim, int64_t v_heads, int64_t v_dim);
// moe_step.cpp: a MoEStep object (Python) as a call x [n, dim], counts [experts] -> [n, dim]; the caller keeps the
// object alive
std::function<at::Tensor(const at::Tensor&, at::Tensor)> moe_step_runner(const pybind11::object& step);

namespace superslm_parts {

using namespace superslm_rows;

// the layer kinds of the plan: a plain attention layer (transformer.Layer), a parts layer's attention
// (GatedAttention; its gate where the Arch has one), a parts layer's delta rule (DeltaRule)
enum LayerKind : int64_t { PLAIN = 0, ATTENTION = 1, DELTA = 2 };

// a delta-rule layer's own tensors, float32 where the forward computes in float32
struct DeltaP {
  at::Tensor conv, norm;        // [C, K] and [Dv], as the layer holds them (delta_decode_step takes either dtype)
  at::Tensor a_log, dt_bias;    // [Hv] float32
  int64_t k_heads = 0, k_dim = 0, v_heads = 0, v_dim = 0;

  // tensors: conv [C, K], norm [Dv], a_log [Hv], dt_bias [Hv]; ints: (its state layer), k_heads, k_dim, v_heads, v_dim
  static DeltaP make(const std::vector<at::Tensor>& t, const std::vector<int64_t>& ints) {
    TORCH_CHECK(t.size() == 4 && ints.size() == 5, "DecodePlan.set_kind: a delta rule takes 4 tensors and 5 ints");
    DeltaP d;
    d.k_heads = ints[1], d.k_dim = ints[2], d.v_heads = ints[3], d.v_dim = ints[4];
    TORCH_CHECK(d.k_heads > 0 && d.k_dim > 0 && d.v_heads > 0 && d.v_dim > 0 && t[2].numel() == d.v_heads &&
                    t[3].numel() == d.v_heads && t[1].numel() == d.v_dim && t[0].dim() == 2,
                "DecodePlan.set_kind: a delta rule's tensors do not fit its heads");
    d.conv = t[0].contiguous();
    d.norm = t[1].contiguous();
    d.a_log = t[2].to(at::kFloat).contiguous();
    d.dt_bias = t[3].to(at::kFloat).contiguous();
    return d;
  }
};

// the recurrent states a run's delta-rule layers read: conv [layers, rows, C, K - 1] and float32 ssm [layers, rows,
// Hv, Dk, Dv] with at least `layers` layers (0: none read, nothing checked), one distinct int64 row per decode row
inline void check_states(int64_t layers, int64_t B, const at::Tensor& conv, const at::Tensor& ssm,
                         const at::Tensor& slots) {
  if (layers == 0) return;
  TORCH_CHECK(conv.dim() == 4 && ssm.dim() == 5 && conv.size(0) >= layers && ssm.size(0) >= layers &&
                  conv.size(1) == ssm.size(1) && conv.is_contiguous() && ssm.is_contiguous() &&
                  ssm.scalar_type() == at::kFloat,
              "DecodePlan: delta-rule layers need contiguous conv [layers, rows, C, K - 1] and float32 ssm "
              "[layers, rows, Hv, Dk, Dv] states");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
              "DecodePlan: one int64 state slot per row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < conv.size(1), "DecodePlan: state slot ", sp[b], " out of range");
    for (int64_t c = 0; c < b; ++c) TORCH_CHECK(sp[c] != sp[b], "DecodePlan: state slot ", sp[b], " given twice");
  }
}

// rms_norm_rows with the weight in its own dtype: the model dtype (rowops.h), or float32 (kernels/norm.py
// rms_norm with weight_in_float: y * w in float32, rounded once to T)
template <typename T>
void norm_rows(const T* x, const at::Tensor& w, T* out, int64_t rows, int64_t n, int64_t stride_in, int64_t stride_out,
               double eps, bool w_float) {
  if (w.scalar_type() == c10::CppTypeToScalarType<T>::value) {
    rms_norm_rows<T>(x, w.data_ptr<T>(), out, rows, n, stride_in, stride_out, eps, w_float);
    return;
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat && w_float, "DecodePlan: a float32 norm weight multiplies in float32");
  const float* wp = w.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride_in;
    T* orow = out + r * stride_out;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const float v = ld(xr + i);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) orow[i] = static_cast<T>(ld(xr + i) * inv * wp[i]);
  }
}

// a gated query's linear output [B, 2 qs + 2 ks] (each head's query, then its gate; then k, v) -> the plain
// layout [B, qs + 2 ks] and the gates [B, qs]
template <typename T>
void split_gate(const at::Tensor& out, int64_t heads, int64_t D, at::Tensor& qkv, at::Tensor& gate) {
  const int64_t B = out.size(0), row = out.size(1), qs = heads * D, kv = row - 2 * qs;
  qkv = at::empty({B, qs + kv}, out.options());
  gate = at::empty({B, qs}, out.options());
  const T* src = out.data_ptr<T>();
  T* q = qkv.data_ptr<T>();
  T* g = gate.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) {
    const T* s = src + b * row;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(q + b * (qs + kv) + h * D, s + 2 * h * D, D * sizeof(T));
      std::memcpy(g + b * qs + h * D, s + 2 * h * D + D, D * sizeof(T));
    }
    std::memcpy(q + b * (qs + kv) + qs, s + 2 * qs, kv * sizeof(T));
  }
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// attn *= sigmoid(gate) elementwise: torch's sigmoid on a T tensor (rounded to T), then the product in T
template <typename T>
void apply_gate(T* attn, const T* gate, int64_t n) {
  for (int64_t i = 0; i < n; ++i) attn[i] = static_cast<T>(ld(attn + i) * rnd<T>(sigmoid(ld(gate + i))));
}

// a delta-rule layer's mixer for B decode rows from its input projection proj [B, C + V + 2 Hv] (mixed, z, b, a):
// beta = sigmoid(b) in T, g = -exp(a_log) * softplus(a + dt_bias) in float32 (DeltaRule.forward); a row whose
// sequence starts here (lens 1) gets its state rows zeroed first; then delta_step.cpp's step on the state rows
// `slots` -> the gated norm's output [B, V]
template <typename T>
at::Tensor delta_mixer(const DeltaP& d, const at::Tensor& proj, at::Tensor conv_state, at::Tensor ssm_state,
                       const at::Tensor& slots, const int64_t* lens, double eps) {
  const int64_t B = proj.size(0), Hv = d.v_heads;
  const int64_t C = 2 * d.k_heads * d.k_dim + Hv * d.v_dim, V = Hv * d.v_dim, row = proj.size(1);
  TORCH_CHECK(row == C + V + 2 * Hv, "DecodePlan: a delta-rule projection gives ", row, " values, not ", C + V + 2 * Hv);
  at::Tensor beta = at::empty({B, Hv}, proj.options());
  at::Tensor g = at::empty({B, Hv}, proj.options().dtype(at::kFloat));
  const T* p = proj.data_ptr<T>();
  T* bp = beta.data_ptr<T>();
  float* gp = g.data_ptr<float>();
  const float* al = d.a_log.data_ptr<float>();
  const float* dt = d.dt_bias.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hv; ++h) {
      bp[b * Hv + h] = static_cast<T>(sigmoid(ld(p + b * row + C + V + h)));
      const float x = ld(p + b * row + C + V + Hv + h) + dt[h];
      const float softplus = x > 20.f ? x : std::log1p(std::exp(x));  // torch's threshold 20
      gp[b * Hv + h] = -std::exp(al[h]) * softplus;
    }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    if (lens[b] == 1) {
      conv_state[sp[b]].zero_();
      ssm_state[sp[b]].zero_();
    }
  return delta_decode_step(proj.narrow(1, 0, C), proj.narrow(1, C, V), g, beta, d.conv, conv_state, ssm_state, slots,
                           d.norm, eps, d.k_heads, d.k_dim, Hv, d.v_dim);
}

}  // namespace superslm_parts

// The decode step of a gated delta-rule layer (Qwen3.5, Qwen3-Next) in one call: the glue between its two
// linears, which eager torch ran as ~40 small ops (~0.9 ms a layer on 2 cores).
//
// For each of B sequences (one new row each): the depthwise causal convolution over the conv state and the
// row, then SiLU; q and k L2-normalized per head (q also scaled by Dk^-0.5); the gated delta rule on the
// float32 state [Hv, Dk, Dv], updated in place; the output's gated RMS norm. Values are rounded to the model
// dtype (and the conv's and norm weight's dtypes) where the torch reference rounds them, so results agree
// with it to within float32 rounding, or a bf16 rounding where a product lands next to a rounding boundary.
// Every sequence and head is computed alone in a fixed order: a row's bits never depend on the rows beside it.
// Each multiply-add is an explicit std::fma: with -ffp-contract=fast GCC fuses a*b+c in a loop's vector body
// but not always in its scalar peel or tail, so a value's rounding would move with trip counts and alignment.
// The torch reference with the same arguments is kernels/delta_rule.py `decode_step_reference`.
#include "aten_ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dynamic_for.h"
#include "rowops.h"

namespace {

using namespace superslm_rows;

// a float32 or bfloat16 element as float: the small tensors (weights, conv state) come in either dtype
inline float load_any(const void* p, int64_t i, bool bf16) {
  return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

struct Dims {
  int64_t B, C, K, Hk, Dk, Hv, Dv;
};

// channels of one conv task: a fixed grid, so no value's arithmetic depends on how the work was split
constexpr int64_t kConvBlock = 512;

// silu in place over n floats, each rounded to W (the conv's dtype) before and after, as torch's F.silu on a
// tensor of W; 16 lanes at a time (masked at the end) where the CPU has AVX-512, so every value takes one path
template <typename W>
void silu_block(float* p, int64_t n) {
#if defined(SUPERSLM_AVX512)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = rnd16<W>(_mm512_maskz_loadu_ps(mk, p + i));
    _mm512_mask_storeu_ps(p + i, mk, rnd16<W>(act16(0, v)));
  }
#else
  for (int64_t i = 0; i < n; ++i) p[i] = rnd<W>(silu(rnd<W>(p[i])));
#endif
}

// conv_block's channels for any number of taps K
template <typename T, typename W, typename SC>
void conv_block_any(const T* x, const W* w, SC* st, int64_t c0, int64_t c1, int64_t K, float* y) {
  for (int64_t c = c0; c < c1; ++c) {
    SC* sc = st + c * (K - 1);
    const W* wc = w + c * K;
    float acc = 0.f;
    for (int64_t j = 0; j < K; ++j) {
      const float v = j < K - 1 ? rnd<T>(ld(sc + j)) : ld(x + c);  // state.to(x.dtype), then x
      if constexpr (std::is_same_v<W, float>)
        acc = std::fma(v, ld(wc + j), acc);
      else
        acc += bf16_round(bf16_round(v) * ld(wc + j));
    }
    y[c] = acc;
    for (int64_t j = 0; j + 1 < K - 1; ++j) sc[j] = static_cast<SC>(rnd<T>(ld(sc + j + 1)));  // kept in T
    sc[K - 2] = static_cast<SC>(ld(x + c));
  }
}

// channels [c0, c1) of one row x: the depthwise conv over the slot's last K - 1 inputs and x (the reference
// casts both to the weight's dtype W: each product rounds to W, the sum accumulates in float and rounds to W),
// SiLU, rounded to T -> y[c]; the conv state shifted by one, x appended, in place
template <typename T, typename W, typename SC>
void conv_block(const T* x, const at::Tensor& weight, at::Tensor& state, int64_t slot, int64_t c0, int64_t c1,
                int64_t K, float* y) {
  const W* w = weight.data_ptr<W>();
  SC* st = state.data_ptr<SC>() + slot * state.size(1) * (K - 1);
  if (K == 4) {  // the checkpoints' taps: unrolled, so the loop vectorizes across channels
    for (int64_t c = c0; c < c1; ++c) {
      SC* sc = st + c * 3;
      const W* wc = w + c * 4;
      const float v0 = rnd<T>(ld(sc)), v1 = rnd<T>(ld(sc + 1)), v2 = rnd<T>(ld(sc + 2)), v3 = ld(x + c);
      if constexpr (std::is_same_v<W, float>) {
        y[c] = std::fma(v3, wc[3], std::fma(v2, wc[2], std::fma(v1, wc[1], v0 * wc[0])));
      } else {
        const float p0 = bf16_round(bf16_round(v0) * ld(wc)), p1 = bf16_round(bf16_round(v1) * ld(wc + 1));
        const float p2 = bf16_round(bf16_round(v2) * ld(wc + 2)), p3 = bf16_round(bf16_round(v3) * ld(wc + 3));
        y[c] = ((p0 + p1) + p2) + p3;
      }
      sc[0] = static_cast<SC>(v1);
      sc[1] = static_cast<SC>(v2);
      sc[2] = static_cast<SC>(v3);
    }
  } else {
    conv_block_any<T, W, SC>(x, w, st, c0, c1, K, y);
  }
  silu_block<W>(y + c0, c1 - c0);
  if constexpr (std::is_same_v<T, at::BFloat16>)
    for (int64_t c = c0; c < c1; ++c) y[c] = bf16_round(y[c]);
}

template <typename T>
void run_step(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& g, const at::Tensor& beta,
              const at::Tensor& conv_weight, at::Tensor& conv_state, at::Tensor& ssm_state, const int64_t* slots,
              const at::Tensor& norm_weight, float eps, const Dims& d, at::Tensor& out) {
  const int64_t B = d.B, C = d.C, K = d.K, Hk = d.Hk, Dk = d.Dk, Hv = d.Hv, Dv = d.Dv;
  const int64_t key_width = Hk * Dk, rep = Hv / Hk;
  const bool w_bf16 = conv_weight.scalar_type() == at::kBFloat16;
  const bool cs_bf16 = conv_state.scalar_type() == at::kBFloat16;

  // the convolution, SiLU and the new conv state in blocks of a row's channels: y [B, C] float, each value
  // rounded to T; blocks start at fixed channels, so a value's arithmetic never depends on B or the threads
  std::vector<float> y(B * C);
  const int64_t blocks = (C + kConvBlock - 1) / kConvBlock;
  at::parallel_for(0, B * blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / blocks, c0 = (t % blocks) * kConvBlock, c1 = std::min(C, c0 + kConvBlock);
      const T* x = mixed.data_ptr<T>() + b * mixed.stride(0);
      float* yr = y.data() + b * C;
      const int64_t slot = slots[b];
      if (w_bf16 && cs_bf16)
        conv_block<T, at::BFloat16, at::BFloat16>(x, conv_weight, conv_state, slot, c0, c1, K, yr);
      else if (w_bf16)
        conv_block<T, at::BFloat16, float>(x, conv_weight, conv_state, slot, c0, c1, K, yr);
      else if (cs_bf16)
        conv_block<T, float, at::BFloat16>(x, conv_weight, conv_state, slot, c0, c1, K, yr);
      else
        conv_block<T, float, float>(x, conv_weight, conv_state, slot, c0, c1, K, yr);
    }
  });

  const float* gp = g.data_ptr<float>();
  const T* bp = beta.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  const int64_t g_stride = g.stride(0), b_stride = beta.stride(0), z_stride = z.stride(0);
  const bool nw_bf16 = norm_weight.scalar_type() == at::kBFloat16;
  // weight * y rounds to bf16 when both are bf16 (torch's type promotion), else stays float
  const bool prod_bf16 = nw_bf16 && std::is_same_v<T, at::BFloat16>;
  const void* nwp = norm_weight.data_ptr();
  float* state = ssm_state.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const float q_scale = static_cast<float>(std::pow(static_cast<double>(Dk), -0.5));

  // the delta rule and the gated norm per (sequence, value head): its state [Dk, Dv] read twice; heads taken in
  // turn (dynamic_for.h), a few at a time
  superslm_dyn::dynamic_for(B * Hv, std::max<int64_t>(1, B * Hv / (8 * at::get_num_threads())),
                            [&](int64_t begin, int64_t end) {
    std::vector<float> q(Dk), k(Dk), pred(Dv), delta(Dv), o(Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hv, h = bh % Hv, kh = h / rep;
      const float* yr = y.data() + b * C;
      const float* qin = yr + kh * Dk;
      const float* kin = yr + key_width + kh * Dk;
      const float* vin = yr + 2 * key_width + h * Dv;
      float qq = 0.f, kk = 0.f;
      for (int64_t i = 0; i < Dk; ++i) {
        qq = std::fma(qin[i], qin[i], qq);
        kk = std::fma(kin[i], kin[i], kk);
      }
      const float rq = 1.f / std::sqrt(qq + 1e-6f), rk = 1.f / std::sqrt(kk + 1e-6f);
      for (int64_t i = 0; i < Dk; ++i) {
        q[i] = (qin[i] * rq) * q_scale;
        k[i] = kin[i] * rk;
      }
      float* S = state + (slots[b] * Hv + h) * Dk * Dv;
      const float decay = std::exp(gp[b * g_stride + h]);
      const float bt = ld(bp + b * b_stride + h);
      // S *= exp(g), pred = k^T S
      for (int64_t j = 0; j < Dv; ++j) pred[j] = 0.f;
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = S + i * Dv;
        const float ki = k[i];
        for (int64_t j = 0; j < Dv; ++j) {
          const float s = row[j] * decay;
          row[j] = s;
          pred[j] = std::fma(ki, s, pred[j]);
        }
      }
      for (int64_t j = 0; j < Dv; ++j) {
        delta[j] = (vin[j] - pred[j]) * bt;
        o[j] = 0.f;
      }
      // S += k delta^T, o = q^T S
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = S + i * Dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < Dv; ++j) {
          const float s = std::fma(ki, delta[j], row[j]);
          row[j] = s;
          o[j] = std::fma(qi, s, o[j]);
        }
      }
      // the gated RMS norm of the head's output, rounded to T first as the reference's core.to(dtype)
      float ss = 0.f;
      for (int64_t j = 0; j < Dv; ++j) {
        o[j] = rnd<T>(o[j]);
        ss = std::fma(o[j], o[j], ss);
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(Dv) + eps);
      const T* zr = zp + b * z_stride + h * Dv;
      T* outr = op + b * Hv * Dv + h * Dv;
      for (int64_t j = 0; j < Dv; ++j) {
        float t = load_any(nwp, j, nw_bf16) * rnd<T>(o[j] * r);
        if (prod_bf16) t = bf16_round(t);
        outr[j] = static_cast<T>(t * silu(ld(zr + j)));
      }
    }
  });
}

}  // namespace

// mixed [B, C] and z [B, Hv * Dv] (model dtype, rows may be strided), g [B, Hv] float32, beta [B, Hv] (model
// dtype), conv_weight [C, K], conv_state [S, C, K - 1] and ssm_state [S, Hv, Dk, Dv] float32 (updated in place
// at rows `slots` [B] int64, distinct), norm_weight [Dv] -> the normed output rows [B, Hv * Dv] (model dtype)
at::Tensor delta_decode_step(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& g,
                             const at::Tensor& beta, const at::Tensor& conv_weight, at::Tensor conv_state,
                             at::Tensor ssm_state, const at::Tensor& slots, const at::Tensor& norm_weight,
                             double eps, int64_t k_heads, int64_t k_dim, int64_t v_heads, int64_t v_dim) {
  const at::Tensor* all[] = {&mixed, &z, &g, &beta, &conv_weight, &conv_state, &ssm_state, &slots, &norm_weight};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->device().is_cpu(), "delta_decode_step: CPU tensors only");
  TORCH_CHECK(k_heads > 0 && k_dim > 0 && v_heads > 0 && v_dim > 0 && v_heads % k_heads == 0,
              "delta_decode_step: positive head counts and dims, v_heads a multiple of k_heads");
  const auto dt = mixed.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "delta_decode_step: mixed must be float32 or bfloat16");
  TORCH_CHECK(mixed.dim() == 2 && mixed.stride(1) == 1, "delta_decode_step: mixed must be [B, C] with unit column stride");
  const int64_t B = mixed.size(0), C = mixed.size(1);
  TORCH_CHECK(C == 2 * k_heads * k_dim + v_heads * v_dim, "delta_decode_step: mixed has ", C,
              " columns, expected 2 * k_heads * k_dim + v_heads * v_dim = ", 2 * k_heads * k_dim + v_heads * v_dim);
  TORCH_CHECK(z.scalar_type() == dt && z.dim() == 2 && z.size(0) == B && z.size(1) == v_heads * v_dim &&
                  z.stride(1) == 1,
              "delta_decode_step: z must be [B, v_heads * v_dim] in mixed's dtype with unit column stride");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 2 && g.size(0) == B && g.size(1) == v_heads &&
                  g.stride(1) == 1,
              "delta_decode_step: g must be float32 [B, v_heads] with unit column stride");
  TORCH_CHECK(beta.scalar_type() == dt && beta.dim() == 2 && beta.size(0) == B && beta.size(1) == v_heads &&
                  beta.stride(1) == 1,
              "delta_decode_step: beta must be [B, v_heads] in mixed's dtype with unit column stride");
  TORCH_CHECK(float_or_bf16(conv_weight) && conv_weight.dim() == 2 && conv_weight.size(0) == C &&
                  conv_weight.size(1) >= 2 && conv_weight.is_contiguous(),
              "delta_decode_step: conv_weight must be a contiguous float32 or bfloat16 [C, K], K >= 2");
  const int64_t K = conv_weight.size(1);
  TORCH_CHECK(float_or_bf16(conv_state) && conv_state.dim() == 3 && conv_state.size(1) == C &&
                  conv_state.size(2) == K - 1 && conv_state.is_contiguous(),
              "delta_decode_step: conv_state must be a contiguous float32 or bfloat16 [S, C, K - 1]");
  const int64_t S = conv_state.size(0);
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat && ssm_state.dim() == 4 && ssm_state.size(0) == S &&
                  ssm_state.size(1) == v_heads && ssm_state.size(2) == k_dim && ssm_state.size(3) == v_dim &&
                  ssm_state.is_contiguous(),
              "delta_decode_step: ssm_state must be a contiguous float32 [S, v_heads, k_dim, v_dim] with "
              "conv_state's S");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == B && slots.is_contiguous(),
              "delta_decode_step: slots must be a contiguous int64 [B]");
  TORCH_CHECK(float_or_bf16(norm_weight) && norm_weight.dim() == 1 && norm_weight.size(0) == v_dim &&
                  norm_weight.is_contiguous(),
              "delta_decode_step: norm_weight must be a contiguous float32 or bfloat16 [v_dim]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "delta_decode_step: slot ", sp[b], " out of range [0, ", S, ")");
    for (int64_t c = 0; c < b; ++c)
      TORCH_CHECK(sp[c] != sp[b], "delta_decode_step: slot ", sp[b], " given twice");
  }
  at::Tensor out = at::empty({B, v_heads * v_dim}, mixed.options());
  if (B == 0) return out;
  const Dims d{B, C, K, k_heads, k_dim, v_heads, v_dim};
  const float e = static_cast<float>(eps);
  if (dt == at::kFloat)
    run_step<float>(mixed, z, g, beta, conv_weight, conv_state, ssm_state, sp, norm_weight, e, d, out);
  else
    run_step<at::BFloat16>(mixed, z, g, beta, conv_weight, conv_state, ssm_state, sp, norm_weight, e, d, out);
  return out;
}

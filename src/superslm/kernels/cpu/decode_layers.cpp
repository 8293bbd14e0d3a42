// Decode layers on the CPU in one call: the glue between the weight kernels without Python.
//
// Eager torch spent ~8 ms of a SmolLM2 decode step on ~1,000 small calls (norms, rope, paged attention,
// casts) around ~3.4 ms of weight kernels. This file runs the arithmetic of models/transformer.py
// Layer.forward for a step's rows (decode rows, and prompt chunks where models/transformer.py sends
// them): the linears through the VNNI kernels (gemv.cpp, gemm.cpp), the AVX2 kernels (avx2.cpp: one row,
// avx2_rows.cpp: a few; default mode, CPUs without VNNI) or torch's, everything between them in per-row loops (rowops.h).
// Rounding to the model dtype happens where the torch reference rounds, so bf16 results stay within a
// rounding of it.
// The torch reference with the same signature is kernels/cpu_decode.py `decode_layers_reference`.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#include "rowops.h"

#include "plan_linear.h"

#include "parts_layer.h"

// moe_step.cpp: a mixture-of-experts block's decode rows (its class MoEStep, registered into this module)
void register_moe_step(pybind11::module& m);
// prompt.cpp: int4 / int5 prompt rows decoded to float32 for a BLAS GEMM
void int4_dequant_rows(const at::Tensor& qweight, const at::Tensor& sz, int64_t group, int64_t n0, int64_t n1,
                       at::Tensor& w);
void int5_dequant_rows(const at::Tensor& qweight, const at::Tensor& sz, const at::Tensor& bits, int64_t n0, int64_t n1,
                       at::Tensor& w);

namespace {

using namespace superslm_rows;
using namespace superslm_plan;
using namespace superslm_parts;

struct LayerP {
  // a parts layer: qkv and o are its mixer's two linears (a delta rule's in_proj and out); gate_up and down its
  // dense MLP's, absent where `moe` runs its mixture of experts
  Lin qkv, o, gate_up, down;
  at::Tensor attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffn_norm;
  int64_t window = -1, rope_kind = 0;
  int64_t kind = PLAIN;  // LayerKind
  int64_t cache = -1;    // its KV pages' layer (attention) or its recurrent states' (delta); -1: the layer's own index
  bool gated = false;    // ATTENTION: q's linear gives each head its query, then its gate
  DeltaP delta;
  std::function<at::Tensor(const at::Tensor&, at::Tensor)> moe;
  at::Tensor moe_counts;  // MoE.tokens_per_expert, added to in place
};

// f(b0, b1) over a step's rows [0, B), split across the threads once the rows hold `per_row` values each and
// ~8K values in all (a norm or an activation over 16 rows: ~5% of a step left to one thread); each row's
// values never depend on the split
template <typename F>
void for_rows(int64_t B, int64_t per_row, const F& f) {
  at::parallel_for(0, B, std::max<int64_t>(1, 8192 / std::max<int64_t>(per_row, 1)), f);
}

}  // namespace

// ---- the plan: a model's decode layers, registered once, run per step ---------------------------------

class DecodePlan {
 public:
  DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, double eps, bool norm_float,
             int64_t act, double attn_scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), rot_(rotary_dim), eps_(eps),
        norm_float_(norm_float), act_(act), scale_(attn_scale) {}

  // tensors: 4 linears x (a, b, bias, signs, hadamard, extra) then 6 norms (None = absent);
  // ints: 4 linears x (kind, group, out, in, kpad; kind -1: absent, a MoE layer's MLP) then window, rope_kind
  void add_layer(const std::vector<std::optional<at::Tensor>>& t, const std::vector<int64_t>& ints) {
    TORCH_CHECK(t.size() == 30 && ints.size() == 22, "DecodePlan.add_layer: 30 tensors and 22 ints");
    auto get = [&](size_t i) { return t[i].has_value() ? *t[i] : at::Tensor(); };
    LayerP p;
    Lin* lins[4] = {&p.qkv, &p.o, &p.gate_up, &p.down};
    for (int i = 0; i < 4; ++i)
      if (ints[5 * i] >= 0 || i < 2) *lins[i] = Lin::make(t, 6 * i, ints, 5 * i);
    p.attn_norm = get(24);
    p.ffn_norm = get(25);
    p.q_norm = get(26);
    p.k_norm = get(27);
    p.post_attn_norm = get(28);
    p.post_ffn_norm = get(29);
    p.window = ints[20];
    p.rope_kind = ints[21];
    layers_.push_back(std::move(p));
  }

  // one part of linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`, added as CONCAT
  void add_part(int64_t layer, int64_t which, const std::vector<std::optional<at::Tensor>>& t,
                const std::vector<int64_t>& ints) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && which >= 0 && which < 4 && t.size() == 6 && ints.size() == 5,
                "DecodePlan.add_part: a layer, a linear 0..3, 6 tensors and 5 ints");
    LayerP& p = layers_[layer];
    Lin* lins[4] = {&p.qkv, &p.o, &p.gate_up, &p.down};
    TORCH_CHECK(lins[which]->kind == CONCAT && ints[0] != CONCAT, "DecodePlan.add_part: parts go into a CONCAT linear");
    lins[which]->parts.push_back(Lin::make(t, 0, ints, 0));
  }

  // layer `layer` as a parts layer (parts_layer.h LayerKind): ATTENTION (ints: KV layer, gated) or DELTA
  // (tensors: conv [C, K], norm [Dv], a_log [Hv], dt_bias [Hv]; ints: state layer, k_heads, k_dim, v_heads, v_dim)
  void set_kind(int64_t layer, int64_t kind, const std::vector<at::Tensor>& t, const std::vector<int64_t>& ints) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "DecodePlan.set_kind: no layer ", layer);
    LayerP& p = layers_[layer];
    if (kind == ATTENTION) {
      TORCH_CHECK(ints.size() == 2 && ints[0] >= 0 && t.empty(), "DecodePlan.set_kind: attention takes 2 ints");
      p.cache = ints[0];
      p.gated = ints[1] != 0;
    } else {
      TORCH_CHECK(kind == DELTA && ints.size() == 5 && ints[0] >= 0, "DecodePlan.set_kind: a kind 1 or 2");
      p.delta = DeltaP::make(t, ints);
      p.cache = ints[0];
    }
    p.kind = kind;
  }

  // layer `layer`'s MLP as a mixture of experts: `step` a MoEStep (moe_step.cpp), `counts` its MoE's
  // tokens_per_expert (int64 [experts], added to in place)
  void set_moe(int64_t layer, const pybind11::object& step, const at::Tensor& counts) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && layers_[layer].kind != PLAIN, "DecodePlan.set_moe: a parts layer");
    TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.dim() == 1,
                "DecodePlan.set_moe: counts int64 [experts]");
    layers_[layer].moe = moe_step_runner(step);
    layers_[layer].moe_counts = counts;
    keep_.push_back(step);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // the rotation 4-bit KV rows were written in (cache/kv.py rotation_signs and rotation_block of head_dim):
  // given once, so the attention rotates each query head into the keys' basis and each output head back
  void set_kv_rotation(const at::Tensor& signs, int64_t block) {
    TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.dim() == 1 && signs.numel() == head_dim_ && block > 0 &&
                    (block & (block - 1)) == 0 && head_dim_ % block == 0,
                "set_kv_rotation: float signs [head_dim] and a power-of-two block dividing head_dim");
    const at::Tensor sg = signs.contiguous();
    kv_signs_.assign(sg.data_ptr<float>(), sg.data_ptr<float>() + head_dim_);
    for (float x : kv_signs_) TORCH_CHECK(x == 1.f || x == -1.f, "set_kv_rotation: signs are +-1");
    kv_block_ = block;
  }

  // h [B, dim]; slot_mapping [B]; key_slots [S, L] (each sequence's key slots in position order) and
  // row_seq [B] (the sequence of each row); seq_lens [B] (keys visible to each row: its position + 1);
  // cos/sin per rope kind [B, rot]; k_cache/v_cache [layers, slots, kv_heads, width] in a page format of
  // cache/kv.py: both float rows of h's dtype [.., D], or each int8 rows [.., D + 4] or 4-bit rows (uint8, rotated
  // by set_kv_rotation's rotation) [.., D / 2 + 4]. Runs layers start..end-1.
  // lora_rows [B] int64: each row's adapter group, -1 for none (empty: no adapters); lora: per group, layer and
  // linear (A, B) as adapters/lora.py Adapter.weights holds them, at ((g * layers + layer) * 4 + linear) * 2
  // (None where the adapter leaves that linear alone).
  // Delta-rule layers (set_kind DELTA): conv_state [state layers, rows, C, K - 1] and ssm_state [state layers, rows,
  // Hv, Dk, Dv] float32 (cache/state.py RecurrentStates), updated in place at rows state_slots [B] int64 (distinct:
  // one decode row of each sequence); empty tensors where no layer run is one
  at::Tensor run(at::Tensor h, const at::Tensor& slot_mapping, const at::Tensor& key_slots, const at::Tensor& row_seq,
                 const at::Tensor& seq_lens, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start, int64_t end, bool det,
                 const at::Tensor& lora_rows, const std::vector<std::optional<at::Tensor>>& lora,
                 const at::Tensor& conv_state, const at::Tensor& ssm_state, const at::Tensor& state_slots) {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) > 0, "h must be a contiguous [B, dim] tensor");
    const int64_t B = h.size(0);
    // float rows of h's dtype [.., D] (keys and values), else each of them int8 rows of D codes and a float32
    // scale [.., D + 4] or 4-bit rows of D / 2 bytes of codes and a float32 scale [.., D / 2 + 4] (cache/kv.py)
    const auto kt = k_cache.scalar_type(), vt = v_cache.scalar_type();
    const bool floats = kt == h.scalar_type() && vt == kt;
    auto quant = [](at::ScalarType t) { return t == at::kChar || t == at::kByte; };
    TORCH_CHECK(floats || (quant(kt) && quant(vt)),
                "the KV caches must both be float rows of h's dtype, or int8 / 4-bit (uint8) rows each");
    auto width = [&](at::ScalarType t) {
      return t == at::kChar ? head_dim_ + 4 : t == at::kByte ? head_dim_ / 2 + 4 : head_dim_;
    };
    for (const at::Tensor* c : {&k_cache, &v_cache})
      TORCH_CHECK(c->is_contiguous() && c->dim() == 4 && c->size(0) >= kv_layers() && c->size(1) == k_cache.size(1) &&
                      c->size(2) == kv_heads_ && c->size(3) == width(c->scalar_type()),
                  "the KV caches must be contiguous [layers, slots, kv, width]: D for float rows, D + 4 for int8 "
                  "rows, D / 2 + 4 for 4-bit rows");
    if (kt == at::kByte || vt == at::kByte)
      TORCH_CHECK(kv_block_ > 0 && head_dim_ % 32 == 0,
                  "4-bit KV rows need the plan's rotation (set_kv_rotation) and a head_dim that is a multiple of 32");
    for (const at::Tensor* t : {&key_slots, &row_seq, &seq_lens, &slot_mapping})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "slots, rows and lengths must be int64");
    TORCH_CHECK(key_slots.dim() == 2 && row_seq.numel() == B && seq_lens.numel() == B && slot_mapping.numel() == B,
                "one slot, sequence and length per row");
    TORCH_CHECK(cos.size() == sin.size() && !cos.empty(), "cos and sin per rope kind");
    for (size_t i = 0; i < cos.size(); ++i)
      TORCH_CHECK(cos[i].scalar_type() == h.scalar_type() && cos[i].is_contiguous() && sin[i].is_contiguous() &&
                      cos[i].dim() == 2 && cos[i].size(0) == B && cos[i].size(1) == rot_ && sin[i].sizes() == cos[i].sizes(),
                  "cos/sin must be [B, rotary_dim] of h's dtype");
    for (const LayerP& p : layers_) TORCH_CHECK(p.rope_kind < static_cast<int64_t>(cos.size()), "a rope kind is missing");
    TORCH_CHECK(start >= 0 && end <= num_layers() && start <= end, "layer range out of bounds");
    if (B > 0) {
      // every index the loops follow stays inside its buffer
      const int64_t slots = k_cache.size(1), L = key_slots.size(1);
      TORCH_CHECK(slot_mapping.min().item<int64_t>() >= 0 && slot_mapping.max().item<int64_t>() < slots,
                  "slot_mapping outside the cache");
      // the rows store their keys and values on several threads (for_rows): one slot a row
      std::vector<int64_t> sorted(slot_mapping.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>() + B);
      std::sort(sorted.begin(), sorted.end());
      TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "slot_mapping names a slot twice");
      TORCH_CHECK(row_seq.min().item<int64_t>() >= 0 && row_seq.max().item<int64_t>() < key_slots.size(0),
                  "row_seq outside key_slots");
      TORCH_CHECK(seq_lens.min().item<int64_t>() >= 1 && seq_lens.max().item<int64_t>() <= L,
                  "seq_lens must be in 1..key_slots.size(1)");
      TORCH_CHECK(key_slots.numel() == 0 || (key_slots.min().item<int64_t>() >= 0 && key_slots.max().item<int64_t>() < slots),
                  "key_slots outside the cache");
    }
    std::vector<at::Tensor> group_rows;
    if (lora_rows.numel() > 0) {
      TORCH_CHECK(lora_rows.scalar_type() == at::kLong && lora_rows.numel() == B, "lora_rows: int64, one per row");
      const int64_t groups = lora_rows.max().item<int64_t>() + 1;
      TORCH_CHECK(lora_rows.min().item<int64_t>() >= -1 &&
                      static_cast<int64_t>(lora.size()) == groups * num_layers() * 8,
                  "lora: (A, B) per adapter group, layer and linear");
      for (int64_t g = 0; g < groups; ++g) group_rows.push_back(at::nonzero(lora_rows == g).flatten());
      for (const auto& t : lora)
        TORCH_CHECK(!t.has_value() || (t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous()),
                    "lora weights: 2-D float32");
    }
    TORCH_CHECK(lora_rows.numel() == 0 || std::all_of(layers_.begin(), layers_.end(), [](const LayerP& p) {
                  return p.kind == PLAIN;
                }), "DecodePlan: adapters on parts layers are not supported");
    int64_t state_layers = 0;  // the recurrent states' layers that layers start..end-1 read
    for (int64_t i = start; i < end; ++i)
      if (layers_[i].kind == DELTA) state_layers = std::max(state_layers, layers_[i].cache + 1);
    check_states(state_layers, B, conv_state, ssm_state, state_slots);
    const LoraArgs la{&group_rows, &lora};
    const Args args{h, slot_mapping, key_slots, row_seq, seq_lens, cos, sin, k_cache, v_cache, start, end, det, la,
                    conv_state, ssm_state, state_slots};
    if (h.scalar_type() == at::kBFloat16) return run_kv<at::BFloat16>(args);
    TORCH_CHECK(h.scalar_type() == at::kFloat, "decode layers run in bfloat16 or float32");
    return run_kv<float>(args);
  }

 private:
  // a run's adapter groups: each group's rows, and `run`'s lora weights
  struct LoraArgs {
    const std::vector<at::Tensor>* rows;
    const std::vector<std::optional<at::Tensor>>* weights;
  };

  // y [B, out] plus each adapter group's delta on its own rows (adapters/lora.py LoraBatch.apply), in place
  void add_lora(const LoraArgs& la, at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t which, bool det) const {
    const auto& rows = *la.rows;
    const auto& w = *la.weights;
    for (size_t g = 0; g < rows.size(); ++g) {
      const size_t at = ((g * num_layers() + layer) * 4 + which) * 2;
      if (!w[at].has_value() || rows[g].numel() == 0) continue;
      const at::Tensor& a = *w[at];
      const at::Tensor& b = *w[at + 1];
      TORCH_CHECK(a.size(1) == x.size(1) && b.size(0) == y.size(1) && b.size(1) == a.size(0),
                  "a LoRA adapter that does not fit linear ", which, " of layer ", layer);
      // float32 products (the weights are float32 here): CPUs without AVX512-BF16 multiply bf16 slowly
      if (rows[g].numel() == y.size(0))  // every row (one request decoding alone): no gather, no scatter
        y.add_(low_rank(x.to(at::kFloat), a, b, det).to(y.scalar_type()));
      else
        y.index_add_(0, rows[g], low_rank(x.index_select(0, rows[g]).to(at::kFloat), a, b, det).to(y.scalar_type()));
    }
  }

  // `run`'s operands, checked
  struct Args {
    const at::Tensor& h;
    const at::Tensor &slot_mapping, &key_slots, &row_seq, &seq_lens;
    const std::vector<at::Tensor>&cos, &sin;
    const at::Tensor &k_cache, &v_cache;
    int64_t start, end;
    bool det;
    const LoraArgs& la;
    const at::Tensor &conv_state, &ssm_state, &state_slots;
  };

  // KV layers the attention layers read: each plain layer its own, a parts layer its `cache`
  int64_t kv_layers() const {
    int64_t n = 0;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const LayerP& p = layers_[i];
      if (p.kind != DELTA) n = std::max(n, (p.kind == PLAIN ? i : p.cache) + 1);
    }
    return n;
  }

  // run_t for the caches' formats: float rows of T, or keys and values each int8 or 4-bit rows
  template <typename T>
  at::Tensor run_kv(const Args& a) {
    const auto kt = a.k_cache.scalar_type(), vt = a.v_cache.scalar_type();
    if (kt != at::kChar && kt != at::kByte) return run_t<T, T, T>(a);
    if (kt == at::kChar) return vt == at::kChar ? run_t<T, int8_t, int8_t>(a) : run_t<T, int8_t, uint8_t>(a);
    return vt == at::kChar ? run_t<T, uint8_t, int8_t>(a) : run_t<T, uint8_t, uint8_t>(a);
  }

  // T: the model dtype; KC, VC: the key and value rows' (T, or int8_t / uint8_t: quantized as written, codes times
  // their scale as read; 4-bit rows rotated as written and attended in that basis)
  template <typename T, typename KC, typename VC>
  at::Tensor run_t(const Args& a) {
    const int64_t start = a.start, end = a.end;
    const bool det = a.det;
    const LoraArgs& la = a.la;
    at::Tensor h = a.h;
    const int64_t B = h.size(0), dim = h.size(1);
    h = h.clone();
    at::Tensor x = at::empty_like(h);
    at::Tensor attn = at::empty({B, heads_ * head_dim_}, h.options());
    for (int64_t i = start; i < end; ++i) {
      const LayerP& p = layers_[i];
      T* hp = h.data_ptr<T>();
      T* xp = x.data_ptr<T>();
      for_rows(B, dim, [&](int64_t b0, int64_t b1) {
        norm_rows<T>(hp + b0 * dim, p.attn_norm, xp + b0 * dim, b1 - b0, dim, dim, dim, eps_, norm_float_);
      });
      at::Tensor o;
      if (p.kind == DELTA) {
        const at::Tensor proj = p.qkv(x, det);  // [B, C + V + 2 Hv]: mixed, z, b, a
        const at::Tensor normed = delta_mixer<T>(p.delta, proj, a.conv_state[p.cache], a.ssm_state[p.cache],
                                                 a.state_slots, a.seq_lens.data_ptr<int64_t>(), eps_);
        o = p.o(normed, det);
      } else {
        at::Tensor qkv = p.qkv(x, det);  // [B, qs + 2 ks] (gated: [B, 2 qs + 2 ks])
        add_lora(la, qkv, x, i, 0, det);
        at::Tensor gate;
        if (p.gated) split_gate<T>(at::Tensor(qkv), heads_, head_dim_, qkv, gate);
        attend_layer<T, KC, VC>(a, p, p.kind == PLAIN ? i : p.cache, qkv, attn);
        if (p.gated) apply_gate<T>(attn.data_ptr<T>(), gate.data_ptr<T>(), attn.numel());
        o = p.o(attn, det);  // [B, dim]
        add_lora(la, o, attn, i, 1, det);
      }
      T* op = o.data_ptr<T>();
      hp = h.data_ptr<T>();
      // the residual add between the mixer's norm (Gemma's post-attention one) and the MLP's
      for_rows(B, dim, [&](int64_t b0, int64_t b1) {
        T* orow = op + b0 * dim;
        if (p.post_attn_norm.defined())
          norm_rows<T>(orow, p.post_attn_norm, orow, b1 - b0, dim, dim, dim, eps_, norm_float_);
        for (int64_t j = b0 * dim; j < b1 * dim; ++j) hp[j] = static_cast<T>(ld(hp + j) + ld(op + j));
        norm_rows<T>(hp + b0 * dim, p.ffn_norm, xp + b0 * dim, b1 - b0, dim, dim, dim, eps_, norm_float_);
      });
      at::Tensor y;
      if (p.moe) {
        y = p.moe(x, p.moe_counts);  // [B, dim]
      } else {
        at::Tensor gu = p.gate_up(x, det);  // [B, 2 * inter]
        add_lora(la, gu, x, i, 2, det);
        const int64_t inter = gu.size(1) / 2;
        at::Tensor act = at::empty({B, inter}, h.options());
        const T* gp = gu.data_ptr<T>();
        T* ap = act.data_ptr<T>();
        for_rows(B, 4 * inter, [&](int64_t b0, int64_t b1) {  // an exp a value: ~4 norm values' time
          act_rows<T>(gp + b0 * 2 * inter, ap + b0 * inter, b1 - b0, inter, act_);
        });
        y = p.down(act, det);  // [B, dim]
        add_lora(la, y, act, i, 3, det);
      }
      T* yp = y.data_ptr<T>();
      for_rows(B, dim, [&](int64_t b0, int64_t b1) {
        T* yrow = yp + b0 * dim;
        if (p.post_ffn_norm.defined())
          norm_rows<T>(yrow, p.post_ffn_norm, yrow, b1 - b0, dim, dim, dim, eps_, norm_float_);
        for (int64_t j = b0 * dim; j < b1 * dim; ++j) hp[j] = static_cast<T>(ld(hp + j) + ld(yp + j));
      });
    }
    return h;
  }

  // an attention layer's rows from its qkv [B, qs + 2 ks]: q/k norms, rope, k and v stored into KV layer `kv`,
  // each row's attention over its sequence's keys -> attn [B, qs]
  template <typename T, typename KC, typename VC>
  void attend_layer(const Args& a, const LayerP& p, int64_t kv, at::Tensor& qkv, at::Tensor& attn) {
    const at::Tensor &slot_mapping = a.slot_mapping, &key_slots = a.key_slots, &row_seq = a.row_seq;
    const at::Tensor &seq_lens = a.seq_lens, &k_cache = a.k_cache, &v_cache = a.v_cache;
    const int64_t B = qkv.size(0), D = head_dim_;
    const int64_t qs = heads_ * D, ks = kv_heads_ * D, groups = heads_ / kv_heads_;
    const int64_t L = key_slots.size(1);
    const int64_t* slots_p = key_slots.data_ptr<int64_t>();
    const int64_t* lens_p = seq_lens.data_ptr<int64_t>();
    const int64_t* rows_p = row_seq.data_ptr<int64_t>();
    const int64_t* map_p = slot_mapping.data_ptr<int64_t>();
    const int64_t kwidth = kv_width<KC>(D), vwidth = kv_width<VC>(D);
    const int64_t krow = kv_heads_ * kwidth, vrow = kv_heads_ * vwidth;  // elements of KC, VC per slot
    const KVRotation rot{kv_signs_.data(), kv_block_,
                         static_cast<float>(1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(kv_block_, 1))))};
    constexpr bool rot_q = is_q4<KC>, rot_o = is_q4<VC>;
    T* qkv_p = qkv.data_ptr<T>();
    const int64_t qkv_row = qkv.size(1);
    TORCH_CHECK(qkv_row == qs + 2 * ks, "DecodePlan: an attention layer's qkv gives ", qkv_row, " values, not ",
                qs + 2 * ks);
    const T* c = a.cos[p.rope_kind].data_ptr<T>();
    const T* s = a.sin[p.rope_kind].data_ptr<T>();
    KC* kc = k_cache[kv].data_ptr<KC>();
    VC* vc = v_cache[kv].data_ptr<VC>();
    // each row's q/k norms, rope and its key and value stored (rope_rows reads row b's position from cos, sin)
    for_rows(B, qkv_row, [&](int64_t b0, int64_t b1) {
      std::vector<float> store_buf(D);
      for (int64_t b = b0; b < b1; ++b) {
        T* row = qkv_p + b * qkv_row;
        if (p.q_norm.defined()) {
          norm_rows<T>(row, p.q_norm, row, heads_, D, D, D, eps_, norm_float_);
          norm_rows<T>(row + qs, p.k_norm, row + qs, kv_heads_, D, D, D, eps_, norm_float_);
        }
      }
      rope_rows<T>(qkv_p + b0 * qkv_row, c + b0 * rot_, s + b0 * rot_, b1 - b0, heads_, D, rot_, qkv_row);
      rope_rows<T>(qkv_p + b0 * qkv_row + qs, c + b0 * rot_, s + b0 * rot_, b1 - b0, kv_heads_, D, rot_, qkv_row);
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t kvh = 0; kvh < kv_heads_; ++kvh) {
          store_row<T, KC>(qkv_p + b * qkv_row + qs + kvh * D, D, kc + map_p[b] * krow + kvh * kwidth, rot,
                           store_buf.data());
          store_row<T, VC>(qkv_p + b * qkv_row + qs + ks + kvh * D, D, vc + map_p[b] * vrow + kvh * vwidth, rot,
                           store_buf.data());
        }
    });
    T* attn_p = attn.data_ptr<T>();
    const int64_t window = p.window;
    const float scale = static_cast<float>(scale_);
    // split across threads only when there is enough work to pay for waking them: the rows times the longest
    // row's keys (16 decode rows of 40 keys count as one row of 640)
    const bool split = B * L * D * heads_ >= 32768;
    // where the rows' kv heads do not share out evenly over the threads (one row of Gemma-3: one kv head of four
    // query heads, all on one thread; of SmolLM2: three kv heads, two on one thread), each kv head's query heads
    // go in `slices` parts, about two a thread: a head's arithmetic is its own, so every bit stays
    const int64_t threads = at::get_num_threads(), pairs = B * kv_heads_;
    const int64_t slices = split && pairs < 2 * threads && pairs % threads
                               ? std::min<int64_t>(groups, (2 * threads + pairs - 1) / pairs)
                               : 1;
    const int64_t per = (groups + slices - 1) / slices;  // query heads a slice (the last may have fewer)
    const int64_t work = pairs * slices;
    const int64_t grain = split ? 1 : work;
    // the vector kernels' lanes (their 4-bit lane order, rowbase.h lane_index), 0 for the scalar one
#ifdef SUPERSLM_AVX512
    const int64_t lanes = (D % 16 == 0 && D <= 256 && groups <= 64) ? 16 : 0;
#elif defined(SUPERSLM_ROWS_AVX2)
    const int64_t lanes = (D % 8 == 0 && D <= 256 && groups <= 64) ? 8 : 0;
#else
    const int64_t lanes = 0;
#endif
    at::parallel_for(0, work, grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> scores(L * groups), acc(D), qf(groups * D), buf(D);
      // 4-bit keys: the query heads rotated into the keys' basis; 4-bit values: the sums before rotating back
      std::vector<float> qr(rot_q ? groups * D : 0), of(rot_o ? groups * D : 0);
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t b = w / slices / kv_heads_, kvh = w / slices % kv_heads_;
        const int64_t h0 = w % slices * per, hn = std::min(per, groups - h0);  // this slice's query heads
        if (hn <= 0) continue;
        const int64_t len = lens_p[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const T* qg = qkv_p + b * qkv_row + (kvh * groups + h0) * D;  // the slice's query heads [hn, D]
        for (int64_t d = 0; d < hn * D; ++d) qf[d] = ld(qg + d);
        const float* q = qf.data();
        if constexpr (rot_q) {
          for (int64_t g = 0; g < hn; ++g) rotate_head(qf.data() + g * D, rot, D, lanes, buf.data(), qr.data() + g * D);
          q = qr.data();
        }
        T* dst = attn_p + b * qs + (kvh * groups + h0) * D;
        const int64_t* sl = slots_p + rows_p[b] * L;
        auto attend_all = [&](auto* out) {
          using O = std::remove_pointer_t<decltype(out)>;
#ifdef SUPERSLM_AVX512
          if (lanes == 16) {
            attend_group16<O, KC, VC>(q, hn, kc, vc, sl, first, len, kvh, kv_heads_, D, scale, scores.data(), out, D);
            return;
          }
#elif defined(SUPERSLM_ROWS_AVX2)
          if (lanes == 8) {
            attend_group8<O, KC, VC>(q, hn, kc, vc, sl, first, len, kvh, kv_heads_, D, scale, scores.data(), out, D);
            return;
          }
#endif
          for (int64_t g = 0; g < hn; ++g)
            attend<O, KC, VC>(q + g * D, kc, vc, sl, first, len, kvh, kv_heads_, D, scale, scores.data(), acc.data(),
                              out + g * D);
        };
        if constexpr (rot_o) {
          attend_all(of.data());
          for (int64_t g = 0; g < hn; ++g) unrotate_head<T>(of.data() + g * D, rot, D, lanes, buf.data(), dst + g * D);
        } else {
          attend_all(dst);
        }
      }
    });
  }

  int64_t heads_, kv_heads_, head_dim_, rot_;
  double eps_;
  bool norm_float_;
  int64_t act_;
  double scale_;
  std::vector<LayerP> layers_;
  std::vector<float> kv_signs_;  // set_kv_rotation's signs and block (0: none given)
  int64_t kv_block_ = 0;
  std::vector<pybind11::object> keep_;  // set_moe's steps, alive as long as the plan
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodePlan>(m, "DecodePlan")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, bool, int64_t, double>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("add_part", &DecodePlan::add_part)
      .def("set_kind", &DecodePlan::set_kind)
      .def("set_moe", &DecodePlan::set_moe)
      .def("num_layers", &DecodePlan::num_layers)
      .def("set_kv_rotation", &DecodePlan::set_kv_rotation)
      .def("run", &DecodePlan::run, pybind11::call_guard<pybind11::gil_scoped_release>());
  // the block Hadamard rotation of kernels/hadamard.py Rotation, row by row in float, bf16 out
  m.def(
      "hadamard_rows",
      [](const at::Tensor& x, const at::Tensor& signs, int64_t block, int64_t kpad) {
        return rotate_input(x, signs, block, kpad, at::kBFloat16);
      },
      pybind11::call_guard<pybind11::gil_scoped_release>());
  // rows [N, D] (float or bf16) -> int8 KV rows [N, D + 4] as the plan writes them (cache/kv.py quantize_rows)
  m.def(
      "quantize_kv_rows",
      [](const at::Tensor& x) {
        TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "quantize_kv_rows: a contiguous [N, D] float32 or bfloat16 tensor");
        const int64_t N = x.size(0), D = x.size(1);
        at::Tensor out = at::empty({N, D + 4}, x.options().dtype(at::kChar));
        int8_t* o = out.data_ptr<int8_t>();
        for (int64_t r = 0; r < N; ++r) {
          if (x.scalar_type() == at::kFloat)
            quantize_row<float>(x.data_ptr<float>() + r * D, D, o + r * (D + 4));
          else
            quantize_row<at::BFloat16>(x.data_ptr<at::BFloat16>() + r * D, D, o + r * (D + 4));
        }
        return out;
      },
      pybind11::call_guard<pybind11::gil_scoped_release>());
  // rows [N, D] (float or bf16) -> 4-bit KV rows [N, D / 2 + 4] as the plan writes them: rotated by (signs,
  // block), then cache/kv.py quantize_rows4's bits
  m.def(
      "quantize_kv_rows4",
      [](const at::Tensor& x, const at::Tensor& signs, int64_t block) {
        TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0 &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "quantize_kv_rows4: a contiguous [N, D] float32 or bfloat16 tensor, D even");
        const int64_t N = x.size(0), D = x.size(1);
        TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.is_contiguous() && signs.numel() == D && block > 0 &&
                        (block & (block - 1)) == 0 && D % block == 0,
                    "quantize_kv_rows4: float signs [D] and a power-of-two block dividing D");
        const KVRotation rot{signs.data_ptr<float>(), block,
                             static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)))};
        at::Tensor out = at::empty({N, D / 2 + 4}, x.options().dtype(at::kByte));
        uint8_t* o = out.data_ptr<uint8_t>();
        std::vector<float> buf(D);
        for (int64_t r = 0; r < N; ++r) {
          if (x.scalar_type() == at::kFloat)
            quantize_row4<float>(x.data_ptr<float>() + r * D, D, rot, buf.data(), o + r * (D / 2 + 4));
          else
            quantize_row4<at::BFloat16>(x.data_ptr<at::BFloat16>() + r * D, D, rot, buf.data(), o + r * (D / 2 + 4));
        }
        return out;
      },
      pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("vnni_available", &vnni_available);
  m.def("gemm_rows", &gemm_rows);
  m.def("set_vnni", &set_vnni);
  m.def("avx2_available", &avx2_available);
  m.def("set_avx2", &set_avx2);
  m.def("torch_int4_block", &torch_int4_block);
  m.def("int4_gemv_avx2", &int4_gemv_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_gemv_avx2", &int8_gemv_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int5_gemv_avx2", &int5_gemv_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int5_gemm_avx2", &int5_gemm_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("avx2_gemm_rows", &avx2_gemm_rows);
  m.def("int4_gemm_avx2", &int4_gemm_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_gemm_avx2", &int8_gemm_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_rowsum", &int8_rowsum);
  m.def("int8_gemv", &int8_gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_gemv", &int4_gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_gemm", &int8_gemm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int5_gemv", &int5_gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int5_gemm", &int5_gemm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int5_reference", &int5_reference, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_gemm", &int4_gemm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_rownorm", &int8_rownorm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_greedy_candidates", &int8_greedy_candidates, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("iq4_available", &iq4_available);
  m.def("iq4_gemv", &iq4_gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("iq4_gemm", &iq4_gemm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("iq4_dequantize", &iq4_dequantize, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("iq4_gemv_rows", &iq4_gemv_rows);
  m.def("iq4_gemm_avx2", &iq4_gemm_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_prompt_avx2", &int8_prompt_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("iq4_linear", &iq4_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q6k_available", &q6k_available);
  m.def("q6k_gemv", &q6k_gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q6k_gemm", &q6k_gemm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q6k_dequantize", &q6k_dequantize, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q80_available", &q80_available);
  m.def("q80_gemv", &q80_gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q80_gemm", &q80_gemm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q80_dequantize", &q80_dequantize, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("delta_decode_step", &delta_decode_step, pybind11::call_guard<pybind11::gil_scoped_release>());
  register_moe_step(m);
  m.def("int4_dequant_rows", &int4_dequant_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int5_dequant_rows", &int5_dequant_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_prompt_avx2", &int4_prompt_avx2, pybind11::call_guard<pybind11::gil_scoped_release>());
}

// A mixture-of-experts block's decode rows in one call (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): the router's
// softmax and top k, the rows grouped by expert so each chosen expert's weights are read once, each expert's
// gate_up, act(gate) * up and down, the weighted sum, and the shared expert times sigmoid(its gate).
//
// In torch (models/layers.py MoE.forward) a decode step of the MoE 1.8B config spent ~0.6 ms a layer on ~100
// small ops and Python calls between weight reads of ~0.1 ms. Here the linears are the decode plan's
// (plan_linear.h Lin: the same int4 / int8 / dense kernels, rotated inputs included) and the glue runs in
// loops. The small routing ops (softmax, top k, the renormalization, sigmoid, the activation) are ATen's own
// kernels called from here: the twin calls the same ones, so a decode row gets the twin's bits. The weighted
// sum is rounded where torch rounds it: y * weight to the model dtype, then each expert's term added to the
// row in expert order (index_add_), then the shared expert's scaled output added.
// The torch twin with the same arguments is kernels/moe_step.py `moe_decode_reference`.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "plan_linear.h"

namespace {

using namespace superslm_rows;
using namespace superslm_plan;

struct Mlp {
  Lin gate_up, down;
};

// Lin::make's operands: 6 tensors (a, b, bias, signs, hadamard, extra) and 5 ints (kind, group, out, in, kpad)
constexpr size_t kTensors = 6, kInts = 5;

// rows up to which a block's units (its chosen experts, the shared one) run side by side, one thread each: decode
// steps of up to this many sequences, whose experts' GEMVs are too small to split across threads well
constexpr int64_t kUnitRows = 32;

// act(gate) * up for gate_up [m, 2 I] (gate, then up) in its dtype: kernels/fused.py gated_act's ops
at::Tensor gated_act(const at::Tensor& gu, int64_t act) {
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
  const at::Tensor a = act == 0 ? at::silu(gate) : act == 1 ? at::gelu(gate, "tanh") : at::gelu(gate);
  return a * up;
}

// out[d] = T(out[d] + T(y[d] * w)) over d < n: the product rounded to T, then the sum (torch's y * w, then
// index_add_ / +). The products go through memory first: with -ffp-contract=fast GCC would otherwise fuse a
// float32 product and sum into one FMA, one rounding fewer than torch's two ops.
template <typename T>
void add_scaled(T* out, const T* y, float w, int64_t n, float* tmp) {
  for (int64_t d = 0; d < n; ++d) tmp[d] = rnd<T>(ld(y + d) * w);
  asm volatile("" ::: "memory");
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<T>(ld(out + d) + tmp[d]);
}

class MoEStep {
 public:
  // act: 0 silu, 1 gelu_tanh, 2 gelu (erf); the router, the experts and the shared expert are added after
  MoEStep(int64_t top_k, bool norm_top_k, int64_t act) : top_k_(top_k), norm_(norm_top_k), act_(act) {
    TORCH_CHECK(top_k > 0 && act >= 0 && act <= 2, "MoEStep: top_k > 0 and an activation 0..2");
  }

  // the router's linear [experts, dim]
  void set_router(const std::vector<std::optional<at::Tensor>>& t, const std::vector<int64_t>& ints) {
    TORCH_CHECK(t.size() == kTensors && ints.size() == kInts, "MoEStep.set_router: 6 tensors and 5 ints");
    router_ = Lin::make(t, 0, ints, 0);
    has_router_ = true;
  }

  // one expert's gate_up [2 I, dim] and down [dim, I], in expert order
  void add_expert(const std::vector<std::optional<at::Tensor>>& t, const std::vector<int64_t>& ints) {
    experts_.push_back(make_mlp(t, ints, "add_expert"));
  }

  // the shared expert's gate_up and down, then its gate's linear [1, dim]
  void set_shared(const std::vector<std::optional<at::Tensor>>& t, const std::vector<int64_t>& ints) {
    TORCH_CHECK(t.size() == 3 * kTensors && ints.size() == 3 * kInts, "MoEStep.set_shared: 18 tensors and 15 ints");
    shared_ = make_mlp(t, ints, "set_shared");
    shared_gate_ = Lin::make(t, 2 * kTensors, ints, 2 * kInts);
    has_shared_ = true;
  }

  // one part of a CONCAT linear: `which` 0 gate_up, 1 down, of expert `expert` (-1: the shared expert)
  void add_part(int64_t expert, int64_t which, const std::vector<std::optional<at::Tensor>>& t,
                const std::vector<int64_t>& ints) {
    TORCH_CHECK(expert >= -1 && expert < num_experts() && (expert >= 0 || has_shared_) && (which == 0 || which == 1) &&
                    t.size() == kTensors && ints.size() == kInts,
                "MoEStep.add_part: an expert (-1: the shared one), a linear 0..1, 6 tensors and 5 ints");
    Mlp& m = expert < 0 ? shared_ : experts_[expert];
    Lin& lin = which == 0 ? m.gate_up : m.down;
    TORCH_CHECK(lin.kind == CONCAT && ints[0] != CONCAT, "MoEStep.add_part: parts go into a CONCAT linear");
    lin.parts.push_back(Lin::make(t, 0, ints, 0));
  }

  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }

  // x [n, dim] (float32 or bfloat16, contiguous) -> the block's output [n, dim] in x's dtype; counts int64
  // [experts] gets the rows each expert took added (MoE.tokens_per_expert)
  at::Tensor run(const at::Tensor& x, at::Tensor counts) const {
    TORCH_CHECK(has_router_ && num_experts() >= top_k_, "MoEStep.run: a router and at least top_k experts");
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "MoEStep.run: x must be a contiguous float32 or bfloat16 [n, dim] CPU tensor");
    TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.is_contiguous() &&
                    counts.numel() == num_experts(),
                "MoEStep.run: counts must be a contiguous int64 [experts]");
    TORCH_CHECK(x.size(1) == router_.in, "MoEStep.run: x has ", x.size(1), " features, the router takes ", router_.in);
    if (x.scalar_type() == at::kBFloat16) return run_t<at::BFloat16>(x, counts);
    return run_t<float>(x, counts);
  }

 private:
  static Mlp make_mlp(const std::vector<std::optional<at::Tensor>>& t, const std::vector<int64_t>& ints,
                      const char* what) {
    TORCH_CHECK(t.size() >= 2 * kTensors && ints.size() >= 2 * kInts, "MoEStep.", what, ": 12 tensors and 10 ints");
    Mlp m{Lin::make(t, 0, ints, 0), Lin::make(t, kTensors, ints, kInts)};
    TORCH_CHECK(m.gate_up.out % 2 == 0 && m.down.in == m.gate_up.out / 2 && m.down.out == m.gate_up.in,
                "MoEStep.", what, ": gate_up [2 I, dim] and down [dim, I]");
    return m;
  }

  at::Tensor mlp(const Mlp& m, const at::Tensor& x) const { return m.down(gated_act(m.gate_up(x, false), act_), false); }

  template <typename T>
  at::Tensor run_t(const at::Tensor& x, at::Tensor& counts) const {
    const int64_t n = x.size(0), dim = x.size(1), E = num_experts(), k = top_k_;
    for (const Mlp& m : experts_)
      TORCH_CHECK(m.gate_up.in == dim, "MoEStep.run: an expert takes ", m.gate_up.in, " features, x has ", dim);
    at::Tensor out = at::zeros_like(x);
    if (n == 0) return out;
    // the routing, as MoE.forward: softmax in float32, the top k, optionally renormalized, weights in x's dtype
    const at::Tensor logits = router_(x, false);
    TORCH_CHECK(logits.dim() == 2 && logits.size(1) == E, "MoEStep.run: the router gives ", logits.size(1),
                " logits for ", E, " experts");
    auto [top, chosen] = at::topk(at::softmax(logits.to(at::kFloat), -1), k, -1);  // [n, k]
    if (norm_) top = top / top.sum(-1, true);
    const at::Tensor weights = top.to(x.scalar_type()).contiguous();
    chosen = chosen.contiguous();
    const int64_t* ch = chosen.data_ptr<int64_t>();
    const T* wp = weights.data_ptr<T>();
    // the (row, slot) pairs grouped by expert, in row order within each (a stable sort of the flat choices)
    std::vector<int64_t> start(E + 1, 0), pairs(n * k);
    for (int64_t i = 0; i < n * k; ++i) {
      TORCH_CHECK(ch[i] >= 0 && ch[i] < E, "MoEStep.run: the top k chose expert ", ch[i]);
      ++start[ch[i] + 1];
    }
    int64_t* cp = counts.data_ptr<int64_t>();
    for (int64_t e = 0; e < E; ++e) {
      cp[e] += start[e + 1];
      start[e + 1] += start[e];
    }
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n * k; ++i) pairs[fill[ch[i]]++] = i;
    // the chosen experts in order, then the shared expert (index E): each unit's MLP output, computed before any
    // sum so that the units can run side by side
    std::vector<int64_t> units;
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) units.push_back(e);
    if (has_shared_) units.push_back(E);
    const int64_t U = static_cast<int64_t>(units.size());
    std::vector<at::Tensor> ys(U);
    auto run_unit = [&](int64_t u) {
      const int64_t e = units[u];
      if (e == E) {
        ys[u] = mlp(shared_, x);
        return;
      }
      const int64_t m = start[e + 1] - start[e];
      const int64_t* pe = pairs.data() + start[e];
      at::Tensor xe = x;  // every row chose this expert (each row chooses an expert once): x as it is
      if (m < n) {
        xe = at::empty({m, dim}, x.options());
        for (int64_t i = 0; i < m; ++i)
          std::memcpy(xe.data_ptr<T>() + i * dim, x.data_ptr<T>() + (pe[i] / k) * dim, dim * sizeof(T));
      }
      ys[u] = mlp(experts_[e], xe);  // [m, dim]
    };
    const std::vector<std::vector<int64_t>> lanes = split_units(units, start, n);
    if (lanes.size() > 1) {
      // decode rows: each thread runs whole units with their kernels serially (nested parallel_for runs inline),
      // one fork a block instead of two a linear; every kernel gives an output row the same bits on any thread
      at::parallel_for(0, static_cast<int64_t>(lanes.size()), 1, [&](int64_t lo, int64_t hi) {
        for (int64_t l = lo; l < hi; ++l)
          for (const int64_t u : lanes[l]) run_unit(u);
      });
    } else {
      for (int64_t u = 0; u < U; ++u) run_unit(u);
    }
    T* op = out.data_ptr<T>();
    std::vector<float> tmp(dim);
    for (int64_t u = 0; u < U; ++u) {  // the sums in expert order, the shared expert last: the twin's order
      const int64_t e = units[u];
      const at::Tensor& y = ys[u];
      if (e == E) {
        const at::Tensor scale = at::sigmoid(shared_gate_(x, false));  // [n, 1]
        TORCH_CHECK(scale.size(0) == n && scale.size(1) == 1 && y.size(0) == n && y.size(1) == dim,
                    "MoEStep.run: the shared expert gives ", y.sizes(), ", its gate ", scale.sizes());
        const at::Tensor sc = scale.contiguous();
        const T* sp = sc.data_ptr<T>();
        const T* yp = y.data_ptr<T>();
        for (int64_t r = 0; r < n; ++r) add_scaled<T>(op + r * dim, yp + r * dim, ld(sp + r), dim, tmp.data());
        continue;
      }
      const int64_t m = start[e + 1] - start[e];
      const int64_t* pe = pairs.data() + start[e];
      TORCH_CHECK(y.size(0) == m && y.size(1) == dim && y.is_contiguous(), "MoEStep.run: an expert's output is not [m, dim]");
      const T* yp = y.data_ptr<T>();
      for (int64_t i = 0; i < m; ++i) add_scaled<T>(op + (pe[i] / k) * dim, yp + i * dim, ld(wp + pe[i]), dim, tmp.data());
    }
    return out;
  }

  // The units (positions in `units`: expert indices, E the shared expert) dealt to the threads by their cost,
  // largest first onto the least loaded thread; none (the caller runs them in order, each kernel splitting its own
  // work) where that would not pay: one thread, one unit, or rows enough that an expert's GEMM splits well alone
  std::vector<std::vector<int64_t>> split_units(const std::vector<int64_t>& units, const std::vector<int64_t>& start,
                                                int64_t n) const {
    const int64_t threads = at::get_num_threads(), U = static_cast<int64_t>(units.size());
    if (threads < 2 || U < 2 || n > kUnitRows || at::in_parallel_region()) return {};
    const int64_t E = num_experts();
    std::vector<std::pair<double, int64_t>> cost(U);  // (cost, unit position)
    for (int64_t u = 0; u < U; ++u) {
      const int64_t e = units[u];
      const Mlp& m = e == E ? shared_ : experts_[e];
      const int64_t rows = e == E ? n : start[e + 1] - start[e];
      // its weights (read once) and a share of them per further row (the row kernels' arithmetic)
      cost[u] = {static_cast<double>(m.gate_up.out + m.down.out) * static_cast<double>(m.gate_up.in + m.down.in) *
                     (1.0 + 0.25 * static_cast<double>(rows - 1)),
                 u};
    }
    std::stable_sort(cost.begin(), cost.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    const int64_t L = std::min(threads, U);
    std::vector<std::vector<int64_t>> lanes(L);
    std::vector<double> load(L, 0.0);
    for (const auto& [c, u] : cost) {
      const int64_t l = std::min_element(load.begin(), load.end()) - load.begin();
      lanes[l].push_back(u);
      load[l] += c;
    }
    return lanes;
  }

  int64_t top_k_;
  bool norm_;
  int64_t act_;
  Lin router_, shared_gate_;
  bool has_router_ = false, has_shared_ = false;
  std::vector<Mlp> experts_;
  Mlp shared_;
};

}  // namespace

// a MoEStep object as the decode plan calls it (decode_layers.cpp DecodePlan.set_moe, which keeps the object)
std::function<at::Tensor(const at::Tensor&, at::Tensor)> moe_step_runner(const pybind11::object& step) {
  const MoEStep* p = step.cast<const MoEStep*>();
  return [p](const at::Tensor& x, at::Tensor counts) { return p->run(x, counts); };
}

// registered by decode_layers.cpp's module
void register_moe_step(pybind11::module& m) {
  pybind11::class_<MoEStep>(m, "MoEStep")
      .def(pybind11::init<int64_t, bool, int64_t>())
      .def("set_router", &MoEStep::set_router)
      .def("add_expert", &MoEStep::add_expert)
      .def("set_shared", &MoEStep::set_shared)
      .def("add_part", &MoEStep::add_part)
      .def("num_experts", &MoEStep::num_experts)
      .def("run", &MoEStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}

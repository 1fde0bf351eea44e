#include "pipeline/train/gemm_rates.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>

#include "kernels/backend.h"
#include "kernels/meta_backend.h"
#include "layers/tensor_parallel.h"
#include "runtime/heartbeat.h"
#include "runtime/stream.h"

namespace gpipe {
namespace pipeline {

namespace {

// Timing stops adding calls once this much has been timed (after at least one).
constexpr double kBudgetMs = 50;
constexpr int kMaxCalls = 20;

// Layer indices as ranges: "0, 2, 4-7".
std::string index_ranges(const std::set<int>& xs) {
  std::string out;
  for (auto it = xs.begin(); it != xs.end();) {
    const int first = *it;
    int last = first;
    for (++it; it != xs.end() && *it == last + 1; ++it) last = *it;
    if (!out.empty()) out += ", ";
    out += last == first ? std::to_string(first) : std::to_string(first) + "-" + std::to_string(last);
  }
  return out;
}

// The product called as its op calls it, on operands of its sizes on `be`'s device.
class ProductCall {
 public:
  ProductCall(Backend& be, const MetaProduct& p) : be_(be), p_(p) {
    auto filled = [&](const Shape& s, DType t, double v) {
      Tensor x = be.empty(s, t);
      be.fill(x, v);
      return x;
    };
    if (!p.is_gemm()) {  // attention or a convolution: its tensors as listed, in the op's order
      for (size_t i = 0; i < p.tensors.size(); ++i) {
        t_.push_back(p.tensors[i].empty() ? Tensor() : filled(p.tensors[i], p.types.at(i), 0.01 * (1 + i % 3)));
      }
      // What a backward reads of its forward, made by the forward.
      if (p.op == "attention_backward") {
        Tensor out = be.empty(t_[0].shape(), t_[0].dtype());
        be.attention(t_[1], static_cast<int>(p.ints.at(0)), t_[2], out);
      }
      if (p.op == "fused_attention_backward") {
        be.fused_attention(t_[1], t_[2], t_[3], static_cast<int>(p.ints.at(0)), t_[4], t_[5]);
      }
      return;
    }
    const Shape a_shape = p.trans_a ? Shape{p.k, p.m} : Shape{p.m, p.k};
    const Shape b_shape = p.trans_b ? Shape{p.n, p.k} : Shape{p.k, p.n};
    a_ = filled(a_shape, p.dtype, 0.01);
    b_ = filled(b_shape, p.dtype, 0.02);
    c_ = filled({p.m, p.n}, p.c_dtype, 0.0);
    // linear_bias adds a bias of c's columns; linear_weight_grad sums into one of c's rows;
    // linear_residual reads a residual of c's shape (and linear_input_grad_add c itself).
    if (p.op == "linear_bias") bias_ = filled({p.n}, p.dtype, 0.5);
    if (p.op == "linear_weight_grad") bias_ = filled({p.m}, p.c_dtype, 0.0);
    if (p.op == "linear_residual") bias_ = filled({p.m, p.n}, p.c_dtype, 0.5);
  }
  void operator()() {
    if (!p_.is_gemm()) return call_op();
    if (p_.op == "linear_bias") return be_.linear_bias(a_, b_, bias_, c_);
    if (p_.op == "linear_weight_grad") return be_.linear_weight_grad(a_, b_, c_, bias_);
    if (p_.op == "linear_residual") return be_.linear_residual(a_, b_, bias_, c_);
    if (p_.op == "linear_input_grad_add") return be_.linear_input_grad_add(a_, b_, c_);
    if (p_.op == "matmul_weight") return be_.matmul_weight(a_, p_.trans_a, b_, p_.trans_b, c_);
    be_.matmul(a_, p_.trans_a, b_, p_.trans_b, c_);
  }

 private:
  void call_op() {
    const auto& t = t_;
    const int a = p_.ints.empty() ? 0 : static_cast<int>(p_.ints[0]);
    const int b = p_.ints.size() < 2 ? 0 : static_cast<int>(p_.ints[1]);
    if (p_.op == "attention") return be_.attention(t[0], a, t_[1], t_[2]);
    if (p_.op == "attention_backward") return be_.attention_backward(t[0], t[1], t[2], a, t_[3]);
    if (p_.op == "fused_attention") return be_.fused_attention(t[0], t[1], t[2], a, t_[3], t_[4]);
    if (p_.op == "fused_attention_backward") {
      return be_.fused_attention_backward(t[0], t[1], t[2], t[3], t[4], t[5], a, t_[6], t_[7], t_[8]);
    }
    if (p_.op == "conv2d") return be_.conv2d(t[0], t[1], a, b, t_[2]);
    if (p_.op == "conv2d_backward") return be_.conv2d_backward(t[0], t[1], t[2], a, b, t_[3], t_[4]);
    throw Error("no timed call for the op " + p_.op);
  }
  Backend& be_;
  const MetaProduct& p_;
  Tensor a_, b_, c_, bias_;
  std::vector<Tensor> t_;  // a non-GEMM op's tensors
};

// Milliseconds of one call of `p` on `device` (the mean of the timed calls), and how many
// were timed: one, then more while the time so far is under `budget_ms` (at most kBudgetMs).
std::pair<double, int> time_product(Device device, const MetaProduct& p, double budget_ms) {
  budget_ms = std::min(budget_ms, kBudgetMs);
  Backend& be = backend_for(device);
  ProductCall call(be, p);
  // The weights stay as they are, as the executor promises around a stage's instructions:
  // a CPU's oneDNN packs a weight at the first call and reads the copy after, as in a step.
  FrozenWeights frozen;
  call();  // warm-up: the library's choice of kernel, its buffers, the device's clocks
  be.synchronize();
  std::unique_ptr<Event> start = make_event(device), end = make_event(device);
  double total = 0;
  int calls = 0;
  while (calls < kMaxCalls && (calls == 0 || total < budget_ms)) {
    heartbeat();  // progress, for gpipe run (runtime/heartbeat.h)
    // One call at first; then as many as the rest of the budget holds, between one pair of events.
    int n = 1;
    if (calls > 0) {  // a clock too coarse to see the calls so far: the rest at once
      const double per_call = total / calls;
      n = per_call > 0 ? static_cast<int>(std::min<double>((budget_ms - total) / per_call, kMaxCalls - calls))
                       : kMaxCalls - calls;
      n = std::max(n, 1);
    }
    start->record(be.stream());
    for (int i = 0; i < n; ++i) call();
    end->record(be.stream());
    end->synchronize();
    total += start->elapsed_ms(*end);
    calls += n;
  }
  return {total / calls, calls};
}

using ProductKey =
    std::tuple<std::string, int64_t, int64_t, int64_t, bool, bool, DType, DType, std::string, std::string>;

ProductKey key_of(const MetaProduct& p, Device d) {
  std::string types;  // a non-GEMM op's each tensor's
  for (DType t : p.types) types += dtype_name(t) + std::string(" ");
  return {p.op, p.m, p.n, p.k, p.trans_a, p.trans_b, p.dtype, p.c_dtype, d.str(), p.describe() + types};
}

}  // namespace

double product_peak(const Plan& plan, const std::vector<double>& stage_peaks, int stage) {
  const auto k = static_cast<size_t>(stage);
  if (k >= stage_peaks.size() || k >= plan.devices.size()) return 0;
  const Device d = plan.devices[k];
  // A CPU stage's own threads time the product: its peak, or, where stages take turns on
  // its device (Plan::turns), the device's whole, their shares added.
  const bool turns = k < plan.turns.size();
  double sum = 0;  // a GPU's whole: the shares of the stages on it added
  for (size_t j = 0; j < plan.devices.size() && j < stage_peaks.size(); ++j) {
    if (d.is_cpu() ? j == k || (turns && j < plan.turns.size() && plan.turns[j] == plan.turns[k]) : plan.devices[j] == d) {
      sum += stage_peaks[j];
    }
  }
  return sum;
}

std::vector<GemmRate> measure_gemm_rates(layers::Sequential& model, const Plan& plan, const std::vector<int>& stages,
                                         const std::vector<double>& stage_peaks, int tensor_rank,
                                         double budget_seconds) {
  if (plan.micro_batch_sizes.empty()) return {};
  std::vector<LayerProducts> products;  // on shapes, at the run's micro-batch size
  {
    // A tensor group's layers ask their group for sums: on shapes, a group that only
    // answers with shapes (as the executor's probe does, executor/cell.cc), then the
    // run's group back.
    layers::ShapeCollectives group(tensor_rank, plan.tensor_parallel);
    std::optional<layers::Sequential::CollectivesFor> shapes_group;
    if (model.collectives() != nullptr) shapes_group.emplace(model, &group);
    // The layers are on their stages' devices by now, so each layer's meta backend answers
    // which attention it runs as its device's backend did in the run.
    count_launches(model, plan.micro_batch_sizes.front(), &products);
  }
  struct Entry {
    MetaProduct product;
    Device device;
    std::set<int> stages, layers;
    std::set<char> phases;
    int64_t calls = 0;
  };
  std::map<ProductKey, Entry> entries;
  for (int stage : stages) {
    const Device device = plan.devices.at(static_cast<size_t>(stage));
    for (int c = 0; c < plan.num_cells(); ++c) {
      if (plan.schedule.stage_of_cell(c) != stage) continue;
      const CellSpec& cell = plan.cells.at(static_cast<size_t>(c));
      for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
        const LayerProducts& lp = products.at(static_cast<size_t>(i));
        for (const auto& [phase, list] : {std::pair<char, const std::vector<MetaProduct>*>{'F', &lp.forward},
                                          {'B', &lp.backward}, {'W', &lp.weight}}) {
          for (const MetaProduct& p : *list) {
            Entry& e = entries.try_emplace(key_of(p, device), Entry{p, device}).first->second;
            e.stages.insert(stage);
            e.layers.insert(i);
            e.phases.insert(phase);
            ++e.calls;
          }
        }
      }
    }
  }
  // The most FLOPs a micro-batch first, so that a budget spent leaves out the smallest.
  std::vector<Entry*> order;
  for (auto& kv : entries) order.push_back(&kv.second);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->product.flops() * static_cast<double>(a->calls) > b->product.flops() * static_cast<double>(b->calls);
  });
  const auto start = std::chrono::steady_clock::now();
  auto spent_ms = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count(); };
  std::vector<GemmRate> out;
  size_t refused = 0;  // ops the device would not run alone
  for (Entry* ep : order) {
    const Entry& e = *ep;
    if (spent_ms() >= budget_seconds * 1e3) break;
    GemmRate r;
    r.op = e.product.op;
    r.m = e.product.m;
    r.n = e.product.n;
    r.k = e.product.k;
    r.trans_a = e.product.trans_a;
    r.trans_b = e.product.trans_b;
    r.operands = e.product.describe();
    r.op_flops = e.product.is_gemm() ? 0 : e.product.flops();
    r.dtype = dtype_name(e.product.dtype);
    r.c_dtype = dtype_name(e.product.c_dtype);
    r.device = e.device.str();
    r.stages.assign(e.stages.begin(), e.stages.end());
    r.layers = index_ranges(e.layers);
    for (char ph : {'F', 'B', 'W'}) {
      if (e.phases.count(ph) > 0) r.phases += ph;
    }
    r.calls = e.calls;
    try {
      std::tie(r.ms, r.timed_calls) = time_product(e.device, e.product, budget_seconds * 1e3 - spent_ms());
    } catch (const std::exception& x) {
      // An op that will not run alone (a shape cuDNN's fused attention refused, which the
      // layer ran another way) costs the report its line, not the others'.
      spdlog::warn("the run's {} ({}) could not be timed alone on {}: {}", r.op,
                   r.operands.empty() ? std::to_string(r.m) + "x" + std::to_string(r.n) + "x" + std::to_string(r.k)
                                      : r.operands,
                   r.device, x.what());
      ++refused;
      continue;
    }
    r.flops_per_second = r.ms > 0 ? e.product.flops() / (r.ms / 1e3) : 0;
    r.peak_flops_per_second = product_peak(plan, stage_peaks, *e.stages.begin());
    out.push_back(std::move(r));
  }
  if (out.size() + refused < order.size()) {
    spdlog::warn("the run's matrix products: {} of {} timed within {:.2g} s (a quarter of pipeline.timeout_s, at most "
                 "10 s); the others, the fewest FLOPs a micro-batch, are not in the report",
                 out.size(), order.size() - refused, budget_seconds);
  }
  std::stable_sort(out.begin(), out.end(), [](const GemmRate& a, const GemmRate& b) {
    return a.ms * static_cast<double>(a.calls) > b.ms * static_cast<double>(b.calls);
  });
  return out;
}

}  // namespace pipeline
}  // namespace gpipe

#include "layers/layer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include "layers/tensor_parallel.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

void mark_sequence_partial(const std::vector<Parameter*>& params, bool partial) {
  for (Parameter* p : params) p->sequence_partial = partial;
}

void refresh_all(Backend& be, const std::vector<Parameter*>& params) {
  std::vector<Tensor> masters, working;
  for (Parameter* p : params) {
    if (!p->working.defined()) continue;
    masters.push_back(p->value);
    working.push_back(p->working);
  }
  be.cast_all(masters, working);
}

std::vector<CostPart> backward_parts(const LayerCost& c) {
  if (!c.backward_parts.empty()) return c.backward_parts;
  std::vector<CostPart> parts;
  const CostPart b{false, c.backward_flops - c.weight_grad_flops, c.backward_bytes - c.weight_grad_bytes};
  const CostPart w{true, c.weight_grad_flops, c.weight_grad_bytes};
  for (const CostPart& p : {b, w}) {
    if (p.flops > 0 || p.bytes > 0) parts.push_back(p);
  }
  return parts;
}

LayerCost without_input_grad(LayerCost c) {
  const double input_flops = c.backward_flops - c.weight_grad_flops;  // B's
  const double share = input_flops > 0 ? c.input_grad_flops / input_flops : 0.0;
  c.backward_bytes = c.weight_grad_bytes + (c.backward_bytes - c.weight_grad_bytes) * (1.0 - share);
  c.backward_flops -= c.input_grad_flops;
  c.input_grad_flops = 0;
  for (CostPart& p : c.backward_parts) {
    if (p.weight) continue;
    p.flops *= 1.0 - share;
    p.bytes *= 1.0 - share;
  }
  return c;
}

Shape batched(int64_t batch, const Shape& sample) {
  Shape s{batch};
  s.insert(s.end(), sample.begin(), sample.end());
  return s;
}

void check_batch(const Tensor& x, const Shape& sample, DType dtype, const std::string& who, const char* what) {
  Shape want{x.dim() > 0 ? x.size(0) : -1};
  want.insert(want.end(), sample.begin(), sample.end());
  if (!x.defined() || x.shape() != want || x.dtype() != dtype) {
    throw UserError(who + ": " + what + " is " + (x.defined() ? x.str() : std::string("undefined")) +
                    ", expected " + dtype_name(dtype) + " (batch, " + shape_str(sample).substr(1) +
                    "; check the previous layer's output size or model.input");
  }
}

namespace {

bool same_place(Device a, Device b) { return a == b || (a.is_cpu() && b.is_cpu()); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

std::string Layer::name_for_errors() const {
  return (index_ >= 0 ? "layer " + std::to_string(index_) : std::string("layer")) +
         (name_.empty() ? "" : " '" + name_ + "'") + " (" + describe() + ", type '" + type() + "')";
}

Tensor Layer::forward(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  check_batch(x, input_shape_, input_dtype_, describe(), "input");
  GPIPE_CHECK(same_place(x.device(), be.device()),
              describe() + ": input on " + x.device().str() + ", backend on " + be.device().str());
  Tensor y = forward_impl(be, x, ctx, args);
  // A layer of one's own that returns the wrong shape would otherwise fail somewhere
  // downstream (the next layer, the loss, a transport) under another name.
  const Shape want = batched(x.size(0), output_shape_);
  if (!y.defined() || y.shape() != want || y.dtype() != dtype_ || !same_place(y.device(), be.device())) {
    throw UserError(name_for_errors() + ": forward returned " + (y.defined() ? y.str() : std::string("no tensor")) +
                    " for a batch of " + std::to_string(x.size(0)) + ", but it must return (batch, *output_shape()) = " +
                    dtype_name(dtype_) + shape_str(want) + " on " + be.device().str() + "; fix forward_impl, or the "
                    "output shape and dtype the layer gives its Layer constructor");
  }
  return y;
}

Tensor Layer::backward(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  check_batch(dy, output_shape_, dtype_, describe(), "output gradient");
  const bool dx_wanted = need_dx && input_dtype_ != DType::kI32;
  Tensor dx = backward_impl(be, dy, ctx, dx_wanted);
  const Shape want = batched(dy.size(0), input_shape_);
  if (dx_wanted && (!dx.defined() || dx.shape() != want || dx.dtype() != input_dtype_ ||
                    !same_place(dx.device(), be.device()))) {
    throw UserError(name_for_errors() + ": backward returned " + (dx.defined() ? dx.str() : std::string("no tensor")) +
                    " as the input gradient, but it must return dx shaped like the input, " +
                    dtype_name(input_dtype_) + shape_str(want) + " on " + be.device().str() +
                    " (an undefined tensor only when need_dx is false); fix backward_impl");
  }
  return dx;
}

namespace {

// What is wrong with a cost's listed backward_parts, or "": each is finite and
// non-negative, and they sum to the totals (to rounding: a composite adds them in
// another order than its totals).
std::string parts_mistake(const LayerCost& c) {
  if (c.backward_parts.empty()) return "";
  double sums[4] = {0, 0, 0, 0};  // flops, bytes, W's flops, W's bytes
  for (const CostPart& p : c.backward_parts) {
    if (!(p.flops >= 0) || !(p.bytes >= 0) || !std::isfinite(p.flops) || !std::isfinite(p.bytes)) {
      return "a backward part counts flops = " + num(p.flops) + " and bytes = " + num(p.bytes) +
             "; every count must be finite and non-negative";
    }
    sums[0] += p.flops;
    sums[1] += p.bytes;
    if (p.weight) {
      sums[2] += p.flops;
      sums[3] += p.bytes;
    }
  }
  const std::pair<const char*, double> totals[] = {{"backward_flops", c.backward_flops},
                                                   {"backward_bytes", c.backward_bytes},
                                                   {"weight_grad_flops", c.weight_grad_flops},
                                                   {"weight_grad_bytes", c.weight_grad_bytes}};
  const char* of[] = {"flops of its backward_parts", "bytes of its backward_parts", "flops of its W parts",
                      "bytes of its W parts"};
  for (int i = 0; i < 4; ++i) {
    const double total = totals[i].second;
    if (std::abs(sums[i] - total) > 1e-9 * std::max(1.0, std::abs(total))) {
      return std::string("the ") + of[i] + " sum to " + num(sums[i]) + " but " + totals[i].first + " = " + num(total) +
             "; every kernel of backward is one part (a composite adds a part for its own work beside its "
             "sub-layers')";
    }
  }
  return "";
}

// What is wrong with a layer's cost(batch), or "" (the rule is check_cost's, layer.h).
std::string cost_mistake(Layer& layer, int64_t batch, const LayerCost& c) {
  const std::pair<const char*, double> counts[] = {
      {"forward_flops", c.forward_flops},
      {"backward_flops", c.backward_flops},
      {"input_grad_flops", c.input_grad_flops},
      {"weight_grad_flops", c.weight_grad_flops},
      {"forward_bytes", c.forward_bytes},
      {"backward_bytes", c.backward_bytes},
      {"weight_grad_bytes", c.weight_grad_bytes},
      {"param_bytes", static_cast<double>(c.param_bytes)},
      {"output_bytes", static_cast<double>(c.output_bytes)},
      {"saved_bytes", static_cast<double>(c.saved_bytes)}};
  for (const auto& [name, v] : counts) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return std::string(name) + " = " + num(v) + "; every count must be finite and non-negative";
    }
  }
  int64_t param_bytes = 0;
  for (Parameter* p : layer.parameters()) {
    param_bytes += static_cast<int64_t>(p->compute().nbytes());  // as the layer computes with them
  }
  if (c.param_bytes != param_bytes) {
    return "param_bytes = " + std::to_string(c.param_bytes) + " but its parameters() hold " +
           std::to_string(param_bytes) + " bytes";
  }
  const int64_t output_bytes =
      batch * shape_numel(layer.output_shape()) * static_cast<int64_t>(dtype_size(layer.dtype()));
  if (c.output_bytes != output_bytes) {
    return "output_bytes = " + std::to_string(c.output_bytes) + " but its output for this batch, " +
           std::to_string(batch) + " x " + dtype_name(layer.dtype()) + shape_str(layer.output_shape()) + ", is " +
           std::to_string(output_bytes) + " bytes";
  }
  // A forward without arithmetic is allowed for a table lookup (its input is int32 ids, as
  // an embedding without learned positions), which then counts its moves in bytes (at
  // least its output, read and written).
  const bool moves_only = layer.input_dtype() == DType::kI32 && c.forward_flops == 0 &&
                          c.forward_bytes >= 2.0 * static_cast<double>(output_bytes);
  if (param_bytes > 0 && ((c.forward_flops <= 0 && !moves_only) || c.backward_flops <= 0)) {
    return "it has parameters but counts forward_flops = " + num(c.forward_flops) + " and backward_flops = " +
           num(c.backward_flops) + "; count the arithmetic its forward and backward do";
  }
  if (c.input_grad_flops > c.backward_flops) {
    return "input_grad_flops = " + num(c.input_grad_flops) + " exceeds backward_flops = " + num(c.backward_flops) +
           " (it is the part of backward that computes dx)";
  }
  if (!layer.splits_backward() && (c.weight_grad_flops > 0 || c.weight_grad_bytes > 0)) {
    return "weight_grad_flops = " + num(c.weight_grad_flops) + " and weight_grad_bytes = " + num(c.weight_grad_bytes) +
           " but it does not split its backward (splits_backward() is false), so its W does nothing; count 0";
  }
  if (layer.splits_backward() && param_bytes > 0 && c.weight_grad_flops <= 0) {
    return "it splits its backward but counts weight_grad_flops = 0; count what backward_weight_impl does (its "
           "weight gradients), or the planner takes W for free";
  }
  if (c.input_grad_flops + c.weight_grad_flops > c.backward_flops) {
    return "input_grad_flops + weight_grad_flops = " + num(c.input_grad_flops) + " + " + num(c.weight_grad_flops) +
           " exceeds backward_flops = " + num(c.backward_flops) +
           " (dx is computed in B and the weight gradients in W, two parts of backward)";
  }
  if (c.weight_grad_bytes > c.backward_bytes) {
    return "weight_grad_bytes = " + num(c.weight_grad_bytes) + " exceeds backward_bytes = " + num(c.backward_bytes) +
           " (it is the part of backward's memory traffic that W moves)";
  }
  return parts_mistake(c);
}

}  // namespace

void check_cost(Layer& layer, int64_t batch, const LayerCost& cost) {
  const std::string wrong = cost_mistake(layer, batch, cost);
  if (wrong.empty()) return;
  throw UserError(layer.name_for_errors() + ": cost(" + std::to_string(batch) + ") is wrong: " + wrong +
                  ". The balancer splits the model by these counts, so cost() must count exactly what the layer "
                  "does for a batch of that size (see docs/WRITING_LAYERS.md); fix the layer's cost()");
}

Tensor Layer::backward_input(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  check_batch(dy, output_shape_, dtype_, describe(), "output gradient");
  return backward_input_impl(be, dy, ctx, need_dx && input_dtype_ != DType::kI32);
}

Tensor Layer::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  GPIPE_CHECK(splits_backward(), describe() + " implements neither backward_impl nor backward_input_impl");
  Context c = ctx;  // shallow: the halves add what W needs to the copy
  Tensor dx = backward_input_impl(be, dy, c, need_dx);
  backward_weight_impl(be, c);
  return dx;
}

void Layer::backward_weight(Backend& be, const std::vector<Context*>& ctxs) {
  GPIPE_CHECK(!ctxs.empty(), describe() + ": a batched weight gradient of no micro-batch");
  if (ctxs.size() == 1) {
    backward_weight_impl(be, *ctxs[0]);
  } else {
    backward_weight_batch_impl(be, ctxs);
  }
}

std::vector<Context*> children_at(const std::vector<Context*>& ctxs, size_t index) {
  std::vector<Context*> out;
  out.reserve(ctxs.size());
  for (Context* c : ctxs) out.push_back(&c->children.at(index));
  return out;
}

Tensor concat_saved(Backend& be, const std::vector<Context*>& ctxs, size_t i, const std::string& who) {
  std::vector<const Tensor*> parts;
  for (const Context* c : ctxs) {
    GPIPE_CHECK(c->saved.size() > i, who + ": weight gradient without its backward_input");
    parts.push_back(&c->saved[i]);
  }
  GPIPE_CHECK(!parts.empty() && parts[0]->dim() >= 1, "concat_saved: nothing to stack");
  const Tensor& first = *parts[0];
  Shape shape = first.shape();
  int64_t rows = 0;
  for (const Tensor* t : parts) {
    GPIPE_CHECK(t->dim() == first.dim() && t->dtype() == first.dtype() && t->device() == first.device() &&
                    std::equal(t->shape().begin() + 1, t->shape().end(), first.shape().begin() + 1),
                "concat_saved: parts of different shapes, dtypes or devices");
    rows += t->size(0);
  }
  shape[0] = rows;
  Tensor out = be.empty(shape, first.dtype());
  int64_t at = 0;
  for (const Tensor* t : parts) {
    Tensor slot = out.narrow_rows(at, t->size(0));
    be.copy(*t, slot);
    at += t->size(0);
  }
  return out;
}

void Layer::to(Device device) {
  for (Parameter* p : parameters()) {
    if (p->value.is_meta()) {  // planning on shapes: the same tensors without data, on `device`
      const ShapesOnly shapes;
      p->value = Tensor::empty(p->value.shape(), p->value.dtype(), device);
      p->grad = Tensor::empty(p->value.shape(), p->value.dtype(), device);
      if (p->working.defined()) p->working = Tensor::empty(p->value.shape(), p->working.dtype(), device);
      continue;
    }
    if (p->value.device() != device) {
      Tensor moved = Tensor::empty(p->value.shape(), p->value.dtype(), device);
      copy_tensor(p->value, moved);
      p->value = moved;
    }
    p->grad = backend_for(device).zeros(p->value.shape(), p->value.dtype());
    if (p->working.defined()) {  // made again from value: a layer may have set value since
      p->working = Tensor::empty(p->value.shape(), p->working.dtype(), device);
      p->refresh(backend_for(device));
    }
  }
  device_ = device;
}

void fill_uniform(Tensor& t, double bound, uint64_t seed) {
  const int64_t n = t.numel();
  const bool f32 = t.dtype() == DType::kF32;
  GPIPE_CHECK(f32 || t.dtype() == DType::kF64, "fill_uniform of " + t.str());
  void* data = t.raw_data();
  auto fill = [&](int64_t begin, int64_t end) {
    Rng rng(seed);
    rng.discard(static_cast<uint64_t>(begin));
    if (f32) {
      float* d = static_cast<float*>(data);
      for (int64_t i = begin; i < end; ++i) d[i] = static_cast<float>(rng.uniform(-bound, bound));
    } else {
      double* d = static_cast<double*>(data);
      for (int64_t i = begin; i < end; ++i) d[i] = rng.uniform(-bound, bound);
    }
  };
  // One stream, cut among the cores for a large tensor: the same values as one thread's.
  const int64_t chunk = int64_t{1} << 20;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), n / chunk));
  if (threads <= 1) {
    fill(0, n);
    return;
  }
  std::vector<std::thread> workers;
  for (int w = 1; w < threads; ++w) workers.emplace_back(fill, n * w / threads, n * (w + 1) / threads);
  fill(0, n / threads);
  for (std::thread& w : workers) w.join();
}

Parameter Layer::make_parameter(const std::string& name, const Shape& shape, double bound, uint64_t seed) {
  if (dtype_ != DType::kF32 && dtype_ != DType::kF64 && !is_narrow(dtype_)) {
    throw UserError(std::string("parameters in ") + dtype_name(dtype_) +
                    " are not supported; use model.dtype: float32, float64, bf16 or fp16");
  }
  Parameter p;
  p.name = name;
  const DType master = master_dtype(dtype_);
  if (ShapesOnly::active()) {  // planning on shapes: the tensors, without data or values
    p.value = Tensor::empty(shape, master, Device::cpu());
    p.grad = Tensor::empty(shape, master, Device::cpu());
    if (is_narrow(dtype_)) p.working = Tensor::empty(shape, dtype_, Device::cpu());
    return p;
  }
  p.value = Tensor::empty(shape, master, Device::cpu());
  fill_uniform(p.value, bound, seed);
  heartbeat();  // building a large model is progress (runtime/heartbeat.h)
  Backend& be = backend_for(Device::cpu());
  p.grad = be.zeros(shape, master);
  if (is_narrow(dtype_)) {
    p.working = be.empty(shape, dtype_);
    p.refresh(be);
  }
  return p;
}

// Block `rank` of `count` along `dim` (of each of `groups` parts of it) of the values
// fill_uniform(whole, bound, seed) draws: each run of the block that is contiguous in
// the whole tensor, from its place in the stream.
void fill_uniform_block(Tensor& t, double bound, uint64_t seed, const Shape& whole, int dim, int rank, int count,
                        int groups) {
  const bool f32 = t.dtype() == DType::kF32;
  GPIPE_CHECK(f32 || t.dtype() == DType::kF64, "fill_uniform_block of " + t.str());
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= whole[d];
  for (size_t d = static_cast<size_t>(dim) + 1; d < whole.size(); ++d) inner *= whole[d];
  const int64_t part = whole[dim] / groups;  // a part's extent along dim
  const int64_t run = part / count * inner;   // the block's contiguous run in each part of each outer slice
  int64_t i = 0;                              // the next element of t
  for (int64_t o = 0; o < outer; ++o) {
    for (int g = 0; g < groups; ++g) {
      Rng rng(seed);
      rng.discard(static_cast<uint64_t>((o * whole[dim] + g * part) * inner + rank * run));
      for (int64_t j = 0; j < run; ++j, ++i) {
        const double v = rng.uniform(-bound, bound);
        if (f32) {
          t.data<float>()[i] = static_cast<float>(v);
        } else {
          t.data<double>()[i] = v;
        }
      }
    }
  }
}

Parameter Layer::make_parameter_block(const std::string& name, const Shape& whole, int dim, int rank, int count,
                                      int groups, double bound, uint64_t seed) {
  GPIPE_CHECK(dim >= 0 && dim < static_cast<int>(whole.size()) && count >= 1 && rank >= 0 && rank < count &&
                  groups >= 1 && whole[dim] % groups == 0,
              name + ": no block " + std::to_string(rank) + " of " + std::to_string(count) + " along dimension " +
                  std::to_string(dim) + " of " + shape_str(whole) + " in " + std::to_string(groups) + " parts");
  Shape shape = whole;
  shape[dim] = groups * block_length(whole[dim] / groups, count, "parameter '" + name + "' " + shape_str(whole));
  Parameter p = make_parameter(name, shape, 0.0, 0);  // the dtype checks, a zero gradient, the working copy
  p.shard_dim = dim;
  p.shard_rank = rank;
  p.shard_count = count;
  p.shard_groups = groups;
  p.whole = whole;
  if (p.value.defined() && !p.value.is_meta()) {
    fill_uniform_block(p.value, bound, seed, whole, dim, rank, count, groups);
    p.refresh(backend_for(Device::cpu()));
  }
  return p;
}

Parameter Layer::constant_parameter(const std::string& name, const Shape& shape, double value) {
  Parameter p = make_parameter(name, shape, 0.0, 0);  // uniform in [0, 0]: the dtype checks and a zero gradient
  if (p.value.defined() && !p.value.is_meta()) {
    backend_for(Device::cpu()).fill(p.value, value);
    p.refresh(backend_for(Device::cpu()));
  }
  return p;
}

}  // namespace layers
}  // namespace gpipe

#include "pipeline/planning/plan.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "kernels/backend.h"
#include "kernels/meta_backend.h"
#include "layers/tensor_parallel.h"
#include "partition/balance.h"
#include "pipeline/executor/held_bytes.h"
#include "pipeline/planning/profile.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// The stages' devices. In a multi-process run only this process's stage (local_stage)
// must exist here; the others are on other nodes.
std::vector<Device> plan_devices(const Config& c, int local_stage) {
  const int K = c.pipeline.partitions;
  std::vector<Device> out;
  if (c.pipeline.devices.empty()) {
    for (int k = 0; k < K; ++k) out.push_back(Device::cpu(k));
    return out;
  }
  if (static_cast<int>(c.pipeline.devices.size()) != K) {
    throw UserError("pipeline.devices lists " + std::to_string(c.pipeline.devices.size()) +
                    " devices but pipeline.partitions is " + std::to_string(K) + "; give one device per partition");
  }
  for (const auto& d : c.pipeline.devices) {
    Device dev = parse_device(d);
    const bool here = local_stage < 0 || static_cast<int>(out.size()) == local_stage;
    if (here && dev.is_cuda() && dev.index >= cuda_device_count()) {
      throw UserError("pipeline.devices names " + dev.str() + " but this machine has " +
                      std::to_string(cuda_device_count()) + " visible CUDA devices; use cpu:N devices instead");
    }
    out.push_back(dev);
  }
  return out;
}

}  // namespace

std::vector<int> plan_balance(const Config& c, const layers::Sequential& model, int cells, int64_t micro) {
  if (!c.pipeline.balance.empty()) {
    partition::validate_balance(c.pipeline.balance, model.size(), cells);
    return c.pipeline.balance;
  }
  const bool recompute = recomputes(c.pipeline.recompute);
  if (c.pipeline.balance_by == "profile") {  // torchgpipe's balance by time
    const ProfileEntry e =
        require_profile(c.pipeline.profile, profile_key(model, micro, first_device(c), c.train.blas_threads));
    return partition::balance_by_cost(profile_layer_costs(e, recompute), cells);
  }
  return partition::balance_by_cost(partition::layer_costs(model, micro, recompute, cost_overrides(c)), cells);
}

Device first_device(const Config& c) {
  return c.pipeline.devices.empty() ? Device::cpu() : parse_device(c.pipeline.devices[0]);
}

std::vector<std::optional<double>> cost_overrides(const Config& c) {
  std::vector<std::optional<double>> out;
  for (const auto& l : c.model.layers) out.push_back(l.cost);
  return out;
}

Plan plan_sizes(const Config& c) {
  Plan p;
  p.stages = c.pipeline.partitions;
  p.virtual_stages = c.pipeline.virtual_stages;
  p.replicas = c.pipeline.replicas;
  p.tensor_parallel = c.pipeline.tensor_parallel;
  p.sequence_parallel = c.pipeline.sequence_parallel && p.tensor_parallel > 1;
  p.shard_optimizer = c.pipeline.shard_optimizer == "optimizer" && p.replicas > 1;
  p.batch_size = c.train.batch_size;
  p.recompute = c.pipeline.recompute;
  if (p.replicas > 1 && p.batch_size % p.replicas != 0) {
    throw UserError("train.batch_size = " + std::to_string(p.batch_size) + " does not split evenly over " +
                    std::to_string(p.replicas) + " replicas; make it a multiple of pipeline.replicas");
  }
  p.replica_batch = p.batch_size / p.replicas;
  p.micro_batch_sizes = split_sizes(p.replica_batch, c.pipeline.micro_batches);  // validates N >= M
  return p;
}

Plan make_plan(const Config& c, const layers::Sequential& model, const PlanOptions& options) {
  Plan p = plan_sizes(c);
  const int cells = p.stages * p.virtual_stages;
  if (cells > model.size()) {
    throw UserError("the model has only " + std::to_string(model.size()) + " layers but the pipeline has " +
                    std::to_string(cells) + " cells (pipeline.partitions x pipeline.virtual_stages); every cell "
                    "needs a layer: lower pipeline.partitions or pipeline.virtual_stages");
  }
  ScheduleRequest request;
  request.name = c.pipeline.schedule;
  request.num_stages = p.stages;
  request.num_chunks = p.virtual_stages;
  request.num_micro_batches = p.micro_batches();
  request.mode = p.recompute;
  request.file = c.pipeline.schedule_file;
  request.comm = options.comm;
  request.batch_weights = c.pipeline.batch_weight_gradients;
  p.schedule = make_schedule(request);
  p.balance = plan_balance(c, model, cells, p.largest_micro_batch());
  p.devices = plan_devices(c, options.local_stage);
  // A tensor group's members are processes, each running its stage alone (as under mpirun).
  p.turns = device_turns(p.devices, options.local_stage < 0 && p.tensor_parallel <= 1);
  p.cells = make_cells(p.balance, p.schedule, p.devices);
  // NORM: clipping's global norm, and fp16 loss scaling's overflow check.
  lower_collectives(p.schedule, run_collectives(model, p.cells, p.replicas > 1,
                                                c.optimizer.clip_grad_norm > 0 || c.optimizer.loss_scale > 0,
                                                p.shard_optimizer));
  // The tensor group's collectives inside each compute instruction, found on the
  // member's shapes (any member's: they ask the same).
  if (p.tensor_parallel > 1) {
    auto& member = const_cast<layers::Sequential&>(model);  // run on shapes; its group is set back
    lower_tensor_collectives(p.schedule, run_tensor_program(member, p.cells, c.model.member.rank, p.tensor_parallel));
  }
  p.stage_flops = useful_flops(model, p);
  // One probe of the model on shapes (or the sweep's, made once for many plans): what
  // the stages hold, and each layer's ops.
  const ActivationLayout probed = options.layout != nullptr ? ActivationLayout{} : probe_activations(model, p.devices);
  const ActivationLayout& layout = options.layout != nullptr ? *options.layout : probed;
  p.memory = estimate_memory(p, model, c.optimizer.optimizer, layout);
  p.launches = layout.launches;
  return p;
}

std::vector<double> useful_flops(const layers::Sequential& model, const Plan& p) {
  std::vector<double> out(p.stages, 0.0);
  std::map<int64_t, std::vector<layers::LayerCost>> at;  // per micro-batch size
  for (int64_t rows : p.micro_batch_sizes) {
    auto it = at.find(rows);
    if (it == at.end()) it = at.emplace(rows, model.costs(rows)).first;
    const std::vector<layers::LayerCost>& costs = it->second;
    for (int cell = 0; cell < p.num_cells(); ++cell) {
      const int stage = p.schedule.stage_of_cell(cell);
      const CellSpec& s = p.cells[cell];
      for (int l = s.first_layer; l < s.first_layer + s.num_layers; ++l) {
        const layers::LayerCost c = l == 0 ? layers::without_input_grad(costs[l]) : costs[l];
        out[stage] += c.forward_flops + c.backward_flops;
      }
    }
  }
  return out;
}

int optimizer_slots(const layers::OptimizerConfig& o) {
  if (o.type == "adam" || o.type == "adamw") return 2;
  return o.momentum != 0.0 ? 1 : 0;
}

int64_t ContextKeeps::own(int64_t batch) const {
  return static_cast<int64_t>(std::llround(std::max(0.0, own_base + own_per_sample * static_cast<double>(batch))));
}

namespace {

// A layer's (or the loss's) context: bytes besides its input x and output y (and after
// B, the output gradient dy and the input gradient dx), and which of those it keeps.
struct ContextBytes {
  int64_t own = 0;
  bool input = false, output = false, grad_output = false, grad_input = false;
};
ContextBytes context_bytes(const layers::Context& ctx, const Tensor& in, const Tensor& out, const Tensor& dy = {},
                           const Tensor& dx = {}) {
  BufferList all;
  add_buffers(ctx, all);
  BufferList rest;
  ContextBytes k;
  auto is = [](const Tensor& t, const void* data) { return t.defined() && t.raw_data() == data; };
  for (const auto& b : all) {
    if (is(in, b.first)) {
      k.input = true;
    } else if (is(out, b.first)) {
      k.output = true;
    } else if (is(dy, b.first)) {
      k.grad_output = true;
    } else if (is(dx, b.first)) {
      k.grad_input = true;
    } else {
      rest.push_back(b);
    }
  }
  k.own = distinct_bytes(std::move(rest));
  return k;
}

}  // namespace

namespace {

// The layout from the layers' cost() counts, where a probe cannot run: each layer's
// saved bytes as its own, nothing shared (an overestimate where layers share buffers);
// a splitting layer's W keeps as much again, its input and its output gradient.
ActivationLayout layout_from_costs(const layers::Sequential& model) {
  const auto one = model.costs(1), two = model.costs(2);
  ActivationLayout out;
  for (size_t i = 0; i < one.size(); ++i) {
    LayerActivation a;
    a.forward.own_per_sample = static_cast<double>(two[i].saved_bytes - one[i].saved_bytes);
    a.forward.own_base = static_cast<double>(one[i].saved_bytes) - a.forward.own_per_sample;
    if (model.layer(static_cast<int>(i)).splits_backward()) {
      a.weight = a.forward;
      a.weight.keeps_input = a.weight.keeps_grad_output = true;
    }
    out.layers.push_back(a);
  }
  return out;
}

ActivationLayout probe_layers(const layers::Sequential& model_in, bool on_shapes);

}  // namespace

ActivationLayout probe_activations(const layers::Sequential& model) {
  try {
    ActivationLayout out = probe_layers(model, /*on_shapes=*/true);
    try {
      out.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(count_launches(model));
    } catch (const std::exception& e) {  // a backward that reads data on the host: no launch term
      spdlog::debug("planning: the model's ops were not counted ({})", e.what());
    }
    return out;
  } catch (const std::exception& e) {
    // A layer of one's own that reads tensor data on the host cannot run on shapes: the
    // probe computes instead (costing a forward at batch 1 and 2), and says so.
    spdlog::warn("planning: the model cannot run on shapes ({}); its activations are probed by computing on its "
                 "devices instead, which takes as long as a forward and backward of two samples",
                 e.what());
  }
  try {
    return probe_layers(model, /*on_shapes=*/false);
  } catch (const std::exception&) {
    // A layer that fails on a batch of zeros fails in the run too, where its error
    // names the real batch; the estimate falls back to the cost counts meanwhile.
    return layout_from_costs(model);
  }
}

ActivationLayout probe_activations(const layers::Sequential& model, const std::vector<Device>& devices) {
  std::optional<MetaAnswersAs> as_gpu;
  for (Device d : devices) {
    if (!d.is_cpu()) {
      as_gpu.emplace(d);
      break;
    }
  }
  return probe_activations(model);
}

ActivationLayout probe_activations_on_devices(const layers::Sequential& model) {
  return probe_layers(model, /*on_shapes=*/false);
}

namespace {
// Runs one phase of a layer (or the loss) on shapes and adds its ops and its
// collectives over the tensor group (sums; all-gathers and reduce-scatters) to the
// counts given.
template <typename Phase>
void count_phase(int64_t& ops, int64_t& group_sums, int64_t& group_bytes, int64_t& gathers, int64_t& gather_bytes,
                 Phase&& phase) {
  const MetaOpCount op_count;
  const layers::GroupSumCount sum_count;
  phase();
  ops += op_count.count();
  group_sums += sum_count.sums();
  group_bytes += sum_count.bytes();
  gathers += sum_count.gathers();
  gather_bytes += sum_count.gather_bytes();
}

// `h` on `be`'s device: a copy there when the previous layer's device is another, as the
// executor hands activations over between stages.
Tensor handed_over(Backend& be, const Tensor& h) {
  if (h.device() == be.device()) return h;
  Tensor moved = be.empty(h.shape(), h.dtype());
  be.copy(h, moved);
  return moved;
}
}  // namespace

std::vector<partition::LayerLaunches> count_launches(const layers::Sequential& model_in, int64_t batch,
                                                     std::vector<LayerProducts>* products) {
  // Recompute mode changes no layer state (as in probe_layers below).
  auto& model = const_cast<layers::Sequential&>(model_in);
  ShapesOnly shapes;
  const int L = model.size();
  std::vector<partition::LayerLaunches> out(static_cast<size_t>(L));
  if (products != nullptr) products->assign(static_cast<size_t>(L), {});
  MetaProducts listed;  // each phase's products, taken into `products` after it
  auto take = [&](int layer, std::vector<MetaProduct> LayerProducts::*phase) {
    std::vector<MetaProduct> got = listed.take();
    if (products == nullptr) return;
    auto& to = (*products)[static_cast<size_t>(layer)].*phase;
    to.insert(to.end(), got.begin(), got.end());
  };
  Shape shape{batch};
  for (int64_t d : model.input_shape()) shape.push_back(d);
  Backend* be = &meta_backend(model.layer(0).device());
  Tensor h = be->zeros(shape, model.input_dtype());
  // Training, as F runs: dropout's ops counted, and BatchNorm's copies of its statistics
  // (which it keeps nothing of on shapes); at a step no run takes, as the executor's
  // shape probe (executor/cell.cc).
  layers::ForwardArgs args;
  args.step = std::numeric_limits<uint64_t>::max();
  layers::ForwardArgs again = args;  // R: the same forward, keeping nothing
  again.recompute = true;
  for (int i = 0; i < L; ++i) {
    be = &meta_backend(model.layer(i).device());
    h = handed_over(*be, h);  // the executor's hand-over, not the layer's ops
    layers::Layer& layer = model.layer(i);
    partition::LayerLaunches& n = out[static_cast<size_t>(i)];
    layers::Context ctx;
    Tensor y;
    count_phase(n.forward, n.group_sums_forward, n.group_bytes_forward, n.group_gathers_forward,
                n.group_gather_bytes_forward, [&] { y = layer.forward(*be, h, &ctx, args); });
    take(i, &LayerProducts::forward);
    {  // R's ops; its sums and gathers over the group are F's (GroupSumCount counted once)
      int64_t sums = 0, bytes = 0, gathers = 0, gather_bytes = 0;
      layers::Context rctx;
      count_phase(n.recompute, sums, bytes, gathers, gather_bytes, [&] { layer.forward(*be, h, &rctx, again); });
      listed.take();  // R's products are F's
    }
    const Tensor dy = be->zeros(y.shape(), y.dtype());
    auto backward_input = [&] { layer.backward_input(*be, dy, ctx, i > 0); };
    auto whole_backward = [&] { layer.backward(*be, dy, ctx, i > 0); };
    if (layer.splits_backward()) {
      count_phase(n.backward_input, n.group_sums_backward, n.group_bytes_backward, n.group_gathers_backward,
                  n.group_gather_bytes_backward, backward_input);
      take(i, &LayerProducts::backward);
      // W's sums: replicated key/value heads' weight gradients (W gathers nothing: B kept
      // what it gathered).
      int64_t gathers = 0, gather_bytes = 0;
      count_phase(n.backward_weight, n.group_sums_weight, n.group_bytes_weight, gathers, gather_bytes,
                  [&] { layer.backward_weight(*be, ctx); });
      take(i, &LayerProducts::weight);
      GPIPE_CHECK(gathers == 0, "layer " + std::to_string(i) + "'s W gathers positions");
    } else {
      count_phase(n.backward_input, n.group_sums_backward, n.group_bytes_backward, n.group_gathers_backward,
                  n.group_gather_bytes_backward, whole_backward);
      take(i, &LayerProducts::backward);
    }
    // Once a step: its sequence-partial gradients summed over the group in one collective
    // (Executor::gradients_final), a narrow one as float32 (GroupCollectives).
    for (const layers::Parameter* p : layer.parameters()) {
      if (!p->sequence_partial) continue;
      n.group_sums_step = 1;
      n.group_bytes_step += p->value.numel() * static_cast<int64_t>(is_narrow(p->value.dtype()) ? 4 : dtype_size(p->value.dtype()));
    }
    h = y;
  }
  if (model.has_loss() && L > 0) {
    Shape target_shape(h.shape().begin(), h.shape().end() - 1);
    const Tensor targets = be->zeros(target_shape, DType::kI32);
    layers::Context lctx;
    partition::LayerLaunches& last = out.back();
    count_phase(last.forward, last.group_sums_forward, last.group_bytes_forward, last.group_gathers_forward,
                last.group_gather_bytes_forward, [&] { model.loss().forward(*be, h, targets, 1.0, &lctx); });
    take(L - 1, &LayerProducts::forward);
    int64_t sums = 0, bytes = 0, gathers = 0, gather_bytes = 0;  // R runs the loss's forward again too
    layers::Context rctx;
    count_phase(last.recompute, sums, bytes, gathers, gather_bytes,
                [&] { model.loss().forward(*be, h, targets, 1.0, &rctx); });
    listed.take();
    count_phase(last.backward_input, last.group_sums_backward, last.group_bytes_backward, last.group_gathers_backward,
                last.group_gather_bytes_backward, [&] { model.loss().backward(*be, lctx); });
    take(L - 1, &LayerProducts::backward);
  }
  return out;
}

namespace {

ActivationLayout probe_layers(const layers::Sequential& model_in, bool on_shapes) {
  // Recompute mode changes no layer state (BatchNorm counts no statistics), so probing
  // leaves the model as it was; forward is not const only because layers may cache.
  auto& model = const_cast<layers::Sequential&>(model_in);
  // On shapes: tensors without data on the meta backend of each layer's device.
  std::optional<ShapesOnly> shapes;
  if (on_shapes) shapes.emplace();
  auto backend = [&](Device d) -> Backend& { return on_shapes ? meta_backend(d) : backend_for(d); };
  const int L = model.size();
  ActivationLayout out;
  out.layers.resize(L);
  std::vector<ContextBytes> at[2], for_w[2];
  ContextBytes loss_at[2];
  for (int b = 0; b < 2; ++b) {
    const int64_t n = b + 1;
    Shape shape{n};
    for (int64_t d : model.input_shape()) shape.push_back(d);
    Backend* be = &backend(model.layer(0).device());
    Tensor h = be->zeros(shape, model.input_dtype());
    layers::ForwardArgs args;
    args.recompute = true;
    for (int i = 0; i < L; ++i) {
      be = &backend(model.layer(i).device());
      h = handed_over(*be, h);
      layers::Layer& layer = model.layer(i);
      layers::Context ctx;
      heartbeat();  // probing is progress, for gpipe run (runtime/heartbeat.h)
      Tensor y = layer.forward(*be, h, &ctx, args);
      at[b].push_back(context_bytes(ctx, h, y));
      // B of a split backward on this context, as the executor runs it (need_dx on every
      // layer but the model's first): what stays is W's. Zero gradients add nothing.
      ContextBytes w;
      if (layer.splits_backward()) {
        const Tensor dy = be->zeros(y.shape(), y.dtype());
        const Tensor dx = layer.backward_input(*be, dy, ctx, i > 0);
        w = context_bytes(ctx, h, y, dy, dx);
      }
      for_w[b].push_back(w);
      h = y;
    }
    if (model.has_loss()) {
      Shape target_shape(h.shape().begin(), h.shape().end() - 1);
      const Tensor targets = be->zeros(target_shape, DType::kI32);
      layers::Context lctx;
      model.loss().forward(*be, h, targets, 1.0, &lctx);
      loss_at[b] = context_bytes(lctx, h, Tensor());
    }
  }
  auto fit = [](const ContextBytes& one, const ContextBytes& two) {
    ContextKeeps a;
    a.own_per_sample = static_cast<double>(two.own - one.own);
    a.own_base = static_cast<double>(one.own) - a.own_per_sample;
    a.keeps_input = one.input || two.input;
    a.keeps_output = one.output || two.output;
    a.keeps_grad_output = one.grad_output || two.grad_output;
    a.keeps_grad_input = one.grad_input || two.grad_input;
    return a;
  };
  for (int i = 0; i < L; ++i) out.layers[i] = {fit(at[0][i], at[1][i]), fit(for_w[0][i], for_w[1][i])};
  out.loss = fit(loss_at[0], loss_at[1]);
  return out;
}

}  // namespace

std::vector<StageMemory> estimate_memory(const Plan& plan, const layers::Sequential& model,
                                         const layers::OptimizerConfig& optimizer) {
  return estimate_memory(plan, model, optimizer, probe_activations(model, plan.devices));
}

std::vector<StageMemory> estimate_memory(const Plan& plan, const layers::Sequential& model,
                                         const layers::OptimizerConfig& optimizer, const ActivationLayout& layout) {
  const Schedule& s = plan.schedule;
  const int K = s.num_stages, M = s.num_micro_batches, C = s.num_cells();
  GPIPE_CHECK(static_cast<int>(layout.layers.size()) == model.size(), "estimate_memory: a layout of another model");
  // Per cell and micro-batch: what a forward keeps (each buffer once), what W's
  // contexts keep after B (each buffer once), the cell's input and output, and whether
  // the contexts hold them.
  struct CellBytes {
    int64_t saved = 0, for_w = 0, input = 0, output = 0;
    bool keeps_input = false, keeps_output = false;
    bool w_keeps_grad_input = false;  // W's contexts hold the input gradient B sends
  };
  std::map<int64_t, std::vector<layers::LayerCost>> costs;  // by micro-batch size
  for (int64_t n : plan.micro_batch_sizes) {
    if (!costs.count(n)) costs[n] = model.costs(n);
  }
  auto input_bytes = [&](int layer, int64_t n) {
    const layers::Layer& l = model.layer(layer);
    return n * shape_numel(l.input_shape()) * static_cast<int64_t>(dtype_size(l.input_dtype()));
  };
  auto cell_bytes = [&](int c, int m) {
    const int64_t n = plan.micro_batch_sizes[m];
    const auto& per_layer = costs.at(n);
    const CellSpec& cell = plan.cells[c];
    const int first = cell.first_layer, last = first + cell.num_layers - 1;
    CellBytes b;
    b.input = input_bytes(first, n);
    b.output = per_layer[last].output_bytes;
    for (int i = first; i <= last; ++i) {
      const ContextKeeps& a = layout.layers[i].forward;
      b.saved += a.own(n);
      // The buffer between layer i-1 and i, once, if either context keeps it.
      if (a.keeps_input || (i > first && layout.layers[i - 1].forward.keeps_output)) b.saved += input_bytes(i, n);
      // After B, only W's contexts (the splitting layers') remain: their own bytes, the
      // activation between layer i-1 and i and the gradient between i and i+1 (dy of i,
      // dx of i+1; the received one, or the loss's, above the last layer), each once.
      const ContextKeeps& w = layout.layers[i].weight;
      b.for_w += w.own(n);
      if (w.keeps_input || (i > first && layout.layers[i - 1].weight.keeps_output)) b.for_w += input_bytes(i, n);
      if (w.keeps_grad_output || (i < last && layout.layers[i + 1].weight.keeps_grad_input)) {
        b.for_w += per_layer[i].output_bytes;
      }
    }
    b.keeps_input = layout.layers[first].forward.keeps_input;
    b.keeps_output = layout.layers[last].forward.keeps_output;
    if (layout.layers[last].weight.keeps_output) b.for_w += b.output;
    b.w_keeps_grad_input = layout.layers[first].weight.keeps_grad_input;
    if (b.w_keeps_grad_input) b.for_w += b.input;
    if (c == C - 1) {
      b.saved += layout.loss.own(n);
      b.keeps_output = b.keeps_output || layout.loss.keeps_input;
    }
    if (b.keeps_output) b.saved += b.output;
    return b;
  };
  std::vector<StageMemory> out(K);
  const int slots = optimizer_slots(optimizer);  // state per parameter, besides value and gradient
  const auto& any_costs = costs.begin()->second;
  for (int k = 0; k < K; ++k) {
    for (int c : s.cells[k]) {
      const CellSpec& cell = plan.cells[c];
      for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
        // A bf16 or fp16 layer: float32 master weights, gradients and state, and its
        // working copies beside the masters.
        const DType dt = model.layer(i).dtype();
        const int64_t master = layers::master_param_bytes(any_costs[i].param_bytes, dt);
        out[k].weight_bytes += layers::weight_bytes(any_costs[i].param_bytes, dt);
        out[k].gradient_bytes += master;
        out[k].optimizer_bytes += slots * master;
      }
    }
    if (plan.shard_optimizer) {
      // ZeRO-1: a replica keeps its shard's state, at most ceil(N / D) of the stage's N
      // elements (shard_partition.h; shard 0 is the largest).
      const int64_t elem = static_cast<int64_t>(dtype_size(master_dtype(model.dtype())));
      const int64_t n = out[k].gradient_bytes / elem, D = plan.replicas;
      out[k].optimizer_bytes = slots * elem * ((n + D - 1) / D);
    }
    out[k].parameter_bytes = out[k].weight_bytes + out[k].gradient_bytes + out[k].optimizer_bytes;
    // Walk the program: held[(chunk, m)] is what that micro-batch keeps on this stage.
    std::vector<std::vector<int64_t>> held(s.num_chunks(), std::vector<int64_t>(M, 0));
    const MicroBatchRoles roles = micro_batch_roles(s, k);
    const auto& checkpointed = roles.recomputed;
    const auto& split = roles.split;
    int64_t live = 0, peak = 0;
    for (const Instruction& ins : s.stages[k]) {
      if (!has_cell(ins.op)) continue;  // the optimizer step and the collectives hold no activations
      if (ins.op == Op::kBackwardWeight && ins.count > 1) {  // a batched W frees what each of its B's kept
        for (int m : ins.micro_batches()) {
          int64_t& h = held[ins.chunk][m];
          const int64_t before = h;
          h = std::max<int64_t>(h - cell_bytes(s.cell(k, ins.chunk), m).for_w, 0);
          live += h - before;
        }
        continue;
      }
      const int c = s.cell(k, ins.chunk), m = ins.micro_batch;
      const CellBytes b = cell_bytes(c, m);
      int64_t& h = held[ins.chunk][m];
      const int64_t before = h;
      const bool sends_output = c + 1 < C && s.stage_of_cell(c + 1) != k;
      const bool ckpt = checkpointed[ins.chunk][m];
      switch (ins.op) {
        case Op::kRecvActivation: h += b.input; break;
        case Op::kForward:
          if (ckpt) {
            h = b.input + (sends_output ? b.output : 0);
          } else {
            h = b.saved + (sends_output && !b.keeps_output ? b.output : 0);
          }
          break;
        case Op::kSendActivation:
          if (ckpt || !b.keeps_output) h -= b.output;
          break;
        case Op::kRecompute:  // the contexts join the input, which stays until backward (and a gradient handed over)
          h += b.saved - (b.keeps_input ? b.input : 0);
          break;
        case Op::kRecvGradient: h += b.output; break;
        case Op::kBackward:
          // The input gradient, until sent (a first cell's, or one handed to a cell of this
          // stage, is not held here); the contexts a W still needs (once, should they keep
          // the input gradient too).
          h = (c == 0 || s.stage_of_cell(c - 1) == k) ? 0 : b.input;
          if (split[ins.chunk][m]) h = b.for_w + (b.w_keeps_grad_input ? 0 : h);
          break;
        case Op::kBackwardWeight: h -= b.for_w; break;  // after B's send, which follows B at once
        case Op::kSendGradient:
          if (!(split[ins.chunk][m] && b.w_keeps_grad_input)) h -= b.input;
          break;
        default: break;
      }
      h = std::max<int64_t>(h, 0);
      live += h - before;
      // A hand-over to the neighbouring cell on this stage (chunks of one stage, K = 1):
      // that cell's micro-batch holds the activation, or the gradient, from now on.
      if (ins.op == Op::kForward && c + 1 < C && s.stage_of_cell(c + 1) == k) {
        held[s.chunk_of_cell(c + 1)][m] += b.output;
        live += b.output;
      }
      if (ins.op == Op::kBackward && c > 0 && s.stage_of_cell(c - 1) == k) {
        held[s.chunk_of_cell(c - 1)][m] += b.input;
        live += b.input;
      }
      peak = std::max(peak, live);
    }
    out[k].activation_bytes = peak;
  }
  return out;
}

int64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return -1;
}

int64_t checkpoint_bytes(layers::Sequential& model, const layers::OptimizerConfig& optimizer) {
  int64_t params = 0, buffers = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    if (!model.is_tied_copy(p)) params += static_cast<int64_t>(p->value.nbytes());
  }
  for (int i = 0; i < model.size(); ++i) {
    for (const layers::Buffer& b : model.layer(i).buffers()) buffers += static_cast<int64_t>(b.value->nbytes());
  }
  return params * (1 + optimizer_slots(optimizer)) + buffers;
}

}  // namespace pipeline
}  // namespace gpipe

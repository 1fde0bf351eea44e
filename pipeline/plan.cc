#include "pipeline/plan.h"

#include <algorithm>
#include <map>

#include "partition/balance.h"
#include "runtime/error.h"

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
  std::vector<std::optional<double>> overrides;
  for (const auto& l : c.model.layers) overrides.push_back(l.cost);
  const bool recompute = c.pipeline.recompute != CheckpointMode::kNever;
  return partition::balance_by_cost(partition::layer_costs(model, micro, recompute, overrides), cells);
}

Plan make_plan(const Config& c, const layers::Sequential& model, const PlanOptions& options) {
  Plan p;
  p.stages = c.pipeline.partitions;
  p.virtual_stages = c.pipeline.virtual_stages;
  p.micro_batches = c.pipeline.micro_batches;
  p.replicas = c.pipeline.replicas;
  p.batch_size = c.train.batch_size;
  p.recompute = c.pipeline.recompute;
  if (p.replicas > 1 && p.batch_size % p.replicas != 0) {
    throw UserError("train.batch_size = " + std::to_string(p.batch_size) + " does not split evenly over " +
                    std::to_string(p.replicas) + " replicas; make it a multiple of pipeline.replicas");
  }
  p.replica_batch = p.batch_size / p.replicas;
  p.micro_batch_sizes = split_sizes(p.replica_batch, p.micro_batches);  // validates N >= M
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
  request.num_micro_batches = p.micro_batches;
  request.mode = p.recompute;
  request.file = c.pipeline.schedule_file;
  request.comm = options.comm;
  p.schedule = make_schedule(request);
  p.balance = plan_balance(c, model, cells, p.largest_micro_batch());
  p.devices = plan_devices(c, options.local_stage);
  p.cells = make_cells(p.balance, p.schedule, p.devices);
  return p;
}

int optimizer_slots(const layers::OptimizerConfig& o) {
  if (o.type == "adam" || o.type == "adamw") return 2;
  return o.momentum != 0.0 ? 1 : 0;
}

std::vector<StageMemory> estimate_memory(const Plan& plan, const layers::Sequential& model,
                                         const layers::OptimizerConfig& optimizer) {
  const Schedule& s = plan.schedule;
  const int K = s.num_stages, M = s.num_micro_batches, C = s.num_cells();
  // Per cell and distinct micro-batch size: what a forward keeps, its input, its output.
  struct CellBytes {
    int64_t saved = 0, input = 0, output = 0;
  };
  std::map<int64_t, std::vector<layers::LayerCost>> costs;  // by micro-batch size
  for (int64_t n : plan.micro_batch_sizes) {
    if (!costs.count(n)) costs[n] = model.costs(n);
  }
  auto cell_bytes = [&](int c, int m) {
    const auto& per_layer = costs.at(plan.micro_batch_sizes[m]);
    const StageSpec& cell = plan.cells[c];
    CellBytes b;
    for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) b.saved += per_layer[i].saved_bytes;
    const layers::Layer& first = model.layer(cell.first_layer);
    b.input = plan.micro_batch_sizes[m] * shape_numel(first.input_shape()) *
              static_cast<int64_t>(dtype_size(first.input_dtype()));
    b.output = per_layer[cell.first_layer + cell.num_layers - 1].output_bytes;
    return b;
  };
  std::vector<StageMemory> out(K);
  const int slots = 2 + optimizer_slots(optimizer);  // value, gradient, state
  const auto& any_costs = costs.begin()->second;
  for (int k = 0; k < K; ++k) {
    for (int c : s.cells[k]) {
      const StageSpec& cell = plan.cells[c];
      for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
        out[k].parameter_bytes += slots * any_costs[i].param_bytes;
      }
    }
    // Walk the program: held[(chunk, m)] is what that micro-batch keeps on this stage.
    std::vector<std::vector<int64_t>> held(s.num_chunks(), std::vector<int64_t>(M, 0));
    std::vector<std::vector<char>> checkpointed(s.num_chunks(), std::vector<char>(M, 0)), split = checkpointed;
    for (const Instruction& ins : s.stages[k]) {
      if (ins.op == Op::kRecompute) checkpointed[ins.chunk][ins.micro_batch] = 1;
      if (ins.op == Op::kBackwardWeight) split[ins.chunk][ins.micro_batch] = 1;
    }
    int64_t live = 0, peak = 0;
    for (const Instruction& ins : s.stages[k]) {
      if (ins.op == Op::kOptimizerStep) continue;
      const int c = s.cell(k, ins.chunk), m = ins.micro_batch;
      const CellBytes b = cell_bytes(c, m);
      int64_t& h = held[ins.chunk][m];
      const int64_t before = h;
      const bool sends_output = c + 1 < C && s.stage_of_cell(c + 1) != k;
      switch (ins.op) {
        case Op::kRecvActivation: h += b.input; break;
        case Op::kForward: h = (checkpointed[ins.chunk][m] ? b.input : b.saved) + (sends_output ? b.output : 0); break;
        case Op::kSendActivation: h -= b.output; break;
        case Op::kRecompute: h = b.saved; break;
        case Op::kRecvGradient: h += b.output; break;
        case Op::kBackward: h = b.input; break;  // the input gradient, until sent; W's context below
        case Op::kBackwardWeight: h = 0; break;
        case Op::kSendGradient: h -= b.input; break;
        default: break;
      }
      if (ins.op == Op::kBackward) {
        if (split[ins.chunk][m]) h += b.saved;  // the contexts wait for W
        if (c == 0 || s.stage_of_cell(c - 1) == k) h -= b.input;  // nothing to send
      }
      h = std::max<int64_t>(h, 0);
      live += h - before;
      peak = std::max(peak, live);
    }
    out[k].activation_bytes = peak;
  }
  return out;
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

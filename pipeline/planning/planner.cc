#include "pipeline/planning/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>

#include "pipeline/planning/device_peak.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

double CostTable::tensor_ms(const TensorOp& op, int64_t micro_batch) const {
  if (op.layer >= 0 && op.layer < static_cast<int>(layers.size()) && layers[static_cast<size_t>(op.layer)].group_in_times) {
    return 0.0;  // a user's cost for the layer: its sums are inside its times
  }
  partition::CostModel cm;
  cm.tensor_members = tensor_members;
  cm.group_latency_seconds = group_latency_seconds;
  cm.group_bytes_per_second = group_bytes_per_second;
  const double bytes = static_cast<double>(op.bytes_at(micro_batch));
  const bool pass = op.op == Op::kTensorGather || op.op == Op::kTensorScatter;  // one ring pass, not two
  return 1e3 * (pass ? cm.group_time(0, 0, 1, bytes) : cm.group_time(1, bytes));
}

CostTable estimate_costs(const layers::Sequential& model, int64_t micro, const partition::CostModel& cm,
                         const std::vector<std::optional<double>>& overrides, const layers::OptimizerConfig& opt) {
  auto counts = model.costs(micro);
  CostTable t;
  t.source = "estimate";
  t.micro_batch = micro;
  t.tensor_members = cm.tensor_members;
  t.group_latency_seconds = cm.group_latency_seconds;
  t.group_bytes_per_second = cm.group_bytes_per_second;
  const double slots = optimizer_slots(opt);
  for (size_t i = 0; i < counts.size(); ++i) {
    // Nothing needs the model input's gradient (partition::layer_costs does the same).
    const layers::LayerCost c = i == 0 ? layers::without_input_grad(counts[i]) : counts[i];
    auto ms = [&](double flops, double bytes) {
      return std::max(flops / cm.flops_per_second, bytes / cm.bytes_per_second) * 1e3;
    };
    LayerTimes l;
    const double fwd = ms(c.forward_flops, c.forward_bytes);
    const double bwd = ms(c.backward_flops, c.backward_bytes);
    l.forward = l.forward_nograd = l.recompute = fwd;
    l.backward = bwd;
    // B and W share the whole backward's time as their kernels' roofline times do: W
    // does the weight gradients (the linear layers' dW GEMMs and bias sums), B the rest.
    // Each kernel is charged on its own counts, so B's bytes-bound work (layer norms,
    // GELU's gradient, dropout, the residual adds, the softmax gradient) is not charged
    // at the large products' flop rate, as a roofline over B's sums would. Only the
    // ratio is per kernel: backward's time stays the roofline of the layer's totals
    // (bwd above), which the balancer (partition::CostModel) and the step-time checks
    // against measurement rest on.
    double input_ms = 0, weight_ms = 0;
    for (const layers::CostPart& p : layers::backward_parts(c)) {
      (p.weight ? weight_ms : input_ms) += ms(p.flops, p.bytes);
    }
    const double input_share = input_ms + weight_ms > 0 ? input_ms / (input_ms + weight_ms) : 1.0;
    l.backward_input = bwd * input_share;
    l.backward_weight = bwd - l.backward_input;
    // Each launch's cost on top (0 on a CPU): F's, B's and W's own ops. And a
    // tensor-group member's sums over its group (0 when not split), which run inside F
    // (R too), B and W.
    const partition::LayerLaunches n = cm.launches_of(static_cast<int>(i));
    const partition::CostModel::GroupSeconds g = cm.group_seconds(static_cast<int>(i), micro);
    l.forward_group = g.forward * 1e3;
    l.backward_group = g.backward * 1e3;
    l.weight_group = g.weight * 1e3;
    l.step_group = g.step * 1e3;
    l.forward = l.forward_nograd = fwd + cm.launch_time(n.forward) * 1e3 + l.forward_group;
    l.recompute = fwd + cm.launch_time(n.recompute) * 1e3 + l.forward_group;
    l.backward_input += cm.launch_time(n.backward_input) * 1e3 + l.backward_group;
    l.backward_weight += cm.launch_time(n.backward_weight) * 1e3 + l.weight_group;
    l.backward = l.backward_input + l.backward_weight;
    if (i < overrides.size() && overrides[i]) {  // the user's seconds for forward + backward
      const double total = *overrides[i] * 1e3;
      l.forward = l.forward_nograd = l.recompute = total / 3;
      l.backward = l.backward_input = 2 * total / 3;
      l.backward_weight = 0;
      l.forward_group = l.backward_group = l.weight_group = l.step_group = 0;  // what the user's figure holds is not known
      l.group_in_times = true;
    }
    // The update reads the value, the gradient and each state slot and writes the value
    // and the slots; a bf16 or fp16 model's then writes its working copies.
    const DType dt = model.layer(static_cast<int>(i)).dtype();
    const double master = static_cast<double>(layers::master_param_bytes(c.param_bytes, dt));
    l.optimizer = ((3 + 2 * slots) * master + (is_narrow(dt) ? static_cast<double>(c.param_bytes) : 0.0)) /
                  cm.bytes_per_second * 1e3;
    t.layers.push_back(l);
  }
  return t;
}

CostTable profile_costs(const ProfileEntry& e) {
  CostTable t;
  t.source = "profile";
  t.micro_batch = e.key.micro_batch;
  for (const LayerProfile& p : e.layers) {
    t.layers.push_back({p.forward_ms, p.forward_nograd_ms, p.recompute_ms, p.backward_ms, p.backward_input_ms,
                        p.backward_weight_ms, p.optimizer_ms});
  }
  t.loss_forward = e.loss_forward_ms;
  t.loss_backward = e.loss_backward_ms;
  return t;
}

CostSource::CostSource(const layers::Sequential& model, ProfileStore profile, std::string profile_path, Device device,
                       int blas_threads, partition::CostModel cm, std::vector<std::optional<double>> overrides,
                       layers::OptimizerConfig optimizer, double compute_scale, int concurrency)
    : model_(model), profile_(std::move(profile)), path_(std::move(profile_path)),
      base_key_(profile_key(model, 0, device, blas_threads, concurrency)), cm_(cm), overrides_(std::move(overrides)),
      optimizer_(std::move(optimizer)), compute_scale_(compute_scale) {}

std::vector<const ProfileEntry*> CostSource::family() const {
  auto of = [&](int concurrency) {
    std::vector<const ProfileEntry*> out;
    for (const auto& e : profile_.entries) {
      const ProfileKey& k = e.key;
      if (k.model_hash == base_key_.model_hash && k.dtype == base_key_.dtype && k.device == base_key_.device &&
          k.blas_threads == base_key_.blas_threads && k.concurrency == concurrency) {
        out.push_back(&e);
      }
    }
    return out;
  };
  auto out = of(base_key_.concurrency);
  return out.empty() && base_key_.concurrency > 1 ? of(1) : out;
}

bool CostSource::has_profile() const { return !family().empty(); }

const CostTable& CostSource::at(int64_t micro) const {
  auto it = cache_.find(micro);
  if (it != cache_.end()) return it->second;
  // The profiled size nearest to this one (on a log scale); the same size is exact.
  const ProfileEntry* near = nullptr;
  for (const ProfileEntry* e : family()) {
    auto dist = [&](int64_t n) { return std::abs(std::log(static_cast<double>(n) / static_cast<double>(micro))); };
    if (near == nullptr || dist(e->key.micro_batch) < dist(near->key.micro_batch)) near = e;
  }
  // A profile is measured op by op, each op a launch; a captured step replays its ops as
  // a graph's nodes instead: each phase of a layer is its ops x (launch - node) shorter,
  // and never shorter than its nodes (nor longer than measured). Before any scaling to
  // another size, whose ratio comes from estimates priced as captured.
  const double saved_ms = (cm_.uncaptured_launch_seconds - cm_.launch_seconds) * 1e3;
  auto profiled = [&](const ProfileEntry& e) {
    CostTable p = profile_costs(e);
    if (!cm_.launches_captured || saved_ms <= 0 || cm_.launches == nullptr || cm_.launches->size() != p.layers.size()) {
      return p;
    }
    auto less = [&](double& ms, int64_t ops) {
      const double n = static_cast<double>(ops);
      ms = std::max(ms - n * saved_ms, std::min(ms, n * cm_.launch_seconds * 1e3));
    };
    for (size_t i = 0; i < p.layers.size(); ++i) {
      const partition::LayerLaunches& l = (*cm_.launches)[i];
      LayerTimes& x = p.layers[i];
      less(x.forward, l.forward);
      less(x.forward_nograd, l.recompute);  // a forward that keeps nothing: R's ops
      less(x.recompute, l.recompute);
      less(x.backward, l.backward());
      less(x.backward_input, l.backward_input);
      less(x.backward_weight, l.backward_weight);
    }
    return p;
  };
  CostTable t;
  if (near != nullptr && near->key.micro_batch == micro) {
    t = profiled(*near);
  } else {
    const CostTable est = estimate_costs(model_, micro, cm_, overrides_, optimizer_);
    if (near == nullptr) {
      t = est;
    } else {  // scaled per layer by the cost model's ratio between the two sizes
      const CostTable base = estimate_costs(model_, near->key.micro_batch, cm_, overrides_, optimizer_);
      t = profiled(*near);
      auto ratio = [](double a, double b) { return b > 0 ? a / b : 1.0; };
      for (size_t i = 0; i < t.layers.size(); ++i) {
        LayerTimes& l = t.layers[i];
        const LayerTimes &num = est.layers[i], &den = base.layers[i];
        l.forward *= ratio(num.forward, den.forward);
        l.forward_nograd *= ratio(num.forward, den.forward);
        l.recompute *= ratio(num.recompute, den.recompute);
        l.backward *= ratio(num.backward, den.backward);
        l.backward_input *= ratio(num.backward, den.backward);
        l.backward_weight *= ratio(num.backward, den.backward);
      }
      const double rows = static_cast<double>(micro) / static_cast<double>(near->key.micro_batch);
      t.loss_forward *= rows;
      t.loss_backward *= rows;
      t.source = "profile at micro-batch " + std::to_string(near->key.micro_batch) + ", scaled";
    }
  }
  if (compute_scale_ != 1.0) {
    for (LayerTimes& l : t.layers) {
      // The compute only: more BLAS threads do not speed up the sums over a tensor group.
      auto scale = [this](double& x, double group) { x = compute_scale_ * (x - group) + group; };
      scale(l.forward, l.forward_group);
      scale(l.forward_nograd, l.forward_group);
      scale(l.recompute, l.forward_group);
      scale(l.backward, l.backward_group + l.weight_group);
      scale(l.backward_input, l.backward_group);
      scale(l.backward_weight, l.weight_group);
    }
    t.loss_forward *= compute_scale_;
    t.loss_backward *= compute_scale_;
  }
  return cache_.emplace(micro, std::move(t)).first->second;
}

std::string CostSource::describe() const {
  const std::string scaled =
      compute_scale_ != 1.0 ? " (times x " + std::to_string(compute_scale_).substr(0, 5) + ": perfect BLAS scaling assumed)" : "";
  return describe_sources() + scaled;
}

std::string CostSource::describe_sources() const {
  char rates[192];
  char launch[64] = "";
  if (cm_.launch_seconds > 0 && cm_.launches != nullptr) {
    std::snprintf(launch, sizeof launch, ", %.1f us%s a %s", cm_.launch_seconds * 1e6,
                  cm_.launch_probed ? " probed" : "", cm_.launches_captured ? "captured op" : "launch");
  }
  std::snprintf(rates, sizeof rates, "the cost model (%.0f GFLOP/s%s, %.0f GB/s%s%s per device)",
                cm_.flops_per_second / 1e9, cm_.probed ? " probed" : "", cm_.bytes_per_second / 1e9,
                cm_.bytes_probed ? " probed" : "", launch);
  if (path_.empty()) return rates;  // a device description: nothing was measured
  const auto entries = family();
  if (entries.empty()) {
    return std::string(rates) + "; no layer times in " + path_ + " for this model and device (`gpipe profile` measures them)";
  }
  std::string sizes;
  for (const ProfileEntry* e : entries) sizes += (sizes.empty() ? "" : ", ") + std::to_string(e->key.micro_batch);
  const int measured = entries.front()->key.concurrency;
  std::string at_once = measured > 1 ? ", " + std::to_string(measured) + " stages at once"
                        : base_key_.concurrency > 1 ? ", measured alone" : "";
  char captured[96] = "";
  if (cm_.launches_captured && cm_.uncaptured_launch_seconds > cm_.launch_seconds && cm_.launches != nullptr) {
    std::snprintf(captured, sizeof captured, "; each op %.1f us less, captured, than the launch it was measured with",
                  (cm_.uncaptured_launch_seconds - cm_.launch_seconds) * 1e6);
  }
  return "profile " + path_ + " (micro-batch " + sizes + at_once + captured + "; other sizes scaled by " + rates + ")";
}

PlannedRun predict(const Plan& plan, const layers::Sequential& model, const CostSource& costs, const LinkFn& link,
                   const layers::OptimizerConfig& optimizer, const PredictOptions& options) {
  const Schedule& s = plan.schedule;
  const int K = s.num_stages, C = s.num_cells();
  // Which (stage, chunk, micro-batch) recompute, and which defer their weight gradients.
  std::vector<std::vector<std::vector<char>>> ckpt, split;
  for (int k = 0; k < K; ++k) {
    MicroBatchRoles roles = micro_batch_roles(s, k);
    ckpt.push_back(std::move(roles.recomputed));
    split.push_back(std::move(roles.split));
  }
  std::map<int64_t, std::vector<layers::LayerCost>> counts;  // bytes of messages, by micro-batch size
  for (int64_t n : plan.micro_batch_sizes) {
    if (!counts.count(n)) counts[n] = model.costs(n);
  }
  // The bytes of stage k's parameters (and so of its gradients), in their master type:
  // what RG, RS and AG move.
  auto stage_param_bytes = [&](int k) {
    const auto& layer_costs = counts.at(plan.micro_batch_sizes.front());
    int64_t bytes = 0;
    for (int c : s.cells[k]) {
      for (int i = plan.cells[c].first_layer; i < plan.cells[c].first_layer + plan.cells[c].num_layers; ++i) {
        bytes += layers::master_param_bytes(layer_costs[i].param_bytes, model.layer(i).dtype());
      }
    }
    return bytes;
  };
  // A collective's own time once every stage taking part has arrived (the simulator
  // adds the wait). TIE: the copy's gradient there and the sum back. NORM: one number
  // to a neighbour and back. RG: the buckets still in flight when the stage's last
  // backward ends, at most one bucket (PyTorch DDP's 25 MB; the others overlap the
  // backwards), over a ring of the replicas: 2 (D-1)/D of its bytes each way, on the
  // link between processes of this machine.
  const CostFn collective_ms = [&](int k, const Instruction& ins) -> double {
    switch (ins.op) {
      case Op::kTiedGradients: {
        const auto& tie = s.collectives.ties.at(static_cast<size_t>(ins.micro_batch));
        const layers::Tie& t = model.ties().at(static_cast<size_t>(ins.micro_batch));
        const int64_t bytes = static_cast<int64_t>(t.copy->value.nbytes());
        return 2 * link(s.stage_of_cell(tie.first), s.stage_of_cell(tie.second)).ms(bytes);
      }
      case Op::kGradientNorm:
        return K > 1 ? 2 * link(k, k == 0 ? 1 : k - 1).ms(static_cast<int64_t>(sizeof(double))) : 0.0;
      case Op::kReduceScatterGradients:
      case Op::kGatherParameters: {
        // Sharded optimizer state: all of the stage's gradients reduce-scattered after
        // its last backward (nothing overlaps), then the parameters all-gathered after
        // OPT; each, over a ring of the replicas, moves (D-1)/D of the stage's bytes.
        const double D = plan.replicas;
        return link(k, k).ms(static_cast<int64_t>(static_cast<double>(stage_param_bytes(k)) * (D - 1) / D));
      }
      case Op::kReduceGradients: {
        const int64_t bytes = stage_param_bytes(k);
        const double D = plan.replicas;
        const double in_flight = std::min<double>(static_cast<double>(bytes), 25.0 * (1 << 20));
        return link(k, k).ms(static_cast<int64_t>(in_flight * 2 * (D - 1) / D));
      }
      default: return 0.0;
    }
  };
  // The tensor group's collectives, each priced on its own (CostTable::tensor_ms); the
  // simulator runs each after the compute instruction that asks it, whose own cost is
  // then its layers' compute alone (their times less their group parts).
  std::vector<std::vector<TensorOp>> tensor_ops(static_cast<size_t>(K));  // [stage][position], at tensor collectives
  if (s.tensor_lowered) {
    for (int k = 0; k < K; ++k) {
      const auto& prog = s.stages[static_cast<size_t>(k)];
      const std::vector<std::vector<TensorOp>> asked = stage_tensor_ops(s, s.tensor, k);
      tensor_ops[static_cast<size_t>(k)].resize(prog.size());
      for (size_t pc = 0, owner = 0, next = 0; pc < prog.size(); ++pc) {
        if (!is_tensor_collective(prog[pc].op)) {
          owner = pc;
          next = 0;
          continue;
        }
        tensor_ops[static_cast<size_t>(k)][pc] = asked[owner].at(next++);
      }
    }
  }
  const CostFn cost = [&](int k, const Instruction& ins) -> double {
    if (is_tensor_collective(ins.op)) {
      const TensorOp& op = tensor_ops[static_cast<size_t>(k)].at(program_position(s, k, ins));
      const int64_t n = plan.micro_batch_sizes[ins.micro_batch];
      return costs.at(n).tensor_ms(op, n);
    }
    double t = options.instruction_overhead_ms;
    if (ins.op == Op::kOptimizerStep) {
      const CostTable& table = costs.at(plan.micro_batch_sizes.front());
      for (int c : s.cells[k]) {
        for (int i = plan.cells[c].first_layer; i < plan.cells[c].first_layer + plan.cells[c].num_layers; ++i) {
          t += table.layers[i].optimizer;
        }
      }
      // Sharded optimizer state: each replica updates its 1/D of the stage.
      return plan.shard_optimizer ? options.instruction_overhead_ms + (t - options.instruction_overhead_ms) / plan.replicas
                                  : t;
    }
    if (ins.op == Op::kRecvActivation || ins.op == Op::kRecvGradient) return t;
    if (is_collective(ins.op)) return t + collective_ms(k, ins);
    if (ins.op == Op::kBackwardWeight) {
      // The W of each micro-batch it covers (several for a batched W), each at its size:
      // the table times W per micro-batch, so a batched W's larger product is not priced lower.
      // A member's sums over its group in W (replicated key/value heads) run once per W.
      const CellSpec& cell = plan.cells[s.cell(k, ins.chunk)];
      for (int m : ins.micro_batches()) {
        const CostTable& table = costs.at(plan.micro_batch_sizes[m]);
        for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
          t += table.layers[i].backward_weight - table.layers[i].weight_group;
        }
      }
      return t;
    }
    const int m = ins.micro_batch, c = s.cell(k, ins.chunk);
    const int64_t n = plan.micro_batch_sizes[m];
    const CellSpec& cell = plan.cells[c];
    const CostTable& table = costs.at(n);
    const bool last = c == C - 1;
    switch (ins.op) {
      case Op::kSendActivation: {
        const int64_t bytes = counts.at(n)[cell.first_layer + cell.num_layers - 1].output_bytes;
        return t + link(k, s.stage_of_cell(c + 1)).ms(bytes);
      }
      case Op::kSendGradient: {
        const layers::Layer& first = model.layer(cell.first_layer);
        const int64_t bytes = n * shape_numel(first.input_shape()) * static_cast<int64_t>(dtype_size(first.dtype()));
        return t + link(k, s.stage_of_cell(c - 1)).ms(bytes);
      }
      default: break;
    }
    for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
      const LayerTimes& l = table.layers[i];
      switch (ins.op) {  // less their sums over the tensor group, which are instructions of their own
        case Op::kForward: t += (ckpt[k][ins.chunk][m] ? l.forward_nograd : l.forward) - l.forward_group; break;
        case Op::kRecompute: t += l.recompute - l.forward_group; break;
        case Op::kBackward:
          t += split[k][ins.chunk][m] ? l.backward_input - l.backward_group
                                      : l.backward - l.backward_group - l.weight_group;
          break;
        default: break;
      }
    }
    if (last && (ins.op == Op::kForward || ins.op == Op::kRecompute)) t += table.loss_forward;
    if (last && ins.op == Op::kBackward) t += table.loss_backward;
    return t;
  };
  const Simulation sim = simulate(s, cost, CommModel::kBuffered, plan.turns);
  PlannedRun out;
  out.source = costs.describe();
  out.timeline = sim.timeline;
  out.step_ms = sim.makespan;
  // Where the time goes: the report's accounting, of the simulated step.
  std::vector<std::vector<OpSpan>> spans(K);
  // A tensor collective runs inside the compute instruction that asks it, as the
  // executor's trace has it: its time is that instruction's communication (OpSpan::group_ms).
  for (int k = 0; k < K; ++k) {
    for (const TimedInstruction& ti : sim.timeline[k]) {
      if (is_tensor_collective(ti.ins.op) && !spans[k].empty()) {
        spans[k].back().end_ms = ti.end;
        spans[k].back().group_ms += ti.end - ti.start;
        continue;
      }
      spans[k].push_back({ti.ins.op, ti.start, ti.end, ti.ins.micro_batch, 0.0});
    }
  }
  const StepTime time = account_step(spans);
  out.span_ms = time.span_ms;
  out.stages.assign(K, {});
  double busy = 0;
  for (int k = 0; k < K; ++k) {
    static_cast<StageTime&>(out.stages[k]) = time.stages[k];
    busy += out.stages[k].busy_ms;
  }
  out.bubble = out.span_ms > 0 ? 1.0 - busy / (K * out.span_ms) : 0;
  if (plan.launches != nullptr) {
    for (int k = 0; k < K; ++k) out.stages[k].launches = stage_launches(plan, k);
  }
  out.samples_per_second = out.step_ms > 0 ? static_cast<double>(plan.batch_size) / (out.step_ms / 1e3) : 0;
  // The plan's own figures (make_plan); a plan put together by hand has none yet.
  const std::vector<StageMemory> memory = !plan.memory.empty() ? plan.memory
                                          : options.layout != nullptr
                                              ? estimate_memory(plan, model, optimizer, *options.layout)
                                              : estimate_memory(plan, model, optimizer);
  for (int k = 0; k < K; ++k) {
    out.stages[k].weight_bytes = memory[k].weight_bytes;
    out.stages[k].gradient_bytes = memory[k].gradient_bytes;
    out.stages[k].optimizer_bytes = memory[k].optimizer_bytes;
    out.stages[k].activation_bytes = memory[k].activation_bytes;
  }
  return out;
}

int64_t stage_launches(const Plan& plan, int k) {
  GPIPE_CHECK(plan.launches != nullptr, "stage_launches: the plan's ops were not counted");
  const Schedule& s = plan.schedule;
  const MicroBatchRoles roles = micro_batch_roles(s, k);
  int64_t n = 0;
  for (const Instruction& ins : s.stages[k]) {
    if (!has_cell(ins.op) || is_communication(ins.op)) continue;
    const CellSpec& cell = plan.cells[s.cell(k, ins.chunk)];
    for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
      const partition::LayerLaunches& l = plan.launches->at(static_cast<size_t>(i));
      switch (ins.op) {
        case Op::kForward: n += l.forward; break;
        case Op::kRecompute: n += l.recompute; break;
        case Op::kBackward: n += roles.split[ins.chunk][ins.micro_batch] ? l.backward_input : l.backward(); break;
        // A batched W counted as its micro-batches' W one by one (an upper bound: Linear's
        // batched product is one launch).
        case Op::kBackwardWeight: n += l.backward_weight * ins.count; break;
        default: break;
      }
    }
  }
  return n;
}

LinkCost local_link(const ProfileStore& profile, bool across_processes) {
  // When not measured: the figures of bench/RESULTS.md (transport_bench, 2-vCPU VM): the
  // in-process hand-over is the receiving thread's wake-up, 6 to 7 us whatever the size;
  // MPI over shared memory 3 us and about 8 GB/s.
  const LinkCost fallback = across_processes ? LinkCost{"mpi (not measured: bench/RESULTS.md figures)", 0.003, 8e6}
                                             : LinkCost{"inprocess (not measured: bench/RESULTS.md figures)", 0.006, 0};
  const LinkCost* measured = profile.link(across_processes ? "mpi" : "inprocess");
  return measured != nullptr ? *measured : fallback;
}

void price_tensor_group(partition::CostModel& cm, int members, const LinkCost& link) {
  cm.tensor_members = members;
  cm.group_latency_seconds = link.latency_ms / 1e3;
  cm.group_bytes_per_second = link.bytes_per_ms * 1e3;
}

int stages_at_once(const Plan& plan) {
  if (!plan.devices.front().is_cpu()) return 1;
  int devices = 0;  // stages that take turns on one device compute one at a time
  for (size_t k = 0; k < plan.devices.size(); ++k) devices += plan.turns.empty() || plan.turns[k] == static_cast<int>(k);
  return std::max(1, std::min(devices, static_cast<int>(std::thread::hardware_concurrency())));
}

partition::CostModel probed_cost_model(const Plan& plan, DType dtype, int blas_threads, double flops_per_second,
                                       double bytes_per_second, double launch_seconds, double graph_node_seconds) {
  partition::CostModel cm;
  cm.launches = plan.launches;
  if (flops_per_second == 0) {  // probe (or read the cache): the slowest device's rates
    // Stages that take turns on a device (Plan::turns) each have all of it while they
    // compute, which the simulation serialises: the device is probed once, whole.
    // CPU stages: each stage's T x D members and replicas are processes (or threads)
    // computing at once on this machine's cores, as a run's ranks probe them
    // (run_artifacts.cc): probe that many at once (the cache keys a rate by how many ran).
    std::vector<Device> devices;
    for (size_t k = 0; k < plan.devices.size(); ++k) {
      if (plan.turns.empty() || plan.turns[k] == static_cast<int>(k)) devices.push_back(plan.devices[k]);
    }
    std::vector<Device> probing = devices;
    if (!plan.devices.empty() && plan.devices.front().is_cpu()) {
      for (int copy = 1; copy < std::max(1, plan.tensor_parallel) * std::max(1, plan.replicas); ++copy) {
        probing.insert(probing.end(), devices.begin(), devices.end());
      }
    }
    try {
      for (const DevicePeak& p : device_peaks(probing, dtype, blas_threads)) {
        flops_per_second = flops_per_second > 0 ? std::min(flops_per_second, p.flops_per_second) : p.flops_per_second;
        if (p.bytes_per_second > 0) {
          bytes_per_second =
              bytes_per_second > 0 ? std::min(bytes_per_second, p.bytes_per_second) : p.bytes_per_second;
        }
        launch_seconds = std::max(launch_seconds, p.launch_seconds);  // the slowest device's
        graph_node_seconds = std::max(graph_node_seconds, p.graph_node_seconds);
      }
    } catch (const std::exception& e) {  // the fixed rates instead
      spdlog::warn("the devices' peak could not be probed ({}); the planner assumes {:.0f} GFLOP/s", e.what(),
                   cm.flops_per_second / 1e9);
      flops_per_second = 0;
      bytes_per_second = 0;
      launch_seconds = 0;
      graph_node_seconds = 0;
    }
  }
  if (flops_per_second > 0) {
    cm.flops_per_second = flops_per_second;
    cm.probed = true;
  }
  // A GPU's memory is probed (a CPU's fixed rate stays: its figures in bench/RESULTS.md
  // were measured against it).
  if (bytes_per_second > 0) {
    cm.bytes_per_second = bytes_per_second;
    cm.bytes_probed = true;
  }
  // A GPU's launch cost (a CPU's ops are calls: 0).
  if (launch_seconds > 0) {
    cm.launch_seconds = launch_seconds;
    cm.launch_probed = true;
  }
  cm.graph_node_seconds = graph_node_seconds;  // what a captured step's op costs instead (price_captured)
  return cm;
}

bool captures(const Config& c, const layers::Sequential& model) {
  if (!c.pipeline.capture || !capture_refusal(c.pipeline).empty()) return false;
  for (int i = 0; i < model.size(); ++i) {
    if (!model.layer(i).capturable()) return false;
  }
  return true;
}

PlannedRun predict_config(const Config& c, const layers::Sequential& model, const Plan& plan, bool across_processes,
                          double flops_per_second, double bytes_per_second, double launch_seconds,
                          bool group_across_processes, double graph_node_seconds) {
  const ProfileStore store = load_profile(c.pipeline.profile);
  partition::CostModel cm = probed_cost_model(plan, model.output_dtype(), c.train.blas_threads, flops_per_second,
                                              bytes_per_second, launch_seconds, graph_node_seconds);
  if (captures(c, model)) cm.price_captured();
  price_tensor_group(cm, plan.tensor_parallel, local_link(store, group_across_processes));
  const CostSource costs(model, store, c.pipeline.profile, plan.devices.front(), c.train.blas_threads, cm,
                         cost_overrides(c), c.optimizer.optimizer, 1.0, stages_at_once(plan));
  const LinkCost link = local_link(store, across_processes);
  PlannedRun run = predict(plan, model, costs, [link](int, int) { return link; }, c.optimizer.optimizer);
  run.source += "; messages: " + link.kind;
  run.launches_captured = cm.launches_captured;
  return run;
}

}  // namespace pipeline
}  // namespace gpipe

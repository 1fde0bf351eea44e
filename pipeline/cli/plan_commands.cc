#include "pipeline/cli/plan_commands.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <ostream>

#include "kernels/meta_backend.h"
#include "partition/balance.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/byte_units.h"
#include "pipeline/planning/device_spec.h"
#include "pipeline/planning/memory_check.h"
#include "pipeline/planning/planner.h"
#include "pipeline/planning/profile.h"
#include "pipeline/planning/sweep.h"
#include "pipeline/train/auto_plan.h"
#include "pipeline/train/measured_sweep.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {


void print_planned(const Plan& plan, const PlannedRun& run, int64_t memory_limit, std::ostream& out) {
  char line[512];
  int64_t peak = 0;
  int peak_stage = 0;
  for (size_t k = 0; k < run.stages.size(); ++k) {
    if (run.stages[k].total_bytes() > peak) {
      peak = run.stages[k].total_bytes();
      peak_stage = static_cast<int>(k);
    }
  }
  const ByteUnit unit = byte_unit_for(peak);  // one unit for the memory columns, named over them
  out << "Prediction (costs: " << run.source << "):\n";
  std::snprintf(line, sizeof line, "%76s| memory per stage, %s\n", "", unit.name);
  out << line;
  std::snprintf(line, sizeof line, "%-5s %8s %9s %8s %7s %8s %8s %7s %6s | %9s %9s %9s %11s %9s\n", "stage", "fwd ms",
                "recomp ms", "bwd ms", "W ms", "comm ms", "idle ms", "opt ms", "util", "weights", "grads", "opt state",
                "activations", "total");
  out << line;
  for (size_t k = 0; k < run.stages.size(); ++k) {
    const PlannedStage& s = run.stages[k];
    std::snprintf(line, sizeof line, "%-5zu %8.2f %9.2f %8.2f %7.2f %8.2f %8.2f %7.2f %5.1f%% | %9s %9s %9s %11s %9s\n",
                  k, s.forward_ms, s.recompute_ms, s.backward_ms, s.weight_ms, s.comm_ms, s.idle_ms, s.optimizer_ms,
                  100 * s.utilization, in_unit(s.weight_bytes, unit).c_str(), in_unit(s.gradient_bytes, unit).c_str(),
                  in_unit(s.optimizer_bytes, unit).c_str(), in_unit(s.activation_bytes, unit).c_str(),
                  in_unit(s.total_bytes(), unit).c_str());
    out << line;
  }
  std::snprintf(line, sizeof line,
                "step %.2f ms (span %.2f ms), bubble %.3f (the schedule's formula %.3f), %.1f samples/s; the fullest "
                "device holds %s (stage %d)",
                run.step_ms, run.span_ms, run.bubble, formula_bubble(plan.schedule), run.samples_per_second,
                bytes_str(peak).c_str(), peak_stage);
  out << line;
  if (memory_limit > 0) {
    out << (peak <= memory_limit ? ", within " : ", OVER ") << "the limit of " << bytes_str(memory_limit)
        << " (pipeline.memory_limit)";
  }
  out << "\n";
  // Stages that take turns on one device: their idle time is mostly the others' work.
  for (size_t k = 0; k < plan.turns.size(); ++k) {
    if (plan.turns[k] != static_cast<int>(k)) continue;
    std::string who;
    int n = 0;
    for (size_t j = k; j < plan.turns.size(); ++j) {
      if (plan.turns[j] == static_cast<int>(k)) who += (n++ == 0 ? "" : ", ") + std::to_string(j);
    }
    if (n > 1) {
      out << "stages " << who << " take turns on " << plan.devices[k].str()
          << ": each waits (idle) while another computes, so the step adds up their work; stages on devices of "
             "their own (pipeline.devices) compute at once\n";
    }
  }
  if (!run.stages.empty() && run.stages.front().launches >= 0) {
    out << "ops per step (the layers' F, R, B and W, counted on shapes; on a GPU each one kernel launch or more):";
    for (size_t k = 0; k < run.stages.size(); ++k) {
      out << (k == 0 ? " " : ", ") << "stage " << k << " " << run.stages[k].launches;
    }
    out << "\n";
  }
}

// printf's formatting into a string of any length.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string s(static_cast<size_t>(std::max(n, 0)) + 1, '\0');
  std::snprintf(s.data(), s.size(), fmt, args...);
  s.pop_back();
  return s;
}

}  // namespace

void print_plan(const Config& c, layers::Sequential& model, const Plan& p, std::ostream& out,
                layers::Sequential* whole) {
  const int64_t micro = p.largest_micro_batch();
  // One cost model for every figure below: the probed device speed (probed_cost_model).
  partition::CostModel cm = probed_cost_model(p, model.output_dtype(), c.train.blas_threads);
  price_tensor_group(cm, p.tensor_parallel, local_link(load_profile(c.pipeline.profile), /*across_processes=*/true));
  const auto costs = partition::layer_costs(model, micro, recomputes(p.recompute), cost_overrides(c), cm);
  // Each layer's backward and its B and W halves as the planner estimates them.
  const CostTable times = estimate_costs(model, micro, cm, cost_overrides(c), c.optimizer.optimizer);
  layers::Sequential& unsplit = whole != nullptr ? *whole : model;
  // A member's share of each stage: what each of that stage's processes holds.
  std::string member;
  if (whole != nullptr) {
    std::string held;
    for (int k = 0; k < p.stages; ++k) {
      int64_t n = 0;
      for (int cell : p.schedule.cells[static_cast<size_t>(k)]) {
        for (int i = p.cells[cell].first_layer; i < p.cells[cell].first_layer + p.cells[cell].num_layers; ++i) {
          for (const layers::Parameter* q : model.layer(i).parameters()) {
            if (!model.is_tied_copy(q)) n += q->value.numel();
          }
        }
      }
      held += (p.stages > 1 ? (k == 0 ? ": stage 0 " : ", stage " + std::to_string(k) + " ") : " ") + std::to_string(n);
    }
    member = format(" (each of a stage's %d processes holds", p.tensor_parallel) + held + ")";
  }
  out << format("model: %d layers, %lld parameters%s, input %s; a checkpoint takes %s\n", unsplit.size(),
                static_cast<long long>(unsplit.parameter_count()), member.c_str(), shape_str(model.input_shape()).c_str(),
                bytes_str(checkpoint_bytes(unsplit, c.optimizer.optimizer)).c_str());
  const std::vector<StageMemory>& memory = p.memory;
  for (int k = 0; k < p.stages; ++k) {
    out << format("stage %d on %s: memory %s (parameters+state %s, activations %s)\n", k, p.devices[k].str().c_str(),
                  bytes_str(memory[k].total()).c_str(), bytes_str(memory[k].parameter_bytes).c_str(),
                  bytes_str(memory[k].activation_bytes).c_str());
    for (int cell : p.schedule.cells[k]) {
      const CellSpec& s = p.cells[cell];
      double total = 0, input = 0, weight = 0;
      for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
        total += costs[i];
        input += times.layers[i].backward_input;
        weight += times.layers[i].backward_weight;
      }
      out << format("  cell %d: layers %d-%d, estimated %.3f ms per micro-batch of %lld (backward: B %.3f + W %.3f ms)\n",
                    cell, s.first_layer, s.first_layer + s.num_layers - 1, total * 1e3, static_cast<long long>(micro),
                    input, weight);
      for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
        const LayerTimes& l = times.layers[i];
        std::string ops;  // the layer's ops per phase, where counted
        if (p.launches != nullptr) {
          const partition::LayerLaunches& n = p.launches->at(static_cast<size_t>(i));
          ops = format("; ops F %lld, R %lld, B %lld, W %lld", static_cast<long long>(n.forward),
                       static_cast<long long>(n.recompute),
                       static_cast<long long>(n.backward_input), static_cast<long long>(n.backward_weight));
        }
        out << format("    %3d %-28s %10.3f ms all  (backward %.3f: B %.3f + W %.3f%s)\n", i,
                      model.layer(i).describe().c_str(), costs[i] * 1e3, l.backward, l.backward_input,
                      l.backward_weight, ops.c_str());
      }
    }
  }
  out << format("schedule %s, recompute %s (formula bubble %.3f):\n", p.schedule.name.c_str(),
                recompute_mode_name(p.recompute), formula_bubble(p.schedule))
      << schedule_chart(p.schedule) << "\n"
      << compact_schedule_table(p.schedule);
}

void print_prediction(const Config& c, const layers::Sequential& model, const Plan& plan, std::ostream& out) {
  print_planned(plan, predict_config(c, model, plan), c.pipeline.memory_limit, out);
}

int plan_other_runs(const Config& config, layers::Sequential& model, const PlanCommandOptions& o, std::ostream& out) {
  DeviceSpec spec;
  const bool has_spec = !o.device_spec.empty();
  if (has_spec) spec = load_device_spec(o.device_spec);
  // The spec's devices are GPUs, which this machine may not have: the shape probe keeps
  // what a layer keeps on them (bf16 attention: cuDNN's fused path, where this build has it).
  std::optional<MetaAnswersAs> as_gpu;
  if (has_spec) as_gpu.emplace(Device::cuda(0));
  if (o.sweep) {
    SweepOptions sweep_options;
    sweep_options.devices = o.devices;
    sweep_options.spec = has_spec ? &spec : nullptr;
    sweep_options.micro_batches = micro_batch_counts(o.max_micro_batches);
    const bool cpu = config.pipeline.devices.empty() || parse_device(config.pipeline.devices[0]).is_cpu();
    if (!has_spec && cpu) sweep_options.host_available = std::max<int64_t>(0, host_available_bytes());
    // The tensor-parallel sizes worth trying (a model of YAML layers: each T's member
    // built on shapes), each swept and all ranked together; a T the model does not
    // split into is said and left out.
    const TensorMembers members = o.precisions.empty() ? tensor_members(config, sweep_options) : TensorMembers{};
    SweepResult r = !o.precisions.empty()  ? sweep(o.precisions, sweep_options)
                    : !members.runs.empty() ? sweep(members.swept(), sweep_options)
                                         : sweep(config, model, sweep_options);
    // Measured before recommended (measured_sweep.h), where this machine runs the plans.
    const std::string not_here = why_not_measured(config, r, has_spec);
    if (o.measure > 0 && r.recommended >= 0 && not_here.empty() && o.precisions.empty()) {
      MeasureOptions mo;
      mo.top = o.measure;
      measure_candidates(plain_for_auto(config, model), model, r, mo, out);  // an auto config's own: the plain pipeline
      if (r.recommended >= 0 && r.edges.empty()) r.edges = recommended_edges(r, config, model, sweep_options);
    }
    out << sweep_table(r, o.rows);
    for (const std::string& why : members.unsplit) out << "Not tried: " << why << "\n";
    if (o.measure > 0 && r.recommended >= 0 && !not_here.empty()) {
      out << "Not timed (the recommendation is the prediction's): " << not_here << "\n";
    } else if (o.measure > 0 && r.recommended >= 0 && !o.precisions.empty()) {
      out << "Not timed (the recommendation is the prediction's): --precisions compares models that compute "
             "different numbers; time the one you pick with --sweep alone\n";
    }
    return 0;
  }
  Config c = config;
  // Tensor parallelism: each stage on T devices, planned as its member 0 (on shapes; the
  // members' blocks are alike), its sums priced over the link within a node.
  const int T = c.pipeline.tensor_parallel;
  if (o.devices > 0 && o.devices % T != 0) {
    throw UserError("--devices " + std::to_string(o.devices) + " does not split into stages of pipeline.tensor_parallel = " +
                    std::to_string(T) + " devices each; give a multiple of " + std::to_string(T));
  }
  const RunModel member = T > 1 ? build_member_on_shapes(c, 0) : RunModel{};
  layers::Sequential& planned = T > 1 ? *member.model : model;
  const int n = o.devices > 0 ? o.devices / T : c.pipeline.partitions;  // stages
  const std::string devices_text = T > 1 ? std::to_string(n * T) + " devices (" + std::to_string(n) + " stages x T = " +
                                               std::to_string(T) + ")"
                                         : std::to_string(n) + (n == 1 ? " device" : " devices");
  c.pipeline.partitions = n;
  c.pipeline.replicas = 1;
  c.pipeline.devices.clear();  // labels only: the devices are not this machine's
  c.pipeline.balance.clear();
  if (c.pipeline.balance_by == "profile" && has_spec) c.pipeline.balance_by = "estimate";
  // --devices N plans N stages (N / T with a tensor group): a refusal naming
  // pipeline.partitions means that.
  auto plan_for = [&](const Config& cfg) {
    try {
      return make_plan(cfg, planned);
    } catch (const UserError& e) {
      if (o.devices <= 0) throw;
      throw UserError(std::string(e.what()) + " (here pipeline.partitions is --devices " + std::to_string(o.devices) +
                      (T > 1 ? " / pipeline.tensor_parallel " + std::to_string(T) + " = " + std::to_string(n) : "") +
                      ": give fewer devices, or plan them with --sweep, which leaves some idle)");
    }
  };
  const Plan plan = plan_for(c);
  if (!has_spec) {
    out << "Plan for " << devices_text << " like this machine's (balance";
    for (int b : plan.balance) out << " " << b;
    out << "):\n";
    print_prediction(c, planned, plan, out);
    // A plan over the limit is an error, after it is shown; --devices sets the stages here.
    check_memory_limit(c, plan, 0, {"--devices", "gpipe plan CONFIG --devices N --sweep"});
    return 0;
  }
  if (T > spec.devices_per_node || spec.devices_per_node % T != 0) {
    throw UserError("pipeline.tensor_parallel = " + std::to_string(T) + " puts a stage's tensor group on " +
                    std::to_string(T) + " devices, but " + spec.name + " has " + std::to_string(spec.devices_per_node) +
                    " a node: a group sums at every split layer and must sit within one node, so T must divide "
                    "the devices of a node; choose such a pipeline.tensor_parallel");
  }
  partition::CostModel cm = spec.cost_model_for(planned.output_dtype());
  cm.launches = plan.launches;  // the model's ops, for the spec's launch cost
  if (captures(c, planned)) cm.price_captured();  // at the spec's graph_node_us, where it gives one
  if (T > 1) price_tensor_group(cm, T, spec.link(0, 1));  // a stage's members: one node
  const CostSource costs(planned, ProfileStore{}, "", Device::cuda(0), 0, cm, {}, c.optimizer.optimizer);
  // The balancer's split by the spec's roofline.
  c.pipeline.balance = partition::balance_by_cost(
      partition::layer_costs(planned, plan.largest_micro_batch(), recomputes(plan.recompute), {}, cm),
      plan.num_cells());
  const Plan spec_plan = plan_for(c);
  // Stage k's first device is k T: the link between stages.
  PlannedRun run = predict(spec_plan, planned, costs, [&spec, T](int a, int b) { return spec.link(a * T, b * T); },
                           c.optimizer.optimizer);
  run.launches_captured = cm.launches_captured;
  out << "Plan for " << (T > 1 ? devices_text + " of " : std::to_string(n) + " x ") << spec.name << " (" << spec.source
      << "; " << spec.devices_per_node << " per node, " << spec.intra_node.kind << " within, " << spec.inter_node.kind
      << " between nodes), balance";
  for (int b : spec_plan.balance) out << " " << b;
  out << ":\n";
  print_planned(spec_plan, run, c.pipeline.memory_limit > 0 ? c.pipeline.memory_limit : spec.memory_bytes, out);
  Plan on_spec = spec_plan;  // its stages on the spec's GPUs, for the refusal's words
  for (int k = 0; k < on_spec.stages; ++k) on_spec.devices[k] = Device::cuda(k * T);
  check_memory_limit(c, on_spec, spec.memory_bytes,
                     {"--devices", "gpipe plan CONFIG --devices N --device-spec " + spec.source + " --sweep"});
  return 0;
}


}  // namespace pipeline
}  // namespace gpipe

// Times the executor on an MLP: `depth` x [Linear(width) + ReLU], then Linear(width ->
// classes) and softmax cross-entropy, float32, SGD. Prints one JSON line: the median
// step time over the timed steps (warm-up excluded), the measured bubble from
// ReportBuilder against the ideal (K-1)/(M+K-1), and with --direct the runtime's own
// cost per instruction against the same work done directly on one thread.
//
//   pipeline_bench --k 2 --m 8 --checkpoint never --width 1024 --depth 16 --batch 256 --steps 10
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/direct.h"
#include "kernels/backend.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "pipeline/report/report.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "runtime/logging.h"
#include "runtime/random.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

struct Flags {
  int k = 2, m = 8;
  std::string checkpoint = "never";
  int64_t width = 1024, depth = 16, input = -1, classes = 10, batch = 256;
  int steps = 10, warmup = 2;
  int blas_threads = 1;
  bool pin = true;
  bool lead_relu = false;  // a ReLU before the first Linear, so that every Linear computes dx
  int core = 0;  // the driver thread's core (and a K = 1 stage's)
  bool direct = false;  // also time the direct single-thread baseline
  std::string device = "cpu";  // cpu: stage k on cpu:k; otherwise every stage on this device (e.g. cuda:0)
  bool table = false;   // ReportBuilder's table on stderr
  bool trace = false;   // the last step's per-instruction timeline on stderr
  double lr = 0.01;
  uint64_t seed = 1;
  std::vector<int> balance;  // empty: balance_by_cost, as the trainer does
};

const char* kUsage =
    "usage: pipeline_bench [--k K] [--m M] [--checkpoint never|except_last|always] [--width W] [--depth D]\n"
    "                      [--input I] [--classes C] [--batch N] [--steps S] [--warmup W] [--blas-threads T]\n"
    "                      [--balance a,b,..] [--lr LR] [--seed S] [--core C] [--no-pin] [--direct] [--table]\n"
    "                      [--trace] [--lead-relu] [--device cpu|cuda:N]\n";

[[noreturn]] void usage_error(const std::string& why) {
  std::cerr << "pipeline_bench: " << why << "\n" << kUsage;
  std::exit(2);
}

int64_t to_int(const std::string& key, const std::string& v) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') usage_error("--" + key + " takes an integer, got '" + v + "'");
  return n;
}

Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (a.rfind("--", 0) != 0) usage_error("unexpected argument '" + a + "'");
    a = a.substr(2);
    std::string value;
    const size_t eq = a.find('=');
    const bool has_eq = eq != std::string::npos;
    if (has_eq) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    std::replace(a.begin(), a.end(), '_', '-');
    if (a == "no-pin") { f.pin = false; continue; }
    if (a == "direct") { f.direct = true; continue; }
    if (a == "table") { f.table = true; continue; }
    if (a == "trace") { f.trace = true; continue; }
    if (a == "lead-relu") { f.lead_relu = true; continue; }
    if (!has_eq) {
      if (i + 1 >= argc) usage_error("--" + a + " needs a value");
      value = argv[++i];
    }
    if (a == "k") f.k = static_cast<int>(to_int(a, value));
    else if (a == "m") f.m = static_cast<int>(to_int(a, value));
    else if (a == "checkpoint") f.checkpoint = value;
    else if (a == "device") f.device = value;
    else if (a == "width") f.width = to_int(a, value);
    else if (a == "depth") f.depth = to_int(a, value);
    else if (a == "input") f.input = to_int(a, value);
    else if (a == "classes") f.classes = to_int(a, value);
    else if (a == "batch") f.batch = to_int(a, value);
    else if (a == "steps") f.steps = static_cast<int>(to_int(a, value));
    else if (a == "warmup") f.warmup = static_cast<int>(to_int(a, value));
    else if (a == "blas-threads") f.blas_threads = static_cast<int>(to_int(a, value));
    else if (a == "core") f.core = static_cast<int>(to_int(a, value));
    else if (a == "lr") f.lr = std::atof(value.c_str());
    else if (a == "seed") f.seed = static_cast<uint64_t>(to_int(a, value));
    else if (a == "balance") {
      std::stringstream ss(value);
      std::string part;
      while (std::getline(ss, part, ',')) f.balance.push_back(static_cast<int>(to_int(a, part)));
    } else {
      usage_error("unknown flag --" + a);
    }
  }
  if (f.input < 0) f.input = f.width;
  if (f.k < 1 || f.m < 1 || f.depth < 0 || f.width < 1 || f.steps < 1 || f.warmup < 0) {
    usage_error("K, M, width and steps must be positive; depth and warmup at least 0");
  }
  return f;
}

layers::ModelSpec mlp_spec(const Flags& f) {
  layers::ModelSpec spec;
  spec.input = {f.input};
  spec.dtype = DType::kF32;
  spec.seed = f.seed;
  // The executor skips the input gradient of the model's first layer; a leading ReLU
  // moves that saving off the Linears, so that a split into equal halves of Linears is
  // also equal in work (a diagnostic for the bubble, not the benchmark's model).
  if (f.lead_relu) spec.layers.push_back({"relu", {}, {}, ""});
  for (int64_t i = 0; i < f.depth; ++i) {
    spec.layers.push_back({"linear", {{"out", std::to_string(f.width)}}, {}, ""});
    spec.layers.push_back({"relu", {}, {}, ""});
  }
  spec.layers.push_back({"linear", {{"out", std::to_string(f.classes)}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// CPU seconds the whole machine spent busy (and lost to the hypervisor: steal) from
// /proc/stat, and this process's own from getrusage: their difference over the timed
// steps is what other programs took, which on a 2-core machine slows K = 2 (both
// cores) and not K = 1, so a run reports it and bench/run.sh retries disturbed runs.
struct CpuSample {
  double machine_busy_s = 0, steal_s = 0, self_s = 0;
  std::chrono::steady_clock::time_point when;
};

CpuSample sample_cpu() {
  CpuSample c;
  c.when = std::chrono::steady_clock::now();
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal && cpu == "cpu") {
    const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
    c.machine_busy_s = (user + nice + system + irq + softirq) / hz;
    c.steal_s = steal / hz;
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  c.self_s = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  return c;
}

// The stages' layer counts: --balance as given (checked against the model), or by cost as the trainer balances.
std::vector<int> stage_balance(const Flags& f, const layers::Sequential& model, RecomputeMode mode) {
  std::vector<int> balance = f.balance;
  if (balance.empty()) {
    const int64_t micro = (f.batch + f.m - 1) / f.m;
    balance = partition::balance_by_cost(partition::layer_costs(model, micro, recomputes(mode)), f.k);
  } else {
    partition::validate_balance(balance, model.size(), f.k);
  }
  return balance;
}

// Stage k's device: cpu:k, or with --device every stage on that one device.
std::vector<Device> stage_placement(const Flags& f) {
  std::vector<Device> devices;
  // On one GPU the stages share it (taking turns on its stream), as on a single-GPU
  // machine; the per-instruction timings then measure the host's queuing, and only
  // step_ms (which waits for the device) is the GPU's time.
  for (int k = 0; k < f.k; ++k) devices.push_back(f.device == "cpu" ? Device::cpu(k) : parse_device(f.device));
  return devices;
}

// The batch every step trains on.
struct Batch {
  Tensor x, y;
};

// A fixed synthetic batch: inputs (N, input) ~ N(0, 1), labels uniform in [0, classes).
Batch synthetic_batch(const Flags& f) {
  Tensor x = Tensor::empty({f.batch, f.input}, DType::kF32, Device::cpu());
  Tensor y = Tensor::empty({f.batch}, DType::kI32, Device::cpu());
  Rng rng(f.seed * 7919 + 1);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(rng.normal());
  for (int64_t i = 0; i < f.batch; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(rng.next() % f.classes);
  return {x, y};
}

// The report's stage columns: each stage's layers and device.
ReportBuilder make_report(const Flags& f, const layers::Sequential& model, const std::vector<CellSpec>& stages,
                          const Schedule& schedule, RecomputeMode mode) {
  std::vector<std::string> stage_layers, stage_devices;
  for (const auto& s : stages) {
    stage_layers.push_back(describe_layers(model, s.first_layer, s.num_layers));
    stage_devices.push_back(s.device.str());
  }
  return ReportBuilder(stage_layers, stage_devices, schedule, mode, f.batch);
}

// The direct baseline and the model it runs: its own copy (same seed, same weights).
struct Direct {
  std::unique_ptr<layers::Sequential> model;
  std::unique_ptr<bench::DirectRunner> runner;
};

// With --direct, the baseline on the executor's stages and schedule; otherwise none.
Direct make_direct(const Flags& f, const layers::ModelSpec& spec, const std::vector<CellSpec>& stages,
                   const Schedule& schedule) {
  Direct direct;
  if (f.direct) {
    direct.model = layers::build_model(spec);
    SgdParams sgd;
    sgd.lr = f.lr;
    direct.runner = std::make_unique<bench::DirectRunner>(*direct.model, stages, schedule, sgd, f.pin);
  }
  return direct;
}

// What the timed steps measured: the executor's step times and each stage's time outside and inside its
// instructions, with --direct the baseline's, and the last loss and (with --trace) the last step.
struct Measurements {
  std::vector<double> exec_ms, direct_ms, ideal_ms;
  std::vector<std::vector<double>> exec_prologue_ms, exec_gap_ms, exec_compute_ms, direct_compute_ms,
      direct_zero_grad_ms;
  double last_loss = 0, max_loss_rel_diff = 0;
  StepResult last_step;
  CpuSample cpu_begin;
};

// Records each stage's time of a timed executor step outside and inside its instructions.
void record_exec_stages(const StepResult& r, int K, Measurements& out) {
  for (int k = 0; k < K; ++k) {
    // Time on stage k outside any instruction: from the step's start to its first
    // instruction (thread wake-up, clearing its gradients: the prologue) and
    // between consecutive instructions (the interpreter's bookkeeping).
    const auto& ops = r.stages[k].ops;
    double gap = 0, compute = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (i > 0) gap += ops[i].start_ms - ops[i - 1].end_ms;
      if (is_compute(ops[i].op)) compute += ops[i].end_ms - ops[i].start_ms;
    }
    out.exec_prologue_ms[k].push_back(ops.empty() ? 0.0 : ops.front().start_ms);
    out.exec_gap_ms[k].push_back(gap);
    out.exec_compute_ms[k].push_back(compute);
  }
}

// Checks that the direct step computed the executor's loss (the same weights, data and operations), or it is not
// measuring the same work; keeps the largest relative difference.
void check_direct_loss(const bench::DirectStep& d, const StepResult& r, int s, Measurements& out) {
  const double rel = std::abs(d.loss - r.loss) / std::max(1e-12, std::abs(r.loss));
  out.max_loss_rel_diff = std::max(out.max_loss_rel_diff, rel);
  if (rel > 1e-4) {
    throw Error("the direct baseline's loss " + std::to_string(d.loss) + " differs from the executor's " +
                std::to_string(r.loss) + " at step " + std::to_string(s));
  }
}

// Records a timed direct step: its time, the ideal pipelined makespan of its costs and each stage's compute and
// gradient clearing.
void record_direct_step(const bench::DirectStep& d, const Schedule& schedule, int K, Measurements& out) {
  out.direct_ms.push_back(d.total_ms);
  out.ideal_ms.push_back(bench::ideal_makespan_ms(schedule, d.zero_grad_ms, d.cost_ms));
  for (int k = 0; k < K; ++k) {
    double compute = 0;
    for (size_t i = 0; i < schedule.stages[k].size(); ++i) {
      if (is_compute(schedule.stages[k][i].op)) compute += d.cost_ms[k][i];
    }
    out.direct_compute_ms[k].push_back(compute);
    out.direct_zero_grad_ms[k].push_back(d.zero_grad_ms[k]);
  }
}

// The warm-up and timed steps. Executor and direct steps alternate, so a drift in machine load hits both alike.
Measurements run_steps(const Flags& f, Executor& ex, bench::DirectRunner* direct, const Schedule& schedule,
                       ReportBuilder& report, const Batch& batch) {
  Measurements out;
  out.exec_prologue_ms.resize(f.k);
  out.exec_gap_ms.resize(f.k);
  out.exec_compute_ms.resize(f.k);
  out.direct_compute_ms.resize(f.k);
  out.direct_zero_grad_ms.resize(f.k);
  for (int s = 0; s < f.warmup + f.steps; ++s) {
    const bool timed = s >= f.warmup;
    if (s == f.warmup) out.cpu_begin = sample_cpu();
    const auto t0 = std::chrono::steady_clock::now();
    const StepResult r = ex.step(batch.x, batch.y);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    report.add_step(s, r.loss, r, timed);
    out.last_loss = r.loss;
    if (f.trace && s + 1 == f.warmup + f.steps) out.last_step = r;
    if (!std::isfinite(r.loss)) throw Error("the loss became non-finite at step " + std::to_string(s));
    if (timed) {
      out.exec_ms.push_back(ms);
      record_exec_stages(r, f.k, out);
    }
    if (direct) {
      const bench::DirectStep d = direct->step(batch.x, batch.y);
      check_direct_loss(d, r, s, out);
      if (timed) record_direct_step(d, schedule, f.k, out);
    }
  }
  return out;
}

// Stage k's entry of the JSON line: the report's time breakdown, the medians of its time outside and inside its
// instructions, and with --direct the baseline's.
nlohmann::json stage_json(const StageSummary& s, int k, const Measurements& ms, bool direct) {
  nlohmann::json e = {{"stage", k},
                      {"layers", s.layers},
                      {"forward_ms", s.forward_ms},
                      {"recompute_ms", s.recompute_ms},
                      {"backward_ms", s.backward_ms},
                      {"optimizer_ms", s.optimizer_ms},
                      {"comm_ms", s.comm_ms},
                      {"idle_ms", s.idle_ms},
                      {"busy_ms", s.busy_ms},
                      {"utilization", s.utilization},
                      {"prologue_ms", median(ms.exec_prologue_ms[k])},
                      {"gap_ms", median(ms.exec_gap_ms[k])},
                      {"compute_ms_median", median(ms.exec_compute_ms[k])}};
  if (direct) {
    e["direct_compute_ms"] = median(ms.direct_compute_ms[k]);
    e["direct_zero_grad_ms"] = ms.direct_zero_grad_ms[k].empty() ? 0.0 : median(ms.direct_zero_grad_ms[k]);
  }
  return e;
}

// The run's settings: the flags and the balance they gave.
nlohmann::json settings_json(const Flags& f, const std::vector<int>& balance) {
  nlohmann::json j;
  j["impl"] = "gpipe";
  j["k"] = f.k;
  j["m"] = f.m;
  j["checkpoint"] = f.checkpoint;
  j["device"] = f.device;
  j["width"] = f.width;
  j["depth"] = f.depth;
  j["lead_relu"] = f.lead_relu;
  j["input"] = f.input;
  j["classes"] = f.classes;
  j["batch"] = f.batch;
  j["blas_threads"] = f.blas_threads;
  j["pinned"] = f.pin;
  j["core"] = f.core;
  j["balance"] = balance;
  j["warmup"] = f.warmup;
  j["steps"] = f.steps;
  return j;
}

// With --direct: the baseline's step time and the runtime's own cost, the executor's step time less the ideal
// makespan of the baseline's instruction costs, in all and per instruction.
void add_direct_overhead(nlohmann::json& j, const std::vector<int>& instructions, const Measurements& ms) {
  const int per_stage = *std::max_element(instructions.begin(), instructions.end());
  int total = 0;
  for (int n : instructions) total += n;
  const double overhead = median(ms.exec_ms) - median(ms.ideal_ms);
  j["direct_step_ms"] = median(ms.direct_ms);
  j["direct_loss_max_rel_diff"] = ms.max_loss_rel_diff;
  j["ideal_ms"] = median(ms.ideal_ms);
  j["overhead_ms"] = overhead;
  // Per stage-step: the stages run concurrently, so each stage's runtime cost lies
  // on the step's critical path once per instruction of that stage.
  j["overhead_us_per_instruction"] = 1000.0 * overhead / per_stage;
  j["overhead_us_per_instruction_total"] = 1000.0 * overhead / total;
}

// The run's JSON line: its settings, the other programs' CPU use, step times, bubble, the stages and with
// --direct the runtime's cost per instruction.
nlohmann::json result_json(const Flags& f, const std::vector<int>& balance, const Schedule& schedule,
                           const RunSummary& sum, const Measurements& ms, const CpuSample& cpu_end) {
  const CpuSample& cpu_begin = ms.cpu_begin;
  const double cpu_wall_s = std::chrono::duration<double>(cpu_end.when - cpu_begin.when).count();
  const std::vector<double>& exec_ms = ms.exec_ms;
  nlohmann::json j = settings_json(f, balance);
  j["loss"] = ms.last_loss;
  // Cores' worth of CPU that other programs used (and the hypervisor stole) while
  // this run was timing its steps.
  j["foreign_cores"] = std::max(0.0, (cpu_end.machine_busy_s - cpu_begin.machine_busy_s) -
                                         (cpu_end.self_s - cpu_begin.self_s)) / cpu_wall_s;
  j["steal_cores"] = (cpu_end.steal_s - cpu_begin.steal_s) / cpu_wall_s;
  j["step_ms"] = median(exec_ms);
  j["step_ms_min"] = *std::min_element(exec_ms.begin(), exec_ms.end());
  j["step_ms_max"] = *std::max_element(exec_ms.begin(), exec_ms.end());
  j["span_ms_mean"] = sum.span_ms;
  j["measured_bubble"] = sum.measured_bubble;
  j["ideal_bubble"] = sum.ideal_bubble;
  j["bubble_rel_diff"] = sum.ideal_bubble > 0 ? (sum.measured_bubble - sum.ideal_bubble) / sum.ideal_bubble : 0.0;
  std::vector<int> instructions;
  for (const auto& prog : schedule.stages) instructions.push_back(static_cast<int>(prog.size()));
  j["instructions_per_stage"] = instructions;
  nlohmann::json st = nlohmann::json::array();
  for (int k = 0; k < f.k; ++k) st.push_back(stage_json(sum.stages[k], k, ms, f.direct));
  j["stages"] = st;
  if (f.direct) add_direct_overhead(j, instructions, ms);
  return j;
}

// The last step's timeline on stderr, one line per instruction: stage, op, micro-batch, start and end (ms since the
// step began).
void print_trace(const StepResult& last_step) {
  std::fprintf(stderr, "trace of the last step (wall %.3f ms):\n", last_step.wall_ms);
  for (size_t k = 0; k < last_step.stages.size(); ++k) {
    for (const TimedOp& op : last_step.stages[k].ops) {
      std::fprintf(stderr, "  stage %zu %-3s %2d %9.3f %9.3f\n", k, op_short_name(op.op), op.micro_batch, op.start_ms,
                   op.end_ms);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse_flags(argc, argv);
  try {
    init_logging("warn");
    set_cpu_blas_threads(f.blas_threads);
    const layers::ModelSpec spec = mlp_spec(f);
    auto model = layers::build_model(spec);
    const RecomputeMode mode = parse_recompute_mode(f.checkpoint);
    const std::vector<int> balance = stage_balance(f, *model, mode);
    const std::vector<CellSpec> stages = make_stages(balance, stage_placement(f));
    const Schedule schedule = gpipe_schedule(f.k, f.m, mode);
    const Batch batch = synthetic_batch(f);

    // The driver thread runs on one core (--core, default 0); the executor pins stage k
    // to core k (K = 1 included), and the direct baseline of a K = 1 run shares core 0.
    if (f.pin && !bench::pin_this_thread(f.core)) usage_error("cannot pin to core " + std::to_string(f.core));
    InProcessTransport transport(f.k);
    ExecutorOptions opts;
    opts.optimizer.lr = f.lr;
    opts.pin_threads = f.pin;
    Executor ex(*model, stages, schedule, transport, opts);
    ReportBuilder report = make_report(f, *model, stages, schedule, mode);
    const Direct direct = make_direct(f, spec, stages, schedule);

    const Measurements ms = run_steps(f, ex, direct.runner.get(), schedule, report, batch);
    const CpuSample cpu_end = sample_cpu();
    std::cout << result_json(f, balance, schedule, report.summary(), ms, cpu_end).dump() << std::endl;
    if (f.table) std::cerr << report.table();
    if (f.trace) print_trace(ms.last_step);
  } catch (const std::exception& e) {
    std::cerr << "pipeline_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

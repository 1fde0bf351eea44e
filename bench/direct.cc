#include "bench/direct.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>
#include <tuple>

#include "layers/loss.h"
#include "runtime/error.h"

namespace gpipe {
namespace bench {

using pipeline::Instruction;
using pipeline::Op;

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What a stage keeps per micro-batch; the executor's MicroBatch without the memory meter.
struct Slot {
  Tensor input, output;
  std::vector<layers::Context> ctx;
  layers::Context loss_ctx;
  Tensor targets, loss, grad_output, grad_input;
};

// Tensors sent and not yet received: (destination stage, kind: 0 activation / 1 gradient, micro-batch) -> tensor.
using Mail = std::map<std::tuple<int, int, int>, Tensor>;

// With `pin`, moves the calling thread to core k while it runs stage k's instructions, and puts its original
// affinity back at the end of the step.
class StagePinning {
 public:
  explicit StagePinning(bool pin) : pin_(pin) {
    if (pin_) pthread_getaffinity_np(pthread_self(), sizeof(saved_affinity_), &saved_affinity_);
  }
  void move_to(int k) {
    if (pin_ && on_core_ != k) on_core_ = pin_this_thread(k) ? k : on_core_;
  }
  void restore() {
    if (pin_) pthread_setaffinity_np(pthread_self(), sizeof(saved_affinity_), &saved_affinity_);
  }

 private:
  bool pin_;
  cpu_set_t saved_affinity_;
  int on_core_ = -1;
};

// What the phases of one step share, all owned by DirectRunner::step: the backend, the model and its loss, the
// stages, the batch and where each micro-batch's rows lie in it, each stage's slots and the tensors in flight.
struct StepState {
  Backend& be;
  layers::Sequential& model;
  layers::Loss& loss;
  const std::vector<pipeline::CellSpec>& stages;
  int K;
  const Tensor& inputs;
  const Tensor& targets;
  const std::vector<int64_t>& sizes;
  const std::vector<int64_t>& offsets;
  double scale;
  const std::vector<std::vector<char>>& checkpointed;  // [k][m]: stage k recomputes micro-batch m
  std::vector<std::vector<Slot>>& slots;  // [k][m]
  Mail& mail;
};

// Clears each stage's gradients on that stage's core, as each executor stage does before its first instruction,
// and appends the time each stage took to zero_grad_ms.
void zero_gradients(Backend& be, layers::Sequential& model, const std::vector<pipeline::CellSpec>& stages, int K,
                    StagePinning& pinning, std::vector<double>& zero_grad_ms) {
  for (int k = 0; k < K; ++k) {
    pinning.move_to(k);
    const Clock::time_point t0 = Clock::now();
    const pipeline::CellSpec& s = stages[k];
    for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
      for (layers::Parameter* p : model.layer(i).parameters()) be.fill(p->grad, 0.0);
    }
    zero_grad_ms.push_back(ms_since(t0));
  }
}

// Where each of the M micro-batches' rows start in the batch.
std::vector<int64_t> micro_batch_offsets(const std::vector<int64_t>& sizes, int M) {
  std::vector<int64_t> offsets(M, 0);
  for (int m = 1; m < M; ++m) offsets[m] = offsets[m - 1] + sizes[m - 1];
  return offsets;
}

// checkpointed[k][m]: whether stage k's program recomputes micro-batch m's forward (so its forward keeps no
// contexts).
std::vector<std::vector<char>> checkpointed_micro_batches(const pipeline::Schedule& schedule) {
  std::vector<std::vector<char>> checkpointed;
  for (int k = 0; k < schedule.num_stages; ++k) {
    checkpointed.push_back(pipeline::micro_batch_roles(schedule, k).recomputed.at(0));  // one cell per stage
  }
  return checkpointed;
}

// Stage k's layers on micro-batch m's input, keeping each layer's context when `keep`; the last stage also computes
// the loss. A recompute only rebuilds the contexts: the output and loss stay those of the first forward.
void cell_forward(StepState& st, int k, Slot& mb, int m, bool keep, bool recompute) {
  const pipeline::CellSpec& s = st.stages[k];
  Tensor h = mb.input;
  if (keep) mb.ctx.assign(s.num_layers, {});
  for (int i = 0; i < s.num_layers; ++i) {
    h = st.model.layer(s.first_layer + i).forward(st.be, h, keep ? &mb.ctx[i] : nullptr);
  }
  if (k == st.K - 1) {
    if (!mb.targets.defined()) mb.targets = st.targets.narrow_rows(st.offsets[m], st.sizes[m]);
    Tensor l = st.loss.forward(st.be, h, mb.targets, st.scale, keep ? &mb.loss_ctx : nullptr);
    if (!recompute) mb.loss = l;
  } else if (!recompute) {
    mb.output = h;
  }
}

// A forward instruction: stage 0 takes micro-batch m's rows of the batch as its input; a checkpointed micro-batch
// keeps its input for the recompute and no contexts, any other keeps its contexts and drops its input.
void forward_micro_batch(StepState& st, int k, int m) {
  Slot& mb = st.slots[k][m];
  if (k == 0) mb.input = st.inputs.narrow_rows(st.offsets[m], st.sizes[m]);
  cell_forward(st, k, mb, m, !st.checkpointed[k][m], false);
  if (!st.checkpointed[k][m]) mb.input = Tensor();
}

// A backward instruction: from the loss's gradient (last stage) or the received one back through stage k's layers
// (the model's first layer computes no input gradient), then drops what micro-batch m kept for it.
void backward_micro_batch(StepState& st, int k, int m) {
  Slot& mb = st.slots[k][m];
  const pipeline::CellSpec& s = st.stages[k];
  Tensor g = k == st.K - 1 ? st.loss.backward(st.be, mb.loss_ctx) : mb.grad_output;
  for (int i = s.num_layers - 1; i >= 0; --i) {
    g = st.model.layer(s.first_layer + i).backward(st.be, g, mb.ctx[i], i > 0 || k > 0);
  }
  mb.grad_input = g;
  mb.ctx.clear();
  mb.loss_ctx = {};
  mb.input = Tensor();
  mb.grad_output = Tensor();
}

// A receive instruction of stage k: moves what its neighbour sent into the micro-batch's slot; false if it has not
// been sent yet.
bool receive(StepState& st, int k, const Instruction& ins) {
  const int m = ins.micro_batch;
  const int kind = ins.op == Op::kRecvActivation ? 0 : 1;
  auto it = st.mail.find({k, kind, m});
  if (it == st.mail.end()) return false;
  (kind == 0 ? st.slots[k][m].input : st.slots[k][m].grad_output) = std::move(it->second);
  st.mail.erase(it);
  return true;
}

// Runs one instruction of stage k other than a receive; returns whether its time is its cost (false for sends and
// a skipped optimizer step).
bool run_instruction(StepState& st, int k, const Instruction& ins,
                     const std::vector<std::unique_ptr<layers::Sgd>>& optimizers, bool apply_optimizer) {
  const int m = ins.micro_batch;
  bool timed = true;
  switch (ins.op) {
    case Op::kForward:
      forward_micro_batch(st, k, m);
      break;
    case Op::kRecompute:
      cell_forward(st, k, st.slots[k][m], m, true, true);
      break;
    case Op::kBackward:
      backward_micro_batch(st, k, m);
      break;
    case Op::kOptimizerStep:
      if (apply_optimizer) {
        optimizers[k]->step();
      } else {
        timed = false;
      }
      break;
    case Op::kSendActivation:
      st.mail[{k + 1, 0, m}] = std::move(st.slots[k][m].output);
      st.slots[k][m].output = Tensor();
      timed = false;
      break;
    case Op::kSendGradient:
      st.mail[{k - 1, 1, m}] = std::move(st.slots[k][m].grad_input);
      st.slots[k][m].grad_input = Tensor();
      timed = false;
      break;
    case Op::kRecvActivation:
    case Op::kRecvGradient:
      break;  // handled by receive
    case Op::kReduceGradients:
    case Op::kTiedGradients:
    case Op::kGradientNorm:
    case Op::kReduceScatterGradients:
    case Op::kGatherParameters:
      throw Error("the direct runner runs one replica of a model without ties or clipping; a schedule with "
                  "collectives needs the executor");
    case Op::kTensorSum:
    case Op::kTensorMax:
    case Op::kTensorGather:
    case Op::kTensorScatter:
      throw Error("the direct runner runs no tensor group; a schedule with tensor collectives needs the executor");
    case Op::kBackwardWeight:
      throw Error("the direct runner runs GPipe and 1F1B schedules, whose backward computes the weight gradients; "
                  "a schedule with W instructions needs the executor");
  }
  return timed;
}

// Runs each stage's program as far as its receives allow, stage after stage, until every program is done: for
// GPipe, stage 0's forwards, stage 1's forwards and backwards, then stage 0's backwards. Each timed instruction's
// time goes to cost_ms[k][i].
void run_programs(StepState& st, const pipeline::Schedule& schedule,
                  const std::vector<std::unique_ptr<layers::Sgd>>& optimizers, bool apply_optimizer,
                  StagePinning& pinning, std::vector<std::vector<double>>& cost_ms) {
  const int K = st.K;
  std::vector<size_t> pc(K, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int k = 0; k < K; ++k) {
      const std::vector<Instruction>& prog = schedule.stages[k];
      while (pc[k] < prog.size()) {
        const Instruction ins = prog[pc[k]];
        if (ins.op != Op::kRecvActivation && ins.op != Op::kRecvGradient) pinning.move_to(k);
        if (ins.op == Op::kRecvActivation || ins.op == Op::kRecvGradient) {
          if (!receive(st, k, ins)) break;  // its neighbour has not sent it yet
          ++pc[k];
          progress = true;
          continue;
        }
        const Clock::time_point t0 = Clock::now();
        const bool timed = run_instruction(st, k, ins, optimizers, apply_optimizer);
        if (timed) cost_ms[k][pc[k]] = ms_since(t0);
        ++pc[k];
        progress = true;
      }
    }
  }
  for (int k = 0; k < K; ++k) {
    GPIPE_CHECK(pc[k] == schedule.stages[k].size(), "the direct run of stage " + std::to_string(k) + " stalled");
  }
}

}  // namespace

bool pin_this_thread(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

DirectRunner::DirectRunner(layers::Sequential& model, std::vector<pipeline::CellSpec> stages,
                           pipeline::Schedule schedule, const SgdParams& sgd, bool pin_stages)
    : model_(model), stages_(std::move(stages)), schedule_(std::move(schedule)), pin_stages_(pin_stages) {
  GPIPE_CHECK(static_cast<int>(stages_.size()) == schedule_.num_stages, "one stage spec per schedule stage");
  pipeline::check_schedule(schedule_);
  for (const auto& s : stages_) {
    std::vector<layers::Parameter*> params;
    for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
      for (auto* p : model_.layer(i).parameters()) params.push_back(p);
    }
    optimizers_.push_back(std::make_unique<layers::Sgd>(params, sgd));
  }
}

DirectStep DirectRunner::step(const Tensor& inputs, const Tensor& targets, bool apply_optimizer) {
  const int K = schedule_.num_stages, M = schedule_.num_micro_batches;
  Backend& be = backend_for(Device::cpu());
  layers::Loss& loss = model_.loss();
  DirectStep out;
  out.cost_ms.resize(K);
  for (int k = 0; k < K; ++k) out.cost_ms[k].assign(schedule_.stages[k].size(), 0.0);
  StagePinning pinning(pin_stages_ && K > 1 && static_cast<unsigned>(K) <= std::thread::hardware_concurrency());

  const Clock::time_point t_step = Clock::now();
  zero_gradients(be, model_, stages_, K, pinning, out.zero_grad_ms);
  const int64_t n = inputs.size(0);
  const std::vector<int64_t> sizes = pipeline::split_sizes(n, M);
  const std::vector<int64_t> offsets = micro_batch_offsets(sizes, M);
  const double scale = 1.0 / static_cast<double>(n);  // the benchmark's labels are never ignore_index
  std::vector<std::vector<Slot>> slots(K, std::vector<Slot>(M));
  const std::vector<std::vector<char>> checkpointed = checkpointed_micro_batches(schedule_);
  Mail mail;
  StepState st{be, model_, loss, stages_, K, inputs, targets, sizes, offsets, scale, checkpointed, slots, mail};
  run_programs(st, schedule_, optimizers_, apply_optimizer, pinning, out.cost_ms);
  be.synchronize();
  for (const Slot& mb : slots[K - 1]) out.loss += be.item(mb.loss);
  out.total_ms = ms_since(t_step);
  pinning.restore();
  return out;
}

double ideal_makespan_ms(const pipeline::Schedule& s, const std::vector<double>& start_ms,
                         const std::vector<std::vector<double>>& cost_ms) {
  const int K = s.num_stages;
  std::vector<size_t> pc(K, 0);
  std::vector<double> clock = start_ms;
  std::map<std::tuple<int, int, int>, double> arrival;  // (dst, kind, m) -> when it was sent
  for (bool progress = true; progress;) {
    progress = false;
    for (int k = 0; k < K; ++k) {
      while (pc[k] < s.stages[k].size()) {
        const Instruction& ins = s.stages[k][pc[k]];
        const int m = ins.micro_batch;
        if (ins.op == Op::kRecvActivation || ins.op == Op::kRecvGradient) {
          auto it = arrival.find({k, ins.op == Op::kRecvActivation ? 0 : 1, m});
          if (it == arrival.end()) break;
          clock[k] = std::max(clock[k], it->second);
        } else {
          clock[k] += cost_ms[k][pc[k]];
          if (ins.op == Op::kSendActivation) arrival[{k + 1, 0, m}] = clock[k];
          if (ins.op == Op::kSendGradient) arrival[{k - 1, 1, m}] = clock[k];
        }
        ++pc[k];
        progress = true;
      }
    }
  }
  return *std::max_element(clock.begin(), clock.end());
}

}  // namespace bench
}  // namespace gpipe

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

  const bool pin = pin_stages_ && K > 1 && static_cast<unsigned>(K) <= std::thread::hardware_concurrency();
  cpu_set_t saved_affinity;
  if (pin) pthread_getaffinity_np(pthread_self(), sizeof(saved_affinity), &saved_affinity);
  int on_core = -1;
  auto move_to = [&](int k) {
    if (pin && on_core != k) on_core = pin_this_thread(k) ? k : on_core;
  };

  const Clock::time_point t_step = Clock::now();
  for (int k = 0; k < K; ++k) {
    move_to(k);
    const Clock::time_point t0 = Clock::now();
    const pipeline::CellSpec& s = stages_[k];
    for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) be.fill(p->grad, 0.0);
    }
    out.zero_grad_ms.push_back(ms_since(t0));
  }
  const int64_t n = inputs.size(0);
  const std::vector<int64_t> sizes = pipeline::split_sizes(n, M);
  std::vector<int64_t> offsets(M, 0);
  for (int m = 1; m < M; ++m) offsets[m] = offsets[m - 1] + sizes[m - 1];
  const double scale = 1.0 / static_cast<double>(n);  // the benchmark's labels are never ignore_index

  std::vector<std::vector<Slot>> slots(K, std::vector<Slot>(M));
  std::vector<std::vector<char>> checkpointed(K, std::vector<char>(M, 0));
  for (int k = 0; k < K; ++k) {
    for (const Instruction& ins : schedule_.stages[k]) {
      if (ins.op == Op::kRecompute) checkpointed[k][ins.micro_batch] = 1;
    }
  }
  // (destination stage, kind: 0 activation / 1 gradient, micro-batch) -> tensor
  std::map<std::tuple<int, int, int>, Tensor> mail;

  auto cell_forward = [&](int k, Slot& mb, int m, bool keep, bool recompute) {
    const pipeline::CellSpec& s = stages_[k];
    Tensor h = mb.input;
    if (keep) mb.ctx.assign(s.num_layers, {});
    for (int i = 0; i < s.num_layers; ++i) {
      h = model_.layer(s.first_layer + i).forward(be, h, keep ? &mb.ctx[i] : nullptr);
    }
    if (k == K - 1) {
      if (!mb.targets.defined()) mb.targets = targets.narrow_rows(offsets[m], sizes[m]);
      Tensor l = loss.forward(be, h, mb.targets, scale, keep ? &mb.loss_ctx : nullptr);
      if (!recompute) mb.loss = l;
    } else if (!recompute) {
      mb.output = h;
    }
  };

  // Runs each stage's program as far as its receives allow, stage after stage, until
  // every program is done: for GPipe, stage 0's forwards, stage 1's forwards and
  // backwards, then stage 0's backwards.
  std::vector<size_t> pc(K, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int k = 0; k < K; ++k) {
      const std::vector<Instruction>& prog = schedule_.stages[k];
      while (pc[k] < prog.size()) {
        const Instruction ins = prog[pc[k]];
        if (ins.op != Op::kRecvActivation && ins.op != Op::kRecvGradient) move_to(k);
        const int m = ins.micro_batch;
        if (ins.op == Op::kRecvActivation || ins.op == Op::kRecvGradient) {
          const int kind = ins.op == Op::kRecvActivation ? 0 : 1;
          auto it = mail.find({k, kind, m});
          if (it == mail.end()) break;  // its neighbour has not sent it yet
          (kind == 0 ? slots[k][m].input : slots[k][m].grad_output) = std::move(it->second);
          mail.erase(it);
          ++pc[k];
          progress = true;
          continue;
        }
        const Clock::time_point t0 = Clock::now();
        bool timed = true;
        switch (ins.op) {
          case Op::kForward: {
            Slot& mb = slots[k][m];
            if (k == 0) mb.input = inputs.narrow_rows(offsets[m], sizes[m]);
            cell_forward(k, mb, m, !checkpointed[k][m], false);
            if (!checkpointed[k][m]) mb.input = Tensor();
            break;
          }
          case Op::kRecompute:
            cell_forward(k, slots[k][m], m, true, true);
            break;
          case Op::kBackward: {
            Slot& mb = slots[k][m];
            const pipeline::CellSpec& s = stages_[k];
            Tensor g = k == K - 1 ? loss.backward(be, mb.loss_ctx) : mb.grad_output;
            for (int i = s.num_layers - 1; i >= 0; --i) {
              g = model_.layer(s.first_layer + i).backward(be, g, mb.ctx[i], i > 0 || k > 0);
            }
            mb.grad_input = g;
            mb.ctx.clear();
            mb.loss_ctx = {};
            mb.input = Tensor();
            mb.grad_output = Tensor();
            break;
          }
          case Op::kOptimizerStep:
            if (apply_optimizer) {
              optimizers_[k]->step();
            } else {
              timed = false;
            }
            break;
          case Op::kSendActivation:
            mail[{k + 1, 0, m}] = std::move(slots[k][m].output);
            slots[k][m].output = Tensor();
            timed = false;
            break;
          case Op::kSendGradient:
            mail[{k - 1, 1, m}] = std::move(slots[k][m].grad_input);
            slots[k][m].grad_input = Tensor();
            timed = false;
            break;
          case Op::kRecvActivation:
          case Op::kRecvGradient:
            break;  // handled above
          case Op::kReduceGradients:
          case Op::kTiedGradients:
          case Op::kGradientNorm:
            throw Error("the direct runner runs one replica of a model without ties or clipping; a schedule with "
                        "collectives needs the executor");
          case Op::kBackwardWeight:
            throw Error("the direct runner runs GPipe and 1F1B schedules, whose backward computes the weight gradients; "
                        "a schedule with W instructions needs the executor");
        }
        if (timed) out.cost_ms[k][pc[k]] = ms_since(t0);
        ++pc[k];
        progress = true;
      }
    }
  }
  for (int k = 0; k < K; ++k) {
    GPIPE_CHECK(pc[k] == schedule_.stages[k].size(), "the direct run of stage " + std::to_string(k) + " stalled");
  }
  be.synchronize();
  for (const Slot& mb : slots[K - 1]) out.loss += be.item(mb.loss);
  out.total_ms = ms_since(t_step);
  if (pin) pthread_setaffinity_np(pthread_self(), sizeof(saved_affinity), &saved_affinity);
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

#include "pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

const char* op_name(Op op) {
  switch (op) {
    case Op::kRecvActivation: return "recv_activation";
    case Op::kForward: return "forward";
    case Op::kSendActivation: return "send_activation";
    case Op::kRecompute: return "recompute";
    case Op::kRecvGradient: return "recv_gradient";
    case Op::kBackward: return "backward";
    case Op::kSendGradient: return "send_gradient";
    case Op::kOptimizerStep: return "optimizer_step";
  }
  return "?";
}

const char* op_short_name(Op op) {
  switch (op) {
    case Op::kRecvActivation: return "rA";
    case Op::kForward: return "F";
    case Op::kSendActivation: return "sA";
    case Op::kRecompute: return "R";
    case Op::kRecvGradient: return "rG";
    case Op::kBackward: return "B";
    case Op::kSendGradient: return "sG";
    case Op::kOptimizerStep: return "OPT";
  }
  return "?";
}

CheckpointMode parse_checkpoint_mode(const std::string& name) {
  if (name == "always") return CheckpointMode::kAlways;
  if (name == "except_last") return CheckpointMode::kExceptLast;
  if (name == "never") return CheckpointMode::kNever;
  throw UserError("pipeline.checkpoint: unknown mode '" + name + "'; use always, except_last or never");
}

const char* checkpoint_mode_name(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::kAlways: return "always";
    case CheckpointMode::kExceptLast: return "except_last";
    case CheckpointMode::kNever: return "never";
  }
  return "?";
}

bool is_checkpointed(CheckpointMode mode, int m, int num_micro_batches) {
  switch (mode) {
    case CheckpointMode::kAlways: return true;
    case CheckpointMode::kExceptLast: return m != num_micro_batches - 1;
    case CheckpointMode::kNever: return false;
  }
  return false;
}

Schedule gpipe_schedule(int K, int M, CheckpointMode mode) {
  if (K < 1) throw UserError("pipeline.partitions must be at least 1, got " + std::to_string(K));
  if (M < 1) throw UserError("pipeline.micro_batches must be at least 1, got " + std::to_string(M));
  Schedule s;
  s.name = "gpipe";
  s.num_stages = K;
  s.num_micro_batches = M;
  s.stages.resize(K);
  for (int k = 0; k < K; ++k) {
    auto& out = s.stages[k];
    for (int m = 0; m < M; ++m) {
      if (k > 0) out.push_back({Op::kRecvActivation, m});
      out.push_back({Op::kForward, m});
      if (k < K - 1) out.push_back({Op::kSendActivation, m});
    }
    for (int m = M - 1; m >= 0; --m) {
      if (is_checkpointed(mode, m, M)) out.push_back({Op::kRecompute, m});
      if (k < K - 1) out.push_back({Op::kRecvGradient, m});
      out.push_back({Op::kBackward, m});
      if (k > 0) out.push_back({Op::kSendGradient, m});
    }
    out.push_back({Op::kOptimizerStep, -1});
  }
  return s;
}

Schedule make_schedule(const std::string& name, int K, int M, CheckpointMode mode) {
  if (name == "gpipe" || name == "fill_drain") return gpipe_schedule(K, M, mode);
  throw UserError("pipeline.schedule: unknown schedule '" + name + "'; valid schedules: gpipe (alias fill_drain)");
}

namespace {

std::string where(int k, const Instruction& ins) {
  return "stage " + std::to_string(k) + ": " + op_name(ins.op) +
         (ins.micro_batch >= 0 ? " of micro-batch " + std::to_string(ins.micro_batch) : std::string());
}

// Executes the schedule abstractly: per-stage order, blocking receives, messages that
// arrive at their send's finish time. Validates dependencies on the way and returns
// the simulated timing. Throws Error on the first violation or on a deadlock.
Simulation run_abstract(const Schedule& s, const OpCosts& c) {
  const int K = s.num_stages, M = s.num_micro_batches;
  GPIPE_CHECK(static_cast<int>(s.stages.size()) == K, "schedule has " + std::to_string(s.stages.size()) + " stages");
  // sent[(dst, kind, m)] = arrival time; kind 0 = activation, 1 = gradient
  std::map<std::tuple<int, int, int>, double> sent;
  std::map<std::tuple<int, int, int>, int> received;
  struct StageState {
    size_t pc = 0;
    double clock = 0, busy = 0;
    std::vector<int> recv_act, fwd, sent_act, recompute, recv_grad, bwd, sent_grad;
    int opt = 0;
  };
  std::vector<StageState> st(K);
  for (auto& x : st) {
    for (auto* v : {&x.recv_act, &x.fwd, &x.sent_act, &x.recompute, &x.recv_grad, &x.bwd, &x.sent_grad}) {
      v->assign(M, 0);
    }
  }
  auto mb_ok = [&](int k, const Instruction& ins) {
    if (ins.op == Op::kOptimizerStep) return;
    if (ins.micro_batch < 0 || ins.micro_batch >= M) throw Error("schedule " + where(k, ins) + ": no such micro-batch");
  };
  bool progress = true;
  size_t done = 0, total = 0;
  for (auto& v : s.stages) total += v.size();
  while (done < total && progress) {
    progress = false;
    for (int k = 0; k < K; ++k) {
      StageState& x = st[k];
      while (x.pc < s.stages[k].size()) {
        const Instruction& ins = s.stages[k][x.pc];
        mb_ok(k, ins);
        const int m = ins.micro_batch;
        auto fail = [&](const std::string& why) { throw Error("schedule " + where(k, ins) + ": " + why); };
        double start = x.clock, cost = 0;
        switch (ins.op) {
          case Op::kRecvActivation:
          case Op::kRecvGradient: {
            const bool act = ins.op == Op::kRecvActivation;
            if (act && k == 0) fail("the first stage has no previous stage");
            if (!act && k == K - 1) fail("the last stage has no next stage");
            const auto key = std::make_tuple(k, act ? 0 : 1, m);
            auto it = sent.find(key);
            if (it == sent.end()) goto blocked;  // wait for the neighbour
            if (received[key]++ > 0) fail("received twice");
            start = std::max(start, it->second);
            (act ? x.recv_act : x.recv_grad)[m] = 1;
            break;
          }
          case Op::kForward:
            if (x.fwd[m]) fail("forward twice");
            if (k > 0 && !x.recv_act[m]) fail("forward before its input was received");
            x.fwd[m] = 1;
            cost = c.forward;
            break;
          case Op::kSendActivation:
          case Op::kSendGradient: {
            const bool act = ins.op == Op::kSendActivation;
            if (act && k == K - 1) fail("the last stage has no next stage");
            if (!act && k == 0) fail("the first stage has no previous stage");
            if (act && !x.fwd[m]) fail("sent before the forward that produces it");
            if (!act && !x.bwd[m]) fail("sent before the backward that produces it");
            auto& flag = act ? x.sent_act[m] : x.sent_grad[m];
            if (flag) fail("sent twice");
            flag = 1;
            cost = c.send;
            sent[std::make_tuple(act ? k + 1 : k - 1, act ? 0 : 1, m)] = start + cost;
            break;
          }
          case Op::kRecompute:
            if (!x.fwd[m]) fail("recompute before forward");
            if (x.recompute[m]) fail("recompute twice");
            if (x.bwd[m]) fail("recompute after backward");
            x.recompute[m] = 1;
            cost = c.recompute;
            break;
          case Op::kBackward:
            if (!x.fwd[m]) fail("backward before forward");
            if (x.bwd[m]) fail("backward twice");
            if (k < K - 1 && !x.recv_grad[m]) fail("backward before its output gradient was received");
            x.bwd[m] = 1;
            cost = c.backward;
            break;
          case Op::kOptimizerStep:
            for (int j = 0; j < M; ++j) {
              if (!x.bwd[j]) fail("optimizer step before the backward of micro-batch " + std::to_string(j));
            }
            if (x.opt++) fail("optimizer step twice");
            cost = c.optimizer;
            break;
        }
        if (ins.op == Op::kForward || ins.op == Op::kBackward || ins.op == Op::kRecompute) x.busy += cost;
        x.clock = start + cost;
        ++x.pc;
        ++done;
        progress = true;
      }
    blocked:;
    }
  }
  if (done < total) {
    std::string stuck;
    for (int k = 0; k < K; ++k) {
      if (st[k].pc < s.stages[k].size()) stuck += "\n  " + where(k, s.stages[k][st[k].pc]) + " waits";
    }
    throw Error("schedule '" + s.name + "' deadlocks:" + stuck);
  }
  for (int k = 0; k < K; ++k) {
    for (int m = 0; m < M; ++m) {
      const StageState& x = st[k];
      auto missing = [&](const char* what) {
        throw Error("schedule stage " + std::to_string(k) + " never runs " + what + " of micro-batch " +
                    std::to_string(m));
      };
      if (!x.fwd[m]) missing("the forward");
      if (!x.bwd[m]) missing("the backward");
      if (k < K - 1 && !x.sent_act[m]) missing("the activation send");
      if (k > 0 && !x.sent_grad[m]) missing("the gradient send");
    }
    if (!st[k].opt) throw Error("schedule stage " + std::to_string(k) + " has no optimizer step");
  }
  for (const auto& kv : sent) {
    if (!received.count(kv.first)) {
      throw Error("schedule: a message to stage " + std::to_string(std::get<0>(kv.first)) + " is never received");
    }
  }
  Simulation sim;
  double total_busy = 0;
  for (auto& x : st) {
    sim.makespan = std::max(sim.makespan, x.clock);
    sim.busy.push_back(x.busy);
    total_busy += x.busy;
  }
  sim.bubble = sim.makespan > 0 ? 1.0 - total_busy / (K * sim.makespan) : 0.0;
  return sim;
}

}  // namespace

void check_schedule(const Schedule& s) { run_abstract(s, OpCosts{}); }

Simulation simulate(const Schedule& s, const OpCosts& costs) { return run_abstract(s, costs); }

std::string schedule_table(const Schedule& s) {
  std::ostringstream os;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    os << "stage " << k << ":";
    for (const auto& ins : s.stages[k]) {
      os << " " << op_short_name(ins.op);
      if (ins.micro_batch >= 0) os << ins.micro_batch;
    }
    os << "\n";
  }
  return os.str();
}

double ideal_bubble(int K, int M) { return static_cast<double>(K - 1) / (M + K - 1); }

}  // namespace pipeline
}  // namespace gpipe

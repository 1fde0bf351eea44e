// The schedule's data types, their text forms, and the passes every generator shares:
// recompute insertion, communication lowering, and batching of weight gradients.
#include "pipeline/schedule/schedule.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <utility>

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
    case Op::kBackwardWeight: return "weight_gradient";
    case Op::kSendGradient: return "send_gradient";
    case Op::kOptimizerStep: return "optimizer_step";
    case Op::kReduceGradients: return "reduce_gradients";
    case Op::kTiedGradients: return "tied_gradients";
    case Op::kGradientNorm: return "gradient_norm";
    case Op::kReduceScatterGradients: return "reduce_scatter_gradients";
    case Op::kGatherParameters: return "gather_parameters";
    case Op::kTensorSum: return "tensor_all_reduce";
    case Op::kTensorMax: return "tensor_all_reduce_max";
    case Op::kTensorGather: return "tensor_all_gather";
    case Op::kTensorScatter: return "tensor_reduce_scatter";
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
    case Op::kBackwardWeight: return "W";
    case Op::kSendGradient: return "sG";
    case Op::kOptimizerStep: return "OPT";
    case Op::kReduceGradients: return "RG";
    case Op::kTiedGradients: return "TIE";
    case Op::kGradientNorm: return "NORM";
    case Op::kReduceScatterGradients: return "RS";
    case Op::kGatherParameters: return "AG";
    case Op::kTensorSum: return "tAR";
    case Op::kTensorMax: return "tMAX";
    case Op::kTensorGather: return "tAG";
    case Op::kTensorScatter: return "tRS";
  }
  return "?";
}

bool is_communication(Op op) {
  return op == Op::kRecvActivation || op == Op::kSendActivation || op == Op::kRecvGradient ||
         op == Op::kSendGradient;
}

bool is_collective(Op op) {
  return op == Op::kReduceGradients || op == Op::kTiedGradients || op == Op::kGradientNorm ||
         op == Op::kReduceScatterGradients || op == Op::kGatherParameters;
}

bool after_optimizer(Op op) { return op == Op::kGatherParameters; }

bool has_cell(Op op) { return is_compute(op) || is_communication(op); }

bool is_tensor_collective(Op op) {
  return op == Op::kTensorSum || op == Op::kTensorMax || op == Op::kTensorGather || op == Op::kTensorScatter;
}

bool is_compute(Op op) {
  return op == Op::kForward || op == Op::kRecompute || op == Op::kBackward || op == Op::kBackwardWeight;
}

RecomputeMode parse_recompute_mode(const std::string& name) {
  if (name == "always") return RecomputeMode::kAlways;
  if (name == "except_last") return RecomputeMode::kExceptLast;
  if (name == "never") return RecomputeMode::kNever;
  throw UserError("pipeline.recompute: unknown mode '" + name + "'; use always, except_last or never");
}

const char* recompute_mode_name(RecomputeMode mode) {
  switch (mode) {
    case RecomputeMode::kAlways: return "always";
    case RecomputeMode::kExceptLast: return "except_last";
    case RecomputeMode::kNever: return "never";
  }
  return "?";
}

bool is_recomputed(RecomputeMode mode, const std::vector<Instruction>& program, size_t backward) {
  const Instruction& b = program.at(backward);
  GPIPE_CHECK(b.op == Op::kBackward, "is_recomputed: instruction " + std::to_string(backward) + " is not a backward");
  switch (mode) {
    case RecomputeMode::kAlways: return true;
    case RecomputeMode::kNever: return false;
    case RecomputeMode::kExceptLast: {
      // The compute instruction before B(c, m): F(c, m) itself means nothing else is
      // computed while its context lives, so it keeps it.
      for (size_t i = backward; i-- > 0;) {
        const Op op = program[i].op;
        if (op != Op::kForward && op != Op::kBackward && op != Op::kBackwardWeight && op != Op::kRecompute) continue;
        return !(op == Op::kForward && program[i].micro_batch == b.micro_batch && program[i].chunk == b.chunk);
      }
      return true;
    }
  }
  return false;
}

std::vector<int> Instruction::micro_batches() const {
  std::vector<int> out;
  if (micro_batch < 0) return out;
  for (int i = 0; i < count; ++i) out.push_back(micro_batch + i);
  return out;
}

int Schedule::num_cells() const {
  int n = 0;
  for (const auto& c : cells) n += static_cast<int>(c.size());
  return n;
}

int Schedule::stage_of_cell(int c) const {
  for (size_t k = 0; k < cells.size(); ++k) {
    if (std::find(cells[k].begin(), cells[k].end(), c) != cells[k].end()) return static_cast<int>(k);
  }
  throw Error("schedule '" + name + "' places no stage on cell " + std::to_string(c));
}

int Schedule::chunk_of_cell(int c) const {
  const auto& mine = cells.at(stage_of_cell(c));
  return static_cast<int>(std::find(mine.begin(), mine.end(), c) - mine.begin());
}

std::vector<std::vector<int>> interleaved_cells(int K, int v) {
  std::vector<std::vector<int>> out(K);
  for (int k = 0; k < K; ++k) {
    for (int j = 0; j < v; ++j) out[k].push_back(j * K + k);
  }
  return out;
}

void insert_recompute(Schedule& s, RecomputeMode mode) {
  for (size_t k = 0; k < s.stages.size(); ++k) {
    std::vector<Instruction> out;
    std::vector<int> lines;
    for (size_t i = 0; i < s.stages[k].size(); ++i) {
      const Instruction& ins = s.stages[k][i];
      const int line = s.lines.empty() ? 0 : s.lines[k][i];
      if (ins.op == Op::kBackward && is_recomputed(mode, s.stages[k], i)) {
        out.push_back({Op::kRecompute, ins.micro_batch, ins.chunk});
        lines.push_back(line);
      }
      out.push_back(ins);
      lines.push_back(line);
    }
    s.stages[k] = std::move(out);
    if (!s.lines.empty()) s.lines[k] = std::move(lines);
  }
}

namespace {

// Whether the micro-batches are consecutive numbers (in any order), none repeated.
bool consecutive(std::vector<int> ms) {
  std::sort(ms.begin(), ms.end());
  for (size_t i = 0; i < ms.size(); ++i) {
    if (ms[i] != ms[0] + static_cast<int>(i)) return false;
  }
  return !ms.empty();
}

}  // namespace

void batch_weight_gradients(Schedule& s, CommModel comm) {
  const int v = s.num_chunks();
  for (size_t k = 0; k < s.stages.size(); ++k) {
    std::vector<Instruction>& prog = s.stages[k];
    std::vector<int> no_lines(prog.size(), 0);
    std::vector<int>& lines = s.lines.empty() ? no_lines : s.lines[k];
    for (int j = 0; j < v; ++j) {
      // 1. The drain: the chunk's backwards after its last forward that have no W.
      std::set<int> has_w;
      long last_forward = -1;
      for (size_t i = 0; i < prog.size(); ++i) {
        if (prog[i].chunk != j) continue;
        if (prog[i].op == Op::kForward) last_forward = static_cast<long>(i);
        if (prog[i].op == Op::kBackwardWeight) {
          for (int m : prog[i].micro_batches()) has_w.insert(m);
        }
      }
      std::vector<size_t> drain;
      std::vector<int> drained;
      for (size_t i = static_cast<size_t>(last_forward + 1); i < prog.size(); ++i) {
        if (prog[i].op == Op::kBackward && prog[i].chunk == j && !has_w.count(prog[i].micro_batch)) {
          drain.push_back(i);
          drained.push_back(prog[i].micro_batch);
        }
      }
      if (drain.size() >= 2 && consecutive(drained)) {
        // After the last backward and its sends (on a rendezvous transport, after the
        // group of messages it ends in, which progresses as one), before any receive, so
        // that the W fills the wait for it.
        auto is_send = [](Op op) { return op == Op::kSendActivation || op == Op::kSendGradient; };
        size_t at = drain.back() + 1;
        while (at < prog.size() && (comm == CommModel::kRendezvous ? is_communication(prog[at].op) : is_send(prog[at].op))) {
          ++at;
        }
        const int line = lines[drain.back()];
        for (size_t n = 0; n < drain.size(); ++n) {
          prog.insert(prog.begin() + static_cast<long>(at + n), Instruction{Op::kBackwardWeight, drained[n], j});
          lines.insert(lines.begin() + static_cast<long>(at + n), line);
        }
      }
      // 2. Runs of the chunk's W's with only messages between them.
      std::vector<Instruction> out;
      std::vector<int> out_lines;
      for (size_t i = 0; i < prog.size(); ++i) {
        if (prog[i].op != Op::kBackwardWeight || prog[i].chunk != j) {
          out.push_back(prog[i]);
          out_lines.push_back(lines[i]);
          continue;
        }
        std::vector<size_t> run{i};
        for (size_t p = i + 1; p < prog.size(); ++p) {
          if (prog[p].op == Op::kBackwardWeight && prog[p].chunk == j) {
            run.push_back(p);
          } else if (!is_communication(prog[p].op)) {
            break;
          }
        }
        std::vector<int> ms;
        for (size_t r : run) {
          for (int m : prog[r].micro_batches()) ms.push_back(m);
        }
        if (run.size() < 2 || !consecutive(ms)) {
          out.push_back(prog[i]);
          out_lines.push_back(lines[i]);
          continue;
        }
        // The messages between the run's W's keep their places; the W comes last.
        for (size_t p = i + 1; p < run.back(); ++p) {
          if (prog[p].op == Op::kBackwardWeight) continue;
          out.push_back(prog[p]);
          out_lines.push_back(lines[p]);
        }
        Instruction w{Op::kBackwardWeight, *std::min_element(ms.begin(), ms.end()), j};
        w.count = static_cast<int>(ms.size());
        out.push_back(w);
        out_lines.push_back(lines[run.back()]);
        i = run.back();
      }
      prog = std::move(out);
      lines = std::move(out_lines);
    }
  }
}

namespace {

// The receive a compute instruction consumes and the send its result needs, given
// where the neighbouring cells live (none when the neighbour is on the same stage).
struct Messages {
  bool recv = false, send = false;
  Instruction recv_ins{Op::kRecvActivation}, send_ins{Op::kSendActivation};
};

Messages messages_of(const Schedule& s, int stage, const Instruction& ins) {
  Messages out;
  if (ins.chunk < 0 || ins.chunk >= static_cast<int>(s.cells.at(stage).size())) return out;  // the checker names it
  const int c = s.cell(stage, ins.chunk), C = s.num_cells();
  const bool prev_remote = c > 0 && s.stage_of_cell(c - 1) != stage;
  const bool next_remote = c + 1 < C && s.stage_of_cell(c + 1) != stage;
  if (ins.op == Op::kForward) {
    out.recv = prev_remote;
    out.send = next_remote;
    out.recv_ins = {Op::kRecvActivation, ins.micro_batch, ins.chunk};
    out.send_ins = {Op::kSendActivation, ins.micro_batch, ins.chunk};
  } else if (ins.op == Op::kBackward) {
    out.recv = next_remote;
    out.send = prev_remote;
    out.recv_ins = {Op::kRecvGradient, ins.micro_batch, ins.chunk};
    out.send_ins = {Op::kSendGradient, ins.micro_batch, ins.chunk};
  }
  return out;
}

}  // namespace

namespace {

// Rendezvous lowering (NCCL), as Megatron-LM's send_forward_backward_recv_forward_backward:
// the program runs in steps, and between two steps one group holds the sends of the step
// before and the receives of the step after, so that messages in both directions
// progress together. With merge, a step holds at most one forward and one backward (the
// 1F1B steady state); without, one of either. Recomputes and weight gradients ride along.
std::vector<Instruction> lower_in_steps(const Schedule& s, int stage, bool merge, std::vector<int>& lines) {
  const auto& prog = s.stages[stage];
  std::vector<Instruction> out;
  auto line_of = [&](size_t i) { return s.lines.empty() ? 0 : s.lines[stage][i]; };
  auto emit = [&](Instruction ins, int line) {
    out.push_back(ins);
    lines.push_back(line);
  };
  std::vector<std::pair<size_t, size_t>> steps;  // [begin, end) in prog
  for (size_t i = 0; i < prog.size();) {
    size_t j = i;
    int f = -1;  // the step's forward micro-batch
    bool b = false;
    while (j < prog.size() && has_cell(prog[j].op)) {
      const Op op = prog[j].op;
      if ((op == Op::kForward && (f >= 0 || (b && !merge))) || (op == Op::kBackward && (b || (f >= 0 && !merge))) ||
          (op == Op::kRecompute && b)) {
        break;
      }
      // A backward whose output gradient comes from another stage cannot share a step
      // with the forward of its own micro-batch: that gradient follows from the
      // forward's output, sent after the step.
      if (op == Op::kBackward && prog[j].micro_batch == f && messages_of(s, stage, prog[j]).recv) break;
      if (op == Op::kForward) f = prog[j].micro_batch;
      b = b || op == Op::kBackward;
      ++j;
    }
    if (j == i) ++j;  // an optimizer step (or a collective) is a step of its own
    steps.emplace_back(i, j);
    i = j;
  }
  auto receives = [&](size_t n) {
    if (n >= steps.size()) return;
    for (size_t i = steps[n].first; i < steps[n].second; ++i) {
      const Messages msg = messages_of(s, stage, prog[i]);
      if (msg.recv) emit(msg.recv_ins, line_of(i));  // named by the line of its consumer
    }
  };
  receives(0);
  for (size_t n = 0; n < steps.size(); ++n) {
    for (size_t i = steps[n].first; i < steps[n].second; ++i) emit(prog[i], line_of(i));
    for (size_t i = steps[n].first; i < steps[n].second; ++i) {
      const Messages msg = messages_of(s, stage, prog[i]);
      if (msg.send) emit(msg.send_ins, line_of(i));  // and a send by its producer's
    }
    receives(n + 1);
  }
  return out;
}

// Each receive right before the instruction that consumes it, each send right after
// the one that produces it.
std::vector<Instruction> lower_in_place(const Schedule& s, int stage, std::vector<int>& lines) {
  const auto& prog = s.stages[stage];
  std::vector<Instruction> out;
  for (size_t i = 0; i < prog.size(); ++i) {
    const Messages msg = messages_of(s, stage, prog[i]);
    const int line = s.lines.empty() ? 0 : s.lines[stage][i];  // messages go by their compute's line
    if (msg.recv) {
      out.push_back(msg.recv_ins);
      lines.push_back(line);
    }
    out.push_back(prog[i]);
    lines.push_back(line);
    if (msg.send) {
      out.push_back(msg.send_ins);
      lines.push_back(line);
    }
  }
  return out;
}

Schedule lowered(const Schedule& s, CommModel comm, bool merge) {
  Schedule out = s;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    std::vector<int> lines;
    out.stages[k] = comm == CommModel::kBuffered ? lower_in_place(s, static_cast<int>(k), lines)
                                                 : lower_in_steps(s, static_cast<int>(k), merge, lines);
    if (!s.forward_only && std::none_of(out.stages[k].begin(), out.stages[k].end(),
                                        [](const Instruction& i) { return i.op == Op::kOptimizerStep; })) {
      out.stages[k].push_back({Op::kOptimizerStep, -1, 0});
      lines.push_back(0);
    }
    if (!s.lines.empty()) out.lines[k] = std::move(lines);
  }
  return out;
}

}  // namespace

void lower_communication(Schedule& s, CommModel comm) {
  if (comm == CommModel::kBuffered) {
    s = lowered(s, comm, false);
    return;
  }
  // Steps of one forward and one backward where the transport allows it; where that
  // grouping would deadlock (fewer micro-batches than stages, say), steps of one.
  Schedule merged = lowered(s, comm, true);
  try {
    check_schedule(merged, comm);
  } catch (const UserError&) {
    Schedule single = lowered(s, comm, false);
    try {
      check_schedule(single, comm);
      s = std::move(single);
      return;
    } catch (const UserError&) {
    }
  }
  s = std::move(merged);  // fine, or its check names the problem
}

std::vector<Instruction> stage_collectives(const Schedule& s, const Schedule::Collectives& c, int stage) {
  std::vector<Instruction> out;
  const bool sharded = c.replicas && c.shard_optimizer;
  if (c.replicas && !sharded) out.push_back({Op::kReduceGradients, -1, 0});
  for (size_t i = 0; i < c.ties.size(); ++i) {
    const int a = s.stage_of_cell(c.ties[i].first), b = s.stage_of_cell(c.ties[i].second);
    if (a != b && (a == stage || b == stage)) out.push_back({Op::kTiedGradients, static_cast<int>(i), 0});
  }
  if (sharded) out.push_back({Op::kReduceScatterGradients, -1, 0});
  if (c.gradient_norm) out.push_back({Op::kGradientNorm, -1, 0});
  if (sharded) out.push_back({Op::kGatherParameters, -1, 0});  // after OPT (after_optimizer)
  return out;
}

void lower_collectives(Schedule& s, const Schedule::Collectives& c) {
  if (s.collectives_lowered) {
    if (s.collectives == c) return;
    throw Error("schedule '" + s.name + "' already holds other collectives than this run needs");
  }
  for (size_t k = 0; k < s.stages.size(); ++k) {
    std::vector<Instruction> before, after;
    for (const Instruction& i : stage_collectives(s, c, static_cast<int>(k))) {
      (after_optimizer(i.op) ? after : before).push_back(i);
    }
    auto& prog = s.stages[k];
    auto at = std::find_if(prog.begin(), prog.end(), [](const Instruction& i) { return i.op == Op::kOptimizerStep; });
    const size_t pos = static_cast<size_t>(at - prog.begin());
    prog.insert(at, before.begin(), before.end());
    if (!s.lines.empty()) s.lines[k].insert(s.lines[k].begin() + static_cast<long>(pos), before.size(), 0);
    const size_t opt = pos + before.size();
    GPIPE_CHECK(after.empty() || opt < prog.size(), "a collective after the optimizer step of a program without one");
    prog.insert(prog.begin() + static_cast<long>(opt) + 1, after.begin(), after.end());
    if (!s.lines.empty()) s.lines[k].insert(s.lines[k].begin() + static_cast<long>(opt) + 1, after.size(), 0);
  }
  s.collectives = c;
  s.collectives_lowered = true;
}

std::vector<int> collective_stages(const Schedule& s, int stage, const Instruction& ins) {
  switch (ins.op) {
    case Op::kTiedGradients: {
      const auto& tie = s.collectives.ties.at(static_cast<size_t>(ins.micro_batch));
      std::vector<int> out{s.stage_of_cell(tie.first), s.stage_of_cell(tie.second)};
      std::sort(out.begin(), out.end());
      return out;
    }
    case Op::kGradientNorm: {
      std::vector<int> out;
      for (int k = 0; k < s.num_stages; ++k) out.push_back(k);
      return out;
    }
    default: return {stage};
  }
}

Schedule forward_only_program(const Schedule& s, int num_micro_batches, CommModel comm) {
  if (num_micro_batches < 1 || num_micro_batches > s.num_micro_batches) {
    throw Error("a forward-only program of schedule '" + s.name + "' takes 1 to " +
                std::to_string(s.num_micro_batches) + " micro-batches, not " + std::to_string(num_micro_batches));
  }
  Schedule out = s;
  out.name = s.name + " (forward only)";
  out.num_micro_batches = num_micro_batches;
  out.forward_only = true;
  out.collectives = {};  // no gradients: no collectives
  out.collectives_lowered = false;
  out.tensor_lowered = false;  // lowered again below: an evaluation's F asks its own
  for (size_t k = 0; k < s.stages.size(); ++k) {
    out.stages[k].clear();
    if (!s.lines.empty()) out.lines[k].clear();
    for (size_t i = 0; i < s.stages[k].size(); ++i) {
      const Instruction& ins = s.stages[k][i];
      if (ins.op != Op::kForward || ins.micro_batch >= num_micro_batches) continue;
      out.stages[k].push_back(ins);
      if (!s.lines.empty()) out.lines[k].push_back(s.lines[k][i]);
    }
  }
  lower_communication(out, comm);
  if (s.tensor_lowered) lower_tensor_collectives(out, s.tensor);
  return out;
}

namespace {

// One compute instruction as a file line.
std::string file_line(const Schedule& s, int stage, const Instruction& ins, ScheduleNotation notation,
                      bool weight_follows) {
  if (ins.count > 1) {  // a batched W: its micro-batches' W's, in a run that loading batches again
    std::string out;
    for (int m : ins.micro_batches()) {
      Instruction one = ins;
      one.micro_batch = m;
      one.count = 1;
      out += (out.empty() ? "" : "\n") + file_line(s, stage, one, notation, false);
    }
    return out;
  }
  const std::string m = std::to_string(ins.micro_batch);
  if (notation == ScheduleNotation::kActions) {
    const char* op = ins.op == Op::kBackward && weight_follows ? "I" : op_short_name(ins.op);
    return std::to_string(s.cell(stage, ins.chunk)) + op + m;
  }
  std::string out = std::to_string(stage) + "," + op_short_name(ins.op) + "," + m;
  if (s.num_chunks() > 1) out += "," + std::to_string(ins.chunk);
  return out;
}

}  // namespace

std::string schedule_file_text(const Schedule& s, ScheduleNotation notation, const std::string& comment) {
  const int K = s.num_stages, v = s.num_chunks(), M = s.num_micro_batches;
  if (s.cells != interleaved_cells(K, v)) {
    throw Error("schedule '" + s.name + "' does not place cell j K + k on stage k, the only placement a schedule "
                "file can express; it has no file form");
  }
  bool any_recompute = false;
  for (const auto& prog : s.stages) {
    for (const Instruction& ins : prog) any_recompute = any_recompute || ins.op == Op::kRecompute;
  }
  std::ostringstream os;
  os << "# schedule '" << s.name << "' for " << K << " stage" << (K == 1 ? "" : "s") << ", " << v << " cell"
     << (v == 1 ? "" : "s") << " per stage, " << M << " micro-batch" << (M == 1 ? "" : "es")
     << ", written by gpipe (schedule_file_text).\n"
     << "# Load it with pipeline.schedule_file and the same pipeline.partitions (" << K << "), virtual_stages (" << v
     << ") and micro_batches (" << M << ").\n";
  std::istringstream extra(comment);
  for (std::string line; std::getline(extra, line);) os << "# " << line << "\n";
  os << (any_recompute ? "# The R lines place the recomputes; pipeline.recompute is not applied to this file.\n"
                       : "# No R lines: pipeline.recompute decides which micro-batches recompute (never keeps this "
                         "schedule as it is).\n")
     << "# Each stage runs its lines in file order; gpipe inserts the sends, receives and optimizer step.\n"
     << (notation == ScheduleNotation::kCsv
             ? "# stage,op,micro_batch" + std::string(v > 1 ? ",chunk" : "") +
                   "   (op F forward, B backward, W weight gradient, R recompute)\n"
             : std::string("# <cell><op><micro-batch>   (op F forward, B backward, I backward whose weight gradient "
                           "is a later W, W weight gradient, R recompute") +
                   (v > 1 ? "; cell = chunk x " + std::to_string(K) + " + stage" : "") + ")\n");
  for (int k = 0; k < K; ++k) {
    const auto& prog = s.stages[k];
    os << "\n# stage " << k;
    if (v > 1) {
      os << ": cells";
      for (int c : s.cells[k]) os << " " << c;
    }
    os << "\n";
    std::set<std::pair<int, int>> split;  // (chunk, micro-batch) whose weight gradient is a W
    for (const Instruction& ins : prog) {
      if (ins.op != Op::kBackwardWeight) continue;
      for (int m : ins.micro_batches()) split.insert({ins.chunk, m});
    }
    for (const Instruction& ins : prog) {
      if (!is_compute(ins.op)) continue;  // derived again when the file is loaded
      os << file_line(s, k, ins, notation, split.count({ins.chunk, ins.micro_batch}) > 0) << "\n";
    }
  }
  return os.str();
}

std::string instruction_str(const Schedule& s, int stage, const Instruction& ins) {
  std::string out;
  if (s.num_chunks() > 1 && (has_cell(ins.op) || is_tensor_collective(ins.op)) && ins.chunk >= 0 &&
      ins.chunk < s.num_chunks()) {
    out += std::to_string(s.cell(stage, ins.chunk));
  }
  out += op_short_name(ins.op);
  if (ins.micro_batch >= 0) out += std::to_string(ins.micro_batch);
  if (ins.count > 1) out += "-" + std::to_string(ins.micro_batch + ins.count - 1);  // W0-7
  return out;
}

std::string schedule_table(const Schedule& s) {
  std::ostringstream os;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    os << "stage " << k << ":";
    for (const auto& ins : s.stages[k]) os << " " << instruction_str(s, static_cast<int>(k), ins);
    os << "\n";
  }
  return os.str();
}

std::string compact_schedule_table(const Schedule& s) {
  std::ostringstream os;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    os << "stage " << k << ":";
    const auto& prog = s.stages[k];
    for (size_t i = 0; i < prog.size();) {
      size_t j = i + 1;
      while (is_tensor_collective(prog[i].op) && j < prog.size() && prog[j] == prog[i]) ++j;
      os << " " << instruction_str(s, static_cast<int>(k), prog[i]);
      if (j - i > 1) os << "*" << j - i;
      i = j;
    }
    os << "\n";
  }
  return os.str();
}

std::string schedule_chart(const Schedule& s) {
  OpCosts unit;
  unit.forward = unit.backward = unit.weight = unit.recompute = 1.0;
  const Simulation sim = simulate(s, unit);
  const int slots = static_cast<int>(sim.makespan + 0.5);
  size_t width = 1;
  std::vector<std::vector<std::string>> rows(s.stages.size(), std::vector<std::string>(slots, "."));
  for (size_t k = 0; k < sim.timeline.size(); ++k) {
    for (const TimedInstruction& t : sim.timeline[k]) {
      if (!is_compute(t.ins.op)) continue;
      const int slot = static_cast<int>(t.start + 0.5);
      if (slot < 0 || slot >= slots) continue;
      rows[k][slot] = instruction_str(s, static_cast<int>(k), t.ins);
      width = std::max(width, rows[k][slot].size());
    }
  }
  std::ostringstream os;
  for (size_t k = 0; k < rows.size(); ++k) {
    os << "stage " << k << ":";
    for (const std::string& cell : rows[k]) os << " " << cell << std::string(width - cell.size(), ' ');
    os << "\n";
  }
  return os.str();
}

double ideal_bubble(int K, int M) { return static_cast<double>(K - 1) / (M + K - 1); }

MicroBatchRoles micro_batch_roles(const Schedule& s, int stage) {
  const int v = s.num_chunks(), M = s.num_micro_batches;
  MicroBatchRoles roles;
  roles.recomputed.assign(v, std::vector<char>(M, 0));
  roles.split.assign(v, std::vector<char>(M, 0));
  for (const Instruction& ins : s.stages.at(stage)) {
    if (ins.op == Op::kRecompute) roles.recomputed[ins.chunk][ins.micro_batch] = 1;
    if (ins.op == Op::kBackwardWeight) {
      for (int m : ins.micro_batches()) roles.split[ins.chunk][m] = 1;
    }
  }
  return roles;
}

ChunkFinals chunk_finals(const Schedule& s, int stage, const MicroBatchRoles& roles) {
  const int v = s.num_chunks();
  ChunkFinals f;
  f.last_backward.assign(static_cast<size_t>(v), -1);
  f.last_weights.assign(static_cast<size_t>(v), -1);
  const auto& prog = s.stages.at(static_cast<size_t>(stage));
  for (size_t i = 0; i < prog.size(); ++i) {
    const Instruction& ins = prog[i];
    if (ins.op == Op::kBackward) f.last_backward[static_cast<size_t>(ins.chunk)] = static_cast<long>(i);
    if (ins.op == Op::kBackwardWeight || (ins.op == Op::kBackward && !roles.split[ins.chunk][ins.micro_batch])) {
      f.last_weights[static_cast<size_t>(ins.chunk)] = static_cast<long>(i);
    }
  }
  return f;
}

std::vector<std::vector<TensorOp>> stage_tensor_ops(const Schedule& s, const TensorProgram& t, int stage) {
  const auto& prog = s.stages.at(static_cast<size_t>(stage));
  std::vector<std::vector<TensorOp>> out(prog.size());
  if (t.members <= 1) return out;
  GPIPE_CHECK(static_cast<int>(t.cells.size()) == s.num_cells(),
              "the tensor group's program has " + std::to_string(t.cells.size()) + " cells for a schedule of " +
                  std::to_string(s.num_cells()));
  const MicroBatchRoles roles = micro_batch_roles(s, stage);
  const ChunkFinals finals = chunk_finals(s, stage, roles);
  const int C = s.num_cells();
  for (size_t pc = 0; pc < prog.size(); ++pc) {
    const Instruction& ins = prog[pc];
    if (!is_compute(ins.op)) continue;
    const int c = s.cell(stage, ins.chunk);
    const CellTensorOps& cell = t.cells[static_cast<size_t>(c)];
    std::vector<TensorOp>& ops = out[pc];
    auto add = [&ops](const std::vector<TensorOp>& more) { ops.insert(ops.end(), more.begin(), more.end()); };
    switch (ins.op) {
      case Op::kForward: add(s.forward_only ? cell.evaluate : cell.forward); break;
      case Op::kRecompute: add(cell.recompute); break;
      case Op::kBackward: {
        const bool split = roles.split[ins.chunk][ins.micro_batch] != 0;
        if (c == C - 1) add(cell.loss_backward);
        for (size_t i = cell.layers.size(); i-- > 0;) {
          const CellTensorOps::Layer& l = cell.layers[i];
          add(split ? l.backward_input : l.backward);
          if (finals.at(ins.chunk, l.splits) == static_cast<long>(pc)) add(l.step);
        }
        break;
      }
      default: {  // W
        for (size_t i = cell.layers.size(); i-- > 0;) {
          const CellTensorOps::Layer& l = cell.layers[i];
          if (l.splits) add(l.weight);
          if (finals.at(ins.chunk, l.splits) == static_cast<long>(pc)) add(l.step);
        }
        break;
      }
    }
  }
  return out;
}

size_t program_position(const Schedule& s, int stage, const Instruction& ins) {
  const auto& prog = s.stages.at(static_cast<size_t>(stage));
  GPIPE_CHECK(!prog.empty() && &ins >= prog.data() && &ins < prog.data() + prog.size(),
              "an instruction that is not one of stage " + std::to_string(stage) + "'s program");
  return static_cast<size_t>(&ins - prog.data());
}

void lower_tensor_collectives(Schedule& s, const TensorProgram& t) {
  if (s.tensor_lowered) {
    if (s.tensor == t) return;
    throw Error("schedule '" + s.name + "' already holds other tensor-group collectives than this run's");
  }
  for (const auto& prog : s.stages) {
    for (const Instruction& ins : prog) {
      if (is_tensor_collective(ins.op)) {
        throw Error("schedule '" + s.name + "' holds a tensor-group collective before lower_tensor_collectives");
      }
    }
  }
  for (size_t k = 0; k < s.stages.size(); ++k) {
    const std::vector<std::vector<TensorOp>> ops = stage_tensor_ops(s, t, static_cast<int>(k));
    std::vector<Instruction> prog;
    std::vector<int> lines;
    for (size_t pc = 0; pc < s.stages[k].size(); ++pc) {
      const Instruction& ins = s.stages[k][pc];
      prog.push_back(ins);
      if (!s.lines.empty()) lines.push_back(s.lines[k][pc]);
      for (const TensorOp& op : ops[pc]) {
        prog.push_back({op.op, ins.micro_batch, ins.chunk});
        if (!s.lines.empty()) lines.push_back(0);
      }
    }
    s.stages[k] = std::move(prog);
    if (!s.lines.empty()) s.lines[k] = std::move(lines);
  }
  s.tensor = t;
  s.tensor_lowered = true;
}

double formula_bubble(const Schedule& s) {
  const int K = s.num_stages, M = s.num_micro_batches, v = s.num_chunks();
  return static_cast<double>(K - 1) / (static_cast<double>(v) * M + K - 1);
}

}  // namespace pipeline
}  // namespace gpipe

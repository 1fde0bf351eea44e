// The checker and the simulator: one abstract interpreter that runs every stage's
// program against the others, with receives that wait for their send (and, on a
// rendezvous transport, sends that wait for their receive), validating every
// dependency on the way and timing each instruction.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "pipeline/schedule/schedule.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

MessageKey message_key(const Schedule& s, int k, const Instruction& ins, int* peer_out) {
  int unused = -1;
  int* peer = peer_out != nullptr ? peer_out : &unused;
  const int c = s.cell(k, ins.chunk), C = s.num_cells();
  switch (ins.op) {
    case Op::kSendActivation: *peer = c + 1 < C ? s.stage_of_cell(c + 1) : -1; return {*peer, 0, ins.micro_batch, c + 1};
    case Op::kRecvActivation: *peer = c > 0 ? s.stage_of_cell(c - 1) : -1; return {k, 0, ins.micro_batch, c};
    case Op::kSendGradient: *peer = c > 0 ? s.stage_of_cell(c - 1) : -1; return {*peer, 1, ins.micro_batch, c - 1};
    case Op::kRecvGradient: *peer = c + 1 < C ? s.stage_of_cell(c + 1) : -1; return {k, 1, ins.micro_batch, c};
    default: *peer = -1; return {};
  }
}

namespace {

// Every stage's program in the log form (schedule_table), one indented line each, with
// the instruction at marks[k] (if >= 0) marked: the whole picture for an error.
std::string marked_table(const Schedule& s, const std::vector<long>& marks) {
  std::string out = "\n  every stage's program";
  out += s.lines.empty() ? ":" : " (the file's lines, with the sends and receives gpipe inserts):";
  for (size_t k = 0; k < s.stages.size(); ++k) {
    out += "\n  stage " + std::to_string(k) + ":";
    for (size_t i = 0; i < s.stages[k].size(); ++i) {
      out += " " + instruction_str(s, static_cast<int>(k), s.stages[k][i]);
      if (k < marks.size() && marks[k] == static_cast<long>(i)) out += " <-- HERE";
    }
  }
  return out;
}

bool is_send(Op op) { return op == Op::kSendActivation || op == Op::kSendGradient; }

struct ChunkState {
  std::vector<char> fwd, rcmp, bwd, wgt, recv_act, recv_grad, sent_act, sent_grad, has_r, has_w;
  explicit ChunkState(int M)
      : fwd(M), rcmp(M), bwd(M), wgt(M), recv_act(M), recv_grad(M), sent_act(M), sent_grad(M), has_r(M), has_w(M) {}
};

struct StageProgress {
  size_t pc = 0;
  double clock = 0, busy = 0;
  std::vector<ChunkState> chunks;
  int opt = 0;
  int collectives_expected = 0, collectives_done = 0;
  int collectives_after_opt = 0;  // of the expected ones, those after OPT (AG)
};

// A collective instruction's identity: (op, tie index or -1).
using CollectiveKey = std::pair<int, int>;
struct CollectiveState {
  std::map<int, double> arrived;  // stage -> when it reached the collective
  std::set<int> done;             // stages that ran it
};

// How many collective instructions lower_collectives() gives stage k.
int collectives_of_stage(const Schedule& s, int k) {
  return s.collectives_lowered ? static_cast<int>(stage_collectives(s, s.collectives, k).size()) : 0;
}

class Interpreter {
 public:
  Interpreter(const Schedule& s, const CostFn& cost, std::vector<int> turns = {})
      : s_(s), cost_(cost), turns_(std::move(turns)) {}

  Simulation run() {
    check_shape();
    const int K = s_.num_stages, M = s_.num_micro_batches, v = s_.num_chunks();
    st_.resize(K);
    sim_.timeline.assign(K, {});
    for (int k = 0; k < K; ++k) {
      st_[k].chunks.assign(v, ChunkState(M));
      st_[k].collectives_expected = collectives_of_stage(s_, k);
      if (s_.collectives_lowered) {
        for (const Instruction& i : stage_collectives(s_, s_.collectives, k)) st_[k].collectives_after_opt += after_optimizer(i.op);
      }
      for (size_t i = 0; i < s_.stages[k].size(); ++i) {
        const Instruction& ins = s_.stages[k][i];
        validate_indices(k, i);
        if (ins.op == Op::kRecompute) st_[k].chunks[ins.chunk].has_r[ins.micro_batch] = 1;
        if (ins.op == Op::kBackwardWeight) {
          for (int m : ins.micro_batches()) st_[k].chunks[ins.chunk].has_w[m] = 1;
        }
      }
    }
    for (int k = 0; k < K; ++k) check_tensor_ops(k);  // on valid indices
    if (!turns_.empty() && static_cast<int>(turns_.size()) != K) {
      throw Error("simulate: " + std::to_string(turns_.size()) + " device turns for " + std::to_string(K) + " stages");
    }
    for (int k = 0; k < static_cast<int>(turns_.size()); ++k) shared_ = shared_ || turns_[k] != k;
    size_t done = 0, total = 0;
    for (const auto& p : s_.stages) total += p.size();
    bool progress = true;
    while (done < total && progress) {
      progress = false;
      if (shared_) {
        // Stages taking turns on a device: they ask for it in time order, so each
        // instruction runs on the stage that is earliest, of those not waiting.
        std::vector<int> order;
        for (int k = 0; k < K; ++k) {
          if (st_[k].pc < s_.stages[k].size()) order.push_back(k);
        }
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return st_[a].clock < st_[b].clock; });
        for (int k : order) {
          if (const size_t n = step(k); n > 0) {
            done += n;
            progress = true;
            break;
          }
        }
        continue;
      }
      for (int k = 0; k < K; ++k) {
        size_t n = 0;
        while (st_[k].pc < s_.stages[k].size() && (n = step(k)) > 0) {
          done += n;
          progress = true;
        }
      }
    }
    if (done < total) {
      std::string stuck;
      std::vector<long> marks(K, -1);
      for (int k = 0; k < K; ++k) {
        if (st_[k].pc < s_.stages[k].size()) {
          stuck += "\n  stage " + std::to_string(k) + " waits at " + where(k, st_[k].pc);
          marks[k] = static_cast<long>(st_[k].pc);
        }
      }
      throw UserError("schedule '" + s_.name + "' deadlocks:" + stuck + marked_table(s_, marks));
    }
    check_complete();
    double total_busy = 0;
    for (auto& x : st_) {
      sim_.makespan = std::max(sim_.makespan, x.clock);
      sim_.busy.push_back(x.busy);
      total_busy += x.busy;
    }
    sim_.bubble = sim_.makespan > 0 ? 1.0 - total_busy / (K * sim_.makespan) : 0.0;
    return sim_;
  }

 private:
  // "F3 (cell 2) at schedule file line 7"
  std::string where(int k, size_t pc) const {
    const Instruction& ins = s_.stages[k][pc];
    std::string out = instruction_str(s_, k, ins);
    if (has_cell(ins.op) && s_.num_chunks() > 1) out += " (chunk " + std::to_string(ins.chunk) + ")";
    if (!s_.lines.empty() && s_.lines[k][pc] > 0) {
      out += " at " + s_.source + ":" + std::to_string(s_.lines[k][pc]);
    }
    return out;
  }

  [[noreturn]] void fail(int k, size_t pc, const std::string& why) const {
    std::vector<long> marks(s_.stages.size(), -1);
    marks[k] = static_cast<long>(pc);
    throw UserError("schedule '" + s_.name + "' stage " + std::to_string(k) + ": " + where(k, pc) + ": " + why +
                    marked_table(s_, marks));
  }

  void check_shape() const {
    const int K = s_.num_stages;
    auto bad = [&](const std::string& why) { throw UserError("schedule '" + s_.name + "': " + why); };
    if (static_cast<int>(s_.stages.size()) != K || static_cast<int>(s_.cells.size()) != K) {
      bad("has " + std::to_string(s_.stages.size()) + " programs and " + std::to_string(s_.cells.size()) +
          " cell lists for " + std::to_string(K) + " stages");
    }
    std::set<int> seen;
    for (const auto& c : s_.cells) {
      if (static_cast<int>(c.size()) != s_.num_chunks()) bad("stages hold different numbers of cells");
      seen.insert(c.begin(), c.end());
    }
    const int C = s_.num_cells();
    if (static_cast<int>(seen.size()) != C || *seen.begin() != 0 || *seen.rbegin() != C - 1) {
      bad("its stages must hold cells 0.." + std::to_string(C - 1) + " once each");
    }
  }

  // The tensor group's collectives: each right after the compute instruction that asks
  // for it, with its micro-batch and chunk, exactly those stage_tensor_ops gives it, in
  // that order. The T members of a stage run this one program, so their i-th tensor
  // collectives meet; one stage's members wait for no other stage there, so these add
  // no wait between stages beyond their compute instruction's (the deadlock proof below
  // holds as for the compute instruction alone).
  void check_tensor_ops(int k) const {
    const auto& prog = s_.stages[k];
    const std::vector<std::vector<TensorOp>> expected =
        s_.tensor_lowered ? stage_tensor_ops(s_, s_.tensor, k) : std::vector<std::vector<TensorOp>>(prog.size());
    size_t owner = prog.size(), next = 0;  // the compute instruction the ops follow, and its next op
    for (size_t pc = 0; pc < prog.size(); ++pc) {
      const Instruction& ins = prog[pc];
      if (!is_tensor_collective(ins.op)) {
        if (owner < prog.size() && next < expected[owner].size()) {
          fail(k, owner, "its cell asks the tensor group for " + std::to_string(expected[owner].size()) +
                             " collectives and the program has " + std::to_string(next) + " after it");
        }
        owner = is_compute(ins.op) ? pc : prog.size();
        next = 0;
        continue;
      }
      if (!s_.tensor_lowered) fail(k, pc, "tensor-group collectives are inserted by lower_tensor_collectives, not written");
      if (owner == prog.size()) fail(k, pc, "a tensor-group collective runs inside a compute instruction (F, R, B, W), after it");
      if (ins.micro_batch != prog[owner].micro_batch || ins.chunk != prog[owner].chunk || ins.count != 1) {
        fail(k, pc, "a tensor-group collective carries its compute instruction's micro-batch and chunk");
      }
      if (next >= expected[owner].size() || expected[owner][next].op != ins.op) {
        fail(k, pc, next >= expected[owner].size()
                        ? "its cell asks the tensor group for " + std::to_string(expected[owner].size()) +
                              " collectives in " + instruction_str(s_, k, prog[owner]) + ", not more"
                        : "its cell asks for " + std::string(op_short_name(expected[owner][next].op)) + " here");
      }
      ++next;
    }
    if (owner < prog.size() && next < expected[owner].size()) {
      fail(k, owner, "its cell asks the tensor group for " + std::to_string(expected[owner].size()) +
                         " collectives and the program has " + std::to_string(next) + " after it");
    }
  }

  void validate_indices(int k, size_t pc) const {
    const Instruction& ins = s_.stages[k][pc];
    if (ins.op == Op::kOptimizerStep || is_tensor_collective(ins.op)) return;  // the latter: check_tensor_ops
    if (is_collective(ins.op)) {
      const auto& c = s_.collectives;
      if (!s_.collectives_lowered) fail(k, pc, "collectives are inserted by lower_collectives, not written");
      if (ins.op == Op::kReduceGradients && !c.replicas) fail(k, pc, "the run has no data-parallel replicas");
      if ((ins.op == Op::kReduceScatterGradients || ins.op == Op::kGatherParameters) &&
          !(c.replicas && c.shard_optimizer)) {
        fail(k, pc, "the run does not shard its optimizer state over data-parallel replicas");
      }
      if (ins.op == Op::kReduceGradients && c.shard_optimizer) fail(k, pc, "a sharded run reduce-scatters (RS), it does not all-reduce");
      if (ins.op == Op::kGradientNorm && !c.gradient_norm) fail(k, pc, "the run does not need the gradient norm");
      if (ins.op == Op::kTiedGradients) {
        if (ins.micro_batch < 0 || ins.micro_batch >= static_cast<int>(c.ties.size())) fail(k, pc, "no such tied weight");
        const auto who = collective_stages(s_, k, ins);
        if (who[0] == who[1] || std::find(who.begin(), who.end(), k) == who.end()) {
          fail(k, pc, "the tied weight has no copy on another stage than this one");
        }
      }
      return;
    }
    if (ins.chunk < 0 || ins.chunk >= s_.num_chunks()) fail(k, pc, "the stage has no such chunk");
    if (ins.micro_batch < 0 || ins.micro_batch >= s_.num_micro_batches) fail(k, pc, "no such micro-batch");
    if (ins.count < 1 || (ins.count > 1 && ins.op != Op::kBackwardWeight)) {
      fail(k, pc, "only a weight gradient covers several micro-batches");
    }
    if (ins.micro_batch + ins.count > s_.num_micro_batches) fail(k, pc, "no such micro-batch");
  }

  MessageKey key_of(int k, const Instruction& ins, int* peer) const { return message_key(s_, k, ins, peer); }

  // Validates one communication instruction before it runs.
  void check_comm(int k, size_t pc) {
    const Instruction& ins = s_.stages[k][pc];
    ChunkState& x = st_[k].chunks[ins.chunk];
    const int m = ins.micro_batch;
    int peer = -1;
    key_of(k, ins, &peer);
    const bool act = ins.op == Op::kSendActivation || ins.op == Op::kRecvActivation;
    if (peer < 0) fail(k, pc, act ? (ins.op == Op::kSendActivation ? "the model's last cell has no next cell" : "the model's first cell has no previous cell")
                                  : (ins.op == Op::kSendGradient ? "the model's first cell has no previous cell" : "the model's last cell has no next cell"));
    if (peer == k) fail(k, pc, "the neighbouring cell is on this stage: it hands over directly, without a message");
    if (s_.forward_only && !act) fail(k, pc, "a forward-only program sends and receives activations only");
    switch (ins.op) {
      case Op::kSendActivation:
        if (!x.fwd[m]) fail(k, pc, "sent before the forward that produces it");
        if (x.sent_act[m]++) fail(k, pc, "sent twice");
        break;
      case Op::kSendGradient:
        if (!x.bwd[m]) fail(k, pc, "sent before the backward that produces it");
        if (x.sent_grad[m]++) fail(k, pc, "sent twice");
        break;
      case Op::kRecvActivation:
        if (x.recv_act[m]++) fail(k, pc, "received twice");
        break;
      case Op::kRecvGradient:
        if (x.recv_grad[m]++) fail(k, pc, "received twice");
        break;
      default: break;
    }
  }

  // Runs the compute or optimizer instruction at pc; returns its cost.
  double run_compute(int k, size_t pc) {
    const Instruction& ins = s_.stages[k][pc];
    StageProgress& S = st_[k];
    if (s_.forward_only && ins.op != Op::kForward) fail(k, pc, "a forward-only program runs forwards only");
    if (ins.op == Op::kOptimizerStep) {
      check_gradients_final(k, pc, "optimizer step");
      if (S.collectives_done < S.collectives_expected - S.collectives_after_opt) {
        fail(k, pc, "optimizer step before the stage's collectives (RG, TIE, NORM, RS) have run");
      }
      if (S.opt++) fail(k, pc, "optimizer step twice");
      return cost_(k, ins);
    }
    ChunkState& x = S.chunks[ins.chunk];
    const int m = ins.micro_batch, c = s_.cell(k, ins.chunk), C = s_.num_cells();
    switch (ins.op) {
      case Op::kForward:
        if (x.fwd[m]) fail(k, pc, "forward twice");
        if (c > 0) {
          const int prev = s_.stage_of_cell(c - 1);
          if (prev == k ? !S.chunks[s_.chunk_of_cell(c - 1)].fwd[m] : !x.recv_act[m]) {
            fail(k, pc, "forward before its input " + std::string(prev == k ? "was computed by cell " + std::to_string(c - 1) : "was received"));
          }
        }
        x.fwd[m] = 1;
        break;
      case Op::kRecompute:
        if (!x.fwd[m]) fail(k, pc, "recompute before forward");
        if (x.rcmp[m]) fail(k, pc, "recompute twice");
        if (x.bwd[m]) fail(k, pc, "recompute after backward");
        x.rcmp[m] = 1;
        break;
      case Op::kBackward:
        if (!x.fwd[m]) fail(k, pc, "backward before forward");
        if (x.bwd[m]) fail(k, pc, "backward twice");
        if (x.has_r[m] && !x.rcmp[m]) fail(k, pc, "backward of a checkpointed micro-batch before its recompute");
        if (c + 1 < C) {
          const int next = s_.stage_of_cell(c + 1);
          if (next == k ? !S.chunks[s_.chunk_of_cell(c + 1)].bwd[m] : !x.recv_grad[m]) {
            fail(k, pc, "backward before its output gradient " +
                            std::string(next == k ? "was computed by cell " + std::to_string(c + 1) : "was received"));
          }
        }
        x.bwd[m] = 1;
        break;
      case Op::kBackwardWeight:
        for (int w : ins.micro_batches()) {  // a batched W waits for the last backward it covers
          if (!x.bwd[w]) {
            fail(k, pc, "weight gradient before the backward" +
                            (ins.count > 1 ? " of micro-batch " + std::to_string(w) : std::string()));
          }
          if (x.wgt[w]++) fail(k, pc, "weight gradient twice");
        }
        break;
      default: break;
    }
    const double d = cost_(k, ins);
    S.busy += d;
    return d;
  }

  // Every backward and weight gradient of the stage has run: its gradients are final.
  void check_gradients_final(int k, size_t pc, const std::string& what) const {
    const StageProgress& S = st_[k];
    for (int j = 0; j < s_.num_chunks(); ++j) {
      for (int m = 0; m < s_.num_micro_batches; ++m) {
        const ChunkState& x = S.chunks[j];
        if (!x.bwd[m] || (x.has_w[m] && !x.wgt[m])) {
          fail(k, pc, what + " before the " + std::string(x.bwd[m] ? "weight gradient" : "backward") +
                          " of micro-batch " + std::to_string(m) + (s_.num_chunks() > 1 ? " of chunk " + std::to_string(j) : ""));
        }
      }
    }
  }

  // A collective: the stage waits until every stage taking part has reached it (a
  // stage that waits elsewhere meanwhile deadlocks them, as on a real transport); it
  // ends its cost after the last one arrived. Returns 0 while waiting.
  size_t collective(int k) {
    StageProgress& S = st_[k];
    const size_t pc = S.pc;
    const Instruction& ins = s_.stages[k][pc];
    CollectiveState& c = collectives_[{static_cast<int>(ins.op), ins.micro_batch}];
    if (c.done.count(k)) fail(k, pc, "the collective runs twice");
    if (!c.arrived.count(k)) {
      check_gradients_final(k, pc, "collective");
      if (after_optimizer(ins.op)) {
        if (!S.opt) fail(k, pc, "the parameters' all-gather before the optimizer step that updates them");
      } else if (S.opt) {
        fail(k, pc, "collective after the optimizer step");
      }
      c.arrived[k] = S.clock;
    }
    double last = 0;
    for (int other : collective_stages(s_, k, ins)) {
      auto it = c.arrived.find(other);
      if (it == c.arrived.end()) return 0;  // wait for it
      last = std::max(last, it->second);
    }
    // Its device part (a sum of squares, a copy) is small beside the wait and the link,
    // and holds no turn here.
    record(k, pc, S.clock, last + cost_(k, ins));
    c.done.insert(k);
    ++S.collectives_done;
    ++S.pc;
    return 1;
  }

  void record(int k, size_t pc, double start, double end) {
    sim_.timeline[k].push_back({s_.stages[k][pc], start, end});
    st_[k].clock = end;
  }

  // When stage k's work of `d` asked for at `at` starts: on a device it shares with other
  // stages (turns_), once the device is free, which it then holds until the work's end.
  double take_turn(int k, double at, double d) {
    if (!shared_ || d <= 0) return at;
    double& free = device_free_[turns_[k]];
    const double start = std::max(at, free);
    free = start + d;
    return start;
  }

  // Advances stage k by one instruction (or one communication group); returns how
  // many instructions ran, 0 when blocked.
  size_t step(int k) {
    StageProgress& S = st_[k];
    const auto& prog = s_.stages[k];
    const Instruction& ins = prog[S.pc];
    if (is_collective(ins.op)) return collective(k);
    if (is_tensor_collective(ins.op)) {  // its members meet (they run this program): its cost, after its F, R, B or W
      const double d = cost_(k, ins);
      const double start = take_turn(k, S.clock, d);
      record(k, S.pc, start, start + d);
      ++S.pc;
      return 1;
    }
    if (!is_communication(ins.op)) {
      const double d = run_compute(k, S.pc);
      const double start = take_turn(k, S.clock, d);
      record(k, S.pc, start, start + d);
      ++S.pc;
      return 1;
    }
    {
      int peer = -1;
      const MessageKey key = key_of(k, ins, &peer);
      const bool send = ins.op == Op::kSendActivation || ins.op == Op::kSendGradient;
      double start = S.clock, end = S.clock;
      if (send) {
        check_comm(k, S.pc);
        end = start + cost_(k, ins);
        arrived_[key] = end;
      } else {
        auto it = arrived_.find(key);
        if (it == arrived_.end()) return 0;  // wait for the neighbour
        check_comm(k, S.pc);
        end = std::max(start, it->second + cost_(k, ins));  // the message's delivery
        consumed_.insert(key);
      }
      record(k, S.pc, start, end);
      ++S.pc;
      return 1;
    }
    GPIPE_CHECK(false, "the validating interpreter runs buffered");
    return 0;
  }

  void check_complete() const {
    const int K = s_.num_stages, M = s_.num_micro_batches, C = s_.num_cells();
    for (int k = 0; k < K; ++k) {
      for (int j = 0; j < s_.num_chunks(); ++j) {
        const int c = s_.cell(k, j);
        const ChunkState& x = st_[k].chunks[j];
        for (int m = 0; m < M; ++m) {
          auto missing = [&](const char* what) {
            throw UserError("schedule '" + s_.name + "': stage " + std::to_string(k) + " never runs " + what +
                            " of micro-batch " + std::to_string(m) + " for cell " + std::to_string(c) +
                            marked_table(s_, {}));
          };
          if (!x.fwd[m]) missing("the forward");
          if (!x.bwd[m] && !s_.forward_only) missing("the backward");
          if (c + 1 < C && s_.stage_of_cell(c + 1) != k && !x.sent_act[m]) missing("the activation send");
          if (c > 0 && s_.stage_of_cell(c - 1) != k && !x.sent_grad[m] && !s_.forward_only) missing("the gradient send");
        }
      }
      if (!st_[k].opt && !s_.forward_only) {
        throw UserError("schedule '" + s_.name + "': stage " + std::to_string(k) + " has no optimizer step" +
                        marked_table(s_, {}));
      }
      if (st_[k].collectives_done != st_[k].collectives_expected) {
        throw UserError("schedule '" + s_.name + "': stage " + std::to_string(k) + " runs " +
                        std::to_string(st_[k].collectives_done) + " collectives (RG, TIE, NORM, RS, AG) where the run needs " +
                        std::to_string(st_[k].collectives_expected) + marked_table(s_, {}));
      }
    }
    for (const auto& kv : arrived_) {
      if (!consumed_.count(kv.first)) {
        throw UserError("schedule '" + s_.name + "': a message to stage " + std::to_string(std::get<0>(kv.first)) +
                        " (micro-batch " + std::to_string(std::get<2>(kv.first)) + ", cell " +
                        std::to_string(std::get<3>(kv.first)) + ") is never received" + marked_table(s_, {}));
      }
    }
  }

  const Schedule& s_;
  const CostFn& cost_;
  const std::vector<int> turns_;  // per stage, the first stage on its device (device_turns), or none
  bool shared_ = false;            // some stages take turns
  std::map<int, double> device_free_;  // by turns_' first stage: when the device is next free
  std::vector<StageProgress> st_;
  std::map<MessageKey, double> arrived_;  // arrival time of sent messages
  std::set<MessageKey> consumed_;
  std::map<CollectiveKey, CollectiveState> collectives_;
  Simulation sim_;
};

// Rendezvous transports (NCCL) as the GPU runs them: each stage has a compute queue
// (F, R, B, W, OPT in program order) and a communication queue of groups (each maximal
// run of consecutive sends and receives in the program is one ncclGroupStart/End),
// executed one after another as NCCL serialises a communicator's operations. A group
// starts once the compute that produces its sends is done; it completes once every
// partner's group has started. A compute waits for the receive it consumes. The
// program's order was validated first by the buffered interpreter.
class RendezvousRun {
 public:
  RendezvousRun(const Schedule& s, const CostFn& cost) : s_(s), cost_(cost) {}

  Simulation run() {
    const int K = s_.num_stages;
    st_.assign(K, {});
    for (int k = 0; k < K; ++k) prepare(k);
    bool progress = true;
    size_t left = 0;
    for (const auto& p : s_.stages) left += p.size();
    while (left > 0 && progress) {
      progress = false;
      for (int k = 0; k < K; ++k) {
        size_t n = 0;
        while ((n = advance_compute(k) + advance_comm(k)) > 0) {
          left -= n;
          progress = true;
        }
      }
    }
    if (left > 0) {
      std::string stuck;
      std::vector<long> marks(K, -1);
      for (int k = 0; k < K; ++k) {
        Stage& x = st_[k];
        if (x.gpc < x.groups.size()) {
          stuck += "\n  stage " + std::to_string(k) + ": the group {";
          for (size_t i : x.groups[x.gpc]) stuck += " " + instruction_str(s_, k, s_.stages[k][i]);
          stuck += " } waits for its partners";
          marks[k] = static_cast<long>(x.groups[x.gpc].front());
        } else if (x.cpc < x.compute.size() && is_collective(s_.stages[k][x.compute[x.cpc]].op)) {
          stuck += "\n  stage " + std::to_string(k) + ": " + instruction_str(s_, k, s_.stages[k][x.compute[x.cpc]]) +
                   " waits for the other stages taking part";
          marks[k] = static_cast<long>(x.compute[x.cpc]);
        }
      }
      throw UserError("schedule '" + s_.name + "' deadlocks on a transport whose sends wait for their receive "
                      "(NCCL between GPU processes):" + stuck + marked_table(s_, marks));
    }
    Simulation sim;
    sim.timeline.assign(K, {});
    double total_busy = 0;
    for (int k = 0; k < K; ++k) {
      for (size_t i = 0; i < s_.stages[k].size(); ++i) {
        sim.timeline[k].push_back({s_.stages[k][i], st_[k].start[i], st_[k].end[i]});
        sim.makespan = std::max(sim.makespan, st_[k].end[i]);
      }
      sim.busy.push_back(st_[k].busy);
      total_busy += st_[k].busy;
    }
    sim.bubble = sim.makespan > 0 ? 1.0 - total_busy / (K * sim.makespan) : 0.0;
    return sim;
  }

 private:
  struct Stage {
    std::vector<size_t> compute;             // instruction indices
    std::vector<std::vector<size_t>> groups;  // instruction indices per group
    std::vector<long> needs;                 // per instruction: the receive a compute consumes, or
                                             // the compute a send waits for; -1 for none
    std::vector<char> done;
    std::vector<double> start, end;
    size_t cpc = 0, gpc = 0;
    double compute_clock = 0, comm_clock = 0, busy = 0;
    bool posted = false;
  };

  void prepare(int k) {
    Stage& x = st_[k];
    const auto& prog = s_.stages[k];
    x.needs.assign(prog.size(), -1);
    x.done.assign(prog.size(), 0);
    x.start.assign(prog.size(), 0);
    x.end.assign(prog.size(), 0);
    std::map<std::tuple<int, int, int>, size_t> recv_at, produced_at;  // (op, chunk, m)
    Op producer_op = Op::kForward;  // the last compute instruction's
    for (size_t i = 0; i < prog.size(); ++i) {
      const Instruction& ins = prog[i];
      if (is_communication(ins.op)) {
        if (i == 0 || !is_communication(prog[i - 1].op)) x.groups.emplace_back();
        x.groups.back().push_back(i);
        if (is_send(ins.op)) {
          const Op producer = ins.op == Op::kSendActivation ? Op::kForward : Op::kBackward;
          x.needs[i] = static_cast<long>(produced_at.at({static_cast<int>(producer), ins.chunk, ins.micro_batch}));
        } else {
          const Op consumer = ins.op == Op::kRecvActivation ? Op::kForward : Op::kBackward;
          recv_at[{static_cast<int>(consumer), ins.chunk, ins.micro_batch}] = i;
        }
      } else if (is_tensor_collective(ins.op)) {
        // Inside the compute instruction before it: what that one sends is there after its last.
        x.compute.push_back(i);
        produced_at[{static_cast<int>(producer_op), ins.chunk, ins.micro_batch}] = i;
      } else {
        x.compute.push_back(i);
        auto it = recv_at.find({static_cast<int>(ins.op), ins.chunk, ins.micro_batch});
        if (it != recv_at.end()) x.needs[i] = static_cast<long>(it->second);
        produced_at[{static_cast<int>(ins.op), ins.chunk, ins.micro_batch}] = i;
        producer_op = ins.op;
      }
    }
  }

  size_t advance_compute(int k) {
    Stage& x = st_[k];
    size_t n = 0;
    while (x.cpc < x.compute.size()) {
      const size_t i = x.compute[x.cpc];
      const long r = x.needs[i];
      if (r >= 0 && !x.done[r]) break;
      const Instruction& ins = s_.stages[k][i];
      const double d = cost_(k, ins);
      x.start[i] = std::max(x.compute_clock, r >= 0 ? x.end[r] : 0.0);
      if (is_collective(ins.op)) {
        // After everything before it on the stage (its messages included), once every
        // stage taking part has arrived.
        double arrival = x.start[i];
        for (size_t j = 0; j < i; ++j) {
          if (!x.done[j]) return n;
          arrival = std::max(arrival, x.end[j]);
        }
        auto& arrived = collective_arrivals_[{static_cast<int>(ins.op), ins.micro_batch}];
        arrived.emplace(k, arrival);
        double last = arrival;
        for (int other : collective_stages(s_, k, ins)) {
          auto it = arrived.find(other);
          if (it == arrived.end()) return n;
          last = std::max(last, it->second);
        }
        x.start[i] = arrival;
        x.end[i] = last + d;
        x.compute_clock = x.end[i];
        x.done[i] = 1;
        ++x.cpc;
        ++n;
        continue;
      }
      x.end[i] = x.start[i] + d;
      x.compute_clock = x.end[i];
      if (is_compute(ins.op)) x.busy += d;
      x.done[i] = 1;
      ++x.cpc;
      ++n;
    }
    return n;
  }

  size_t advance_comm(int k) {
    Stage& x = st_[k];
    size_t n = 0;
    while (x.gpc < x.groups.size()) {
      const auto& g = x.groups[x.gpc];
      if (!x.posted) {
        double t = x.comm_clock;
        for (size_t i : g) {
          const long p = x.needs[i];
          if (p >= 0 && !x.done[p]) return n;  // the send's data is not computed yet
          if (p >= 0) t = std::max(t, x.end[p]);
        }
        for (size_t i : g) {
          int peer = -1;
          const MessageKey key = message_key(s_, k, s_.stages[k][i], &peer);
          (is_send(s_.stages[k][i].op) ? posted_sends_ : posted_recvs_)[key] = t;
          x.start[i] = t;
        }
        x.posted = true;
      }
      double ready = x.start[g.front()], cost = 0;
      for (size_t i : g) {
        const Instruction& ins = s_.stages[k][i];
        int peer = -1;
        const MessageKey key = message_key(s_, k, ins, &peer);
        const auto& partners = is_send(ins.op) ? posted_recvs_ : posted_sends_;
        auto it = partners.find(key);
        if (it == partners.end()) return n;
        ready = std::max(ready, it->second);
        if (is_send(ins.op)) cost += cost_(k, ins);
      }
      for (size_t i : g) {
        x.end[i] = ready + cost;
        x.done[i] = 1;
      }
      x.comm_clock = ready + cost;
      x.posted = false;
      ++x.gpc;
      n += g.size();
    }
    return n;
  }

  const Schedule& s_;
  const CostFn& cost_;
  std::vector<Stage> st_;
  std::map<MessageKey, double> posted_sends_, posted_recvs_;
  std::map<CollectiveKey, std::map<int, double>> collective_arrivals_;
};

}  // namespace

void check_schedule(const Schedule& s, CommModel comm) {
  const CostFn unit = [](int, const Instruction& ins) {
    return is_compute(ins.op) ? 1.0 : 0.0;
  };
  simulate(s, unit, comm);
}

Simulation simulate(const Schedule& s, const CostFn& cost, CommModel comm, const std::vector<int>& turns) {
  for (size_t k = 0; k < turns.size(); ++k) {
    if (comm == CommModel::kRendezvous && turns[k] != static_cast<int>(k)) {
      throw Error("simulate: stages that take turns on a device hand over in memory (the buffered model), not by rendezvous");
    }
  }
  Simulation sim = Interpreter(s, cost, turns).run();  // validates the order, names the first problem
  if (comm == CommModel::kRendezvous) sim = RendezvousRun(s, cost).run();
  return sim;
}

Simulation simulate(const Schedule& s, const OpCosts& c) {
  const CostFn cost = [&c](int, const Instruction& ins) {
    switch (ins.op) {
      case Op::kForward: return c.forward;
      case Op::kBackward: return c.backward;
      case Op::kBackwardWeight: return c.weight * ins.count;
      case Op::kRecompute: return c.recompute;
      case Op::kSendActivation:
      case Op::kSendGradient: return c.send;
      case Op::kOptimizerStep: return c.optimizer;
      case Op::kReduceGradients:
      case Op::kTiedGradients:
      case Op::kGradientNorm:
      case Op::kReduceScatterGradients:
      case Op::kGatherParameters: return c.collective;
      default: return 0.0;
    }
  };
  return Interpreter(s, cost).run();
}

}  // namespace pipeline
}  // namespace gpipe

// The schedule generators (GPipe, 1F1B, interleaved 1F1B, zero bubble) and schedule
// files. Each emits compute instructions per stage; insert_recompute() and
// lower_communication() (schedule.cc) finish the job the same way for all of them.
#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <sstream>

#include "pipeline/schedule/schedule.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {

void check_sizes(int K, int v, int M) {
  if (K < 1) throw UserError("pipeline.partitions must be at least 1, got " + std::to_string(K));
  if (v < 1) throw UserError("pipeline.virtual_stages must be at least 1, got " + std::to_string(v));
  if (M < 1) throw UserError("pipeline.micro_batches must be at least 1, got " + std::to_string(M));
}

Schedule empty_schedule(const std::string& name, int K, int v, int M) {
  check_sizes(K, v, M);
  Schedule s;
  s.name = name;
  s.num_stages = K;
  s.num_micro_batches = M;
  s.cells = interleaved_cells(K, v);
  s.stages.resize(K);
  return s;
}

Schedule insert_recompute_and_messages(Schedule s, RecomputeMode mode, CommModel comm) {
  insert_recompute(s, mode);
  lower_communication(s, comm);
  return s;
}

// The 1F1B family, as PyTorch's _get_1f1b_rank_ops: `warmup` forwards, then a forward
// and a backward in turn until the forwards run out, then the remaining backwards.
// fwd_chunk/bwd_chunk say which chunk the op-th forward/backward belongs to; each
// chunk's micro-batches go in order. With zero_bubble, backwards are split and the
// weight gradient of the oldest backward follows each backward once `defer` of them
// have been held back; the held-back ones run at the end.
template <typename FwdChunk, typename BwdChunk>
std::vector<Instruction> one_f_one_b_ops(int v, int M, int warmup, FwdChunk fwd_chunk, BwdChunk bwd_chunk,
                                         bool zero_bubble, int defer) {
  const int total = v * M;
  std::vector<int> next_f(v, 0), next_b(v, 0), next_w(v, 0);
  std::vector<int> backward_chunks;  // chunk of each backward issued, in order
  size_t weights_done = 0;
  std::vector<Instruction> out;
  auto forward = [&](int op) {
    const int j = fwd_chunk(op);
    out.push_back({Op::kForward, next_f[j]++, j});
  };
  auto backward = [&](int op) {
    const int j = bwd_chunk(op);
    out.push_back({Op::kBackward, next_b[j]++, j});
    backward_chunks.push_back(j);
    if (zero_bubble && op - warmup >= defer) {
      const int wj = backward_chunks[weights_done++];
      out.push_back({Op::kBackwardWeight, next_w[wj]++, wj});
    }
  };
  for (int op = 0; op < warmup; ++op) forward(op);
  for (int op = warmup; op < total; ++op) {
    forward(op);
    backward(op);
  }
  for (int op = total; op < total + warmup; ++op) backward(op);
  while (zero_bubble && weights_done < backward_chunks.size()) {
    const int wj = backward_chunks[weights_done++];
    out.push_back({Op::kBackwardWeight, next_w[wj]++, wj});
  }
  return out;
}

// Interleaved schedules take the micro-batches in rounds of K (PyTorch's flexible
// variant of Megatron's rule M % K == 0): rounds = max(1, M / K) must divide M.
int micro_batches_per_round(const std::string& name, int K, int v, int M) {
  const int rounds = std::max(1, M / K);
  if (v > 1 && M % rounds != 0) {
    throw UserError("pipeline.schedule " + name + " with pipeline.virtual_stages = " + std::to_string(v) +
                    " takes the micro-batches in rounds of about K = " + std::to_string(K) + ": " +
                    std::to_string(M) + " micro-batches make " + std::to_string(rounds) +
                    " rounds, which do not divide them evenly; use a pipeline.micro_batches that is a multiple "
                    "of pipeline.partitions (or at most pipeline.partitions)");
  }
  return M / rounds;
}

Schedule interleaved_family(const std::string& name, int K, int v, int M, RecomputeMode mode, CommModel comm,
                            bool zero_bubble) {
  Schedule s = empty_schedule(name, K, v, M);
  const int per_round = micro_batches_per_round(name, K, v, M);
  for (int k = 0; k < K; ++k) {
    // Forwards in flight before the first backward reaches this stage: a whole chunk
    // round per later chunk, plus the hops to the last stage (two per hop, forward and
    // back, when every backward comes right after a forward; one with zero bubble,
    // which moves the weight gradients out of the way).
    const int hops = (K - 1 - k) * (zero_bubble ? 1 : 2);
    const int warmup = v == 1 ? std::min(K - 1 - k, M) : std::min((v - 1) * per_round + hops, v * M);
    auto fwd_chunk = [&](int op) { return (op / per_round) % v; };
    auto bwd_chunk = [&](int op) { return v - 1 - ((op - warmup) / per_round) % v; };
    s.stages[k] = one_f_one_b_ops(v, M, warmup, fwd_chunk, bwd_chunk, zero_bubble, k);
  }
  return insert_recompute_and_messages(std::move(s), mode, comm);
}

}  // namespace

Schedule gpipe_schedule(int K, int M, RecomputeMode mode, CommModel comm) {
  Schedule s = empty_schedule("gpipe", K, 1, M);
  for (int k = 0; k < K; ++k) {
    for (int m = 0; m < M; ++m) s.stages[k].push_back({Op::kForward, m, 0});
    for (int m = M - 1; m >= 0; --m) s.stages[k].push_back({Op::kBackward, m, 0});
  }
  return insert_recompute_and_messages(std::move(s), mode, comm);
}

Schedule one_f_one_b_schedule(int K, int M, RecomputeMode mode, CommModel comm) {
  return interleaved_family("1f1b", K, 1, M, mode, comm, /*zero_bubble=*/false);
}

Schedule interleaved_1f1b_schedule(int K, int v, int M, RecomputeMode mode, CommModel comm) {
  return interleaved_family("interleaved_1f1b", K, v, M, mode, comm, /*zero_bubble=*/false);
}

Schedule zero_bubble_schedule(int K, int v, int M, RecomputeMode mode, CommModel comm) {
  return interleaved_family("zero_bubble", K, v, M, mode, comm, /*zero_bubble=*/true);
}

std::vector<std::string> schedule_names() { return {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}; }

Schedule make_schedule(const ScheduleRequest& r) {
  check_sizes(r.num_stages, r.num_chunks, r.num_micro_batches);
  Schedule s;
  if (!r.file.empty()) {
    s = load_schedule_file(r.file, r.num_stages, r.num_chunks, r.num_micro_batches, r.mode, r.comm);
  } else if (r.name == "gpipe" || r.name == "fill_drain" || r.name == "1f1b") {
    if (r.num_chunks != 1) {
      throw UserError("pipeline.schedule " + r.name + " runs one cell per stage, but pipeline.virtual_stages is " +
                      std::to_string(r.num_chunks) + "; use interleaved_1f1b or zero_bubble, or virtual_stages: 1");
    }
    s = r.name == "1f1b" ? one_f_one_b_schedule(r.num_stages, r.num_micro_batches, r.mode, r.comm)
                         : gpipe_schedule(r.num_stages, r.num_micro_batches, r.mode, r.comm);
  } else if (r.name == "interleaved_1f1b") {
    s = interleaved_1f1b_schedule(r.num_stages, r.num_chunks, r.num_micro_batches, r.mode, r.comm);
  } else if (r.name == "zero_bubble") {
    s = zero_bubble_schedule(r.num_stages, r.num_chunks, r.num_micro_batches, r.mode, r.comm);
  } else {
    std::string names;
    for (const auto& n : schedule_names()) names += (names.empty() ? "" : ", ") + n;
    throw UserError("pipeline.schedule: unknown schedule '" + r.name + "'; valid schedules: " + names +
                    " (gpipe is also called fill_drain), or pipeline.schedule_file for one of your own");
  }
  if (r.batch_weights) {
    check_schedule(s, r.comm);  // a mistake of a schedule file is told of as written
    batch_weight_gradients(s, r.comm);
  }
  check_schedule(s, r.comm);
  return s;
}

Schedule make_schedule(const std::string& name, int K, int M, RecomputeMode mode) {
  ScheduleRequest r;
  r.name = name;
  r.num_stages = K;
  r.num_micro_batches = M;
  r.mode = mode;
  return make_schedule(r);
}

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool parse_int(const std::string& text, int* out) {
  const std::string t = trim(text);
  if (t.empty() || t.size() > 9) return false;
  for (char ch : t) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
  }
  *out = std::stoi(t);
  return true;
}

bool parse_op(const std::string& text, Op* op) {
  const std::string t = trim(text);
  if (t == "F") *op = Op::kForward;
  else if (t == "B" || t == "I") *op = Op::kBackward;
  else if (t == "W") *op = Op::kBackwardWeight;
  else if (t == "R") *op = Op::kRecompute;
  else return false;
  return true;
}

// Why a token of the log form (instruction_str: "rA0", "OPT", "2sG1") is not a file
// line, or "" if it is none of those. Every op that is not compute counts, those
// added to Op later included: their short names are looked up, not listed here.
std::string log_form_op(const std::string& token) {
  size_t b = 0, e = token.size();
  while (b < e && std::isdigit(static_cast<unsigned char>(token[b]))) ++b;
  while (e > b && std::isdigit(static_cast<unsigned char>(token[e - 1]))) --e;
  const std::string name = token.substr(b, e - b);
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (name == op_short_name(op) && name != "?" && !is_compute(op)) {
      return "'" + name + "' (" + op_name(op) + ") is an instruction gpipe inserts itself when it loads the file";
    }
  }
  return "";
}

}  // namespace

Schedule parse_schedule_text(const std::string& text, const std::string& source, int K, int v, int M,
                             RecomputeMode mode, CommModel comm) {
  Schedule s = empty_schedule("file", K, v, M);
  s.source = source;
  s.lines.assign(K, {});
  std::istringstream in(text);
  std::string raw;
  int line_no = 0;
  bool any_recompute = false;
  auto fail = [&](const std::string& why) {
    throw UserError("schedule file " + source + ":" + std::to_string(line_no) + ": " + why +
                    "; a line is `stage,op,micro_batch[,chunk]` (op F, B, W or R) or an action such as 1F3");
  };
  while (std::getline(in, raw)) {
    ++line_no;
    const std::string line = trim(raw.substr(0, raw.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> fields;
    std::stringstream ss(line);
    std::string f;
    while (std::getline(ss, f, ',')) fields.push_back(trim(f));
    int stage = 0, mb = 0, chunk = 0;
    Op op = Op::kForward;
    if (line.rfind("stage ", 0) == 0) {
      fail("'" + line.substr(0, 16) + "...' is a line of the log form (schedule_table), not of a schedule file; "
           "write one compute instruction per line (`gpipe plan CONFIG --schedule-file-out FILE` writes a "
           "schedule in this form to start from)");
    }
    if (fields.size() == 1) {  // PyTorch's action notation: <cell><op><micro-batch>
      const std::string& a = fields[0];
      size_t i = 0;
      while (i < a.size() && std::isdigit(static_cast<unsigned char>(a[i]))) ++i;
      int cell = 0;
      const std::string inserted = log_form_op(a);
      if (!inserted.empty()) fail(inserted + "; a file holds only F, B, W and R");
      if (i == 0 && parse_op(a.substr(0, 1), &op)) {
        fail("'" + a + "' has no cell (the log form leaves it out); an action names it first, e.g. 0" + a +
             " for cell 0");
      }
      if (i == 0 || i >= a.size() || !parse_int(a.substr(0, i), &cell) || !parse_op(a.substr(i, 1), &op) ||
          !parse_int(a.substr(i + 1), &mb)) {
        fail("cannot read '" + a + "'");
      }
      if (cell >= K * v) {
        fail("cell " + std::to_string(cell) + " does not exist: " + std::to_string(K) + " stages x " +
             std::to_string(v) + " virtual stages make cells 0.." + std::to_string(K * v - 1));
      }
      stage = s.stage_of_cell(cell);
      chunk = s.chunk_of_cell(cell);
    } else if (fields.size() == 3 || fields.size() == 4) {
      if (!parse_int(fields[0], &stage)) fail("stage '" + fields[0] + "' is not a number");
      if (!parse_op(fields[1], &op)) {
        const std::string inserted = log_form_op(fields[1]);
        fail("op '" + fields[1] + "' is not F, B, W or R" + (inserted.empty() ? "" : ": " + inserted));
      }
      if (!parse_int(fields[2], &mb)) fail("micro-batch '" + fields[2] + "' is not a number");
      if (fields.size() == 4 && !parse_int(fields[3], &chunk)) fail("chunk '" + fields[3] + "' is not a number");
    } else {
      fail("expected 3 or 4 comma-separated fields, got " + std::to_string(fields.size()));
    }
    if (stage >= K) fail("stage " + std::to_string(stage) + " does not exist (pipeline.partitions is " + std::to_string(K) + ")");
    if (chunk >= v) {
      fail("chunk " + std::to_string(chunk) + " does not exist (pipeline.virtual_stages is " + std::to_string(v) + ")");
    }
    if (mb >= M) {
      fail("micro-batch " + std::to_string(mb) + " does not exist (pipeline.micro_batches is " + std::to_string(M) + ")");
    }
    any_recompute = any_recompute || op == Op::kRecompute;
    s.stages[stage].push_back({op, mb, chunk});
    s.lines[stage].push_back(line_no);
  }
  for (int k = 0; k < K; ++k) {
    if (s.stages[k].empty()) {
      throw UserError("schedule file " + source + " gives stage " + std::to_string(k) +
                      " no instructions; every stage needs a line for each of its forwards and backwards");
    }
  }
  if (!any_recompute) insert_recompute(s, mode);
  lower_communication(s, comm);
  return s;
}

Schedule load_schedule_file(const std::string& path, int K, int v, int M, RecomputeMode mode, CommModel comm) {
  std::ifstream f(path);
  if (!f) throw UserError("pipeline.schedule_file: cannot read '" + path + "'; check the path");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_schedule_text(ss.str(), path, K, v, M, mode, comm);
}

}  // namespace pipeline
}  // namespace gpipe

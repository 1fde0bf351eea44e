#include "pipeline/report/trace.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

void StepRecorder::add(int step, double loss, const StepResult& r) {
  if (!records(step)) return;
  steps_.push_back({step, loss, r.wall_ms, r.stages});
}

const RecordedStep* StepRecorder::median_step() const {
  if (steps_.empty()) return nullptr;
  std::vector<const RecordedStep*> by_wall;
  for (const auto& s : steps_) by_wall.push_back(&s);
  std::sort(by_wall.begin(), by_wall.end(), [](auto* a, auto* b) { return a->wall_ms < b->wall_ms; });
  return by_wall[(by_wall.size() - 1) / 2];
}

namespace {

constexpr int kComputeTrack = 0, kCommTrack = 1;

// Microseconds on a nanosecond grid, so that slices that follow each other on a track
// still do after rounding.
double us(double ms) { return std::round(ms * 1e6) / 1e3; }

nlohmann::json metadata(const char* what, int pid, int tid, nlohmann::json args) {
  nlohmann::json e = {{"ph", "M"}, {"name", what}, {"pid", pid}, {"args", std::move(args)}};
  if (tid >= 0) e["tid"] = tid;
  return e;
}

}  // namespace

nlohmann::json chrome_trace(const Schedule& s, const std::vector<TraceProcess>& processes,
                            const std::vector<RecordedStep>& steps, double epoch_ms) {
  const int K = s.num_stages;
  GPIPE_CHECK(static_cast<int>(processes.size()) == K, "chrome_trace: one process per stage");
  nlohmann::json events = nlohmann::json::array();
  for (const TraceProcess& p : processes) {
    const int pid = p.stage;
    events.push_back(metadata("process_name", pid, -1,
                              {{"name", "stage " + std::to_string(p.stage) + " · rank " + std::to_string(p.rank) +
                                            " · " + p.device}}));
    events.push_back(metadata("process_labels", pid, -1, {{"labels", "layers " + p.layers}}));
    events.push_back(metadata("process_sort_index", pid, -1, {{"sort_index", p.stage}}));
    events.push_back(metadata("thread_name", pid, kComputeTrack, {{"name", "compute"}}));
    events.push_back(metadata("thread_sort_index", pid, kComputeTrack, {{"sort_index", 0}}));
    events.push_back(metadata("thread_name", pid, kCommTrack, {{"name", "communication"}}));
    events.push_back(metadata("thread_sort_index", pid, kCommTrack, {{"sort_index", 1}}));
  }
  const int steps_pid = K;
  events.push_back(metadata("process_name", steps_pid, -1, {{"name", "steps"}}));
  events.push_back(metadata("process_sort_index", steps_pid, -1, {{"sort_index", K}}));
  events.push_back(metadata("thread_name", steps_pid, 0, {{"name", "step"}}));

  int64_t next_flow = 1;
  for (const RecordedStep& step : steps) {
    GPIPE_CHECK(static_cast<int>(step.stages.size()) == K,
                "chrome_trace: step " + std::to_string(step.step) + " has timings of " +
                    std::to_string(step.stages.size()) + " stages, the schedule " + std::to_string(K));
    // Each message's send and receive slices, for its flow arrow.
    struct End {
      int pid = -1;
      double ts = 0, end = 0;  // the slice's start and end, us
    };
    std::map<MessageKey, End> sent, received;
    double step_start = 1e300, step_end = -1e300;
    for (int k = 0; k < K; ++k) {
      const StageTrace& t = step.stages[k];
      const auto& prog = s.stages[k];
      GPIPE_CHECK(t.ops.size() == prog.size(), "chrome_trace: stage " + std::to_string(k) + " of step " +
                                                   std::to_string(step.step) + " timed " +
                                                   std::to_string(t.ops.size()) + " instructions of " +
                                                   std::to_string(prog.size()));
      const double base = t.start_ms - epoch_ms;
      step_start = std::min(step_start, us(base));
      double last_live = -1;
      auto counter = [&](double ts, int64_t bytes) {
        if (static_cast<double>(bytes) == last_live) return;
        last_live = static_cast<double>(bytes);
        events.push_back({{"ph", "C"}, {"name", "activations"}, {"pid", k}, {"ts", ts},
                          {"args", {{"MB", static_cast<double>(bytes) / 1e6}}}});
      };
      counter(us(base), 0);
      for (size_t i = 0; i < t.ops.size(); ++i) {
        const TimedOp& op = t.ops[i];
        GPIPE_CHECK(op.op == prog[i].op && op.micro_batch == prog[i].micro_batch,
                    "chrome_trace: stage " + std::to_string(k) + "'s timings do not follow its program");
        const bool comm = is_communication(op.op);
        const double ts = us(base + op.start_ms);
        double end = us(base + op.end_ms);
        // A receive whose message was there already takes a few ns; give it one, so
        // that its flow arrow has a slice to land in, unless the next one starts there.
        if (comm && end <= ts) {
          const double next = i + 1 < t.ops.size() ? us(base + t.ops[i + 1].start_ms) : 1e300;
          if (next >= ts + 0.001) end = ts + 0.001;
        }
        const double dur = std::round((end - ts) * 1e3) / 1e3;
        step_end = std::max(step_end, ts + dur);
        nlohmann::json args = {{"step", step.step}};
        if (op.micro_batch >= 0) args["micro_batch"] = op.micro_batch;
        if (prog[i].count > 1) args["micro_batches"] = prog[i].count;  // a batched W: micro_batch onwards
        if (has_cell(op.op) || is_tensor_collective(op.op)) {
          args["chunk"] = op.chunk;
          args["cell"] = s.cell(k, op.chunk);
        }
        if (comm || is_collective(op.op) || is_tensor_collective(op.op)) args["bytes"] = op.bytes;
        if (op.peer >= 0) args["peer"] = op.peer;
        if (!is_tensor_collective(op.op)) args["activation_bytes"] = op.live_bytes;
        // A split layer's collectives over its tensor group inside this F, R, B or W.
        if (op.group_ms > 0) args["tensor_group_ms"] = op.group_ms;
        // Backend calls (TimedOp::ops); a tensor collective's are in its compute instruction's.
        if (op.ops > 0 && !is_tensor_collective(op.op)) args["ops"] = op.ops;
        events.push_back({{"ph", "X"},
                          {"name", instruction_str(s, k, prog[i])},
                          {"cat", op_name(op.op)},
                          {"pid", k},
                          {"tid", comm || is_collective(op.op) || is_tensor_collective(op.op) ? kCommTrack : kComputeTrack},
                          {"ts", ts},
                          {"dur", dur},
                          {"args", std::move(args)}});
        if (comm) {
          const bool send = op.op == Op::kSendActivation || op.op == Op::kSendGradient;
          (send ? sent : received)[message_key(s, k, prog[i])] = {k, ts, ts + dur};
        }
        if (!is_tensor_collective(op.op)) counter(ts + dur, op.live_bytes);  // inside its compute instruction's
      }
    }
    for (const auto& [key, from] : sent) {
      auto to = received.find(key);
      if (to == received.end()) continue;
      const char* name = std::get<1>(key) == 0 ? "activation" : "gradient";
      const nlohmann::json id = next_flow++;
      // The arrow leaves when the send ended (a message cannot leave after it arrived:
      // a sender may note its end after the receiver took the message) and arrives when
      // the receive completed, each 1 ns inside its slice so that it binds to it.
      const End& at = to->second;
      const double arrive = std::max(at.ts, at.end - 0.001);
      const double leave = std::max(from.ts, std::min(from.end, at.end) - 0.001);
      events.push_back({{"ph", "s"}, {"name", name}, {"cat", "message"}, {"id", id}, {"pid", from.pid},
                        {"tid", kCommTrack}, {"ts", std::round(leave * 1e3) / 1e3}});
      events.push_back({{"ph", "f"}, {"bp", "e"}, {"name", name}, {"cat", "message"}, {"id", id},
                        {"pid", at.pid}, {"tid", kCommTrack}, {"ts", std::round(arrive * 1e3) / 1e3}});
    }
    if (step_end > step_start) {
      nlohmann::json args = {{"step", step.step}, {"loss", step.loss}, {"wall_ms", step.wall_ms}};
      // pipeline.capture: a step that was one replay of the captured step's ops (per stage).
      nlohmann::json captured = nlohmann::json::array();
      for (const StageTrace& st : step.stages) captured.push_back(st.captured_nodes);
      if (std::any_of(step.stages.begin(), step.stages.end(), [](const StageTrace& st) { return st.captured_nodes > 0; })) {
        args["captured_ops"] = captured;
      }
      events.push_back({{"ph", "X"},
                        {"name", "step " + std::to_string(step.step)},
                        {"cat", "step"},
                        {"pid", steps_pid},
                        {"tid", 0},
                        {"ts", step_start},
                        {"dur", std::round((step_end - step_start) * 1e3) / 1e3},
                        {"args", std::move(args)}});
    }
  }
  return {{"traceEvents", std::move(events)},
          {"displayTimeUnit", "ms"},
          {"otherData",
           {{"schedule", s.name},
            {"stages", K},
            {"micro_batches", s.num_micro_batches},
            {"virtual_stages", s.num_chunks()},
            {"producer", "gpipe"}}}};
}

}  // namespace pipeline
}  // namespace gpipe

// A stage's step timings as numbers, to gather them into the first stage's process
// (encode_trace, decode_trace in executor.h): the trace's wire format.
#include "pipeline/executor/executor.h"

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {
constexpr size_t kHeader = 5;    // peak activation bytes, start, optimizer bytes, other ops, captured nodes
constexpr size_t kOpFields = 10;  // op, micro-batch, start, end, chunk, bytes, peer, live bytes, group ms, ops
}  // namespace

std::vector<double> encode_trace(const StageTrace& t) {
  std::vector<double> v{static_cast<double>(t.peak_activation_bytes), t.start_ms,
                        static_cast<double>(t.optimizer_bytes), static_cast<double>(t.other_ops),
                        static_cast<double>(t.captured_nodes)};
  v.reserve(kHeader + kOpFields * t.ops.size());
  for (const TimedOp& op : t.ops) {
    v.insert(v.end(), {static_cast<double>(op.op), static_cast<double>(op.micro_batch), op.start_ms, op.end_ms,
                       static_cast<double>(op.chunk), static_cast<double>(op.bytes), static_cast<double>(op.peer),
                       static_cast<double>(op.live_bytes), op.group_ms, static_cast<double>(op.ops)});
  }
  return v;
}

StageTrace decode_trace(const std::vector<double>& v, int stage) {
  GPIPE_CHECK(v.size() >= kHeader && (v.size() - kHeader) % kOpFields == 0,
              "malformed timings from stage " + std::to_string(stage));
  StageTrace t;
  t.peak_activation_bytes = static_cast<int64_t>(v[0]);
  t.start_ms = v[1];
  t.optimizer_bytes = static_cast<int64_t>(v[2]);
  t.other_ops = static_cast<int64_t>(v[3]);
  t.captured_nodes = static_cast<int64_t>(v[4]);
  for (size_t i = kHeader; i < v.size(); i += kOpFields) {
    TimedOp op{static_cast<Op>(static_cast<int>(v[i])), static_cast<int>(v[i + 1]), v[i + 2], v[i + 3]};
    op.chunk = static_cast<int>(v[i + 4]);
    op.bytes = static_cast<int64_t>(v[i + 5]);
    op.peer = static_cast<int>(v[i + 6]);
    op.live_bytes = static_cast<int64_t>(v[i + 7]);
    op.group_ms = v[i + 8];
    op.ops = static_cast<int64_t>(v[i + 9]);
    t.ops.push_back(op);
  }
  return t;
}

}  // namespace pipeline
}  // namespace gpipe

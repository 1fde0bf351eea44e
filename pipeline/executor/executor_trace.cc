// A stage's step timings as numbers, to gather them into the first stage's process
// (encode_trace, decode_trace in executor.h): the trace's wire format.
#include "pipeline/executor/executor.h"

#include <cmath>
#include <string>
#include <utility>

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {
// peak activation bytes, start, optimizer bytes, other ops, captured nodes, device peak
// bytes, op times' count
constexpr size_t kHeader = 7;
constexpr size_t kOpFields = 10;  // op, micro-batch, start, end, chunk, bytes, peer, live bytes, group ms, ops
}  // namespace

// The header, then each op time (calls, ms, the name's length, its characters' codes),
// then the instructions, kOpFields each.
std::vector<double> encode_trace(const StageTrace& t) {
  std::vector<double> v{static_cast<double>(t.peak_activation_bytes), t.start_ms,
                        static_cast<double>(t.optimizer_bytes), static_cast<double>(t.other_ops),
                        static_cast<double>(t.captured_nodes), static_cast<double>(t.device_peak_bytes),
                        static_cast<double>(t.op_times.size())};
  v.reserve(kHeader + kOpFields * t.ops.size());
  for (const OpTimer::Total& o : t.op_times) {
    v.insert(v.end(), {static_cast<double>(o.calls), o.ms, static_cast<double>(o.op.size())});
    for (unsigned char ch : o.op) v.push_back(static_cast<double>(ch));
  }
  for (const TimedOp& op : t.ops) {
    v.insert(v.end(), {static_cast<double>(op.op), static_cast<double>(op.micro_batch), op.start_ms, op.end_ms,
                       static_cast<double>(op.chunk), static_cast<double>(op.bytes), static_cast<double>(op.peer),
                       static_cast<double>(op.live_bytes), op.group_ms, static_cast<double>(op.ops)});
  }
  return v;
}

StageTrace decode_trace(const std::vector<double>& v, int stage) {
  const std::string malformed = "malformed timings from stage " + std::to_string(stage);
  GPIPE_CHECK(v.size() >= kHeader, malformed);
  StageTrace t;
  t.peak_activation_bytes = static_cast<int64_t>(v[0]);
  t.start_ms = v[1];
  t.optimizer_bytes = static_cast<int64_t>(v[2]);
  t.other_ops = static_cast<int64_t>(v[3]);
  t.captured_nodes = static_cast<int64_t>(v[4]);
  t.device_peak_bytes = static_cast<int64_t>(v[5]);
  // A count or a length: a whole number from 0 to `most`, checked before it is cast.
  auto count = [&](double x, size_t most) {
    GPIPE_CHECK(std::isfinite(x) && x >= 0 && x == std::floor(x) && x <= static_cast<double>(most), malformed);
    return static_cast<size_t>(x);
  };
  size_t at = kHeader;
  for (size_t n = count(v[6], v.size()); n > 0; --n) {
    GPIPE_CHECK(v.size() - at >= 3, malformed);
    OpTimer::Total o;
    o.calls = static_cast<int64_t>(count(v[at], size_t{1} << 53));
    o.ms = v[at + 1];
    const size_t len = count(v[at + 2], v.size() - at - 3);
    at += 3;
    for (size_t c = 0; c < len; ++c) o.op.push_back(static_cast<char>(static_cast<unsigned char>(v[at + c])));
    at += len;
    t.op_times.push_back(std::move(o));
  }
  GPIPE_CHECK((v.size() - at) % kOpFields == 0, malformed);
  for (size_t i = at; i < v.size(); i += kOpFields) {
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

#include "pipeline/executor/op_clock.h"

#include <algorithm>

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

OpClock::OpClock(Device device, bool force) : enabled_(force || !device.is_cpu()), device_(device) {}

Event& OpClock::next_event() {
  if (used_ == pool_.size()) pool_.push_back(make_event(device_));
  return *pool_[used_++];
}

void OpClock::start_step(Stream& stream, double host_ms) {
  if (!enabled_) return;
  if (!ref_) ref_ = make_event(device_);
  used_ = kept_;
  spans_.clear();
  ref_->record(stream);
  host_ref_ms_ = host_ms;
}

void OpClock::before(Stream& stream, size_t index) {
  if (!enabled_) return;
  Event& e = next_event();
  e.record(stream);
  spans_.push_back({index, {&e, nullptr}});
}

void OpClock::after(Stream& stream, size_t index) {
  if (!enabled_) return;
  // The innermost open span: a tensor collective's inside its compute instruction's.
  auto open = std::find_if(spans_.rbegin(), spans_.rend(), [](const auto& s) { return s.second.second == nullptr; });
  GPIPE_CHECK(open != spans_.rend() && open->first == index, "OpClock::after without its before");
  Event& e = next_event();
  e.record(stream);
  open->second.second = &e;
}

std::vector<OpClock::Span> OpClock::resolve() {
  std::vector<Span> out;
  if (!enabled_ || !ref_) return out;
  out.reserve(spans_.size());
  for (const auto& [index, events] : spans_) {
    if (events.second == nullptr) continue;  // the instruction failed half-way
    events.second->synchronize();
    out.push_back({index, host_ref_ms_ + ref_->elapsed_ms(*events.first), host_ref_ms_ + ref_->elapsed_ms(*events.second)});
  }
  spans_.clear();
  return out;
}

}  // namespace pipeline
}  // namespace gpipe

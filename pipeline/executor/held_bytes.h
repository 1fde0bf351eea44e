// How activation memory is counted, by the executor's meter (what a micro-batch holds
// after each instruction) and by the planner's probe of a model (plan.h): the distinct
// buffers of tensors and contexts, each counted once at its largest view, since a
// layer's output is often the next layer's saved input.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "layers/layer.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace pipeline {

using BufferList = std::vector<std::pair<const void*, int64_t>>;  // (data, bytes)

void add_buffer(const Tensor& t, BufferList& out);  // nothing for an undefined tensor
// Every buffer a context holds, its sub-layers' (children) included.
void add_buffers(const layers::Context& ctx, BufferList& out);
// The bytes of the distinct buffers, each at its largest view.
int64_t distinct_bytes(BufferList buffers);

}  // namespace pipeline
}  // namespace gpipe

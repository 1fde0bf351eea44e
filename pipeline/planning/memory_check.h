// Whether a run fits in host memory, checked twice so that each refusal gives the
// advice that helps: the weights with their gradients and optimizer state from the
// config alone, before any is allocated (they do not depend on micro-batches), then,
// once the run is planned, those and the activations its schedule keeps (which do).
#pragma once

#include <cstdint>
#include <string>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/planning/plan.h"

namespace gpipe {
namespace pipeline {

// What a model's parameters hold in host memory before the first step.
struct WeightBytes {
  int64_t weights = 0, gradients = 0, optimizer = 0;  // optimizer: its state (optimizer_slots per weight)
  int64_t total() const { return weights + gradients + optimizer; }
};

// Refuses a YAML model whose parameters cannot fit in `available` bytes of host memory
// (host_available_bytes(); <= 0 where unknown: no check), before it is built: the job
// builds every stage's weights on the host once (a process of a multi-process run only
// its own stage's), each weight with its gradient, and on CPU devices the optimizer's
// state beside them. The weights are counted from the spec (layers::measure_parameters),
// so nothing is allocated here. A model built in C++ or with a layer type of one's own
// is checked once it is built, by check_run_fits. Throws UserError with the bytes and
// the advice for weights.
void check_weights_fit(const Config& config, int64_t available);

// Refuses a planned run whose host footprint (estimate_memory: the parameters with
// their gradients and optimizer state, and the peak of the activations, of the stages
// on CPU devices) cannot fit in `available` bytes (host_available_bytes(), measured
// after the model was built) plus what the built model holds on the host already. The
// message says how much is weights and how much activations, and advises on the part
// that does not fit: micro-batches for activations, the model for weights.
void check_run_fits(const Config& config, layers::Sequential& model, const Plan& plan, int64_t available);

// Refuses a planned run one of whose stages would hold more than pipeline.memory_limit
// (bytes per device; 0: no limit), by the plan's own count (Plan::memory, what `gpipe
// plan` prints): the limit the sweep and `auto` plan under holds for a run the config
// fixes too. The message names the stage, its parts and the fix for the part that is
// over: the weights' (more stages, a sharded optimizer) or the activations'. `train`
// and `gpipe plan` call it (plan after printing the plan). With `device_memory` > 0 and
// no pipeline.memory_limit: that limit instead, named as a device description's memory.
// `stages` and `sweep` name, in the fix, what sets the number of stages and the command
// that lists the plans that fit (`gpipe plan --devices N` sets the stages itself).
struct MemoryLimitWords {
  std::string stages = "pipeline.partitions";
  std::string sweep = "gpipe plan CONFIG --sweep";
};
void check_memory_limit(const Config& config, const Plan& plan, int64_t device_memory = 0,
                        const MemoryLimitWords& words = {});

}  // namespace pipeline
}  // namespace gpipe

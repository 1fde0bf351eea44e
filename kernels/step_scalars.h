// The numbers of a training step that change from step to step (the learning rate, the
// step's count, the gradient norm and what it decides), kept in one float64 tensor on
// the stage's device instead of passed to the kernels as host values. The ops that take
// it (kernels/backend_ops.inc, "Step scalars") read and write its slots when they run,
// not when they are called, so that a stage calls the same ops with the same arguments
// at every step (what a captured CUDA graph replays, issue 37 item 4) and the host reads
// the step's outcome once, at its end, instead of waiting for the device mid-step.
//
//   host, before the step's first kernel:  number, lr, decay, bias corrections, index,
//                                          the loss's factor, 1 / S, norm^2 = -1 (none),
//                                          scale = 1, skip = 0
//   F, R, B (device): dropout's keys       from the index (DropoutKey)
//                     the loss             times its factor (LossScale)
//   NORM (device): norm^2                  sum_squares_all_to
//   OPT  (device): scale, skip             step_grad_scale (the clip, an overflow, bad data)
//                  grads *= scale          scale_all_by
//                  the update              sgd_step_all / adam_step_all (nothing when skip)
//   host, at the step's end:               norm^2 and skip, in one copy
#pragma once

#include <array>
#include <cstdint>

namespace gpipe {

enum StepScalar : int64_t {
  kStepNumber = 0,       // the step's count from 1, as Adam's `step` (SGD: 1 is its first step)
  kStepLr,               // the learning rate
  kStepDecay,            // AdamW's 1 - lr * weight_decay, computed on the host
  kStepBiasCorrection1,  // Adam's 1 - beta1^step, computed on the host
  kStepBiasCorrection2,  // Adam's 1 - beta2^step
  kStepNormSquared,      // the global gradient norm's square; negative: none was taken
  kStepGradScale,        // what the gradients are multiplied by before the update
  kStepSkip,             // non-zero: no update this step (an overflow, or bad data on a GPU)
  kStepIndex,            // the executor's count of steps before this one (ForwardArgs::step):
                         // what a dropout mask's key mixes in (DropoutKey, kernels/backend.h)
  kStepLossScale,        // the loss's factor: loss scaling's S over the targets the mini-batch
                         // counts (LossScale, kernels/backend.h)
  kStepUnscale,          // 1 / S: what the gradients are divided by before the clip (1 without)
  kStepScalarCount
};

using StepScalarValues = std::array<double, kStepScalarCount>;

// The values the host writes before a step, before the optimizer adds its own: no norm,
// scales of 1, no skip.
inline StepScalarValues initial_step_scalars() {
  StepScalarValues v{};
  v[kStepNormSquared] = -1.0;
  v[kStepGradScale] = 1.0;
  v[kStepLossScale] = 1.0;
  v[kStepUnscale] = 1.0;
  return v;
}

}  // namespace gpipe

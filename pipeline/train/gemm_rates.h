// Each matrix product of a run, timed alone on its stage's device after the last step
// (issue 37 item 5: "the report gives each GEMM's rate against the probed peak"). The
// products are listed on shapes (count_launches' probe at the run's micro-batch size,
// MetaProducts): a layer's forward (F), input gradient (B) and weight gradient (W), each
// product with its op (matmul, matmul_weight, linear_bias, linear_weight_grad), its sizes
// and types. Equal products of a stage's layers, and of stages on one device, are timed
// once: a warm-up call, then calls between two of the device's events (device time on a
// GPU), for about 50 ms at most. The rate is 2 m n k over the time of a call, against the
// device's probed peak (device_peak.h) whole: a stage's peak is its share of its device,
// so the shares of the stages on the device are added back.
#pragma once

#include <vector>

#include "layers/sequential.h"
#include "pipeline/planning/plan.h"
#include "pipeline/report/report.h"

namespace gpipe {
namespace pipeline {

// The products of `stages` (the stages this process runs), timed; `stage_peaks`: every
// stage's peak in FLOP/s (RunArtifacts::stage_peaks; empty or 0: not known, no
// fraction); a CPU's products run with `blas_threads` threads a call (train.blas_threads).
// Ordered by the time they take per micro-batch, longest first. Throws what a device
// throws (out of memory); the caller reports without them then.
std::vector<GemmRate> measure_gemm_rates(const layers::Sequential& model, const Plan& plan,
                                         const std::vector<int>& stages, const std::vector<double>& stage_peaks,
                                         int blas_threads);

}  // namespace pipeline
}  // namespace gpipe

// Each matrix product of a run, timed alone on its stage's device after the last step
// (issue 37 item 5: "the report gives each GEMM's rate against the probed peak"). The
// products are listed on shapes (count_launches' probe at the run's micro-batch size,
// MetaProducts): a layer's forward (F), input gradient (B) and weight gradient (W), each
// product with its op (matmul, matmul_weight, linear_bias, linear_weight_grad,
// linear_residual, linear_input_grad_add), its sizes
// and types; and each op made of several products (attention, fused_attention, conv2d and
// their backwards) with its tensors' shapes and the FLOPs of its products (MetaProduct).
// Equal products of a stage's layers, and of stages on one device, are timed
// once: a warm-up call (a backward's forward first, for what it reads), then calls between
// two of the device's events (device time on a GPU), for about 50 ms at most. The rate is
// 2 m n k (an op's FLOPs) over the time of a call, against the
// probed peak (device_peak.h) of what runs the product: product_peak.
#pragma once

#include <vector>

#include "layers/sequential.h"
#include "pipeline/planning/plan.h"
#include "pipeline/report/report.h"

namespace gpipe {
namespace pipeline {

// The peak a product of `stage` is held against (0: not known). On a GPU, the device's
// whole: device_peaks gives each stage on a shared GPU its share, so the shares of the
// stages on it are added back; a product timed alone has the whole GPU. On the CPU, the
// stage's device's: the rate of its BLAS threads (probed with every device computing at
// once), which are the threads a product is timed with; stages that take turns on one
// device (Plan::turns) have shares of it (stage_peaks), added back likewise.
double product_peak(const Plan& plan, const std::vector<double>& stage_peaks, int stage);

// The products of `stages` (the stages this process runs), timed; `stage_peaks`: every
// stage's peak in FLOP/s (RunArtifacts::stage_peaks; empty or 0: not known, no
// fraction); a CPU's products run with the BLAS threads the run set (train.blas_threads,
// set_cpu_blas_threads at its start).
// `tensor_rank`: this process's member of a tensor group (its layers' shards); the
// model's tensor group is set back as it was. Timing stops starting products once
// `budget_seconds` are spent (the other ranks wait for this one in a collective with a
// deadline), the most FLOPs a micro-batch timed first; a warning says how many were
// left out. Ordered by the time they take per
// micro-batch, longest first. Throws what a device throws (out of memory); the caller
// reports without them then.
// What a timed call is not: a product the run adds into a gradient (W's matmul) is timed
// writing it (beta 0), and with pipeline.batch_weight_gradients a W is timed one
// micro-batch's, where the run makes one product of several.
std::vector<GemmRate> measure_gemm_rates(layers::Sequential& model, const Plan& plan, const std::vector<int>& stages,
                                         const std::vector<double>& stage_peaks, int tensor_rank,
                                         double budget_seconds);

}  // namespace pipeline
}  // namespace gpipe

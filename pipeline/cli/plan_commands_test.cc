// `gpipe plan --devices N --device-spec FILE` (plan_commands.h) from a machine without
// the spec's GPUs: a bf16 LLaMA model is planned as those GPUs keep it. Its attention
// keeps cuDNN's fused operands (q, k, v and a float32 log-sum-exp per row and head), not
// qkv and the (B, H, T, T) probabilities that this machine's CPU keeps for bf16 (the
// exact path, widened): the spec's plan holds less activation memory than the same plan
// for this machine, by exactly that difference, counted here from the shapes.
#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "pipeline/cli/plan_commands.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

// The activations column (GiB) of stage 0 in a printed plan: "0  ... | weights grads
// opt state activations total".
double stage0_activations_gib(const std::string& printed) {
  std::istringstream lines(printed);
  std::string line;
  bool table = false;
  while (std::getline(lines, line)) {
    if (line.find("memory per stage") != std::string::npos) table = true;
    if (table && line.rfind("0 ", 0) == 0) {
      std::istringstream cols(line.substr(line.find('|') + 1));
      double weights, grads, state, activations;
      cols >> weights >> grads >> state >> activations;
      return activations;
    }
  }
  FAIL("no stage 0 row in:\n" << printed);
  return 0;
}

}  // namespace

TEST_CASE("a device description's bf16 plan keeps the fused attention's operands, not the probabilities") {
  const int64_t T = 1024, C = 1024, H = 16, KV = 8, blocks = 8, batch = 16;
  const Config config = parse_config(R"(model:
  input: [1024]
  dtype: bf16
  layers:
    - {type: embedding, vocab: 256, dim: 1024, positions: 0}
    - repeat: 8
      layers:
        - {type: llama_block, heads: 16, kv_heads: 8, hidden: 2816}
    - {type: rmsnorm}
    - {type: linear, out: 256, bias: false}
  loss: {type: softmax_cross_entropy}
data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 1024, validation_fraction: 0}
pipeline: {partitions: 1, micro_batches: 1, recompute: never}
train: {steps: 1, batch_size: 16}
)",
                                     "llama.yaml");
  RunModel run = build_run_model_on_shapes(config);  // 95M parameters: counted, never allocated
  PlanCommandOptions here;
  here.devices = 1;
  PlanCommandOptions spec = here;
  spec.device_spec = "configs/devices/h100_nvlink_ib.yaml";
  std::ostringstream here_out, spec_out;
  plan_other_runs(run.config, *run.model, here, here_out);
  plan_other_runs(run.config, *run.model, spec, spec_out);
  const double D = static_cast<double>(C / H), KC = KV * D;
  // Per block and sample, bf16 (2 bytes): qkv (T, 3C) and probs (H, T, T) against q (T, C),
  // k and v (T, KV D) and the float32 log-sum-exp (H, T); the output (T, C) is kept by
  // the output projection either way.
  const double per = 2.0 * (T * 3 * C + H * T * T) - (2.0 * (T * C + 2 * T * KC) + 4.0 * H * T);
  const double want_gib = blocks * batch * per / (1 << 30);
  CHECK(want_gib > 4);
  CHECK(stage0_activations_gib(here_out.str()) - stage0_activations_gib(spec_out.str()) ==
        doctest::Approx(want_gib).epsilon(0.01));
}

// A plan over the memory limit is printed whole, and then refused (a non-zero exit, as
// `train` refuses it): on this machine's devices against pipeline.memory_limit, on a
// device description's against its memory when the config sets no limit.
TEST_CASE("a plan over the memory limit is shown, then refused with the stage and the fix") {
  const char* text = R"(model:
  input: [64]
  dtype: float32
  layers:
    - repeat: 4
      layers:
        - {type: linear, out: 64}
  loss: softmax_cross_entropy
data: {classes: 64}
pipeline: {partitions: 1, micro_batches: 1, recompute: never}
train: {steps: 1, batch_size: 8}
)";
  {
    const Config config = parse_config(text, "t.yaml", {"pipeline.memory_limit=40KiB"});
    RunModel run = build_run_model_on_shapes(config);
    PlanCommandOptions o;
    o.devices = 1;
    std::ostringstream out;
    CHECK_THROWS_WITH_AS(plan_other_runs(run.config, *run.model, o, out),
                         doctest::Contains("over pipeline.memory_limit of 40.0 KiB"), UserError);
    CHECK(out.str().find("OVER the limit of 40.0 KiB") != std::string::npos);  // the plan was printed first
    const Config roomy = parse_config(text, "t.yaml", {"pipeline.memory_limit=1GiB"});
    RunModel fits = build_run_model_on_shapes(roomy);
    std::ostringstream fine;
    CHECK(plan_other_runs(fits.config, *fits.model, o, fine) == 0);
  }
  {
    // 2^38 parameters' weights, gradients and Adam state: over an 80 GB H100.
    const Config config = parse_config(R"(model:
  input: [524288]
  dtype: float32
  layers:
    - {type: linear, out: 524288, bias: false}
  loss: softmax_cross_entropy
data: {classes: 524288}
pipeline: {partitions: 1, micro_batches: 1, recompute: never}
train: {steps: 1, batch_size: 1}
)",
                                       "t.yaml");
    RunModel run = build_run_model_on_shapes(config);
    PlanCommandOptions o;
    o.devices = 1;
    o.device_spec = "configs/devices/h100_nvlink_ib.yaml";
    std::ostringstream out;
    CHECK_THROWS_WITH_AS(plan_other_runs(run.config, *run.model, o, out),
                         doctest::Contains("would hold 2048.00 GiB on cuda:0 (weights 1024.00 GiB, gradients 1024.00 GiB, optimizer state 0 bytes, activations 4.0 MiB), over the device description's memory of 74.51 GiB"), UserError);
    // Its fix names what sets the stages here, and the sweep over the same devices.
    CHECK_THROWS_WITH_AS(plan_other_runs(run.config, *run.model, o, out),
                         doctest::Contains("use more --devices (fewer layers a stage)"), UserError);
    CHECK_THROWS_WITH_AS(
        plan_other_runs(run.config, *run.model, o, out),
        doctest::Contains("`gpipe plan CONFIG --devices N --device-spec configs/devices/h100_nvlink_ib.yaml --sweep`"),
        UserError);
  }
}

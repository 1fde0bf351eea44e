// The sweep's recommendation, measured (issue 36). The planner ranks the candidates on
// its cost model; before one is recommended, the planner's top few and the config's own
// plan are each timed for a few real training steps, and the measured fastest is
// recommended: a plan gpipe calls best never loses to the config it replaces, in the
// session that measured them. Each timing runs on a model and data of its own, built
// from the config: the run's weights, data order and seed are untouched.
#pragma once

#include <iosfwd>
#include <string>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/planning/sweep.h"

namespace gpipe {
namespace pipeline {

struct MeasureOptions {
  int top = 3;     // the planner's best this many fitting candidates, and the config's own plan
  int warmup = 1;  // untimed steps first (allocations, oneDNN's first calls)
  int steps = 3;   // timed steps; their median is the figure
  // Nothing is timed when the predicted steps would take longer than this, in all.
  double max_seconds = 300;
};

// The config as candidate `k` runs it: its stages, micro-batches, schedule, virtual
// stages, recompute mode, BLAS threads, optimizer sharding, balance, tensor group and
// sequence parallelism.
Config candidate_config(const Config& base, const Candidate& k);

// The median wall-clock milliseconds of `steps` training steps of `config` (optimizer
// step included) after `warmup` untimed ones, on a model of its own (built from the
// config, with the run's initial weights) and the mini-batch of the config's step 0.
// One process: a config with pipeline.replicas > 1 is a UserError. With
// pipeline.tensor_parallel = T > 1, K x T executors on threads (each (stage, member) the
// member's model with its stage's weights), a step's time its slowest thread's.
double measure_step_ms(const Config& config, int warmup, int steps);

// Why this sweep's candidates cannot be timed here ("" when they can): they plan for
// devices this machine does not have (a device spec, more CPU devices than cores, GPUs
// it lacks), or for replicas (several processes).
std::string why_not_measured(const Config& config, const SweepResult& r, bool device_spec);

// Times r's top `o.top` fitting candidates of distinct shapes (stages, virtual stages,
// micro-batches, schedule, BLAS threads: the best recompute mode of each) and the config's
// own plan (added to r as a candidate of its own when the sweep did not try its exact
// plan), each in turn, saying so on `out`; sets their Candidate::measured_ms and
// recommends the measured fastest, or the config's own plan where nothing beats it by
// 3% (the drift between two timings on a shared machine). Times nothing, and says why, when the predicted
// steps would take longer than o.max_seconds.
// `model` is the config's (on shapes is enough): the own plan's prediction is read from it.
void measure_candidates(const Config& config, const layers::Sequential& model, SweepResult& r,
                        const MeasureOptions& o, std::ostream& out);

}  // namespace pipeline
}  // namespace gpipe

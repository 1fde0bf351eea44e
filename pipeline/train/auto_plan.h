// `auto` in a config (pipeline.partitions, pipeline.micro_batches, pipeline.schedule,
// train.blas_threads): the plan `gpipe plan CONFIG --sweep` ranks fastest among those
// that fit and keep every key the config names, predicted from the config's profile,
// which is measured first (as `gpipe profile CONFIG --sweep` does) when it has nothing
// of this model.
#pragma once

#include <iosfwd>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/train/launch.h"

namespace gpipe {
namespace pipeline {

// The config with its `auto` keys set to the sweep's choice (and its balance, so the run
// is the plan that was predicted); says on `out` what it chose and why. A config with no
// `auto` comes back as it is. Throws UserError where auto cannot choose: under mpirun or
// with replicas (each process would choose alone: give the values), with
// pipeline.balance or pipeline.schedule_file beside the key they fix, or when no plan
// that keeps the named keys fits.
Config resolve_auto(const Config& config, const layers::Sequential& model, const Launch& launch, std::ostream& out);

// The plain pipeline a config with `auto` keys stands for, which auto's choice must not
// lose to (the plan timed as the config's own): K = the devices (pipeline.devices, else
// this machine's cores; at most one a layer), M = 8 (at most the batch), GPipe, one BLAS
// thread a stage. A config without `auto` comes back as it is.
Config plain_for_auto(const Config& config, const layers::Sequential& model);

// Throws the UserError of `auto` in a run of several processes (each would choose on its
// own) or with replicas; nothing for a config without `auto`. mpirun's launch checks it
// before it counts the processes against pipeline.partitions.
void check_auto_launch(const Config& config, int processes);

}  // namespace pipeline
}  // namespace gpipe

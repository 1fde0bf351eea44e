// A training run from a Config without the command line, pipeline::train: a public entry
// point of pipeline/ (target //pipeline:trainer). It lives in pipeline/train/trainer.h.
#pragma once

#include "pipeline/train/trainer.h"

#include "pipeline/config/run_model.h"

#include "layers/registry.h"
#include "layers/tensor_parallel.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

RunModel build_run_model(const Config& config, const MakeModel& make_model) {
  RunModel run;
  run.model = make_model ? make_model() : layers::build_model(config.model);
  if (run.model == nullptr || run.model->size() == 0) {
    throw UserError("the model factory returned " + std::string(run.model ? "a model without layers" : "no model") +
                    "; return a layers::Sequential with its layers and loss");
  }
  run.config = config;
  if (make_model || config.model.cpp) {
    layers::ModelSpec& m = run.config.model;
    m.layers.clear();
    m.input = run.model->input_shape();
    m.dtype = run.model->dtype();
    m.input_dtype = run.model->input_dtype();
  }
  return run;
}

RunModel build_run_model_on_shapes(const Config& config, const MakeModel& make_model) {
  try {
    const ShapesOnly shapes;
    RunModel run = build_run_model(config, make_model);
    run.on_shapes = true;
    const layers::TensorShard& member = config.model.member;
    if (member.split() && !make_model) {
      run.shape_group = std::make_unique<layers::ShapeCollectives>(member.rank, member.size);
      run.model->set_collectives(run.shape_group.get());
    }
    return run;
  } catch (const UserError&) {
    throw;  // the config's mistake, whatever the tensors
  } catch (const Error& e) {
    spdlog::warn("the model cannot be built on shapes ({}); it is built with its weights for planning too", e.what());
  }
  return build_run_model(config, make_model);
}

layers::TensorShard tensor_member(const Config& config, int rank) {
  return {rank, config.pipeline.tensor_parallel, config.pipeline.sequence_parallel};
}

RunModel build_member_on_shapes(const Config& config, int rank) {
  Config member = config;
  member.model.member = tensor_member(config, rank);
  return build_run_model_on_shapes(member);
}

}  // namespace pipeline
}  // namespace gpipe

// The model a run trains, from one of three places: YAML layers in the config, a model
// built in C++ and registered by name (model: {cpp: NAME}), or a factory handed to the
// trainer in C++. Every process of a multi-process run builds it the same way.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "layers/sequential.h"
#include "layers/tensor_parallel.h"
#include "pipeline/config/config.h"

namespace gpipe {
namespace pipeline {

// Builds the whole model (layers, loss, ties); called once in every process.
using MakeModel = std::function<std::unique_ptr<layers::Sequential>()>;

struct RunModel {
  std::unique_ptr<layers::Sequential> model;
  // The config as the run sees it. For a model built in C++, its model section is
  // rewritten to describe that model (input shape and dtypes, which the data follows)
  // and has no layers, so no per-layer `cost:` overrides.
  Config config;
  bool on_shapes = false;  // built without weights (build_run_model_on_shapes)
  // A member of a tensor group built on shapes (config.model.member split): the group's
  // place its split layers sum over while planning (layers::ShapeCollectives).
  std::unique_ptr<layers::TensorCollectives> shape_group;
};

// From `make_model` when it is set (config.model is then ignored), else from
// config.model (layers::build_model: YAML layers or model.cpp).
RunModel build_run_model(const Config& config, const MakeModel& make_model = {});
// The same model built on shapes (runtime/tensor.h: ShapesOnly): its layers, shapes,
// costs and parameter counts, and parameters without data, neither allocated nor
// initialised. What planning reads (gpipe plan, the sweep): a 7B-parameter config plans
// in megabytes. It cannot train; reading a parameter's data throws. A layer of one's own
// that writes its weights in its constructor cannot be built so: the model is then built
// with its weights, with a warning that says why (on_shapes false).
RunModel build_run_model_on_shapes(const Config& config, const MakeModel& make_model = {});
// Member `rank`'s place in the config's tensor group: of pipeline.tensor_parallel = T
// members, by positions where pipeline.sequence_parallel says (layers::ModelSpec::member).
layers::TensorShard tensor_member(const Config& config, int rank);
// Member `rank` of the config's model split over pipeline.tensor_parallel = T members
// (layers::ModelSpec::member), on shapes: its config says which member it is.
RunModel build_member_on_shapes(const Config& config, int rank);

}  // namespace pipeline
}  // namespace gpipe

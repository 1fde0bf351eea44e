// The gradient checker every layer of ours passes, public so that a layer of one's own
// is checked the same way: its backward (input gradient and every parameter gradient)
// against float64 central finite differences of its forward, on the CPU. It returns a
// report that names the parameter and its worst element; use it from any test framework:
//
//   layers::GradCheckReport r = layers::check_layer_gradients(my_layer, /*batch=*/4);
//   CHECK_MESSAGE(r.ok, r.str());      // doctest; gtest: EXPECT_TRUE(r.ok) << r.str();
//   r.require();                       // or: throws GradCheckFailure with the report
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "layers/layer.h"
#include "layers/sequential.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace layers {

struct GradCheckOptions {
  double eps = 1e-6;   // the central-difference step
  double rtol = 1e-6;  // an element passes when |analytic - numeric| <= atol + rtol * |numeric|
  double atol = 1e-6;
  uint64_t seed = 11;  // for the random input, targets and output weights
  // Drawn inputs (float layers) are uniform in [input_low, input_high).
  double input_low = -1.0, input_high = 1.0;
  // Drawn inputs of int32 layers (token ids) are uniform in [0, vocab); required for
  // them when no input tensor is given.
  int64_t vocab = 0;
  // Every evaluation uses these arguments, so a layer with randomness keyed on
  // (step, sample_offset), such as dropout, is the same deterministic function each
  // time. The probing forwards are marked `recompute` (a layer that gathers statistics,
  // such as batch norm, must not count them again); otherwise they are identical.
  ForwardArgs args;
  // Parameter gradients start at this value, so a backward that overwrites instead of
  // adding into Parameter::grad fails (layer checks; model checks start from zero).
  double initial_grad = 0.5;
};

// One checked gradient: the input's or a parameter's.
struct GradCheckEntry {
  std::string name;  // "input", "weight", "3.bias"
  Shape shape;
  bool ok = true;
  std::string problem;          // set when the analytic gradient is missing or misshapen
  std::vector<int64_t> worst;   // coordinates of the element furthest outside (or nearest to) its tolerance
  double analytic = 0, numeric = 0;
  double abs_err = 0, rel_err = 0;  // at the worst element
  double max_abs_err = 0;           // over all elements
};

struct GradCheckReport {
  std::string subject;  // the layer's describe(), or "model (N layers)"
  GradCheckOptions options;
  bool ok = true;
  std::vector<GradCheckEntry> entries;
  explicit operator bool() const { return ok; }
  // Every entry, one line each; a failed one names its worst element.
  std::string str() const;
  // Throws GradCheckFailure(str()) unless ok.
  void require() const;
};

// What require() throws: an Error whose message is the report.
class GradCheckFailure : public Error {
 public:
  explicit GradCheckFailure(const std::string& what) : Error(what) {}
};

// f(x) = <layer(x), r> for a fixed random r (batch, *output_shape()); checks the input
// gradient (of float inputs: int32 token ids have none) and every parameter gradient
// of layer.backward against central differences of f. The layer must have float64
// parameters on the CPU (build it with dtype float64: float32 rounding swamps finite
// differences). The input is drawn as (batch, *input_shape()). A layer that breaks the
// layer contract (a misshapen output or input gradient) throws Layer::forward's or
// Layer::backward's UserError.
GradCheckReport check_layer_gradients(Layer& layer, int64_t batch, const GradCheckOptions& options = {});
// The same with a given input (float64, or int32 token ids).
GradCheckReport check_layer_gradients(Layer& layer, const Tensor& input, const GradCheckOptions& options = {});

// A whole model with its loss: f = the loss of (input, targets) at scale 1. Checks the
// input gradient and every parameter (a tied pair counts as one weight: both copies
// are perturbed together and compared after Sequential::sum_tied_gradients).
GradCheckReport check_model_gradients(Sequential& model, const Tensor& input, const Tensor& targets,
                                      const GradCheckOptions& options = {});
// The same with a drawn input and class-index targets (batch, *output_shape()[:-1]) in
// [0, output_shape().back()), as softmax_cross_entropy takes.
GradCheckReport check_model_gradients(Sequential& model, int64_t batch, const GradCheckOptions& options = {});

// d f / d t[i] for every element of the float64 CPU tensor t, by central differences
// (each element is perturbed in place by +-eps and restored): the reference every
// backward is checked against.
std::vector<double> numeric_gradient(Tensor& t, const std::function<double()>& f, double eps = 1e-6);

}  // namespace layers
}  // namespace gpipe

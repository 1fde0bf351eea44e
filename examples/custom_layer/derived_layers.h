// Two layers of one's own written as forward only (layers/derived.h): their backward,
// B/W split and cost are derived from the ops each calls. docs/WRITING_LAYERS.md ("The
// short way") shows them; bench/derived_bench.cc times them against hand-written twins.
#pragma once

#include <cmath>

#include "layers/derived.h"
#include "runtime/random.h"

namespace example {

// LLaMA's feed-forward: down(silu(gate(x)) * up(x)), over the last axis.
class MySwiGLU : public gpipe::layers::DerivedLayer {
 public:
  MySwiGLU(const gpipe::Shape& shape, int64_t hidden, gpipe::DType dtype, uint64_t seed)
      : DerivedLayer("my_swiglu", shape, shape, dtype, seed),
        gate_(add_parameter("gate.weight", {hidden, shape.back()}, 1 / std::sqrt(shape.back()), gpipe::mix_seed(seed, 0))),
        up_(add_parameter("up.weight", {hidden, shape.back()}, 1 / std::sqrt(shape.back()), gpipe::mix_seed(seed, 1))),
        down_(add_parameter("down.weight", {shape.back(), hidden}, 1 / std::sqrt(hidden), gpipe::mix_seed(seed, 2))) {}
  Var define(Graph& g, Var x) const override {
    return g.linear(g.mul(g.silu(g.linear(x, gate_)), g.linear(x, up_)), down_);
  }

 private:
  Parameter &gate_, &up_, &down_;
};

// RMSNorm, x / sqrt(mean(x^2) + eps) * g, over the last axis.
class DerivedRmsNorm : public gpipe::layers::DerivedLayer {
 public:
  DerivedRmsNorm(const gpipe::Shape& shape, double eps, gpipe::DType dtype, uint64_t seed)
      : DerivedLayer("derived_rmsnorm", shape, shape, dtype, seed), eps_(eps),
        g_(add_constant_parameter("weight", {shape.back()}, 1.0)) {}
  Var define(Graph& g, Var x) const override {
    Var inv = g.rsqrt(g.add(g.mean(g.square(x)), eps_));  // (..., 1)
    return g.mul(g.mul(x, inv), g.param(g_));             // broadcast over the last axis
  }

 private:
  double eps_;
  Parameter& g_;
};

// Makes `type: my_swiglu` (option hidden) and `type: derived_rmsnorm` (option eps)
// available to YAML configs. Call once, at start.
void register_derived_layers();

}  // namespace example

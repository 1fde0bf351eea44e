// A bfloat16 model in the pipeline (model.dtype: bf16): the pipelined model equals the
// one-stage model with the same micro-batches bit for bit, for every schedule, K and M
// and every recompute mode, over optimizer steps; its messages and kept activations are
// bfloat16 (half of float32's bytes) while its gradients, master weights and optimizer
// state are float32; and it stays within bfloat16's rounding of the float32 model.
// A float16 model with dynamic loss scaling: an overflow skips the step, K stages equal
// one, and clipping uses the unscaled norm (a float64 reference of clip_grad_norm_).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

using gpipe::testing::cpu_devices;

// A byte-level GPT: dropout inside and between the blocks, the head tied to the
// embedding; 9 layers so that 4 stages get two each.
layers::ModelSpec gpt_spec(DType dtype) {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = dtype;
  spec.seed = 17;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""}};
  for (int i = 0; i < 3; ++i) {
    spec.layers.push_back({"transformer_block", {{"heads", "2"}, {"dropout", "0.2"}}, {}, ""});
    spec.layers.push_back({"dropout", {{"p", "0.1"}}, {}, ""});
  }
  spec.layers.push_back({"layernorm", {}, {}, ""});
  spec.layers.push_back({"linear", {{"out", "16"}, {"bias", "false"}, {"tied", "true"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

struct Run {
  std::unique_ptr<layers::Sequential> model;
  std::vector<double> losses;
  std::vector<StepResult> results;
};

// `steps` steps of the model on K stages, AdamW's update after all but the last, whose
// gradients are kept.
Run train(const layers::ModelSpec& spec, const Schedule& schedule, int K, int v, const Tensor& x, const Tensor& y,
          int steps = 3) {
  Run r;
  r.model = layers::build_model(spec);
  const std::vector<int> balance = partition::balance_by_cost(std::vector<double>(r.model->size(), 1.0), K * v);
  InProcessTransport transport(K);
  ExecutorOptions o;
  o.optimizer.type = "adamw";
  o.optimizer.lr = 0.01;
  o.optimizer.weight_decay = 0.1;
  Executor ex(*r.model, make_cells(balance, schedule, cpu_devices(K)), schedule, transport, o);
  for (int step = 0; step < steps; ++step) {
    r.results.push_back(ex.step(x, y, /*apply_optimizer=*/step + 1 < steps));
    r.losses.push_back(r.results.back().loss);
  }
  CHECK(transport.pending() == 0);
  return r;
}

int64_t sent_bytes(const StepResult& r) {
  int64_t bytes = 0;
  for (const StageTrace& t : r.stages) {
    for (const TimedOp& op : t.ops) {
      if (op.op == Op::kSendActivation || op.op == Op::kSendGradient) bytes += op.bytes;
    }
  }
  return bytes;
}

}  // namespace

TEST_CASE("bfloat16: every schedule on K stages equals one stage bit for bit, over optimizer steps") {
  // The same micro-batches go through the same ops in the same order on one stage or
  // many: only where they run differs, so every rounding is the same one.
  const layers::ModelSpec spec = gpt_spec(DType::kBF16);
  const int64_t N = 7;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 51).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 52).reshape({N, 6});
  int compared = 0;
  struct Case {
    std::string name;
    int v;
  };
  for (const Case& sc : {Case{"gpipe", 1}, Case{"1f1b", 1}, Case{"zero_bubble", 1}, Case{"interleaved_1f1b", 2}}) {
    for (int M : {1, 3, 4}) {
      for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever}) {
        CAPTURE(sc.name);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        Schedule one;
        try {
          one = make_schedule(ScheduleRequest{sc.name, 1, sc.v, M, mode});
        } catch (const UserError&) {
          continue;  // interleaving needs M a multiple of K
        }
        const Run base = train(spec, one, 1, sc.v, x, y);
        for (int K = 2; K <= 4; ++K) {
          CAPTURE(K);
          Schedule schedule;
          try {
            schedule = make_schedule(ScheduleRequest{sc.name, K, sc.v, M, mode});
          } catch (const UserError&) {
            continue;
          }
          const Run r = train(spec, schedule, K, sc.v, x, y);
          CHECK(r.losses == base.losses);
          auto ps = r.model->named_parameters(), bs = base.model->named_parameters();
          REQUIRE(ps.size() == bs.size());
          for (size_t i = 0; i < ps.size(); ++i) {
            INFO(ps[i].first);
            CHECK(ps[i].second->value.dtype() == DType::kF32);    // master
            CHECK(ps[i].second->grad.dtype() == DType::kF32);     // accumulated in float32
            CHECK(ps[i].second->working.dtype() == DType::kBF16);  // what the layers read
            CHECK(same_bits(ps[i].second->value, bs[i].second->value));
            CHECK(same_bits(ps[i].second->working, bs[i].second->working));
            CHECK(same_bits(ps[i].second->grad, bs[i].second->grad));
            // The working copy is the stepped master, rounded.
            Tensor rounded = Tensor::empty(ps[i].second->value.shape(), DType::kBF16, Device::cpu());
            backend_for(Device::cpu()).cast(ps[i].second->value, rounded);
            CHECK(same_bits(ps[i].second->working, rounded));
          }
          ++compared;
        }
      }
    }
  }
  CHECK(compared >= 30);
}

TEST_CASE("bfloat16 holds half of float32's activations and sends half its bytes") {
  const int64_t N = 8;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 53).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 54).reshape({N, 6});
  for (auto mode : {RecomputeMode::kNever, RecomputeMode::kAlways}) {
    CAPTURE(recompute_mode_name(mode));
    const Schedule s = make_schedule(ScheduleRequest{"1f1b", 3, 1, 4, mode});
    const Run f32 = train(gpt_spec(DType::kF32), s, 3, 1, x, y);
    const Run b16 = train(gpt_spec(DType::kBF16), s, 3, 1, x, y);
    const StepResult &a = f32.results.back(), &b = b16.results.back();
    CHECK(sent_bytes(a) > 0);
    CHECK(sent_bytes(b) * 2 == sent_bytes(a));  // every message: activations and their gradients
    for (size_t k = 0; k < a.stages.size(); ++k) {
      CAPTURE(k);
      const double ratio =
          static_cast<double>(b.stages[k].peak_activation_bytes) / static_cast<double>(a.stages[k].peak_activation_bytes);
      // Half, but for what stays float32: layer norms' statistics (2 numbers per row
      // beside C = 8 channels) and the loss's probabilities on the last stage.
      CHECK(ratio >= 0.5);
      CHECK(ratio < (k + 1 < a.stages.size() ? 0.56 : 0.8));
      CHECK(b.stages[k].optimizer_bytes == a.stages[k].optimizer_bytes);  // float32 state either way
    }
  }
}

TEST_CASE("a bfloat16 step stays within bfloat16's rounding of the float32 step") {
  // Both start from the same float32 weights (bfloat16's are them rounded). Each stored
  // tensor is rounded once (relative error at most u = 2^-8); layers/
  // mixed_precision_layers_test.cc bounds one layer's error by a few u. Through this
  // model's chain (an embedding, three blocks, a layer norm and the tied head, forward
  // and back) they add up: measured, the loss moves by 0.05u and the gradients by 12u
  // with dropout (24u without), their direction by less than 0.1%. Bounds: 2u on the
  // loss, 32u (0.125) on the gradients' normwise relative error, 0.99 on their cosine.
  const double u = std::ldexp(1.0, -8);
  const int64_t N = 8;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 55).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 56).reshape({N, 6});
  const Schedule s = make_schedule(ScheduleRequest{"gpipe", 2, 1, 2, RecomputeMode::kExceptLast});
  const Run f32 = train(gpt_spec(DType::kF32), s, 2, 1, x, y, 1);
  const Run b16 = train(gpt_spec(DType::kBF16), s, 2, 1, x, y, 1);
  CHECK(std::abs(b16.losses[0] - f32.losses[0]) <= 2 * u * std::abs(f32.losses[0]));
  auto pf = f32.model->named_parameters(), pb = b16.model->named_parameters();
  double dot = 0, nf = 0, nb = 0, diff = 0;
  for (size_t i = 0; i < pf.size(); ++i) {
    const auto gf = gpipe::testing::to_doubles(pf[i].second->grad), gb = gpipe::testing::to_doubles(pb[i].second->grad);
    for (size_t j = 0; j < gf.size(); ++j) {
      dot += gf[j] * gb[j];
      nf += gf[j] * gf[j];
      nb += gb[j] * gb[j];
      diff += (gf[j] - gb[j]) * (gf[j] - gb[j]);
    }
  }
  CHECK(std::sqrt(diff / nf) < 32 * u);
  CHECK(dot / std::sqrt(nf * nb) > 0.99);
  MESSAGE("loss f32 ", f32.losses[0], " bf16 ", b16.losses[0], "; gradient relative error ", std::sqrt(diff / nf),
          " = ", std::sqrt(diff / nf) / u, " u");
}

namespace {

// A float16 MLP on two stages with dynamic loss scaling from `scale`, window `window`.
struct Fp16Run {
  std::unique_ptr<layers::Sequential> model;
  std::unique_ptr<InProcessTransport> transport;
  std::unique_ptr<Executor> ex;
};
layers::ModelSpec fp16_spec() {
  layers::ModelSpec spec;
  spec.input = {8};
  spec.dtype = DType::kF16;
  spec.seed = 5;
  spec.layers = {{"linear", {{"out", "16"}}, {}, ""}, {"gelu", {}, {}, ""}, {"linear", {{"out", "16"}}, {}, ""},
                 {"layernorm", {}, {}, ""},          {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// On K = 2 stages the host sums the stages' norms; on one, the norm, the skip and the
// clip stay on the device (kernels/step_scalars.h).
Fp16Run fp16_run(double scale, int window, int K = 2) {
  Fp16Run r;
  r.model = layers::build_model(fp16_spec());
  r.transport = std::make_unique<InProcessTransport>(K);
  ExecutorOptions o;
  o.optimizer.type = "adam";
  o.optimizer.lr = 0.01;
  o.loss_scale = scale;
  o.loss_scale_window = window;
  const Schedule s = make_schedule(ScheduleRequest{"1f1b", K, 1, 2, RecomputeMode::kExceptLast});
  r.ex = std::make_unique<Executor>(*r.model, make_cells(K == 1 ? std::vector<int>{5} : std::vector<int>{3, 2}, s,
                                                         cpu_devices(K)),
                                    s, *r.transport, o);
  return r;
}

std::vector<std::vector<double>> masters(layers::Sequential& model) {
  std::vector<std::vector<double>> out;
  for (auto& [name, p] : model.named_parameters()) out.push_back(gpipe::testing::to_doubles(p->value));
  return out;
}

}  // namespace

TEST_CASE("float16 loss scaling: an overflow skips the step everywhere and halves the scale; clean steps double it") {
  const int64_t N = 16;
  const Tensor x = gpipe::testing::random_tensor({N, 8}, DType::kF32, 61, -2, 2);
  const Tensor y = gpipe::testing::random_labels(N, 4, 62);
  // 2^24 / 16 rows puts the loss's gradient far above float16's largest value (65504):
  // the first steps overflow, until the scale has come down far enough.
  for (int K : {1, 2}) {
  CAPTURE(K);
  Fp16Run r = fp16_run(16777216.0, 2, K);
  auto before = masters(*r.model);
  std::vector<double> scales;
  std::vector<bool> skipped;
  for (int step = 0; step < 9; ++step) {
    const StepResult s = r.ex->step(x, y);
    scales.push_back(s.loss_scale);
    skipped.push_back(s.skipped);
    CHECK(std::isfinite(s.loss));  // the loss itself is float32's, unscaled
    const auto now = masters(*r.model);
    if (s.skipped) {
      CHECK(now == before);  // no stage stepped
      CHECK(r.ex->loss_scale() == s.loss_scale / 2);
    } else {
      CHECK(now != before);
      CHECK(std::isfinite(s.grad_norm));
    }
    before = now;
  }
  CHECK(skipped[0]);
  CHECK(scales[0] == 16777216.0);
  int first_clean = 0;
  while (first_clean < 9 && skipped[first_clean]) ++first_clean;
  REQUIRE(first_clean < 7);  // it recovers
  CHECK(first_clean >= 2);
  CHECK(scales[first_clean] == 16777216.0 / (1 << first_clean));
  // Window 2: after two clean steps the scale doubles (unless an overflow came first).
  if (!skipped[first_clean + 1]) CHECK(scales[first_clean + 2] == 2 * scales[first_clean]);
  for (const auto& p : before) {
    for (double v : p) REQUIRE(std::isfinite(v));
  }
  // Adam counted only the steps it took (its bias corrections follow that count).
  int taken = 0;
  for (bool s : skipped) taken += s ? 0 : 1;
  for (int k = 0; k < K; ++k) {
    const StageState state = r.ex->save_state(k);
    for (const auto& [name, t] : state.optimizer) {
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".step") == 0) {
        CAPTURE(name);
        CHECK(gpipe::testing::to_doubles(t) == std::vector<double>{static_cast<double>(taken)});
      }
    }
  }
  }
}

TEST_CASE("float16 with loss scaling equals one stage bit for bit, and the loss is the unscaled one") {
  const int64_t N = 16;
  const Tensor x = gpipe::testing::random_tensor({N, 8}, DType::kF32, 63, -2, 2);
  const Tensor y = gpipe::testing::random_labels(N, 4, 64);
  Fp16Run two = fp16_run(1024.0, 3);
  // The same model on one stage.
  auto model = layers::build_model(fp16_spec());
  InProcessTransport t1(1);
  ExecutorOptions o;
  o.optimizer.type = "adam";
  o.optimizer.lr = 0.01;
  o.loss_scale = 1024.0;
  o.loss_scale_window = 3;
  const Schedule s1 = make_schedule(ScheduleRequest{"1f1b", 1, 1, 2, RecomputeMode::kExceptLast});
  Executor one(*model, make_cells({5}, s1, cpu_devices(1)), s1, t1, o);
  for (int step = 0; step < 5; ++step) {
    const StepResult a = two.ex->step(x, y), b = one.step(x, y);
    CHECK(a.loss == b.loss);
    CHECK(a.loss_scale == b.loss_scale);
    CHECK(a.skipped == b.skipped);
  }
  CHECK(masters(*two.model) == masters(*model));
  CHECK(two.ex->loss_scale() == 2048.0);  // doubled after 3 clean steps
}

TEST_CASE("float16 loss scaling with clipping: the step clips by the unscaled norm, as clip_grad_norm_ does") {
  // One SGD step of the float16 MLP on two stages with loss scale 2^16 and clipping that
  // is active (max_norm a quarter of the gradient's norm), against an independent
  // float64 computation: the same weights (the float32 masters) in a float64 model, its
  // unscaled gradient of the whole batch (Sequential::forward_backward, no loss scaling),
  // clipped by the formula of torch.nn.utils.clip_grad_norm_
  //   total_norm = sqrt(sum of g^2 over every parameter's gradient)
  //   clip_coef  = max_norm / (total_norm + 1e-6);  g *= min(clip_coef, 1)
  // and stepped by hand: w -= lr g. Clipping by the scaled norm (2^16 times the
  // unscaled one) would make the update 2^16 times too small; no clipping, 4 times too
  // large.
  const int64_t N = 16;
  const double lr = 0.1;
  Backend& be = backend_for(Device::cpu());
  // Inputs float16 holds exactly, so that both models read the same numbers.
  Tensor x16 = Tensor::empty({N, 8}, DType::kF16, Device::cpu());
  be.cast(gpipe::testing::random_tensor({N, 8}, DType::kF32, 65, -2, 2), x16);
  const std::vector<double> xs = gpipe::testing::to_doubles(x16);
  Tensor x32 = Tensor::empty({N, 8}, DType::kF32, Device::cpu());
  Tensor x64 = Tensor::empty({N, 8}, DType::kF64, Device::cpu());
  for (size_t i = 0; i < xs.size(); ++i) {
    x32.data<float>()[i] = static_cast<float>(xs[i]);
    x64.data<double>()[i] = xs[i];
  }
  const Tensor y = gpipe::testing::random_labels(N, 4, 66);

  auto model = layers::build_model(fp16_spec());
  const auto start = masters(*model);

  // The reference, in float64 from the same (float32 master) weights.
  layers::ModelSpec spec64 = fp16_spec();
  spec64.dtype = DType::kF64;
  auto ref = layers::build_model(spec64);
  auto p64 = ref->named_parameters();
  REQUIRE(p64.size() == start.size());
  for (size_t i = 0; i < p64.size(); ++i) {
    REQUIRE(static_cast<size_t>(p64[i].second->value.numel()) == start[i].size());
    for (size_t j = 0; j < start[i].size(); ++j) p64[i].second->value.data<double>()[j] = start[i][j];
  }
  ref->zero_grad();
  ref->forward_backward(be, x64, y, 1.0 / N);
  std::vector<std::vector<double>> g;
  double sq = 0;
  for (auto& [name, p] : p64) {
    g.push_back(gpipe::testing::to_doubles(p->grad));
    for (double v : g.back()) sq += v * v;
  }
  const double total_norm = std::sqrt(sq);
  const double max_norm = total_norm / 4;
  const double clip_coef = std::min(max_norm / (total_norm + 1e-6), 1.0);
  REQUIRE(clip_coef < 0.3);  // clipping is active
  double ref_sq = 0;
  std::vector<double> want_update;  // every parameter's, flattened
  for (const auto& gi : g) {
    for (double v : gi) {
      want_update.push_back(-lr * clip_coef * v);
      ref_sq += want_update.back() * want_update.back();
    }
  }

  // The pipeline: float16, loss scaling, clipping, SGD without momentum.
  InProcessTransport transport(2);
  ExecutorOptions o;
  o.optimizer.type = "sgd";
  o.optimizer.lr = lr;
  o.clip_grad_norm = max_norm;
  o.loss_scale = 65536.0;
  const Schedule s = make_schedule(ScheduleRequest{"1f1b", 2, 1, 2, RecomputeMode::kExceptLast});
  Executor ex(*model, make_cells({3, 2}, s, cpu_devices(2)), s, transport, o);
  const StepResult r = ex.step(x32, y);
  REQUIRE_FALSE(r.skipped);
  CHECK(r.loss_scale == 65536.0);
  const auto now = masters(*model);
  double err_sq = 0;
  size_t at = 0;
  for (size_t i = 0; i < now.size(); ++i) {
    for (size_t j = 0; j < now[i].size(); ++j, ++at) {
      const double d = (now[i][j] - start[i][j]) - want_update[at];
      err_sq += d * d;
    }
  }
  REQUIRE(at == want_update.size());
  // float16 rounds each stored value (weights, activations, their gradients) with
  // relative error at most u = 2^-11; through this short chain (3 linear layers, gelu, a
  // layer norm, forward and back) the errors add up to a few u: measured, 1.4u on the
  // update's normwise relative error and 0.07u on the norm (the float32 masters' own
  // rounding, 2^-24 of each weight, is far below). Bounds: 8u on both, while a clip by
  // the wrong norm, or none, is off by a factor of 4 or more (relative error >= 0.75).
  const double u = std::ldexp(1.0, -11);
  const double rel = std::sqrt(err_sq / ref_sq);
  CHECK(std::abs(r.grad_norm - total_norm) <= 8 * u * total_norm);
  CHECK(std::sqrt(ref_sq) == doctest::Approx(lr * max_norm).epsilon(1e-5));  // the update's norm: lr x max_norm
  CHECK(rel < 8 * u);
  MESSAGE("unscaled norm ", total_norm, " (pipeline: ", r.grad_norm, "), max_norm ", max_norm,
          "; update's normwise relative error ", rel, " = ", rel / u, " u");
}

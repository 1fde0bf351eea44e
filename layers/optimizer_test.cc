// Each optimizer against its textbook formula, as PyTorch documents it
// (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, and CosineAnnealingLR after a
// linear warm-up): first on numbers worked out by hand, then over several steps with
// changing gradients against the formula written out in scalar double loops, in both
// float64 and float32.
//
//   SGD:   g = grad + wd * w;  b = g (t = 1) else mu * b + g;  g = nesterov ? g + mu * b : b;  w -= lr * g
//   Adam:  g = grad + wd * w;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//          w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//   AdamW: w *= 1 - lr * wd, then Adam with g = grad
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "layers/optimizer.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::layers;

namespace {

Parameter param(DType dt, const std::vector<double>& w, const std::vector<double>& g) {
  Parameter p;
  const int64_t n = static_cast<int64_t>(w.size());
  if (dt == DType::kF64) {
    p.value = Tensor::from_vector<double>(w, {n});
    p.grad = Tensor::from_vector<double>(g, {n});
  } else {
    p.value = Tensor::from_vector<float>(std::vector<float>(w.begin(), w.end()), {n});
    p.grad = Tensor::from_vector<float>(std::vector<float>(g.begin(), g.end()), {n});
  }
  return p;
}

double at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::kF64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

void set(Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::kF64) {
    t.data<double>()[i] = v;
  } else {
    t.data<float>()[i] = static_cast<float>(v);
  }
}

// The gradient at step t (from 1) of element i: changes sign and size between steps,
// so momentum and the moments are exercised.
double grad_at(int t, int i) { return 0.3 * std::sin(1.7 * t + i) + (i == 2 ? 0.0 : 0.05 * i); }

}  // namespace

TEST_CASE("SGD by hand: plain, momentum and Nesterov") {
  {
    Parameter p = param(DType::kF64, {1.0, -2.0}, {0.5, 0.25});
    SgdParams s;
    s.lr = 0.1;
    Sgd(std::vector<Parameter*>{&p}, s).step();  // w -= lr g
    CHECK(at(p.value, 0) == doctest::Approx(0.95).epsilon(1e-15));
    CHECK(at(p.value, 1) == doctest::Approx(-2.025).epsilon(1e-15));
  }
  {
    // Nesterov, weight decay 0.1, momentum 0.9, lr 0.1, the same gradient 0.5 twice:
    //   t=1: g = 0.5 + 0.1 * 1 = 0.6;  b = 0.6;  g = 0.6 + 0.9 * 0.6 = 1.14;  w = 1 - 0.114 = 0.886
    //   t=2: g = 0.5 + 0.0886 = 0.5886;  b = 0.54 + 0.5886 = 1.1286;  g = 0.5886 + 1.01574 = 1.60434;
    //        w = 0.886 - 0.160434 = 0.725566
    // Plain momentum instead takes w = 1 - 0.06 = 0.94, then 0.94 - 0.1 * (0.54 + 0.594) = 0.8266.
    for (bool nesterov : {true, false}) {
      CAPTURE(nesterov);
      Parameter p = param(DType::kF64, {1.0}, {0.5});
      SgdParams s;
      s.lr = 0.1;
      s.momentum = 0.9;
      s.weight_decay = 0.1;
      s.nesterov = nesterov;
      Sgd opt({&p}, s);
      opt.step();
      CHECK(at(p.value, 0) == doctest::Approx(nesterov ? 0.886 : 0.94).epsilon(1e-14));
      opt.step();
      CHECK(at(p.value, 0) == doctest::Approx(nesterov ? 0.725566 : 0.8266).epsilon(1e-14));
    }
  }
}

TEST_CASE("Adam and AdamW by hand: the first step is lr times the sign, decay differs") {
  // t=1: m^ = g, v^ = g^2, so w -= lr * g / (|g| + eps): a step of lr against the sign
  // of the gradient, whatever its size. Adam's L2 term goes into g (and is normalised
  // away on the first step); AdamW's shrinks w by lr * wd first: 1 * (1 - 0.01) - 0.1.
  for (const char* type : {"adam", "adamw"}) {
    CAPTURE(type);
    Parameter p = param(DType::kF64, {1.0, -2.0, 3.0}, {0.5, -0.25, 1e-3});
    OptimizerConfig c;
    c.type = type;
    c.lr = 0.1;
    c.weight_decay = std::string(type) == "adamw" ? 0.1 : 0.0;
    make_optimizer({&p}, c)->step();
    const bool w = std::string(type) == "adamw";
    CHECK(at(p.value, 0) == doctest::Approx(w ? 0.89 : 0.9).epsilon(1e-7));
    CHECK(at(p.value, 1) == doctest::Approx(w ? -2.0 * 0.99 + 0.1 : -1.9).epsilon(1e-7));
    CHECK(at(p.value, 2) == doctest::Approx(w ? 3.0 * 0.99 - 0.1 : 2.9).epsilon(1e-5));  // eps shows at |g| = 1e-3
  }
  // Adam with L2, second step with the same gradient 0.5, lr 0.1, wd 0.1 and eps 0 (so
  // that the first step lands exactly on 0.9):
  //   t=1: g = 0.6, m = 0.06, v = 0.00036, w = 0.9
  //   t=2: g = 0.59, m = 0.113, v = 0.00070774, m^ = 0.113 / 0.19, v^ = 0.00070774 / 0.001999,
  //        w = 0.9 - 0.1 * m^ / sqrt(v^) = 0.800047...
  Parameter p = param(DType::kF64, {1.0}, {0.5});
  OptimizerConfig c;
  c.type = "adam";
  c.lr = 0.1;
  c.weight_decay = 0.1;
  c.eps = 0.0;
  auto opt = make_optimizer({&p}, c);
  opt->step();
  CHECK(at(p.value, 0) == doctest::Approx(0.9).epsilon(1e-15));
  opt->step();
  const double want = 0.9 - 0.1 * (0.113 / 0.19) / std::sqrt(0.00070774 / 0.001999);
  CHECK(want == doctest::Approx(0.800047).epsilon(1e-6));
  CHECK(at(p.value, 0) == doctest::Approx(want).epsilon(1e-12));  // 1 - 0.999^2 loses 3 digits to cancellation
}

TEST_CASE("SGD over several steps follows the formula, float64 and float32") {
  for (DType dt : {DType::kF64, DType::kF32}) {
    for (bool nesterov : {false, true}) {
      for (double momentum : {0.0, 0.8}) {
        if (nesterov && momentum == 0.0) continue;
        CAPTURE(dtype_name(dt));
        CAPTURE(nesterov);
        CAPTURE(momentum);
        std::vector<double> w = {0.7, -1.3, 2.0};
        Parameter p = param(dt, w, {0, 0, 0});
        SgdParams s;
        s.lr = 0.05;
        s.momentum = momentum;
        s.weight_decay = 0.02;
        s.nesterov = nesterov;
        Sgd opt({&p}, s);
        std::vector<double> b(3, 0.0);
        for (int t = 1; t <= 6; ++t) {
          for (int i = 0; i < 3; ++i) set(p.grad, i, grad_at(t, i));
          opt.step();
          for (int i = 0; i < 3; ++i) {
            double g = (dt == DType::kF32 ? static_cast<float>(grad_at(t, i)) : grad_at(t, i)) + 0.02 * w[i];
            if (momentum != 0.0) {
              b[i] = t == 1 ? g : momentum * b[i] + g;
              g = nesterov ? g + momentum * b[i] : b[i];
            }
            w[i] -= 0.05 * g;
            CAPTURE(t);
            CAPTURE(i);
            CHECK(at(p.value, i) == doctest::Approx(w[i]).epsilon(dt == DType::kF64 ? 1e-14 : 1e-6));
          }
        }
      }
    }
  }
}

TEST_CASE("Adam and AdamW over several steps follow the formula, float64 and float32") {
  for (DType dt : {DType::kF64, DType::kF32}) {
    for (bool decoupled : {false, true}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(decoupled);
      const double lr = 0.02, b1 = 0.8, b2 = 0.95, eps = 1e-3, wd = 0.05;
      std::vector<double> w = {0.7, -1.3, 2.0}, m(3, 0.0), v(3, 0.0);
      Parameter p = param(dt, w, {0, 0, 0});
      OptimizerConfig c;
      c.type = decoupled ? "adamw" : "adam";
      c.lr = lr;
      c.beta1 = b1;
      c.beta2 = b2;
      c.eps = eps;
      c.weight_decay = wd;
      auto opt = make_optimizer({&p}, c);
      for (int t = 1; t <= 6; ++t) {
        for (int i = 0; i < 3; ++i) set(p.grad, i, grad_at(t, i));
        opt->step();
        for (int i = 0; i < 3; ++i) {
          double g = dt == DType::kF32 ? static_cast<float>(grad_at(t, i)) : grad_at(t, i);
          if (decoupled) {
            w[i] *= 1 - lr * wd;
          } else {
            g += wd * w[i];
          }
          m[i] = b1 * m[i] + (1 - b1) * g;
          v[i] = b2 * v[i] + (1 - b2) * g * g;
          const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
          w[i] -= lr * mhat / (std::sqrt(vhat) + eps);
          CAPTURE(t);
          CAPTURE(i);
          CHECK(at(p.value, i) == doctest::Approx(w[i]).epsilon(dt == DType::kF64 ? 1e-13 : 1e-6));
        }
      }
    }
  }
}

TEST_CASE("set_lr changes the next step only") {
  Parameter p = param(DType::kF64, {1.0}, {0.5});
  SgdParams s;
  s.lr = 0.1;
  Sgd opt({&p}, s);
  opt.step();
  opt.set_lr(0.2);
  opt.step();
  CHECK(at(p.value, 0) == doctest::Approx(1.0 - 0.05 - 0.1).epsilon(1e-15));
}

TEST_CASE("linear warm-up, then cosine annealing to min_lr") {
  // Warm-up: base * (t + 1) / warmup for t < warmup. Then PyTorch's CosineAnnealingLR,
  //   lr = min + (base - min) * (1 + cos(pi * T_cur / T_max)) / 2,
  // with T_cur = t - warmup and T_max = total - warmup - 1, so the last step gets min.
  LrSchedule s;
  s.kind = "cosine";
  s.base_lr = 1.0;
  s.warmup_steps = 4;
  s.total_steps = 14;  // T_max = 9
  s.min_lr = 0.1;
  const std::vector<double> want = {0.25, 0.5, 0.75, 1.0,                       // warm-up
                                    1.0,                                         // T_cur = 0
                                    0.1 + 0.45 * (1 + std::cos(M_PI / 9)),       // T_cur = 1
                                    0.1 + 0.45 * (1 + std::cos(2 * M_PI / 9)),   //
                                    0.775,                                       // T_cur = 3: cos(pi/3) = 1/2
                                    0.1 + 0.45 * (1 + std::cos(4 * M_PI / 9)),   //
                                    0.1 + 0.45 * (1 + std::cos(5 * M_PI / 9)),   //
                                    0.325,                                       // T_cur = 6: cos(2pi/3) = -1/2
                                    0.1 + 0.45 * (1 + std::cos(7 * M_PI / 9)),   //
                                    0.1 + 0.45 * (1 + std::cos(8 * M_PI / 9)),   //
                                    0.1};                                        // the last step
  for (int t = 0; t < 14; ++t) {
    CAPTURE(t);
    CHECK(s.at(t) == doctest::Approx(want[t]).epsilon(1e-14));
  }
  CHECK(s.at(30) == doctest::Approx(0.1));  // past the end: stays at min
  s.kind = "constant";
  CHECK(s.at(1) == 0.5);  // warm-up applies to the constant schedule too
  CHECK(s.at(10) == 1.0);
  s.warmup_steps = 0;
  CHECK(s.at(0) == 1.0);
}

TEST_CASE("the schedule's boundaries: no warm-up, the last warm-up step, the last step, min_lr") {
  // Closed forms, as in the test above: warm-up base * (t + 1) / W for t < W, then
  // min + (base - min) * (1 + cos(pi * (t - W) / (total - W - 1))) / 2.
  LrSchedule s;
  s.kind = "cosine";
  s.base_lr = 2.0;
  s.total_steps = 5;  // no warm-up: T_max = 4
  const double r = std::sqrt(2.0) / 2;  // cos(pi / 4)
  const std::vector<double> want = {2.0, 1.0 + r, 1.0, 1.0 - r, 0.0};
  for (int t = 0; t < 5; ++t) {
    CAPTURE(t);
    CHECK(s.at(t) == doctest::Approx(want[t]).epsilon(1e-14));
  }
  CHECK(std::abs(s.at(4)) < 1e-15);  // the last step reaches min_lr = 0
  CHECK(std::abs(s.at(5)) < 1e-15);  // and stays there

  s.base_lr = 0.3;
  s.min_lr = 0.03;
  s.warmup_steps = 3;
  s.total_steps = 10;  // T_max = 10 - 3 - 1 = 6
  CHECK(s.at(0) == doctest::Approx(0.1).epsilon(1e-14));  // never 0: the first step already learns
  CHECK(s.at(1) == doctest::Approx(0.2).epsilon(1e-14));
  CHECK(s.at(2) == doctest::Approx(0.3).epsilon(1e-14));  // the last warm-up step reaches base
  CHECK(s.at(3) == doctest::Approx(0.3).epsilon(1e-14));  // T_cur = 0: the decay starts at base
  CHECK(s.at(4) == doctest::Approx(0.03 + 0.135 * (1 + std::cos(M_PI / 6))).epsilon(1e-14));
  CHECK(s.at(6) == doctest::Approx(0.165).epsilon(1e-14));  // T_cur = 3 of 6: halfway
  CHECK(s.at(8) == doctest::Approx(0.03 + 0.135 * (1 + std::cos(5 * M_PI / 6))).epsilon(1e-14));
  CHECK(s.at(9) == doctest::Approx(0.03).epsilon(1e-14));  // the last step: min_lr

  // A warm-up as long as the run: every step is a warm-up step.
  s.warmup_steps = 10;
  CHECK(s.at(0) == doctest::Approx(0.03).epsilon(1e-14));
  CHECK(s.at(9) == doctest::Approx(0.3).epsilon(1e-14));

  // The constant schedule ignores min_lr.
  s.kind = "constant";
  s.warmup_steps = 2;
  CHECK(s.at(0) == doctest::Approx(0.15).epsilon(1e-14));
  CHECK(s.at(1) == doctest::Approx(0.3).epsilon(1e-14));
  CHECK(s.at(2) == 0.3);
  CHECK(s.at(9) == 0.3);
}

TEST_CASE("make_optimizer refuses what PyTorch refuses") {
  Parameter p = param(DType::kF64, {1.0}, {0.5});
  OptimizerConfig c;
  c.nesterov = true;  // momentum 0
  CHECK_THROWS_WITH_AS(make_optimizer({&p}, c), doctest::Contains("optimizer.nesterov needs optimizer.momentum > 0"),
                       UserError);
  c.type = "rmsprop";
  CHECK_THROWS_WITH_AS(make_optimizer({&p}, c), doctest::Contains("optimizer.type: unknown optimizer 'rmsprop'"),
                       UserError);
}

#include "layers/gradcheck.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// A float64 CPU tensor of `shape`, uniform in [lo, hi).
Tensor uniform(const Shape& shape, double lo, double hi, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty(shape, DType::kF64, Device::cpu());
  double* p = t.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = rng.uniform(lo, hi);
  return t;
}

// An int32 CPU tensor of `shape`, uniform in [0, n).
Tensor ids(const Shape& shape, int64_t n, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty(shape, DType::kI32, Device::cpu());
  int32_t* p = t.data<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(n));
  return t;
}

// The input a check draws for a layer or model reading `sample` of `dtype` per sample.
Tensor draw_input(const std::string& who, const Shape& sample, DType dtype, int64_t batch, const GradCheckOptions& o) {
  if (batch < 1) throw UserError("gradient check of " + who + ": batch must be at least 1, got " + std::to_string(batch));
  if (dtype == DType::kF64) return uniform(batched(batch, sample), o.input_low, o.input_high, o.seed);
  if (dtype == DType::kI32) {
    if (o.vocab < 1) {
      throw UserError("gradient check of " + who + ": it reads int32 token ids; set GradCheckOptions::vocab to "
                      "draw them in [0, vocab), or pass an input tensor");
    }
    return ids(batched(batch, sample), o.vocab, o.seed);
  }
  throw UserError("gradient check of " + who + ": it reads " + dtype_name(dtype) + " inputs; build it with dtype "
                  "float64 (float32 rounding swamps finite differences)");
}

// A private copy on the CPU: the check perturbs it in place.
Tensor cpu_copy(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  copy_tensor(t, out);
  return out;
}

void require_float64_cpu(const std::string& who, const std::string& what, const Tensor& t) {
  if (t.dtype() != DType::kF64 || !t.device().is_cpu()) {
    throw UserError("gradient check of " + who + ": " + what + " is " + t.str() + "; build the layer with dtype "
                    "float64 and keep it on the CPU (float32 rounding swamps finite differences)");
  }
}

double dot(const Tensor& y, const Tensor& r) {
  const double* a = y.data<double>();
  const double* b = r.data<double>();
  double s = 0;
  for (int64_t i = 0; i < y.numel(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of f, perturbing the same element of every tensor in `tied`
// together (one weight held by two layers).
std::vector<double> numeric_gradient_tied(const std::vector<Tensor>& tied, const std::function<double()>& f,
                                          double eps) {
  const int64_t n = tied.front().numel();
  std::vector<double*> v;
  for (const Tensor& t : tied) v.push_back(t.data<double>());
  std::vector<double> g(n);
  for (int64_t i = 0; i < n; ++i) {
    const double keep = v[0][i];
    for (double* p : v) p[i] = keep + eps;
    const double fp = f();
    for (double* p : v) p[i] = keep - eps;
    const double fm = f();
    for (double* p : v) p[i] = keep;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

std::vector<int64_t> coordinates(int64_t flat, const Shape& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return c;
}

// Compares an analytic gradient with the numeric one (plus `offset`, what the
// gradient held before backward added into it).
GradCheckEntry compare(const std::string& name, const Tensor& analytic, const Shape& want,
                       const std::vector<double>& numeric, double offset, const GradCheckOptions& o) {
  GradCheckEntry e;
  e.name = name;
  e.shape = want;
  if (!analytic.defined()) {
    e.ok = false;
    e.problem = "backward gave no gradient (an undefined tensor)";
    return e;
  }
  if (analytic.shape() != want || analytic.dtype() != DType::kF64 || !analytic.device().is_cpu()) {
    e.ok = false;
    e.problem = "backward gave " + analytic.str() + ", expected float64" + shape_str(want) + " on the CPU";
    return e;
  }
  const double* a = analytic.data<double>();
  double worst_ratio = -1;
  for (size_t i = 0; i < numeric.size(); ++i) {
    const double n = numeric[i] + offset;
    const double d = std::fabs(a[i] - n);
    const double allowed = o.atol + o.rtol * std::fabs(n);
    const double ratio = std::isnan(d) ? std::numeric_limits<double>::infinity() : d / allowed;
    if (!(d <= allowed)) e.ok = false;  // NaN fails too
    if (std::isnan(d) || d > e.max_abs_err) e.max_abs_err = d;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      e.worst = coordinates(static_cast<int64_t>(i), want);
      e.analytic = a[i];
      e.numeric = n;
      e.abs_err = d;
      e.rel_err = d / std::max(std::fabs(n), 1e-300);
    }
  }
  return e;
}

void add(GradCheckReport& r, GradCheckEntry e) {
  r.ok = r.ok && e.ok;
  r.entries.push_back(std::move(e));
}

}  // namespace

std::vector<double> numeric_gradient(Tensor& t, const std::function<double()>& f, double eps) {
  if (t.dtype() != DType::kF64 || !t.device().is_cpu() || !t.is_contiguous()) {
    throw Error("numeric_gradient: " + t.str() + " must be a contiguous float64 tensor on the CPU");
  }
  return numeric_gradient_tied({t}, f, eps);
}

std::string GradCheckReport::str() const {
  std::ostringstream os;
  os << "gradient check of " << subject << ": " << (ok ? "ok" : "FAILED")
     << " (float64 central differences, eps " << num(options.eps) << "; an element passes when |analytic - numeric| <= "
     << num(options.atol) << " + " << num(options.rtol) << " |numeric|"
     << (options.initial_grad != 0 ? "; parameter gradients started at " + num(options.initial_grad) +
                                         ", which backward must add to, and 'numeric' includes it"
                                   : std::string())
     << ")\n";
  for (const GradCheckEntry& e : entries) {
    os << "  " << e.name << " " << shape_str(e.shape) << ": ";
    if (!e.problem.empty()) {
      os << "FAILED: " << e.problem << "\n";
      continue;
    }
    if (e.ok) {
      os << "ok, max abs err " << num(e.max_abs_err) << "\n";
      continue;
    }
    os << "FAILED, worst at [";
    for (size_t d = 0; d < e.worst.size(); ++d) os << (d ? ", " : "") << e.worst[d];
    os << "]: analytic " << num(e.analytic) << ", numeric " << num(e.numeric) << ", abs err " << num(e.abs_err)
       << ", rel err " << num(e.rel_err) << "\n";
  }
  return os.str();
}

void GradCheckReport::require() const {
  if (!ok) throw GradCheckFailure(str());
}

GradCheckReport check_layer_gradients(Layer& layer, int64_t batch, const GradCheckOptions& options) {
  return check_layer_gradients(
      layer, draw_input(layer.describe(), layer.input_shape(), layer.input_dtype(), batch, options), options);
}

GradCheckReport check_layer_gradients(Layer& layer, const Tensor& input, const GradCheckOptions& options) {
  const std::string who = layer.describe();
  GradCheckReport report;
  report.subject = who;
  report.options = options;
  if (layer.dtype() != DType::kF64) {
    throw UserError("gradient check of " + who + ": its dtype is " + dtype_name(layer.dtype()) + "; build it with "
                    "dtype float64 (float32 rounding swamps finite differences)");
  }
  const std::vector<Parameter*> params = layer.parameters();
  for (Parameter* p : params) require_float64_cpu(who, "parameter '" + p->name + "'", p->value);
  Tensor x = cpu_copy(input);
  const Tensor r = uniform(batched(x.dim() > 0 ? x.size(0) : 0, layer.output_shape()), -1.0, 1.0, options.seed + 1);

  for (Parameter* p : params) cpu().fill(p->grad, options.initial_grad);
  Context ctx;
  layer.forward(cpu(), x, &ctx, options.args);
  const Tensor dx = layer.backward(cpu(), r, ctx, /*need_dx=*/true);

  ForwardArgs probe = options.args;
  probe.recompute = true;
  auto f = [&] { return dot(layer.forward(cpu(), x, nullptr, probe), r); };
  if (x.dtype() == DType::kF64) add(report, compare("input", dx, x.shape(), numeric_gradient(x, f, options.eps), 0, options));
  for (Parameter* p : params) {
    add(report, compare(p->name, p->grad, p->value.shape(), numeric_gradient_tied({p->value}, f, options.eps),
                        options.initial_grad, options));
  }
  return report;
}

GradCheckReport check_model_gradients(Sequential& model, int64_t batch, const GradCheckOptions& options) {
  const std::string who = "the model";
  Tensor x = draw_input(who, model.input_shape(), model.input_dtype(), batch, options);
  const Shape& out = model.output_shape();
  if (out.empty() || out.back() < 1) {
    throw UserError("gradient check of the model: its output " + shape_str(out) + " has no class dimension to draw "
                    "class-index targets for; pass the targets");
  }
  Shape target_shape = batched(batch, Shape(out.begin(), out.end() - 1));
  return check_model_gradients(model, x, ids(target_shape, out.back(), options.seed + 2), options);
}

GradCheckReport check_model_gradients(Sequential& model, const Tensor& input, const Tensor& targets,
                                      const GradCheckOptions& options) {
  GradCheckReport report;
  report.subject = "a model of " + std::to_string(model.size()) + " layers";
  report.options = options;
  report.options.initial_grad = 0;  // the model's gradients start from zero_grad()
  const auto named = model.named_parameters();
  for (const auto& np : named) require_float64_cpu(report.subject, "parameter '" + np.first + "'", np.second->value);
  if (model.output_dtype() != DType::kF64) {
    throw UserError("gradient check of " + report.subject + ": its output is " + dtype_name(model.output_dtype()) +
                    "; build it with dtype float64");
  }
  Tensor x = cpu_copy(input);
  const Tensor y = cpu_copy(targets);
  const int L = model.size();

  model.zero_grad();
  std::vector<Context> ctx(L);
  Tensor h = x;
  for (int i = 0; i < L; ++i) h = model.layer(i).forward(cpu(), h, &ctx[i], options.args);
  Context loss_ctx;
  model.loss().forward(cpu(), h, y, 1.0, &loss_ctx);
  Tensor g = model.loss().backward(cpu(), loss_ctx);
  for (int i = L; i-- > 0;) g = model.layer(i).backward(cpu(), g, ctx[i], /*need_dx=*/true);
  model.sum_tied_gradients(cpu());

  ForwardArgs probe = options.args;
  probe.recompute = true;
  auto f = [&] {
    Tensor a = x;
    for (int i = 0; i < L; ++i) a = model.layer(i).forward(cpu(), a, nullptr, probe);
    return cpu().item(model.loss().forward(cpu(), a, y, 1.0, nullptr));
  };
  if (x.dtype() == DType::kF64) add(report, compare("input", g, x.shape(), numeric_gradient(x, f, options.eps), 0, options));
  for (const auto& np : named) {
    Parameter* p = np.second;
    if (model.is_tied_copy(p)) continue;  // checked with its owner
    std::vector<Tensor> together{p->value};
    std::string name = np.first;
    for (const Tie& t : model.ties()) {
      if (t.owner == p) {
        together.push_back(t.copy->value);
        name += " (tied with " + model.qualified_name(t.copy_layer, t.copy->name) + ")";
      }
    }
    add(report, compare(name, p->grad, p->value.shape(), numeric_gradient_tied(together, f, options.eps), 0, options));
  }
  return report;
}

}  // namespace layers
}  // namespace gpipe

#include "pipeline/planning/profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include "layers/loss.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/stream.h"

namespace gpipe {
namespace pipeline {

std::string ProfileKey::str() const {
  return "model " + model_hash + ", micro-batch " + std::to_string(micro_batch) + ", " + dtype + " on " + device +
         ", " + std::to_string(blas_threads) + " BLAS thread" + (blas_threads == 1 ? "" : "s") +
         (concurrency > 1 ? ", " + std::to_string(concurrency) + " stages at once" : "");
}

namespace {

bool same_key(const ProfileKey& a, const ProfileKey& b) {
  return a.model_hash == b.model_hash && a.micro_batch == b.micro_batch && a.dtype == b.dtype &&
         a.device == b.device && a.blas_threads == b.blas_threads && a.concurrency == b.concurrency;
}

// FNV-1a, 64 bits.
uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ULL) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}


std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Milliseconds `fn` takes on `be`'s device: the device is idle before and waited for
// after. On a GPU the time is the device's, between two events on its stream around
// `fn`'s work (what the executor's clock reads for an instruction), not the host's
// launches and wait; on the CPU, the host clock.
template <typename Fn>
double timed(Backend& be, Fn&& fn) {
  heartbeat();  // each measured piece is progress, for gpipe run (runtime/heartbeat.h)
  be.synchronize();
  if (be.device().is_cpu()) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    be.synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  const std::unique_ptr<Event> start = make_event(be.device()), end = make_event(be.device());
  start->record(be.stream());
  fn();
  end->record(be.stream());
  be.synchronize();  // also reports what the device found wrong in fn's inputs
  return start->elapsed_ms(*end);
}

nlohmann::json to_json(const ProfileEntry& e) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerProfile& l : e.layers) {
    layers.push_back({{"describe", l.describe},
                      {"forward_ms", l.forward_ms},
                      {"forward_nograd_ms", l.forward_nograd_ms},
                      {"recompute_ms", l.recompute_ms},
                      {"backward_ms", l.backward_ms},
                      {"backward_input_ms", l.backward_input_ms},
                      {"backward_weight_ms", l.backward_weight_ms},
                      {"optimizer_ms", l.optimizer_ms},
                      {"param_bytes", l.param_bytes},
                      {"output_bytes", l.output_bytes},
                      {"saved_bytes", l.saved_bytes}});
  }
  return {{"model_hash", e.key.model_hash},
          {"micro_batch", e.key.micro_batch},
          {"dtype", e.key.dtype},
          {"device", e.key.device},
          {"blas_threads", e.key.blas_threads},
          {"concurrency", e.key.concurrency},
          {"host", e.host},
          {"optimizer", e.optimizer},
          {"created", e.created},
          {"warmup", e.warmup},
          {"repeats", e.repeats},
          {"loss_forward_ms", e.loss_forward_ms},
          {"loss_backward_ms", e.loss_backward_ms},
          {"layers", layers}};
}

ProfileEntry entry_from_json(const nlohmann::json& j) {
  ProfileEntry e;
  e.key.model_hash = j.at("model_hash").get<std::string>();
  e.key.micro_batch = j.at("micro_batch").get<int64_t>();
  e.key.dtype = j.at("dtype").get<std::string>();
  e.key.device = j.at("device").get<std::string>();
  e.key.blas_threads = j.at("blas_threads").get<int>();
  e.key.concurrency = j.value("concurrency", 1);
  e.host = j.value("host", "");
  e.optimizer = j.value("optimizer", "");
  e.created = j.value("created", "");
  e.warmup = j.value("warmup", 0);
  e.repeats = j.value("repeats", 0);
  e.loss_forward_ms = j.at("loss_forward_ms").get<double>();
  e.loss_backward_ms = j.at("loss_backward_ms").get<double>();
  for (const auto& l : j.at("layers")) {
    LayerProfile p;
    p.describe = l.at("describe").get<std::string>();
    p.forward_ms = l.at("forward_ms").get<double>();
    p.forward_nograd_ms = l.at("forward_nograd_ms").get<double>();
    p.recompute_ms = l.at("recompute_ms").get<double>();
    p.backward_ms = l.at("backward_ms").get<double>();
    p.backward_input_ms = l.at("backward_input_ms").get<double>();
    p.backward_weight_ms = l.at("backward_weight_ms").get<double>();
    p.optimizer_ms = l.at("optimizer_ms").get<double>();
    p.param_bytes = l.at("param_bytes").get<int64_t>();
    p.output_bytes = l.at("output_bytes").get<int64_t>();
    p.saved_bytes = l.at("saved_bytes").get<int64_t>();
    e.layers.push_back(p);
  }
  return e;
}

}  // namespace

const ProfileEntry* ProfileStore::find(const ProfileKey& key) const {
  for (const auto& e : entries) {
    if (same_key(e.key, key)) return &e;
  }
  return nullptr;
}

const LinkCost* ProfileStore::link(const std::string& kind) const {
  for (const auto& l : links) {
    if (l.kind == kind) return &l;
  }
  return nullptr;
}

void ProfileStore::put(ProfileEntry entry) {
  for (auto& e : entries) {
    if (same_key(e.key, entry.key)) {
      e = std::move(entry);
      return;
    }
  }
  entries.push_back(std::move(entry));
}

void ProfileStore::put(LinkCost l) {
  for (auto& x : links) {
    if (x.kind == l.kind) {
      x = l;
      return;
    }
  }
  links.push_back(l);
}

const StepCalibration* ProfileStore::calibration(const std::string& model_hash, const std::string& device,
                                                 const std::string& dtype, int stages, int blas_threads) const {
  for (const auto& c : calibrations) {
    if (c.model_hash == model_hash && c.device == device && c.dtype == dtype && c.stages == stages &&
        c.blas_threads == blas_threads) {
      return &c;
    }
  }
  return nullptr;
}

void ProfileStore::put(StepCalibration c) {
  if (c.created.empty()) c.created = utc_now();
  for (auto& x : calibrations) {
    if (x.model_hash == c.model_hash && x.device == c.device && x.dtype == c.dtype && x.stages == c.stages &&
        x.blas_threads == c.blas_threads) {
      x = c;
      return;
    }
  }
  calibrations.push_back(c);
}

std::string model_hash(const layers::Sequential& model) {
  std::ostringstream os;
  os << shape_str(model.input_shape()) << ' ' << dtype_name(model.input_dtype()) << ';';
  for (int i = 0; i < model.size(); ++i) {
    const layers::Layer& l = model.layer(i);
    os << l.type() << '|' << l.describe() << '|' << shape_str(l.output_shape()) << '|' << dtype_name(l.dtype())
       << (l.splits_backward() ? "|split" : "") << ';';
  }
  if (model.has_loss()) os << "loss:" << const_cast<layers::Sequential&>(model).loss().type();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a(os.str())));
  return hex;
}

std::string processor_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown CPU";
}

ProfileKey profile_key(const layers::Sequential& model, int64_t micro_batch, Device device, int blas_threads,
                       int concurrency) {
  ProfileKey k;
  k.model_hash = model_hash(model);
  k.micro_batch = micro_batch;
  k.dtype = dtype_name(model.output_dtype());
  k.device = device.is_cpu() ? "cpu" : "cuda";
  k.blas_threads = device.is_cpu() ? blas_threads : 0;
  k.concurrency = device.is_cpu() ? concurrency : 1;
  return k;
}

ProfileStore load_profile(const std::string& path) {
  ProfileStore store;
  std::ifstream f(path);
  if (!f) return store;
  try {
    const nlohmann::json j = nlohmann::json::parse(f);
    if (j.value("format", "") != "gpipe-profile") throw std::runtime_error("not a gpipe profile (no format field)");
    for (const auto& e : j.at("entries")) store.entries.push_back(entry_from_json(e));
    for (const auto& l : j.value("links", nlohmann::json::array())) {
      store.links.push_back({l.at("kind").get<std::string>(), l.at("latency_ms").get<double>(),
                             l.at("bytes_per_ms").get<double>()});
    }
    for (const auto& c : j.value("calibrations", nlohmann::json::array())) {
      StepCalibration k;
      k.model_hash = c.at("model").get<std::string>();
      k.device = c.at("device").get<std::string>();
      k.dtype = c.at("dtype").get<std::string>();
      k.stages = c.at("stages").get<int>();
      k.blas_threads = c.at("blas_threads").get<int>();
      k.ratio = c.at("ratio").get<double>();
      k.plans = c.value("plans", 1);
      k.created = c.value("created", "");
      if (!(k.ratio > 0) || !std::isfinite(k.ratio)) throw std::runtime_error("a calibration ratio is not positive");
      store.calibrations.push_back(k);
    }
  } catch (const std::exception& e) {
    throw UserError("the profile " + path + " cannot be read: " + e.what() +
                    "; delete it and run `gpipe profile CONFIG` again");
  }
  return store;
}

void save_profile(const std::string& path, const ProfileStore& store) {
  nlohmann::json j = {{"format", "gpipe-profile"}, {"version", 1}};
  j["entries"] = nlohmann::json::array();
  for (const auto& e : store.entries) j["entries"].push_back(to_json(e));
  j["links"] = nlohmann::json::array();
  for (const auto& l : store.links) {
    j["links"].push_back({{"kind", l.kind}, {"latency_ms", l.latency_ms}, {"bytes_per_ms", l.bytes_per_ms}});
  }
  j["calibrations"] = nlohmann::json::array();
  for (const auto& c : store.calibrations) {
    j["calibrations"].push_back({{"model", c.model_hash}, {"device", c.device}, {"dtype", c.dtype},
                                 {"stages", c.stages}, {"blas_threads", c.blas_threads}, {"ratio", c.ratio},
                                 {"plans", c.plans}, {"created", c.created}});
  }
  write_file_atomically(path, j.dump(1) + "\n");
}

ProfileEntry require_profile(const std::string& path, const ProfileKey& key) {
  const std::string make = "; make it with `gpipe profile CONFIG` (the same config and --set overrides), or set "
                           "pipeline.balance_by: estimate";
  std::ifstream probe(path);
  if (!probe) throw UserError("pipeline.balance_by is profile but the profile " + path + " does not exist" + make);
  const ProfileStore store = load_profile(path);
  if (const ProfileEntry* e = store.find(key)) return *e;
  std::string why = "it has no entry for " + key.str();
  bool model = false, size = false;
  std::string sizes;
  for (const auto& e : store.entries) {
    if (e.key.model_hash != key.model_hash || e.key.concurrency != key.concurrency) continue;
    model = true;
    if (e.key.micro_batch == key.micro_batch) size = true;
    sizes += (sizes.empty() ? "" : ", ") + std::to_string(e.key.micro_batch) + " (" + e.key.dtype + " on " +
             e.key.device + ", " + std::to_string(e.key.blas_threads) + " BLAS threads)";
  }
  if (!model) {
    why += ": it was made for another model (the layers, their sizes or dtypes differ)";
  } else if (!size) {
    why += ": this model was profiled at micro-batch sizes " + sizes + " only";
  } else {
    why += ": this model was profiled at this size for another dtype, device or BLAS thread count: " + sizes;
  }
  throw UserError("pipeline.balance_by is profile but the profile " + path + " does not fit this run: " + why + make);
}

std::vector<double> profile_layer_costs(const ProfileEntry& e, bool recompute) {
  std::vector<double> out;
  for (const LayerProfile& l : e.layers) {
    out.push_back((l.forward_ms + l.backward_ms + (recompute ? l.recompute_ms : 0.0)) / 1e3);
  }
  if (!out.empty()) out.back() += (e.loss_forward_ms * (recompute ? 2 : 1) + e.loss_backward_ms) / 1e3;
  return out;
}

ProfileEntry measure_layers(layers::Sequential& model, const Tensor& inputs, const Tensor& targets, Device device,
                            const layers::OptimizerConfig& optimizer, int warmup, int repeats, int blas_threads,
                            int concurrency, double min_seconds) {
  GPIPE_CHECK(repeats >= 1 && warmup >= 0, "measure_layers: at least one timed repetition");
  const int L = model.size();
  const int64_t n = inputs.size(0);
  Backend& be = backend_for(device);
  for (int i = 0; i < L; ++i) model.layer(i).to(device);
  auto on_device = [&](const Tensor& host) {
    if (device.is_cpu()) return host;
    Tensor t = be.empty(host.shape(), host.dtype());
    be.copy(host, t);
    return t;
  };
  const Tensor x = on_device(layers::model_input(model, inputs)), y = on_device(targets);
  std::vector<std::unique_ptr<layers::Optimizer>> optimizers(L);
  for (int i = 0; i < L; ++i) {
    if (model.layer(i).parameters().empty()) continue;
    // The update does its usual work at a learning rate of 0, so the weights stay as
    // they are: hundreds of repetitions at the real rate with accumulating gradients
    // would drive them to huge or subnormal values, which compute at other speeds.
    optimizers[i] = layers::make_optimizer(model.layer(i).parameters(), optimizer);
    optimizers[i]->set_lr(0.0);
  }
  // Per layer and repetition: forward, no-grad forward, recompute, backward, B, W, optimizer.
  std::vector<std::vector<std::vector<double>>> t(L, std::vector<std::vector<double>>(7));
  std::vector<double> loss_fwd, loss_bwd;
  const double scale = 1.0 / static_cast<double>(std::max<int64_t>(1, targets.numel()));
  // Each kind of work runs as its own pass over all layers, as a stage runs a whole
  // cell's forward, recompute or backward: a layer's weights come from the cache
  // levels they would come from in a pipeline, not warm from the pass just before.
  // Repetitions go on until `repeats` were timed and `min_seconds` have passed: a
  // core's speed drifts over seconds on a shared machine, and a median over a longer
  // window is what a run of many steps sees.
  const auto started = std::chrono::steady_clock::now();
  auto elapsed_s = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(); };
  int timed_reps = 0;
  for (int rep = 0; rep < warmup + repeats || (elapsed_s() < min_seconds && timed_reps < 10000); ++rep) {
    const bool keep = rep >= warmup;
    timed_reps += keep;
    for (int i = 0; i < L; ++i) {  // each repetition starts from clear gradients, as a step does
      for (layers::Parameter* p : model.layer(i).parameters()) be.fill(p->grad, 0.0);
    }
    auto record = [&](int i, int kind, double ms) {
      if (keep) t[i][kind].push_back(ms);
    };
    layers::ForwardArgs args;
    args.step = static_cast<uint64_t>(rep);
    layers::ForwardArgs again = args;
    again.recompute = true;
    // Each kind of work runs twice in a row and is timed the second time: a stage runs a
    // cell's forward (recompute, backward) for micro-batch after micro-batch, so it finds
    // the cell's weights where the one before left them, not where other work evicted them.
    std::vector<layers::Context> ctx(L);
    std::vector<Tensor> acts{x};
    for (int pass = 0; pass < 2; ++pass) {  // forward, keeping what backward needs
      for (int i = 0; i < L; ++i) {
        Tensor out;
        const double ms = timed(be, [&] { out = model.layer(i).forward(be, acts[i], &ctx[i], args); });
        if (pass) record(i, 0, ms);
        if (!pass) acts.push_back(out);
      }
    }
    for (int pass = 0; pass < 2; ++pass) {  // the forward of a checkpointed micro-batch
      for (int i = 0; i < L; ++i) {
        const double ms = timed(be, [&] { model.layer(i).forward(be, acts[i], nullptr, args); });
        if (pass) record(i, 1, ms);
      }
    }
    for (int pass = 0; pass < 2; ++pass) {  // its recompute
      for (int i = 0; i < L; ++i) {
        layers::Context rctx;
        const double ms = timed(be, [&] { model.layer(i).forward(be, acts[i], &rctx, again); });
        if (pass) record(i, 2, ms);
      }
    }
    layers::Context lctx;
    std::vector<Tensor> grads(L + 1);  // grads[i]: the gradient of layer i's output
    const double lf = timed(be, [&] { model.loss().forward(be, acts[L], y, scale, &lctx); });
    const double lb = timed(be, [&] { grads[L - 1] = model.loss().backward(be, lctx); });
    if (keep) {
      loss_fwd.push_back(lf);
      loss_bwd.push_back(lb);
    }
    // need_dx as the executor: nothing needs the model input's gradient.
    for (int pass = 0; pass < 2; ++pass) {  // the whole backward
      for (int i = L - 1; i >= 0; --i) {
        Tensor dx;
        const double ms = timed(be, [&] { dx = model.layer(i).backward(be, grads[i], ctx[i], i > 0); });
        if (pass) record(i, 3, ms);
        if (i > 0) grads[i - 1] = dx;
      }
    }
    for (int i = L - 1; i >= 0; --i) {  // B, then W, for layers that split
      layers::Layer& layer = model.layer(i);
      record(i, 4, layer.splits_backward() ? timed(be, [&] { layer.backward_input(be, grads[i], ctx[i], i > 0); })
                                           : t[i][3].empty() ? 0.0 : t[i][3].back());
    }
    for (int i = L - 1; i >= 0; --i) {
      layers::Layer& layer = model.layer(i);
      record(i, 5, layer.splits_backward() ? timed(be, [&] { layer.backward_weight(be, ctx[i]); }) : 0.0);
    }
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < L; ++i) {
        const double ms = optimizers[i] ? timed(be, [&] { optimizers[i]->step(); }) : 0.0;
        if (pass) record(i, 6, ms);
      }
    }
  }
  ProfileEntry e;
  e.key = profile_key(model, n, device, blas_threads, concurrency);
  e.host = device.is_cpu() ? processor_name() : device.str();
  e.optimizer = optimizer.type;
  e.created = utc_now();
  e.warmup = warmup;
  e.repeats = timed_reps;
  e.loss_forward_ms = median(loss_fwd);
  e.loss_backward_ms = median(loss_bwd);
  const auto costs = model.costs(n);
  for (int i = 0; i < L; ++i) {
    LayerProfile p;
    p.describe = model.layer(i).describe();
    p.forward_ms = median(t[i][0]);
    p.forward_nograd_ms = median(t[i][1]);
    p.recompute_ms = median(t[i][2]);
    p.backward_ms = median(t[i][3]);
    p.backward_input_ms = median(t[i][4]);
    p.backward_weight_ms = median(t[i][5]);
    p.optimizer_ms = median(t[i][6]);
    p.param_bytes = costs[i].param_bytes;
    p.output_bytes = costs[i].output_bytes;
    p.saved_bytes = costs[i].saved_bytes;
    e.layers.push_back(p);
  }
  return e;
}

LinkCost measure_link(Transport& transport, const std::string& kind, int me, int repeats) {
  constexpr int64_t kSmall = 256, kLarge = int64_t{4} << 20;  // float32 elements: 1 KB and 16 MB
  auto pingpong = [&](int stage, int64_t elements) {
    const Tensor msg = Tensor::zeros_cpu({elements}, DType::kF32);
    std::vector<double> rtt;
    for (int i = 0; i < repeats + 2; ++i) {
      const MessageTag tag{MessageKind::kActivation, i, 0};
      const auto t0 = std::chrono::steady_clock::now();
      if (stage == 0) {
        transport.send(0, 1, tag, msg);
        transport.recv(0, 1, tag, Device::cpu());
      } else {
        Tensor got = transport.recv(1, 0, tag, Device::cpu());
        transport.send(1, 0, tag, got);
      }
      transport.flush(stage);
      if (i >= 2) rtt.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return median(rtt);
  };
  double small = 0, large = 0;
  if (me < 0) {  // both stages here: stage 1 on a thread of its own
    std::thread other([&] {
      pingpong(1, kSmall);
      pingpong(1, kLarge);
    });
    small = pingpong(0, kSmall);
    large = pingpong(0, kLarge);
    other.join();
  } else {
    small = pingpong(me, kSmall);
    large = pingpong(me, kLarge);
  }
  LinkCost l;
  l.kind = kind;
  l.latency_ms = small / 2;
  const double per_byte_ms = (large - small) / 2 / static_cast<double>((kLarge - kSmall) * 4);
  // A hand-over of a pointer costs nothing per byte: within noise of the small message.
  l.bytes_per_ms = per_byte_ms > 1e-9 ? 1.0 / per_byte_ms : 0.0;
  return l;
}

}  // namespace pipeline
}  // namespace gpipe

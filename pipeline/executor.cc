#include "pipeline/executor.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cmath>

#include "runtime/device_binding.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

std::vector<StageSpec> make_stages(const std::vector<int>& balance, const std::vector<Device>& devices) {
  GPIPE_CHECK(balance.size() == devices.size(), "one device per stage");
  std::vector<StageSpec> out;
  int first = 0;
  for (size_t k = 0; k < balance.size(); ++k) {
    out.push_back({first, balance[k], devices[k]});
    first += balance[k];
  }
  return out;
}

std::vector<int64_t> split_sizes(int64_t n, int m) {
  if (m < 1) throw UserError("pipeline.micro_batches must be at least 1, got " + std::to_string(m));
  if (n < m) {
    throw UserError("the batch of " + std::to_string(n) + " samples cannot be split into " + std::to_string(m) +
                    " micro-batches; raise train.batch_size to at least " + std::to_string(m) +
                    " or lower pipeline.micro_batches");
  }
  std::vector<int64_t> sizes(m, n / m);
  for (int i = 0; i < n % m; ++i) ++sizes[i];
  return sizes;
}

// What one stage keeps between instructions, per micro-batch.
struct MicroBatch {
  Tensor input;                       // stage input; kept while the micro-batch is checkpointed
  Tensor output;                      // cell output awaiting its send
  std::vector<layers::Context> ctx;   // per layer; empty while checkpointed
  layers::Context loss_ctx;           // last stage only
  Tensor targets;                     // last stage only
  Tensor loss;                        // last stage only
  Tensor grad_output, grad_input;     // received / to be sent
  int64_t held_bytes = 0;             // activations held, for the memory meter
};

struct Executor::StageRuntime {
  int index = 0;
  bool local = true;  // executed by this process
  StageSpec spec;
  Backend* backend = nullptr;
  std::unique_ptr<layers::Optimizer> optimizer;
  // Shared with the other local stages on the same device, whose backend (its stream,
  // BLAS and cuDNN handles, error checks) they also use: a stage queues work on the
  // device only while it holds it, and never while it waits for a message.
  std::mutex* device_turn = nullptr;
  std::unique_ptr<GradReducer> reducer;  // with data-parallel replicas
  layers::ReplicaSum replica_sum;        // likewise, for BatchNorm's statistics
  double grad_norm = -1;
  std::vector<MicroBatch> mbs;
  StageTrace trace;
  int64_t live_bytes = 0;
  bool grads_dirty = true;  // gradients hold values from an earlier step
  std::exception_ptr error;
  bool error_is_abort = false;
  std::string error_text;
};

namespace {

// Bytes of the distinct buffers a micro-batch holds.
// Every buffer a context holds, its sub-layers' (children) included.
void collect(const layers::Context& c, std::vector<std::pair<const void*, int64_t>>& out) {
  for (const auto& t : c.saved) {
    if (t.defined()) out.emplace_back(t.raw_data(), static_cast<int64_t>(t.nbytes()));
  }
  for (const auto& child : c.children) collect(child, out);
}

int64_t held_bytes(const MicroBatch& mb) {
  std::vector<std::pair<const void*, int64_t>> held;
  for (const Tensor* t : {&mb.input, &mb.output, &mb.grad_output, &mb.grad_input}) {
    if (t->defined()) held.emplace_back(t->raw_data(), static_cast<int64_t>(t->nbytes()));
  }
  for (const auto& c : mb.ctx) collect(c, held);
  collect(mb.loss_ctx, held);
  // A buffer kept by two contexts (a layer's output is the next one's input) counts once,
  // at its largest view.
  std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  });
  held.erase(std::unique(held.begin(), held.end(),
                         [](const auto& a, const auto& b) { return a.first == b.first; }),
             held.end());
  int64_t total = 0;
  for (const auto& h : held) total += h.second;
  return total;
}

void pin_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    spdlog::debug("could not pin the stage thread to core {}", core);
  }
}

}  // namespace

Executor::Executor(layers::Sequential& model, std::vector<StageSpec> stages, Schedule schedule, Transport& transport,
                   ExecutorOptions options)
    : model_(model), stages_(std::move(stages)), schedule_(std::move(schedule)), transport_(transport),
      options_(options) {
  const int K = static_cast<int>(stages_.size());
  if (K != schedule_.num_stages) {
    throw UserError("the schedule has " + std::to_string(schedule_.num_stages) + " stages but " + std::to_string(K) +
                    " cells were given");
  }
  check_schedule(schedule_);
  int expect_first = 0;
  for (int k = 0; k < K; ++k) {
    const StageSpec& s = stages_[k];
    if (s.first_layer != expect_first || s.num_layers < 1) {
      throw UserError("stage " + std::to_string(k) + " must start at layer " + std::to_string(expect_first) +
                      " and hold at least one layer");
    }
    expect_first += s.num_layers;
  }
  if (expect_first != model_.size()) {
    throw UserError("the stages hold " + std::to_string(expect_first) + " layers but the model has " +
                    std::to_string(model_.size()));
  }
  model_.loss();  // the last stage needs one: fail now, not in a worker
  if (options_.local_stage >= K) {
    throw UserError("this process was asked to run stage " + std::to_string(options_.local_stage) + " of a " +
                    std::to_string(K) + "-stage pipeline");
  }
  for (int k = 0; k < K; ++k) {
    auto rt = std::make_unique<StageRuntime>();
    rt->index = k;
    rt->spec = stages_[k];
    rt->local = options_.local_stage < 0 || options_.local_stage == k;
    if (rt->local) {
      rt->backend = &backend_for(stages_[k].device);
      std::vector<layers::Parameter*> params;
      for (int i = rt->spec.first_layer; i < rt->spec.first_layer + rt->spec.num_layers; ++i) {
        model_.layer(i).to(rt->spec.device);
        for (auto* p : model_.layer(i).parameters()) params.push_back(p);
      }
      rt->optimizer = layers::make_optimizer(params, options_.optimizer);
      if (options_.replicas != nullptr && options_.replicas->size() > 1) {
        ReplicaGroup* group = options_.replicas;
        rt->reducer = std::make_unique<GradReducer>(*group, *rt->backend, options_.bucket_bytes);
        rt->replica_sum = [group](std::vector<double>& v) {
          Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kF64, Device::cpu());
          std::copy(v.begin(), v.end(), t.data<double>());
          group->all_reduce_sum(t);
          std::copy(t.data<double>(), t.data<double>() + v.size(), v.begin());
        };
      }
    }
    runtimes_.push_back(std::move(rt));
  }
  // Stages of this process that share a device take turns on its backend.
  for (int k = 0; k < K; ++k) {
    if (!runtimes_[k]->local) continue;
    for (int j = 0; j < k; ++j) {
      if (runtimes_[j]->local && stages_[j].device == stages_[k].device) {
        if (runtimes_[j]->device_turn == nullptr) {
          device_turns_.push_back(std::make_unique<std::mutex>());
          runtimes_[j]->device_turn = device_turns_.back().get();
        }
        runtimes_[k]->device_turn = runtimes_[j]->device_turn;
        break;
      }
    }
  }
  for (const auto& rt : runtimes_) {
    // A replica's collectives block; a stage must not block while other stages wait for
    // their turn on its device.
    if (rt->reducer && rt->device_turn != nullptr) {
      throw UserError("data-parallel replicas need each stage on its own device; pipeline.devices gives stage " +
                      std::to_string(rt->index) + "'s device to another stage too");
    }
  }
  // Threads per process: K in one process, or one stage per process (one per core).
  const int threads = options_.local_stage < 0 ? K : 1;
  const bool pin = options_.pin_threads && static_cast<unsigned>(threads) <= std::thread::hardware_concurrency();
  for (int k = 0; k < K; ++k) {
    if (!runtimes_[k]->local) continue;
    const int core = options_.local_stage < 0 ? k : 0;
    workers_.emplace_back([this, k, pin, core] {
      bind_thread_to_device(stages_[k].device);  // before any CUDA call: its own GPU, never GPU 0 by default
      set_thread_context(options_.rank, k);
      if (pin && options_.local_stage < 0) pin_to_core(core);
      worker_main(k);
    });
  }
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void Executor::set_lr(double lr) {
  for (auto& rt : runtimes_) {
    if (rt->optimizer) rt->optimizer->set_lr(lr);
  }
}

void Executor::worker_main(int k) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, [&] { return shutdown_ || generation_ != seen; });
      if (shutdown_) return;
      seen = generation_;
    }
    run_stage(k);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0) cv_done_.notify_all();
    }
  }
}

std::unique_lock<std::mutex> Executor::device_turn(int k) {
  std::mutex* m = runtimes_[k]->device_turn;
  return m != nullptr ? std::unique_lock<std::mutex>(*m) : std::unique_lock<std::mutex>();
}

void Executor::run_stage(int k) {
  StageRuntime& rt = *runtimes_[k];
  const int K = static_cast<int>(stages_.size());
  const int M = schedule_.num_micro_batches;
  const bool last = k == K - 1;
  Backend& be = *rt.backend;
  const Device dev = rt.spec.device;
  layers::Loss& loss = model_.loss();
  rt.trace = StageTrace{};
  rt.mbs.assign(M, MicroBatch{});
  rt.trace.ops.reserve(schedule_.stages[k].size());
  // The schedule decides rematerialization: a micro-batch is checkpointed on this
  // stage exactly when the stage's program recomputes it.
  std::vector<char> checkpointed(M, 0);
  size_t last_backward = 0;  // the instruction after which every gradient is final
  for (size_t i = 0; i < schedule_.stages[k].size(); ++i) {
    const Instruction& ins = schedule_.stages[k][i];
    if (ins.op == Op::kRecompute) checkpointed[ins.micro_batch] = 1;
    if (ins.op == Op::kBackward) last_backward = i;
  }
  GradReducer* reducer = rt.reducer.get();
  rt.live_bytes = 0;
  rt.error = nullptr;
  rt.error_is_abort = false;
  rt.grad_norm = -1;

  auto to_device = [&](const Tensor& host) {
    if (host.device() == dev || (host.device().is_cpu() && dev.is_cpu())) return host;
    Tensor t = be.empty(host.shape(), host.dtype());
    be.copy(host, t);
    return t;
  };
  // Runs the cell's forward; with keep, records every layer's context (and the loss's).
  // A recompute only rebuilds the contexts: its output was sent already.
  auto cell_forward = [&](MicroBatch& mb, int m, bool keep, bool recompute) {
    Tensor h = mb.input;
    if (keep) mb.ctx.assign(rt.spec.num_layers, {});
    layers::ForwardArgs args;
    args.step = cur_.step;
    args.sample_offset = cur_.offsets[m];
    args.recompute = recompute;
    for (int i = 0; i < rt.spec.num_layers; ++i) {
      h = model_.layer(rt.spec.first_layer + i).forward(be, h, keep ? &mb.ctx[i] : nullptr, args);
    }
    if (last) {
      if (!mb.targets.defined()) {
        mb.targets = to_device(cur_.targets.narrow_rows(cur_.offsets[m], cur_.sizes[m]));
      }
      Tensor l = loss.forward(be, h, mb.targets, cur_.scale, keep ? &mb.loss_ctx : nullptr);
      if (!recompute) mb.loss = l;
    } else if (!recompute) {
      mb.output = h;
    }
  };
  auto now_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - cur_.epoch).count();
  };

  // Each stage clears its own gradients, on its own device, in parallel: right after
  // its optimizer step (so the next step starts at once), or here when the previous
  // step kept its gradients for inspection.
  auto zero_grads = [&] {
    for (int i = rt.spec.first_layer; i < rt.spec.first_layer + rt.spec.num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) be.fill(p->grad, 0.0);
    }
    rt.grads_dirty = false;
  };

  try {
    if (rt.grads_dirty) {
      auto turn = device_turn(k);
      zero_grads();
    }
    rt.grads_dirty = true;
    for (size_t pc = 0; pc < schedule_.stages[k].size(); ++pc) {
      const Instruction& ins = schedule_.stages[k][pc];
      const int m = ins.micro_batch;
      const double t0 = now_ms();
      switch (ins.op) {
        case Op::kRecvActivation:
          rt.mbs[m].input = transport_.recv(k, k - 1, {MessageKind::kActivation, m}, dev);
          break;
        case Op::kForward: {
          auto turn = device_turn(k);
          MicroBatch& mb = rt.mbs[m];
          if (k == 0) mb.input = to_device(cur_.inputs.narrow_rows(cur_.offsets[m], cur_.sizes[m]));
          const bool ckpt = checkpointed[m];
          cell_forward(mb, m, /*keep=*/!ckpt, /*recompute=*/false);
          // A checkpointed micro-batch keeps only its input; otherwise the contexts
          // hold whatever backward needs and the input may go.
          if (!ckpt) mb.input = Tensor();
          break;
        }
        case Op::kSendActivation: {
          MicroBatch& mb = rt.mbs[m];
          transport_.send(k, k + 1, {MessageKind::kActivation, m}, mb.output);
          mb.output = Tensor();
          break;
        }
        case Op::kRecompute: {
          auto turn = device_turn(k);
          cell_forward(rt.mbs[m], m, /*keep=*/true, /*recompute=*/true);
          break;
        }
        case Op::kRecvGradient:
          rt.mbs[m].grad_output = transport_.recv(k, k + 1, {MessageKind::kGradient, m}, dev);
          break;
        case Op::kBackward: {
          auto turn = device_turn(k);
          MicroBatch& mb = rt.mbs[m];
          GPIPE_CHECK(static_cast<int>(mb.ctx.size()) == rt.spec.num_layers,
                      "backward of micro-batch " + std::to_string(m) + " without its forward contexts");
          Tensor g = last ? loss.backward(be, mb.loss_ctx) : mb.grad_output;
          const bool final_grads = reducer != nullptr && pc == last_backward;
          for (int i = rt.spec.num_layers - 1; i >= 0; --i) {
            const bool need_dx = i > 0 || k > 0;
            layers::Layer& layer = model_.layer(rt.spec.first_layer + i);
            g = layer.backward(be, g, mb.ctx[i], need_dx);
            if (final_grads) {
              for (layers::Parameter* p : layer.parameters()) reducer->ready(p);
              reducer->progress();
            }
          }
          mb.grad_input = g;
          // Everything but the gradient to send (and the loss value) is released here.
          mb.ctx.clear();
          mb.loss_ctx = {};
          mb.input = Tensor();
          mb.grad_output = Tensor();
          break;
        }
        case Op::kSendGradient: {
          MicroBatch& mb = rt.mbs[m];
          transport_.send(k, k - 1, {MessageKind::kGradient, m}, mb.grad_input);
          mb.grad_input = Tensor();
          break;
        }
        case Op::kOptimizerStep: {
          if (rt.reducer) rt.reducer->finish(rt.optimizer->params());  // its device is not shared (checked)
          sum_tied_gradients(k);
          if (!cur_.apply_optimizer) break;  // the gradients stay for inspection
          {
            // A device backend reports bad data (a token id, a label) at its next wait:
            // wait here, once per step, so that such an error stops the step before this
            // stage's weights change.
            auto turn = device_turn(k);
            be.synchronize();
          }
          if (options_.clip_grad_norm > 0) clip_gradients(k);
          auto turn = device_turn(k);
          rt.optimizer->step();
          zero_grads();
          for (int i = rt.spec.first_layer; i < rt.spec.first_layer + rt.spec.num_layers; ++i) {
            model_.layer(i).end_step(be, rt.replica_sum);
          }
          break;
        }
      }
      if (m >= 0) {
        MicroBatch& mb = rt.mbs[m];
        const int64_t now_held = held_bytes(mb);
        rt.live_bytes += now_held - mb.held_bytes;
        mb.held_bytes = now_held;
        rt.trace.peak_activation_bytes = std::max(rt.trace.peak_activation_bytes, rt.live_bytes);
      }
      rt.trace.ops.push_back({ins.op, m, t0, now_ms()});
    }
    transport_.flush(k);
    auto turn = device_turn(k);
    be.synchronize();
  } catch (const Aborted& e) {
    rt.error = std::current_exception();
    rt.error_is_abort = true;
    rt.error_text = e.what();
  } catch (const std::exception& e) {
    rt.error = std::current_exception();
    rt.error_text = e.what();
    transport_.abort("stage " + std::to_string(k) + " failed: " + rt.error_text);
  }
}

int Executor::stage_of(int layer) const {
  for (const StageSpec& s : stages_) {
    if (layer >= s.first_layer && layer < s.first_layer + s.num_layers) return static_cast<int>(&s - stages_.data());
  }
  throw Error("layer " + std::to_string(layer) + " is in no stage");
}

// Both copies of a tied weight get the sum of their gradients. On one stage that is
// local; across stages the copy's stage sends its gradient to the owner's, which adds
// it and sends the sum back. Both send copies: a send may still read its tensor when
// the sender overwrites or clears its gradient.
void Executor::sum_tied_gradients(int k) {
  StageRuntime& rt = *runtimes_[k];
  Backend& be = *rt.backend;
  const Device dev = rt.spec.device;
  const auto& ties = model_.ties();
  for (size_t i = 0; i < ties.size(); ++i) {
    const layers::Tie& t = ties[i];
    const int so = stage_of(t.owner_layer), sc = stage_of(t.copy_layer);
    const MessageTag tag{MessageKind::kTiedGradient, static_cast<int>(i)};
    if (so == k && sc == k) {
      auto turn = device_turn(k);
      layers::Sequential::sum_tied_gradient(be, t);
    } else if (sc == k) {
      Tensor mine = be.empty(t.copy->grad.shape(), t.copy->grad.dtype());  // the send may outlive the next line
      {
        auto turn = device_turn(k);
        be.copy(t.copy->grad, mine);
      }
      transport_.send(k, so, tag, mine);
      Tensor sum = transport_.recv(k, so, tag, dev);
      auto turn = device_turn(k);
      be.copy(sum, t.copy->grad);
    } else if (so == k) {
      Tensor other = transport_.recv(k, sc, tag, dev);
      Tensor sum = be.empty(t.owner->grad.shape(), t.owner->grad.dtype());
      {
        auto turn = device_turn(k);
        be.axpy(1.0, other, t.owner->grad);
        be.copy(t.owner->grad, sum);
      }
      transport_.send(k, sc, tag, sum);
    }
  }
}

void Executor::clip_gradients(int k) {
  StageRuntime& rt = *runtimes_[k];
  double local = 0;
  {
    auto turn = device_turn(k);
    for (layers::Parameter* p : rt.optimizer->params()) {
      if (!model_.is_tied_copy(p)) local += rt.backend->sum_squares(p->grad);  // a tied weight counts once
    }
  }
  const double norm = std::sqrt(transport_.all_reduce_sum(k, local));
  rt.grad_norm = norm;
  // As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when above.
  const double coef = options_.clip_grad_norm / (norm + 1e-6);
  if (coef < 1.0) {
    auto turn = device_turn(k);
    for (layers::Parameter* p : rt.optimizer->params()) rt.backend->scale(p->grad, coef);
  }
}

StepResult Executor::step(const Tensor& inputs, const Tensor& targets, bool apply_optimizer) {
  if (failed_) throw Error("the pipeline stopped after an earlier failure; start a new run");
  const int M = schedule_.num_micro_batches;
  if (!inputs.device().is_cpu() || !targets.device().is_cpu()) throw Error("step() takes host tensors");
  if (inputs.dim() < 1 || targets.dim() < 1 || inputs.size(0) != targets.size(0)) {
    throw UserError("inputs " + inputs.str() + " and targets " + targets.str() + " must have the same batch size");
  }
  const int64_t n = inputs.size(0);
  cur_.inputs = inputs;
  cur_.targets = targets;
  cur_.sizes = split_sizes(n, M);
  cur_.offsets.assign(M, 0);
  for (int m = 1; m < M; ++m) cur_.offsets[m] = cur_.offsets[m - 1] + cur_.sizes[m - 1];
  // Mean over the labelled samples of the whole mini-batch, however it is split.
  int64_t counted = targets.numel();
  if (auto* xent = dynamic_cast<layers::SoftmaxCrossEntropy*>(&model_.loss())) {
    const int32_t* t = targets.data<int32_t>();
    counted = std::count_if(t, t + targets.numel(), [&](int32_t v) { return v != xent->ignore_index(); });
  }
  // With replicas, over the whole mini-batch: each replica's share of the loss and of
  // the gradients is then already scaled for the sum over replicas, however unevenly
  // the ignored targets fall.
  if (options_.replicas != nullptr && options_.replicas->size() > 1) {
    counted = static_cast<int64_t>(options_.replicas->all_reduce_sum(static_cast<double>(counted)));
  }
  cur_.scale = counted > 0 ? 1.0 / static_cast<double>(counted) : 0.0;
  cur_.apply_optimizer = apply_optimizer;
  cur_.step = steps_done_++;
  cur_.epoch = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  cv_start_.notify_all();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [&] { return running_ == 0; });
  }
  StepResult result;
  result.wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - cur_.epoch).count();

  // The first real failure wins; the others were told to stop because of it.
  for (auto& rt : runtimes_) {
    if (rt->error && !rt->error_is_abort) {
      failed_ = true;
      const StageSpec& s = rt->spec;
      const std::string msg = "stage " + std::to_string(rt->index) + " (layers " + std::to_string(s.first_layer) +
                              ".." + std::to_string(s.first_layer + s.num_layers - 1) + " on " + s.device.str() +
                              ") failed: " + rt->error_text;
      for (auto& other : runtimes_) other->mbs.clear();
      try {
        std::rethrow_exception(rt->error);
      } catch (const UserError&) {
        throw UserError(msg);
      } catch (...) {
        throw Error(msg);
      }
    }
  }
  for (auto& rt : runtimes_) {
    if (rt->error) {
      failed_ = true;
      throw Error("stage " + std::to_string(rt->index) + " stopped: " + rt->error_text);
    }
  }
  StageRuntime& last = *runtimes_.back();
  if (last.local) {
    for (auto& mb : last.mbs) result.loss += last.backend->item(mb.loss);
  }
  if (options_.local_stage >= 0) {
    // Only the last stage's process has the loss; every process learns it.
    result.loss = transport_.all_reduce_sum(options_.local_stage, result.loss);
    result.grad_norm = runtimes_[options_.local_stage]->grad_norm;
  } else {
    result.grad_norm = last.grad_norm;
  }
  if (options_.replicas != nullptr && options_.replicas->size() > 1) {
    result.loss = options_.replicas->all_reduce_sum(result.loss);
  }
  for (auto& rt : runtimes_) {
    result.stages.push_back(std::move(rt->trace));  // empty for stages of other processes
    rt->mbs.clear();
  }
  return result;
}

}  // namespace pipeline
}  // namespace gpipe

#include "pipeline/executor/executor.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "kernels/op_log.h"
#include "layers/loss.h"
#include "pipeline/executor/held_bytes.h"
#include "pipeline/executor/stage_runtime.h"
#include "runtime/allocator.h"
#include "runtime/device_binding.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// Bytes of the distinct buffers a micro-batch holds (held_bytes.h: the planner counts
// the same way).
template <typename MB>
int64_t held_bytes(const MB& mb) {
  BufferList held;
  for (const Tensor* t : {&mb.input, &mb.output, &mb.grad_output, &mb.grad_input}) add_buffer(*t, held);
  for (const auto& c : mb.ctx) add_buffers(c, held);
  add_buffers(mb.loss_ctx, held);
  return distinct_bytes(std::move(held));
}

void pin_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    spdlog::debug("could not pin the stage thread to core {}", core);
  }
}

// Which instructions open and close a group of messages: each maximal run of
// consecutive sends and receives (one ncclGroupStart/End on a GPU transport).
void message_groups(const std::vector<Instruction>& prog, std::vector<char>& begins, std::vector<char>& ends) {
  begins.clear();
  ends.clear();
  for (size_t i = 0; i < prog.size(); ++i) {
    const bool comm = is_communication(prog[i].op);
    begins.push_back(comm && (i == 0 || !is_communication(prog[i - 1].op)));
    ends.push_back(comm && (i + 1 == prog.size() || !is_communication(prog[i + 1].op)));
  }
}

// Where a training step clears the gradients: before the program's first receive
// (GPipe's last stage waits there for the first activation, its first stage for the
// last gradient, 1F1B's first stage for the first gradient), unless an instruction
// that adds to the gradients or reads them (B, W, a collective, OPT) comes first.
// Clearing them inside that wait takes the pass over every gradient off the step's
// critical path; clearing them right after OPT, as before, put it at the step's end.
size_t first_gradient_wait(const std::vector<Instruction>& prog) {
  for (size_t i = 0; i < prog.size(); ++i) {
    const Op op = prog[i].op;
    if (op == Op::kRecvActivation || op == Op::kRecvGradient || op == Op::kBackward || op == Op::kBackwardWeight ||
        op == Op::kOptimizerStep || is_collective(op)) {
      return i;
    }
  }
  return prog.size();
}

std::string layer_range(const CellSpec& c) {
  return std::to_string(c.first_layer) + ".." + std::to_string(c.first_layer + c.num_layers - 1);
}

}  // namespace

// What a split layer asks of its tensor group, run as the program says
// (Executor::tensor_collective) over the stage's real group.
class Executor::ProgramCollectives : public layers::TensorCollectives {
 public:
  ProgramCollectives(Executor& executor, layers::GroupCollectives& group) : ex_(executor), group_(group) {}
  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  void all_reduce_sum(Backend& be, Tensor& t) override {
    ex_.tensor_collective(Op::kTensorSum, moved_bytes(t), [&] { group_.all_reduce_sum(be, t); });
  }
  void all_reduce_max(Backend& be, Tensor& t) override {
    ex_.tensor_collective(Op::kTensorMax, moved_bytes(t), [&] { group_.all_reduce_max(be, t); });
  }
  void all_gather_positions(Backend& be, const Tensor& shard, Tensor& whole) override {
    ex_.tensor_collective(Op::kTensorGather, moved_bytes(whole), [&] { group_.all_gather_positions(be, shard, whole); });
  }
  void reduce_scatter_positions(Backend& be, const Tensor& whole, Tensor& shard) override {
    ex_.tensor_collective(Op::kTensorScatter, moved_bytes(whole),
                          [&] { group_.reduce_scatter_positions(be, whole, shard); });
  }
  void await_queued() override { group_.await_queued(); }

 private:
  // As the group moves it: a narrow tensor in float32 (TensorOp::bytes).
  static int64_t moved_bytes(const Tensor& t) {
    return t.numel() * static_cast<int64_t>(is_narrow(t.dtype()) ? 4 : dtype_size(t.dtype()));
  }
  Executor& ex_;
  layers::GroupCollectives& group_;
};

Executor::Executor(layers::Sequential& model, std::vector<CellSpec> cells, Schedule schedule, Transport& transport,
                   ExecutorOptions options)
    : model_(model), cells_(std::move(cells)), schedule_(std::move(schedule)), transport_(transport),
      options_(options) {
  const int K = schedule_.num_stages;
  check_cells();
  // The collectives this run needs (the plan's schedule holds them already; a schedule
  // made by hand gets them here), then the whole program is checked.
  lower_collectives(schedule_, run_collectives(model_, cells_, options_.replicas != nullptr && options_.replicas->size() > 1,
                                               options_.clip_grad_norm > 0 || options_.loss_scale > 0,
                                               options_.shard_optimizer));
  const CommModel comm = transport_.sends_wait_for_receiver() ? CommModel::kRendezvous : CommModel::kBuffered;
  check_schedule(schedule_, comm);
  // The tensor group's collectives, each where a compute instruction asks it (the plan's
  // schedule holds them already), on the program checked above; then checked with them.
  const bool tensor = options_.tensor_group != nullptr && options_.tensor_group->size() > 1;
  if (tensor) {
    lower_tensor_collectives(schedule_, run_tensor_program(model_, cells_, options_.tensor_group->rank(),
                                                           options_.tensor_group->size()));
    check_schedule(schedule_, comm);
  } else if (schedule_.tensor_lowered && schedule_.tensor.members > 1) {
    throw Error("schedule '" + schedule_.name + "' holds a tensor group's collectives, but the executor has no tensor "
                "group (ExecutorOptions::tensor_group)");
  }
  model_.loss();  // the last cell needs one: fail now, not in a worker
  if (!options_.micro_batch_sizes.empty() &&
      static_cast<int>(options_.micro_batch_sizes.size()) != schedule_.num_micro_batches) {
    throw Error("the plan has " + std::to_string(options_.micro_batch_sizes.size()) + " micro-batch sizes for a " +
                std::to_string(schedule_.num_micro_batches) + "-micro-batch schedule");
  }
  if (options_.local_stage >= K) {
    throw UserError("this process was asked to run stage " + std::to_string(options_.local_stage) + " of a " +
                    std::to_string(K) + "-stage pipeline");
  }
  if (options_.loss_scale < 0 || !std::isfinite(options_.loss_scale) || options_.loss_scale_window < 1) {
    throw UserError("loss scaling needs a positive, finite initial scale and a window of at least 1 step");
  }
  loss_scale_ = options_.loss_scale;
  if (tensor) {
    // One group per stage: a process (or thread) runs one stage of its tensor group.
    GPIPE_CHECK(options_.local_stage >= 0, "a tensor group needs its stage local to this executor (local_stage)");
    tensor_group_ = std::make_unique<layers::GroupCollectives>(*options_.tensor_group);
    tensor_collectives_ = std::make_unique<ProgramCollectives>(*this, *tensor_group_);
    model_.set_collectives(tensor_collectives_.get());  // only the local stage's layers (and loss) run here
  }
  if (options_.capture && options_.op_times) {
    throw UserError(
        "trace.ops times each op of a step one by one, and pipeline.capture replays the step as one launch, whose ops "
        "are not run one by one: set trace.ops: false, or pipeline.capture: false for the run that times the ops");
  }
  if (options_.capture) {
    const bool replicas = options_.replicas != nullptr && options_.replicas->size() > 1;
    bool one_device = true;
    for (const CellSpec& cell : cells_) one_device = one_device && cell.device == cells_[0].device;
    const bool here = options_.local_stage < 0;  // every stage a thread of this process
    if (replicas || tensor || (K > 1 && !(one_device && here))) {
      throw UserError(std::string("pipeline.capture captures the step of one stage, or of stages that one process "
                                  "runs on one device, without replicas or a tensor group; this run has ") +
                      std::to_string(K) + " stages" + (K > 1 && !one_device ? " on several devices" : "") +
                      (K > 1 && !here ? " in several processes" : "") + (replicas ? ", replicas" : "") +
                      (tensor ? ", a tensor group" : "") +
                      ": set pipeline.capture: false, or train on one stage (pipeline.partitions: 1), or put every "
                      "stage on one device (pipeline.devices)");
    }
    if (K > 1) capture_group_ = std::make_unique<CaptureGroup>(K);
  }
  for (int k = 0; k < K; ++k) runtimes_.push_back(make_stage(k));
  share_devices();
  if (capture_group_) {
    // Captured together or not at all: a stage that cannot be captured keeps them all op by op.
    bool failed = false;
    for (const auto& rt : runtimes_) failed = failed || rt->capture_failed;
    for (auto& rt : runtimes_) {
      rt->capture_failed = failed;
      rt->norm_part = rt->backend->zeros({kStepScalarCount}, DType::kF64);
    }
  }
  start_workers();
}

// The cells cover the model's layers in order, one cell per cell of the schedule.
void Executor::check_cells() const {
  const int K = schedule_.num_stages, C = schedule_.num_cells();
  if (static_cast<int>(cells_.size()) != C) {
    throw UserError("the schedule runs " + std::to_string(C) + " cells on " + std::to_string(K) + " stages but " +
                    std::to_string(cells_.size()) + " cells were given");
  }
  int expect_first = 0;
  for (int c = 0; c < C; ++c) {
    const CellSpec& s = cells_[c];
    if (s.first_layer != expect_first || s.num_layers < 1) {
      throw UserError("cell " + std::to_string(c) + " must start at layer " + std::to_string(expect_first) +
                      " and hold at least one layer");
    }
    expect_first += s.num_layers;
  }
  if (expect_first != model_.size()) {
    throw UserError("the cells hold " + std::to_string(expect_first) + " layers but the model has " +
                    std::to_string(model_.size()));
  }
}

// Stage k's runtime: its cells' device, and on this process its backend, clock,
// optimizer and replicas' reducer; then what its program says (read_program).
std::unique_ptr<Executor::StageRuntime> Executor::make_stage(int k) {
  auto rt = std::make_unique<StageRuntime>();
  rt->index = k;
  rt->cells = schedule_.cells[k];
  rt->device = cells_[rt->cells[0]].device;
  for (int c : rt->cells) {
    if (!(cells_[c].device == rt->device)) {
      throw UserError("stage " + std::to_string(k) + " runs cells on " + rt->device.str() + " and " +
                      cells_[c].device.str() + "; the cells of one stage share its device");
    }
  }
  rt->local = options_.local_stage < 0 || options_.local_stage == k;
  if (rt->local) {
    rt->backend = &backend_for(rt->device);
    // A captured step's instructions are timed by the events it records (a replay
    // runs no host code between them), on the CPU too.
    rt->clock = std::make_unique<OpClock>(rt->device, options_.device_clock_on_cpu || options_.capture);
    if (options_.op_times) rt->op_timer = std::make_unique<OpTimer>(rt->device, rt->backend->stream());
    std::vector<layers::Parameter*> params;
    for (int c : rt->cells) {
      for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
        model_.layer(i).to(rt->device);
        for (auto* p : model_.layer(i).parameters()) params.push_back(p);
      }
    }
    rt->params = params;
    if (options_.capture) {
      // A layer that does host work of its own in a step cannot be replayed: say so once
      // and run the stage's steps op by op.
      for (int c : rt->cells) {
        for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers && !rt->capture_failed; ++i) {
          if (model_.layer(i).capturable()) continue;
          rt->capture_failed = true;
          spdlog::warn("stage {}: its training step cannot be captured: layer {} ({}) does host work in each step; "
                       "the run goes on without capture", k, i, model_.layer(i).describe());
        }
      }
    }
    rt->scalars = rt->backend->empty({kStepScalarCount}, DType::kF64);
    if (schedule_.collectives.replicas && schedule_.collectives.shard_optimizer) {
      make_sharding(*rt);  // the optimizer over this replica's shard
    } else {
      rt->optimizer = layers::make_optimizer(params, options_.optimizer);
    }
    if (options_.replicas != nullptr && options_.replicas->size() > 1) {
      ReplicaGroup* group = options_.replicas;
      if (!rt->sharding) rt->reducer = std::make_unique<GradReducer>(*group, *rt->backend, options_.bucket_bytes);
      rt->replica_sum = [group](std::vector<double>& v) {
        Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kF64, Device::cpu());
        std::copy(v.begin(), v.end(), t.data<double>());
        group->all_reduce_sum(t);
        std::copy(t.data<double>(), t.data<double>() + v.size(), v.begin());
      };
    }
  }
  read_program(*rt);
  return rt;
}

// What the stage's program says, once: which (chunk, micro-batch) recompute and which
// split into B and W, after which instruction each layer's gradients are final, and
// which instructions open and close a group of messages.
void Executor::read_program(StageRuntime& rt) {
  const int k = rt.index;
  const auto& prog = schedule_.stages[k];
  const int v = schedule_.num_chunks();
  MicroBatchRoles roles = micro_batch_roles(schedule_, k);
  // A layer's gradients are final after the last instruction that adds to them: the
  // chunk's last backward, or for a layer that splits its backward, the last weight
  // gradient or whole backward (one without a W) of the chunk.
  const ChunkFinals finals = chunk_finals(schedule_, k, roles);
  rt.checkpointed = std::move(roles.recomputed);
  rt.split = std::move(roles.split);
  message_groups(prog, rt.group_begins, rt.group_ends);
  rt.zero_at = first_gradient_wait(prog);
  rt.final_layers.assign(prog.size(), {});
  for (int j = 0; j < v; ++j) {
    const CellSpec& cell = cells_[rt.cells[j]];
    for (int i = cell.first_layer; i < cell.first_layer + cell.num_layers; ++i) {
      const long at = finals.at(j, model_.layer(i).splits_backward());
      if (at >= 0) rt.final_layers[at].push_back(i);
    }
  }
}

// Stages of this process that share a device take turns on its backend.
void Executor::share_devices() {
  const int K = schedule_.num_stages;
  std::vector<Device> devices;
  for (const auto& rt : runtimes_) devices.push_back(rt->device);
  const std::vector<int> turns = device_turns(devices, options_.local_stage < 0);  // as the Plan has them
  for (int k = 0; k < K; ++k) {
    const int j = turns[k];
    if (j == k || !runtimes_[k]->local) continue;
    if (runtimes_[j]->device_turn == nullptr) {
      device_turns_.push_back(std::make_unique<std::mutex>());
      runtimes_[j]->device_turn = device_turns_.back().get();
    }
    runtimes_[k]->device_turn = runtimes_[j]->device_turn;
  }
  for (const auto& rt : runtimes_) {
    // A replica's collectives block; a stage must not block while other stages wait for
    // their turn on its device.
    if ((rt->reducer || rt->sharding) && rt->device_turn != nullptr) {
      throw UserError("data-parallel replicas need each stage on its own device; pipeline.devices gives stage " +
                      std::to_string(rt->index) + "'s device to another stage too");
    }
  }
}

// One worker thread per local stage, bound to its device (and pinned to a core).
void Executor::start_workers() {
  const int K = schedule_.num_stages;
  // Threads per process: K in one process, or one stage per process (one per core).
  const int threads = options_.local_stage < 0 ? K : 1;
  const bool pin = options_.pin_threads && static_cast<unsigned>(threads) <= std::thread::hardware_concurrency();
  for (int k = 0; k < K; ++k) {
    if (!runtimes_[k]->local) continue;
    const int core = options_.local_stage < 0 ? k : 0;
    workers_.emplace_back([this, k, pin, core] {
      bind_thread_to_device(runtimes_[k]->device);  // before any CUDA call: its own GPU, never GPU 0 by default
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

Executor::Turn Executor::device_turn(int k) {
  StageRuntime& rt = *runtimes_[k];  // called by stage k's own thread
  if (rt.device_turn == nullptr) return {};
  // The times only a CPU's instructions are timed by (a GPU's by its stream's events).
  const bool timed = rt.device.is_cpu();
  Turn turn(*rt.device_turn, this, timed ? &rt.turn_end_ms : nullptr);
  if (timed && rt.turn_at_ms < 0) rt.turn_at_ms = now_ms();
  return turn;
}

void Executor::set_loss_scale(double scale, int clean_steps) {
  if (options_.loss_scale <= 0) return;  // off: nothing to carry
  if (scale == 0) return;  // saved without loss scaling (a float32 or bf16 run): start from the configured scale
  if (!(scale >= 1.0) || !std::isfinite(scale) || clean_steps < 0) {
    throw UserError("a loss scale of " + std::to_string(scale) + " after " + std::to_string(clean_steps) +
                    " clean steps cannot be resumed; it must be at least 1");
  }
  loss_scale_ = scale;
  clean_steps_ = clean_steps;
}

Tensor Executor::to_device(StageRuntime& rt, const Tensor& host) {
  if (host.device() == rt.device || (host.device().is_cpu() && rt.device.is_cpu())) return host;
  Tensor t = rt.backend->empty(host.shape(), host.dtype());
  rt.backend->copy(host, t);
  return t;
}

// Each stage clears its own gradients, on its own device, in parallel, once per
// training step, before its program's first receive (first_gradient_wait): after a
// step they hold what the optimizer applied (or, without it, what was accumulated).
void Executor::zero_grads(StageRuntime& rt) {
  std::vector<Tensor> grads;
  for (auto* p : rt.params) grads.push_back(p->grad);
  rt.backend->fill_all(grads, 0.0);  // one launch on a GPU
}

// The cell's forward; a first forward keeps what backward needs (or, for a
// checkpointed micro-batch, only the cell's input), a recompute rebuilds the contexts
// from that input. The output goes to the next cell: into its input on this stage, or
// out for sending.
void Executor::forward(StageRuntime& rt, const Instruction& ins, bool recompute) {
  const int m = ins.micro_batch, c = rt.cells[ins.chunk], C = schedule_.num_cells();
  const CellSpec& cell = cells_[c];
  Backend& be = *rt.backend;
  MicroBatch& mb = rt.mbs[ins.chunk][m];
  if (c == 0 && !recompute) {
    mb.input = rt.fixed_io ? rt.fixed_inputs[m] : to_device(rt, cur_.inputs.narrow_rows(cur_.offsets[m], cur_.sizes[m]));
  }
  GPIPE_CHECK(mb.input.defined(), "forward of micro-batch " + std::to_string(m) + " of cell " + std::to_string(c) +
                                      " without its input");
  const bool eval = cur_.eval != nullptr;
  const bool keep = !eval && (recompute || !rt.checkpointed[ins.chunk][m]);
  layers::ForwardArgs args;
  args.training = !eval;
  args.step = cur_.step;
  if (!eval) args.step_scalars = rt.scalars;  // holding cur_.step: dropout's keys read it there
  args.sample_offset = options_.sample_offset + cur_.offsets[m];
  args.recompute = recompute;
  if (keep) mb.ctx.assign(cell.num_layers, {});
  Tensor h = mb.input;
  for (int i = 0; i < cell.num_layers; ++i) {
    h = model_.layer(cell.first_layer + i).forward(be, h, keep ? &mb.ctx[i] : nullptr, args);
  }
  if (c == C - 1) {
    if (!mb.targets.defined()) {
      mb.targets = rt.fixed_io ? rt.fixed_targets[m] : to_device(rt, cur_.targets.narrow_rows(cur_.offsets[m], cur_.sizes[m]));
    }
    // The loss's factor read from the step's scalars in a training step (LossScale).
    const LossScale scale = eval ? LossScale(cur_.scale) : LossScale(cur_.scale, rt.scalars);
    Tensor l = model_.loss().forward(be, h, mb.targets, scale, keep ? &mb.loss_ctx : nullptr);
    if (!recompute) mb.loss = l;
    if (eval) mb.correct = model_.loss().correct(be, h, mb.targets);  // on the logits' device: only the count comes back
  } else if (!recompute) {
    if (schedule_.stage_of_cell(c + 1) == rt.index) {
      rt.mbs[schedule_.chunk_of_cell(c + 1)][m].input = h;  // the next cell is ours
    } else {
      mb.output = h;
    }
  }
  // A checkpointed micro-batch keeps only its input; otherwise the contexts hold
  // whatever backward needs and the input may go. Evaluation keeps nothing.
  if (!recompute && (keep || eval)) mb.input = Tensor();
}

// The cell's backward, from the loss (the model's last cell) or the output gradient:
// the whole backward, or with a W to come only the input gradient, the contexts kept
// for it. With replicas, each layer whose gradients are now final joins a bucket.
void Executor::backward(StageRuntime& rt, const Instruction& ins, size_t pc) {
  const int m = ins.micro_batch, c = rt.cells[ins.chunk], C = schedule_.num_cells();
  const CellSpec& cell = cells_[c];
  Backend& be = *rt.backend;
  MicroBatch& mb = rt.mbs[ins.chunk][m];
  GPIPE_CHECK(static_cast<int>(mb.ctx.size()) == cell.num_layers,
              "backward of micro-batch " + std::to_string(m) + " of cell " + std::to_string(c) +
                  " without its forward contexts");
  const bool split = rt.split[ins.chunk][m];
  Tensor g = c == C - 1 ? model_.loss().backward(be, mb.loss_ctx) : mb.grad_output;
  GPIPE_CHECK(g.defined(), "backward of micro-batch " + std::to_string(m) + " of cell " + std::to_string(c) +
                               " without its output gradient");
  const auto& final_layers = rt.final_layers[pc];
  for (int i = cell.num_layers - 1; i >= 0; --i) {
    const bool need_dx = i > 0 || c > 0;
    const int index = cell.first_layer + i;
    layers::Layer& layer = model_.layer(index);
    if (split) {
      g = layer.backward_input(be, g, mb.ctx[i], need_dx);
      if (!layer.splits_backward()) mb.ctx[i] = {};  // its W does nothing: nothing to keep
    } else {
      g = layer.backward(be, g, mb.ctx[i], need_dx);
    }
    if (std::find(final_layers.begin(), final_layers.end(), index) != final_layers.end()) gradients_final(rt, layer);
  }
  if (c > 0 && schedule_.stage_of_cell(c - 1) == rt.index) {
    rt.mbs[schedule_.chunk_of_cell(c - 1)][m].grad_output = g;  // the previous cell is ours
  } else {
    mb.grad_input = g;
  }
  // Everything but the gradient to send (and the loss value) is released here, unless
  // a weight gradient still needs the contexts.
  if (!split) mb.ctx.clear();
  mb.loss_ctx = {};
  mb.input = Tensor();
  mb.grad_output = Tensor();
}

// The weight gradients a split backward deferred, layer by layer as backward would.
// W of one micro-batch, or a batched W of several: each layer's weight gradients over
// all of them at once (Layer::backward_weight of their contexts).
void Executor::weight_gradient(StageRuntime& rt, const Instruction& ins, size_t pc) {
  const int c = rt.cells[ins.chunk];
  const CellSpec& cell = cells_[c];
  std::vector<MicroBatch*> mbs;
  for (int m : ins.micro_batches()) {
    MicroBatch& mb = rt.mbs[ins.chunk][m];
    GPIPE_CHECK(static_cast<int>(mb.ctx.size()) == cell.num_layers,
                "weight gradient of micro-batch " + std::to_string(m) + " of cell " + std::to_string(c) +
                    " without its backward");
    mbs.push_back(&mb);
  }
  const auto& final_layers = rt.final_layers[pc];
  std::vector<layers::Context*> ctxs(mbs.size());
  for (int i = cell.num_layers - 1; i >= 0; --i) {
    const int index = cell.first_layer + i;
    layers::Layer& layer = model_.layer(index);
    for (size_t j = 0; j < mbs.size(); ++j) ctxs[j] = &mbs[j]->ctx[i];
    layer.backward_weight(*rt.backend, ctxs);
    if (std::find(final_layers.begin(), final_layers.end(), index) != final_layers.end()) gradients_final(rt, layer);
  }
  for (MicroBatch* mb : mbs) mb->ctx.clear();
}


// A layer's gradients are final for this step: under sequence parallelism those that saw
// only this member's positions (Parameter::sequence_partial) are summed over the tensor
// group first, in the same order on every member (they run the same program); then with
// replicas the layer's parameters join a bucket.
void Executor::gradients_final(StageRuntime& rt, layers::Layer& layer) {
  if (tensor_collectives_ != nullptr) {
    std::vector<layers::Parameter*> partial;
    for (layers::Parameter* p : layer.parameters()) {
      if (p->sequence_partial) partial.push_back(p);
    }
    sum_over_tensor_group(*rt.backend, partial);
  }
  if (!rt.reducer) return;
  for (layers::Parameter* p : layer.parameters()) rt.reducer->ready(p);
  rt.reducer->progress();
}

// The gradients of `params` summed over the tensor group in one collective (a layer's
// norm weight and bias: small, and each sum waits for the device and the other members).
void Executor::sum_over_tensor_group(Backend& be, const std::vector<layers::Parameter*>& params) {
  if (params.empty()) return;
  if (params.size() == 1) {
    tensor_collectives_->all_reduce_sum(be, params[0]->grad);
    return;
  }
  int64_t n = 0;
  for (const layers::Parameter* p : params) {
    GPIPE_CHECK(p->grad.dtype() == params[0]->grad.dtype(), "sequence-partial gradients of two types in one layer");
    n += p->grad.numel();
  }
  Tensor flat = be.empty({n}, params[0]->grad.dtype());
  int64_t at = 0;
  for (layers::Parameter* p : params) {
    Tensor part = flat.narrow_rows(at, p->grad.numel());
    be.copy(p->grad.reshape({p->grad.numel()}), part);
    at += p->grad.numel();
  }
  tensor_collectives_->all_reduce_sum(be, flat);
  at = 0;
  for (layers::Parameter* p : params) {
    Tensor grad = p->grad.reshape({p->grad.numel()});
    be.copy(flat.narrow_rows(at, p->grad.numel()), grad);
    at += p->grad.numel();
  }
}

// The ties whose two copies are both on this stage: each gets the sum, locally.
void Executor::sum_local_ties(StageRuntime& rt, bool holding_turn) {
  if (rt.local_ties_summed) return;
  for (const layers::Tie& t : model_.ties()) {
    if (stage_of_layer(t.owner_layer) == rt.index && stage_of_layer(t.copy_layer) == rt.index) {
      auto turn = holding_turn ? Turn() : device_turn(rt.index);
      layers::Sequential::sum_tied_gradient(*rt.backend, t);
    }
  }
  rt.local_ties_summed = true;
}

// The optimizer step, local: the collectives before it (RG, TIE, NORM) have finished
// the gradients. Clips by the norm NORM found, steps, and lets layers fold their
// statistics (unless RG did, over the replicas). The host neither waits nor reads here:
// the clip's scale, the step's skip (an overflow; on a GPU also bad data that an op
// flagged, reported at the step's end) and the learning rate are the step's scalars on
// the device, which its kernels read when they run (kernels/step_scalars.h).
void Executor::optimizer_step(StageRuntime& rt) {
  const int k = rt.index;
  if (!cur_.apply_optimizer) {  // the gradients stay for inspection
    sum_local_ties(rt);
    return;
  }
  // A GPU transport's transfers, waited for under its deadline: the wait below then
  // waits for no peer.
  transport_.flush(k);
  // One turn on the device for the whole step, so that on a GPU shared by stages no other
  // stage's kernels fall inside the events that time it (nor, on a CPU, inside its span).
  auto turn = device_turn(k);
  sum_local_ties(rt, /*holding_turn=*/true);
  // Stages sharing a device share its backend, whose wait reports each stage's bad data
  // to that stage only, and clears the flags the skip below reads: one stage's wait could
  // hide another's bad batch from its skip. Such a stage waits here, as every stage did
  // before the skip was decided on the device, so that its error stops it first. Stages
  // capturing their step together wait nowhere inside it (a capture cannot): each skip then
  // reads every stage's flags, and the error is reported at the step's end.
  if (rt.device_turn != nullptr && !rt.device.is_cpu() && !(capture_group_ && rt.capturing)) {
    rt.backend->synchronize();
  }
  const size_t slot = rt.trace.ops.size() - 1;  // run_stage's, reserved for this instruction
  rt.clock->before(rt.backend->stream(), slot);
  // As torch.nn.utils.clip_grad_norm_ on the unscaled norm: scale by max_norm / (norm +
  // 1e-6) when above; the loss scale divided out (exact for a power of two); every stage
  // skips an overflowed step alike (they share the norm).
  rt.backend->step_grad_scale(rt.scalars, options_.clip_grad_norm, options_.loss_scale > 0);
  std::vector<Tensor> grads;
  for (layers::Parameter* p : rt.optimizer->params()) grads.push_back(p->grad);
  rt.backend->scale_all_by(grads, rt.scalars);
  rt.optimizer->apply(rt.scalars);  // one launch per stage on a GPU (multi-tensor)
  // The working copies of a narrow model, from the stepped masters (a sharded
  // optimizer's after AG has gathered them); unchanged masters after a skipped step.
  if (!rt.sharding) layers::refresh_all(*rt.backend, rt.params);
  if (!rt.statistics_folded) fold_statistics(rt);
  rt.clock->after(rt.backend->stream(), slot);
  rt.trace.optimizer_bytes = state_bytes(*rt.optimizer);
}

// Before a training step's first kernel: the optimizer's scalars for this step, the
// step's index (dropout's keys), the loss's factor and 1 / S, no norm, a gradient scale
// of 1 and no skip, in one copy to the device.
void Executor::write_step_scalars(StageRuntime& rt) {
  rt.written = rt.optimizer->step_scalars();
  rt.written[kStepIndex] = static_cast<double>(cur_.step);
  rt.written[kStepLossScale] = cur_.scale;
  rt.written[kStepUnscale] = 1.0 / cur_.loss_scale;  // exact for a power of two
  rt.backend->write_step_scalars(rt.written, rt.scalars);
}

// After the step's last wait: what the device decided, in one copy back; the optimizer
// counts the step unless it was skipped.
void Executor::read_step_scalars(StageRuntime& rt) {
  const StepScalarValues s = rt.backend->read_step_scalars(rt.scalars);
  const double norm_squared = s[kStepNormSquared];
  rt.grad_norm = norm_squared < 0 ? -1.0 : std::sqrt(norm_squared);  // NaN stays NaN
  rt.skipped = s[kStepSkip] != 0;
  if (!rt.skipped) rt.optimizer->stepped();
}

int64_t Executor::run_instruction(StageRuntime& rt, size_t pc) {
  heartbeat();  // progress, for a supervisor watching this process (runtime/heartbeat.h)
  const int k = rt.index;
  const Instruction& ins = program(k)[pc];
  const int m = ins.micro_batch;
  const int c = has_cell(ins.op) ? rt.cells[ins.chunk] : -1;
  switch (ins.op) {
    case Op::kRecvActivation: {
      Tensor& in = rt.mbs[ins.chunk][m].input;
      in = transport_.recv(k, schedule_.stage_of_cell(c - 1), {MessageKind::kActivation, m, c}, rt.device);
      return static_cast<int64_t>(in.nbytes());
    }
    case Op::kSendActivation: {
      Tensor out = rt.mbs[ins.chunk][m].output;
      rt.mbs[ins.chunk][m].output = Tensor();
      transport_.send(k, schedule_.stage_of_cell(c + 1), {MessageKind::kActivation, m, c + 1}, out);
      return static_cast<int64_t>(out.nbytes());
    }
    case Op::kRecvGradient: {
      Tensor& g = rt.mbs[ins.chunk][m].grad_output;
      g = transport_.recv(k, schedule_.stage_of_cell(c + 1), {MessageKind::kGradient, m, c}, rt.device);
      return static_cast<int64_t>(g.nbytes());
    }
    case Op::kSendGradient: {
      Tensor g = rt.mbs[ins.chunk][m].grad_input;
      rt.mbs[ins.chunk][m].grad_input = Tensor();
      transport_.send(k, schedule_.stage_of_cell(c - 1), {MessageKind::kGradient, m, c - 1}, g);
      return static_cast<int64_t>(g.nbytes());
    }
    case Op::kForward:
    case Op::kRecompute: {
      auto turn = device_turn(k);
      rt.clock->before(rt.backend->stream(), pc);
      forward(rt, ins, ins.op == Op::kRecompute);
      rt.clock->after(rt.backend->stream(), pc);
      break;
    }
    case Op::kBackward: {
      auto turn = device_turn(k);
      rt.clock->before(rt.backend->stream(), pc);
      backward(rt, ins, pc);
      rt.clock->after(rt.backend->stream(), pc);
      break;
    }
    case Op::kBackwardWeight: {
      auto turn = device_turn(k);
      rt.clock->before(rt.backend->stream(), pc);
      weight_gradient(rt, ins, pc);
      rt.clock->after(rt.backend->stream(), pc);
      break;
    }
    case Op::kOptimizerStep:
      optimizer_step(rt);
      break;
    case Op::kReduceGradients:
      return reduce_gradients(rt);
    case Op::kTiedGradients:
      return exchange_tied_gradient(rt, ins.micro_batch);
    case Op::kGradientNorm:
      return reduce_gradient_norm(rt);
    case Op::kReduceScatterGradients:
      return reduce_scatter_gradients(rt);
    case Op::kGatherParameters:
      return gather_parameters(rt);
    case Op::kTensorSum:
    case Op::kTensorMax:
    case Op::kTensorGather:
    case Op::kTensorScatter:
      GPIPE_CHECK(false, "a tensor collective runs inside its compute instruction (tensor_collective), not on its own");
  }
  return 0;
}

double Executor::now_ms() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - cur_.epoch).count();
}

void Executor::tensor_collective(Op op, int64_t bytes, const std::function<void()>& run) {
  StageRuntime& rt = *runtimes_[static_cast<size_t>(options_.local_stage)];
  const int k = rt.index;
  const auto& prog = program(k);
  const size_t pc = rt.tensor_next;
  if (rt.tensor_owner == static_cast<size_t>(-1)) {
    throw Error(std::string("a layer of stage ") + std::to_string(k) + " asked its tensor group for " + op_short_name(op) +
                " outside a compute instruction (F, R, B, W)");
  }
  const Instruction& owner = prog[rt.tensor_owner];
  if (pc >= prog.size() || prog[pc].op != op) {
    const bool tensor_op = pc < prog.size() && is_tensor_collective(prog[pc].op);
    throw Error("a layer of stage " + std::to_string(k) + " asked its tensor group for " + op_short_name(op) + " in " +
                instruction_str(schedule_, k, owner) + " where the program has " +
                (tensor_op ? instruction_str(schedule_, k, prog[pc]) : std::string("no more")) +
                ": the tensor-group program (Schedule::tensor) does not match the model");
  }
  GPIPE_CHECK(rt.trace.ops.size() == pc, "stage " + std::to_string(k) + "'s trace is not its program's");
  rt.trace.ops.push_back({op, owner.micro_batch, now_ms(), 0.0, owner.chunk});
  rt.tensor_next = pc + 1;  // taken, whether it succeeds or not
  rt.clock->before(rt.backend->stream(), pc);
  heartbeat();
  const int64_t calls0 = OpLog::calls_on_this_thread();
  run();
  const int64_t calls = OpLog::calls_on_this_thread() - calls0;
  rt.clock->after(rt.backend->stream(), pc);
  TimedOp& t = rt.trace.ops[pc];
  t.bytes = bytes;
  t.ops = calls;
  t.end_ms = now_ms();
}

// A training step of a stage that captures (ExecutorOptions::capture): a replay where a
// capture with these micro-batches' shapes exists; otherwise the program op by op,
// captured once a step with the optimizer has run (warm-up), and run again op by op if
// the capture fails. Any other step (evaluation, or without capture): the program.
void Executor::run_stage(int k) {
  StageRuntime& rt = *runtimes_[k];
  rt.fixed_io = capture_eligible(rt);  // workers run local stages only
  if (rt.fixed_io && rt.captured) return capture_group_ ? replay_group(rt) : replay_stage(rt);
  rt.capturing = rt.fixed_io && rt.warmed_up && !rt.capture_failed;
  run_program(k);
  if (!rt.capture_error.empty()) {
    if (!capture_group_) {
      spdlog::warn("stage {}: its training step could not be captured ({}); the run goes on without capture", k,
                   rt.capture_error);
    } else if (k == 0) {  // the group's first failure, which every stage of it got
      spdlog::warn("stages 0 to {}: their training step could not be captured ({}); the run goes on without capture",
                   schedule_.num_stages - 1, rt.capture_error);
    }
    rt.capture_error.clear();
    rt.capture_failed = true;
    rt.fixed_io = false;
    run_program(k);
  }
}

bool Executor::capture_eligible(const StageRuntime& rt) const {
  if (!options_.capture || rt.capture_failed || cur_.eval != nullptr || !cur_.apply_optimizer) return false;
  // Other micro-batch shapes than the capture's: op by op, the capture kept for later.
  return !rt.captured || fixed_buffers_fit(rt);
}

// Whether the stage's fixed buffers have this step's micro-batches' shapes and types.
bool Executor::fixed_buffers_fit(const StageRuntime& rt) const {
  const size_t M = cur_.sizes.size();
  if (rt.fixed_inputs.size() != M || rt.fixed_targets.size() != M) return false;
  for (size_t m = 0; m < M; ++m) {
    const Tensor in = cur_.inputs.narrow_rows(cur_.offsets[m], cur_.sizes[m]);
    const Tensor tg = cur_.targets.narrow_rows(cur_.offsets[m], cur_.sizes[m]);
    if (rt.fixed_inputs[m].shape() != in.shape() || rt.fixed_inputs[m].dtype() != in.dtype() ||
        rt.fixed_targets[m].shape() != tg.shape() || rt.fixed_targets[m].dtype() != tg.dtype()) {
      return false;
    }
  }
  return true;
}

// Each micro-batch's inputs and targets into the stage's buffers for them (made at the
// first step that uses them, with its shapes, which a capture then keeps).
void Executor::fill_fixed_buffers(StageRuntime& rt) {
  const int M = static_cast<int>(cur_.sizes.size());
  if (!fixed_buffers_fit(rt)) {
    GPIPE_CHECK(!rt.captured, "a captured step's buffers remade");
    rt.fixed_inputs.clear();
    rt.fixed_targets.clear();
    for (int m = 0; m < M; ++m) {
      const Tensor in = cur_.inputs.narrow_rows(cur_.offsets[m], cur_.sizes[m]);
      const Tensor tg = cur_.targets.narrow_rows(cur_.offsets[m], cur_.sizes[m]);
      rt.fixed_inputs.push_back(rt.backend->empty(in.shape(), in.dtype()));
      rt.fixed_targets.push_back(rt.backend->empty(tg.shape(), tg.dtype()));
    }
  }
  for (int m = 0; m < M; ++m) {
    rt.backend->copy(cur_.inputs.narrow_rows(cur_.offsets[m], cur_.sizes[m]), rt.fixed_inputs[m]);
    rt.backend->copy(cur_.targets.narrow_rows(cur_.offsets[m], cur_.sizes[m]), rt.fixed_targets[m]);
  }
}

// The CPU's FrozenWeights window opened or closed, in its place among the stage's ops
// (captured with them).
void Executor::set_frozen(StageRuntime& rt, bool frozen) {
  rt.backend->host_step([&rt, frozen] {
    if (!frozen) {
      rt.frozen.reset();
    } else if (!rt.frozen) {
      rt.frozen = std::make_unique<FrozenWeights>();
    }
  });
}

// A replayed step's state before it, as run_program's, its trace started; returns the
// thread's backend calls so far.
int64_t Executor::begin_replay(StageRuntime& rt) {
  rt.trace = StageTrace{};
  rt.mbs.assign(schedule_.num_chunks(), std::vector<MicroBatch>(schedule_.num_micro_batches));
  rt.error = nullptr;
  rt.error_is_abort = false;
  rt.grad_norm = -1;
  rt.skipped = false;
  rt.trace.start_ms =
      std::chrono::duration<double, std::milli>(cur_.epoch.time_since_epoch()).count() - options_.clock_offset_ms;
  return OpLog::calls_on_this_thread();
}

// Before the replay: the step's scalars and the micro-batches' data on the device, the
// clock started with the capture's spans, whose events the replay records.
void Executor::load_replay(StageRuntime& rt) {
  heartbeat();
  rt.clock->start_step(rt.backend->stream(), now_ms());
  write_step_scalars(rt);
  fill_fixed_buffers(rt);
  rt.clock->set_spans(rt.captured->spans);
}

// After the replay and the wait for it: the capture's trace with this replay's times
// (place_device_times), its backend calls, and the loss tensors
// the replay wrote. `calls0`: begin_replay's; `replayed`: the calls the replay made on
// this thread (the CPU's).
void Executor::end_replay(StageRuntime& rt, int64_t calls0, int64_t replayed) {
  const StageRuntime::Captured& cap = *rt.captured;
  const double start_ms = rt.trace.start_ms;
  rt.trace = cap.trace;
  rt.trace.start_ms = start_ms;
  rt.trace.captured_nodes = cap.nodes;
  rt.trace.other_ops = cap.other_ops_inside + (OpLog::calls_on_this_thread() - calls0 - replayed);
  place_device_times(rt.trace, rt.clock->resolve(), capture_group_ != nullptr);
  auto& last = rt.mbs[schedule_.chunk_of_cell(schedule_.num_cells() - 1)];
  for (size_t m = 0; m < cap.losses.size(); ++m) last[m].loss = cap.losses[m];
}

// A training step as one replay of the captured one: the step's scalars and the
// micro-batches' data written to the device, the replay, one wait, the scalars read
// back. The trace is the capture's, with this replay's times.
void Executor::replay_stage(StageRuntime& rt) {
  const int k = rt.index;
  const int64_t calls0 = begin_replay(rt);
  try {
    load_replay(rt);
    const int64_t replay0 = OpLog::calls_on_this_thread();
    rt.captured->ops->replay();
    const int64_t replayed = OpLog::calls_on_this_thread() - replay0;  // on the CPU, the ops it called again
    rt.backend->synchronize();
    read_step_scalars(rt);
    end_replay(rt, calls0, replayed);
  } catch (const std::exception& e) {
    rt.frozen.reset();  // a CPU replay that failed half-way may have left its window open
    rt.error = std::current_exception();
    rt.error_text = e.what();
    transport_.abort("stage " + std::to_string(k) + " failed: " + rt.error_text);
  }
}

void Executor::run_program(int k) {
  StageRuntime& rt = *runtimes_[k];
  const auto& prog = program(k);
  const EvalProgram* eval = cur_.eval;
  const auto& group_begins = eval != nullptr ? eval->group_begins[k] : rt.group_begins;
  const auto& group_ends = eval != nullptr ? eval->group_ends[k] : rt.group_ends;
  rt.trace = StageTrace{};
  rt.mbs.assign(schedule_.num_chunks(),
                std::vector<MicroBatch>(eval != nullptr ? eval->schedule.num_micro_batches : schedule_.num_micro_batches));
  rt.trace.ops.reserve(prog.size());
  rt.live_bytes = 0;
  rt.error = nullptr;
  rt.error_is_abort = false;
  rt.tensor_owner = static_cast<size_t>(-1);
  rt.grad_norm = -1;
  rt.skipped = false;
  rt.local_ties_summed = rt.statistics_folded = false;
  // The activation meter: what (chunk, m) holds now, folded into the stage's total.
  auto meter = [&](int chunk, int m) {
    MicroBatch& mb = rt.mbs[chunk][m];
    const int64_t now_held = held_bytes(mb);
    rt.live_bytes += now_held - mb.held_bytes;
    mb.held_bytes = now_held;
  };
  rt.trace.start_ms =
      std::chrono::duration<double, std::milli>(cur_.epoch.time_since_epoch()).count() - options_.clock_offset_ms;
  const int64_t step_calls0 = OpLog::calls_on_this_thread();
  int64_t capture_calls0 = step_calls0, replayed = 0;
  // Each op of a training step timed on this thread (ExecutorOptions::op_times).
  OpTimer* const op_timer = eval == nullptr ? rt.op_timer.get() : nullptr;
  if (op_timer != nullptr) op_timer->clear();
  const OpTimer::Scope timing(op_timer);
  try {
    std::exception_ptr not_written;  // a stage capturing with others tells them before it stops
    try {
      auto turn = device_turn(k);
      rt.clock->start_step(rt.backend->stream(), now_ms());
      if (eval == nullptr) write_step_scalars(rt);
      if (rt.fixed_io) fill_fixed_buffers(rt);
      if (rt.capturing && !capture_group_) {
        rt.backend->begin_capture();  // nothing from here on runs until the replay below
        capture_calls0 = OpLog::calls_on_this_thread();
      }
    } catch (const std::exception&) {
      if (!(rt.capturing && capture_group_)) throw;
      not_written = std::current_exception();
    }
    if (rt.capturing && capture_group_) {  // out of the device's turn: it waits for the other stages
      group_begin(rt, not_written);
      capture_calls0 = OpLog::calls_on_this_thread();
    }
    // No instruction but the optimizer step writes this stage's parameters (the
    // collectives write gradients): the weights stay frozen from one step to the next, so
    // a CPU stage's packed copies of them (kernels/cpu_gemm.h) serve every micro-batch.
    // The window (set_frozen) closes before the optimizer step, at the program's end and
    // on a failure.
    for (size_t pc = 0; pc < prog.size(); ++pc) {
      const Instruction& ins = prog[pc];
      if (is_tensor_collective(ins.op)) {  // ran inside the compute instruction before it (tensor_collective)
        GPIPE_CHECK(rt.trace.ops.size() > pc, "stage " + std::to_string(k) + "'s " + instruction_str(schedule_, k, ins) +
                                                  " at " + std::to_string(pc) + " did not run in its compute instruction");
        continue;
      }
      set_frozen(rt, !(ins.op == Op::kOptimizerStep || after_optimizer(ins.op)));  // OPT and after write the parameters
      if (ins.op == Op::kGradientNorm && cur_.apply_optimizer && !rt.device.is_cpu() && !norm_on_device()) {
        // NORM reads a sum back from the device, so its call waits for every kernel queued
        // before it: the backward's, which their own events time. Wait before NORM's clock
        // starts, so that its time is its own (the H200 run's report gave NORM 31 ms of a
        // 37 ms step, the backward counted twice). The compute stream may wait for a
        // peer (a replica's bucket, a tensor group's sum on NCCL): the transport's
        // transfers and its groups' collectives first, under its deadline.
        transport_.flush(k);
        auto turn = device_turn(k);
        rt.backend->synchronize();
      }
      const double t0 = now_ms();
      rt.turn_at_ms = rt.turn_end_ms = -1;
      if (pc == rt.zero_at && eval == nullptr) {  // inside the receive's slot: its wait, usually
        {
          auto turn = device_turn(k);
          zero_grads(rt);
        }
        rt.turn_at_ms = rt.turn_end_ms = -1;  // a compute instruction's own turn times it
      }
      const int64_t calls0 = OpLog::calls_on_this_thread();  // the instruction's own, not the zeroing
      GPIPE_CHECK(rt.trace.ops.size() == pc, "stage " + std::to_string(k) + "'s trace is not its program's");
      rt.trace.ops.emplace_back();  // its slot, before the tensor collectives it runs (program order)
      if (group_begins[pc]) transport_.begin_group(k);
      if (tensor_collectives_ != nullptr && is_compute(ins.op)) {
        rt.tensor_owner = pc;
        rt.tensor_next = pc + 1;
      }
      const int64_t bytes = run_instruction(rt, pc);
      if (rt.tensor_owner == pc) {  // every tensor collective the program has after it ran
        rt.tensor_owner = static_cast<size_t>(-1);
        if (rt.tensor_next < prog.size() && is_tensor_collective(prog[rt.tensor_next].op)) {
          throw Error("stage " + std::to_string(k) + "'s program has " +
                      instruction_str(schedule_, k, prog[rt.tensor_next]) + " in " + instruction_str(schedule_, k, ins) +
                      ", which its layers did not ask the tensor group for: the tensor-group program (Schedule::tensor) "
                      "does not match the model");
        }
      }
      if (group_ends[pc]) transport_.end_group(k);
      // A compute instruction of a CPU stage that shares its device runs while it holds
      // its turn: the other stages' work before and after is this one's wait (on a GPU
      // the stream's events time the work, OpClock).
      const bool by_turn = rt.device.is_cpu() && rt.turn_at_ms >= t0 && rt.turn_end_ms >= rt.turn_at_ms &&
                           (is_compute(ins.op) || ins.op == Op::kOptimizerStep);
      TimedOp op{ins.op, ins.micro_batch, by_turn ? rt.turn_at_ms : t0, 0.0, ins.chunk};
      if (is_collective(ins.op)) {
        op.bytes = bytes;
        if (ins.op == Op::kTiedGradients) {
          const std::vector<int> who = collective_stages(schedule_, k, ins);
          op.peer = who[0] == k ? who[1] : who[0];
        }
      }
      if (has_cell(ins.op)) {
        for (int m = ins.micro_batch; m < ins.micro_batch + ins.count; ++m) meter(ins.chunk, m);  // a batched W's all
        // A hand-over to a neighbouring cell of this stage changed its holdings too.
        const int c = rt.cells[ins.chunk];
        if (ins.op == Op::kForward && c + 1 < schedule_.num_cells() && schedule_.stage_of_cell(c + 1) == k) {
          meter(schedule_.chunk_of_cell(c + 1), ins.micro_batch);
        }
        if (ins.op == Op::kBackward && c > 0 && schedule_.stage_of_cell(c - 1) == k) {
          meter(schedule_.chunk_of_cell(c - 1), ins.micro_batch);
        }
        rt.trace.peak_activation_bytes = std::max(rt.trace.peak_activation_bytes, rt.live_bytes);
        if (is_communication(ins.op)) {
          // Activations go to the next cell and come from the previous one; gradients
          // the other way.
          const bool act = ins.op == Op::kRecvActivation || ins.op == Op::kSendActivation;
          const bool send = ins.op == Op::kSendActivation || ins.op == Op::kSendGradient;
          op.peer = schedule_.stage_of_cell(act == send ? c + 1 : c - 1);
          op.bytes = bytes;
        }
      }
      op.live_bytes = rt.live_bytes;
      op.end_ms = by_turn ? rt.turn_end_ms : now_ms();
      op.ops = OpLog::calls_on_this_thread() - calls0;  // its tensor collectives' included
      rt.trace.ops[pc] = op;
    }
    set_frozen(rt, false);
    transport_.flush(k);
    if (rt.capturing && capture_group_ && !group_end(rt, std::string(), capture_calls0, &replayed)) return;
    auto turn = device_turn(k);
    if (rt.capturing) {
      // The step so far is captured, not run: keep what a replay needs, then run it.
      std::unique_ptr<CapturedOps> ops = rt.backend->end_capture();
      rt.capturing = false;
      keep_capture(rt, OpLog::calls_on_this_thread() - capture_calls0);
      rt.captured->nodes = ops->nodes();
      rt.captured->ops = std::move(ops);
      spdlog::info("stage {}: captured its training step on {} ({} ops); later steps replay it", k, rt.device.str(),
                   rt.captured->ops->nodes());
      const int64_t replay0 = OpLog::calls_on_this_thread();
      rt.captured->ops->replay();
      replayed = OpLog::calls_on_this_thread() - replay0;  // on the CPU, each captured op called again
      rt.trace.captured_nodes = rt.captured->ops->nodes();
    }
    rt.backend->synchronize();
    if (eval == nullptr && cur_.apply_optimizer) read_step_scalars(rt);
    // Warmed up for capture: the step's every op has run once (the optimizer's and the
    // norm's too, whose multi-tensor tables a capture cannot make).
    if (eval == nullptr && cur_.apply_optimizer) rt.warmed_up = true;
    if (op_timer != nullptr) rt.trace.op_times = op_timer->resolve();  // after the wait above: every op has run
    rt.trace.other_ops = OpLog::calls_on_this_thread() - step_calls0 - replayed;
    for (const TimedOp& op : rt.trace.ops) {
      if (!is_tensor_collective(op.op)) rt.trace.other_ops -= op.ops;  // a tensor collective's are its owner's
    }
    // Device times replace the host's (the capture of the stages together just replayed:
    // its messages' host times are the capture's).
    place_device_times(rt.trace, rt.clock->resolve(), rt.trace.captured_nodes > 0 && capture_group_);
    // A compute instruction's tensor collectives ran inside it: their time is its
    // communication (TimedOp::group_ms), on the same clock.
    for (size_t pc = 0, owner = 0; pc < prog.size(); ++pc) {
      if (!is_tensor_collective(prog[pc].op)) {
        owner = pc;
        continue;
      }
      const TimedOp& t = rt.trace.ops[pc];
      rt.trace.ops[owner].group_ms += std::max(0.0, t.end_ms - t.start_ms);
    }
  } catch (const Aborted& e) {
    rt.frozen.reset();
    // Stopped inside a capture of the stages together: by a stage whose part could not be
    // captured (the step then runs again op by op), or by a failure elsewhere, which
    // stands (group_end's recover leaves it).
    if (rt.capturing && capture_group_) {
      // The stage that stopped the others brings the reason; an abort from elsewhere is its own.
      const std::string why = e.what();
      group_end(rt, why == kGroupCaptureStopped ? std::string() : why, capture_calls0, &replayed);
      return;  // the stage that stopped it failed the capture: run_stage runs the step op by op
    }
    rt.backend->abort_capture();
    rt.capturing = false;
    rt.error = std::current_exception();
    rt.error_is_abort = true;
    rt.error_text = e.what();
  } catch (const std::exception& e) {
    rt.frozen.reset();
    if (rt.capturing && capture_group_) {  // the others stop too, and all run the step again op by op
      transport_.abort(kGroupCaptureStopped);
      const std::string why = e.what();
      group_end(rt, why.empty() ? std::string("an error without a message") : why, capture_calls0, &replayed);
      return;
    }
    if (rt.capturing) {  // nothing captured has run: run_stage runs the step again, op by op
      rt.backend->abort_capture();
      rt.capturing = false;
      rt.capture_error = e.what();
      return;
    }
    rt.error = std::current_exception();
    rt.error_text = e.what();
    transport_.abort("stage " + std::to_string(k) + " failed: " + rt.error_text);
  }
}

int Executor::stage_of_layer(int layer) const { return schedule_.stage_of_cell(cell_of_layer(cells_, layer)); }


void Executor::run_workers() {
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
  // The first real failure wins; the others were told to stop because of it.
  for (auto& rt : runtimes_) {
    if (rt->error && !rt->error_is_abort) {
      failed_ = true;
      std::string where;
      for (int c : rt->cells) where += (where.empty() ? "" : ", ") + layer_range(cells_[c]);
      const std::string msg = "stage " + std::to_string(rt->index) + " (layers " + where + " on " +
                              rt->device.str() + ") failed: " + rt->error_text;
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
}

const std::vector<Instruction>& Executor::program(int k) const {
  return cur_.eval != nullptr ? cur_.eval->schedule.stages[k] : schedule_.stages[k];
}

StepResult Executor::step(const Tensor& inputs, const Tensor& targets, bool apply_optimizer) {
  if (failed_) throw Error("the pipeline stopped after an earlier failure; start a new run");
  const int M = schedule_.num_micro_batches;
  if (!inputs.device().is_cpu() || !targets.device().is_cpu()) throw Error("step() takes host tensors");
  if (inputs.dim() < 1 || targets.dim() < 1 || inputs.size(0) != targets.size(0)) {
    throw UserError("inputs " + inputs.str() + " and targets " + targets.str() + " must have the same batch size");
  }
  const int64_t n = inputs.size(0);
  cur_.inputs = layers::model_input(model_, inputs);  // narrow data for a bf16 or fp16 model
  cur_.targets = targets;
  if (options_.micro_batch_sizes.empty()) {
    cur_.sizes = split_sizes(n, M);
  } else {
    int64_t planned = 0;
    for (int64_t rows : options_.micro_batch_sizes) planned += rows;
    if (n != planned) {
      throw UserError("step() got a batch of " + std::to_string(n) + " rows; the plan's " + std::to_string(M) +
                      " micro-batches take " + std::to_string(planned) + " (train.batch_size / pipeline.replicas)");
    }
    cur_.sizes = options_.micro_batch_sizes;
  }
  cur_.offsets.assign(M, 0);
  for (int m = 1; m < M; ++m) cur_.offsets[m] = cur_.offsets[m - 1] + cur_.sizes[m - 1];
  // The loss of a mini-batch is a mean over its counted targets, however the batch is
  // split: each micro-batch's summed loss is scaled by 1 / (targets counted in the
  // whole mini-batch), so the micro-batches' losses and gradients add up to the
  // mini-batch's. With replicas the count is over every replica's rows, so each
  // replica's share is already scaled for the sum over replicas.
  int64_t counted = model_.loss().counted_targets(targets);
  if (options_.replicas != nullptr && options_.replicas->size() > 1) {
    counted = static_cast<int64_t>(options_.replicas->all_reduce_sum(static_cast<double>(counted)));
  }
  cur_.loss_scale = loss_scale_ > 0 ? loss_scale_ : 1.0;
  cur_.scale = counted > 0 ? cur_.loss_scale / static_cast<double>(counted) : 0.0;
  cur_.apply_optimizer = apply_optimizer;
  cur_.step = steps_done_++;
  cur_.eval = nullptr;
  cur_.epoch = std::chrono::steady_clock::now();
  if (!peaks_reset_) {  // the stages' threads wait for run_workers: no tensor is in flight
    for (const auto& rt : runtimes_) {
      if (rt->local) allocator_for(rt->device).reset_peak();
    }
    peaks_reset_ = true;
  }
  run_workers();
  StepResult result;
  result.wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - cur_.epoch).count();
  const int last_stage = schedule_.stage_of_cell(schedule_.num_cells() - 1);
  StageRuntime& last = *runtimes_[last_stage];
  if (last.local) {
    for (auto& mb : last.mbs[schedule_.chunk_of_cell(schedule_.num_cells() - 1)]) {
      result.loss += last.backend->item(mb.loss);
    }
  }
  if (options_.local_stage >= 0) {
    // Only the last cell's process has the loss; every process learns it.
    result.loss = transport_.all_reduce_sum(options_.local_stage, result.loss);
    result.grad_norm = runtimes_[options_.local_stage]->grad_norm;
  } else {
    result.grad_norm = last.grad_norm;
  }
  if (options_.replicas != nullptr && options_.replicas->size() > 1) {
    result.loss = options_.replicas->all_reduce_sum(result.loss);
  }
  if (loss_scale_ > 0) {
    // The loss and the norm as without scaling (dividing by a power of two is exact), and
    // the scale's next value: every process sees the same norm, so all agree.
    result.loss /= cur_.loss_scale;
    result.loss_scale = cur_.loss_scale;
    if (apply_optimizer) {
      result.skipped = overflowed(result.grad_norm);
      if (result.skipped) {
        loss_scale_ = std::max(loss_scale_ / 2, 1.0);
        clean_steps_ = 0;
      } else if (++clean_steps_ >= options_.loss_scale_window) {
        loss_scale_ = std::min(loss_scale_ * 2, 1.0 * (1 << 24));
        clean_steps_ = 0;
      }
    }
    if (result.grad_norm >= 0) result.grad_norm /= cur_.loss_scale;
  }
  for (auto& rt : runtimes_) {
    if (rt->local) rt->trace.device_peak_bytes = allocator_for(rt->device).stats().peak;
    result.stages.push_back(std::move(rt->trace));  // empty for stages of other processes
    rt->mbs.clear();
  }
  return result;
}

EvalResult Executor::evaluate(const Tensor& inputs, const Tensor& targets, int64_t micro_batch_rows,
                              EvalResult sum) {
  if (failed_) throw Error("the pipeline stopped after an earlier failure; start a new run");
  if (!inputs.device().is_cpu() || !targets.device().is_cpu()) throw Error("evaluate() takes host tensors");
  if (inputs.dim() < 1 || targets.dim() < 1 || inputs.size(0) != targets.size(0) || inputs.size(0) < 1) {
    throw UserError("inputs " + inputs.str() + " and targets " + targets.str() +
                    " must have the same batch size, at least 1");
  }
  GPIPE_CHECK(micro_batch_rows >= 1, "evaluate() needs micro-batches of at least one row");
  const int64_t n = inputs.size(0);
  const int64_t count = (n + micro_batch_rows - 1) / micro_batch_rows;
  if (count > schedule_.num_micro_batches) {
    throw Error("evaluate() got " + std::to_string(count) + " micro-batches of " + std::to_string(micro_batch_rows) +
                " rows; the schedule runs at most " + std::to_string(schedule_.num_micro_batches));
  }
  const int M = static_cast<int>(count);
  std::unique_ptr<EvalProgram>& program = eval_programs_[M];
  if (!program) {
    const CommModel comm = transport_.sends_wait_for_receiver() ? CommModel::kRendezvous : CommModel::kBuffered;
    auto p = std::make_unique<EvalProgram>();
    p->schedule = forward_only_program(schedule_, M, comm);
    check_schedule(p->schedule, comm);
    for (const auto& prog : p->schedule.stages) {
      p->group_begins.emplace_back();
      p->group_ends.emplace_back();
      message_groups(prog, p->group_begins.back(), p->group_ends.back());
    }
    program = std::move(p);
  }
  cur_.inputs = layers::model_input(model_, inputs);  // narrow data for a bf16 or fp16 model
  cur_.targets = targets;
  cur_.sizes.assign(M, micro_batch_rows);
  cur_.sizes.back() = n - (M - 1) * micro_batch_rows;
  cur_.offsets.assign(M, 0);
  for (int m = 1; m < M; ++m) cur_.offsets[m] = cur_.offsets[m - 1] + cur_.sizes[m - 1];
  cur_.scale = 1.0;  // the loss summed over the counted targets
  cur_.loss_scale = 1.0;
  cur_.apply_optimizer = false;
  cur_.step = steps_done_;  // evaluation is no step
  cur_.eval = program.get();
  cur_.epoch = std::chrono::steady_clock::now();
  run_workers();
  const int C = schedule_.num_cells();
  StageRuntime& last = *runtimes_[schedule_.stage_of_cell(C - 1)];
  if (last.local) {
    // Micro-batch by micro-batch, in order: sums come out the same however a pass is
    // cut into calls. Means are over the counted targets (PyTorch's ignore_index with
    // reduction 'mean'), not over every row; the targets are on the host.
    auto& mbs = last.mbs[schedule_.chunk_of_cell(C - 1)];
    for (int m = 0; m < M; ++m) {
      sum.loss_sum += last.backend->item(mbs[m].loss);
      sum.correct += static_cast<double>(mbs[m].correct);
      sum.counted += static_cast<double>(
          model_.loss().counted_targets(targets.narrow_rows(cur_.offsets[m], cur_.sizes[m])));
    }
  }
  for (auto& rt : runtimes_) rt->mbs.clear();
  return sum;
}

EvalResult Executor::all_reduce_scores(EvalResult r) {
  if (options_.local_stage >= 0) {  // only the last cell's process has them
    for (double* v : {&r.loss_sum, &r.correct, &r.counted}) *v = transport_.all_reduce_sum(options_.local_stage, *v);
  }
  if (options_.replicas != nullptr && options_.replicas->size() > 1) {
    for (double* v : {&r.loss_sum, &r.correct, &r.counted}) *v = options_.replicas->all_reduce_sum(*v);
  }
  return r;
}

}  // namespace pipeline
}  // namespace gpipe

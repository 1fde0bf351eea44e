#include "pipeline/executor/cell.h"

#include <limits>
#include <string>

#include "kernels/meta_backend.h"
#include "layers/tensor_parallel.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace pipeline {

std::vector<CellSpec> make_stages(const std::vector<int>& balance, const std::vector<Device>& devices) {
  GPIPE_CHECK(balance.size() == devices.size(), "one device per stage");
  std::vector<CellSpec> out;
  int first = 0;
  for (size_t k = 0; k < balance.size(); ++k) {
    out.push_back({first, balance[k], devices[k]});
    first += balance[k];
  }
  return out;
}

std::vector<CellSpec> make_cells(const std::vector<int>& balance, const Schedule& schedule,
                                  const std::vector<Device>& devices) {
  GPIPE_CHECK(static_cast<int>(balance.size()) == schedule.num_cells(), "one balance entry per cell");
  GPIPE_CHECK(static_cast<int>(devices.size()) == schedule.num_stages, "one device per stage");
  std::vector<CellSpec> out;
  int first = 0;
  for (size_t c = 0; c < balance.size(); ++c) {
    out.push_back({first, balance[c], devices[schedule.stage_of_cell(static_cast<int>(c))]});
    first += balance[c];
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

int cell_of_layer(const std::vector<CellSpec>& cells, int layer) {
  for (size_t c = 0; c < cells.size(); ++c) {
    if (layer >= cells[c].first_layer && layer < cells[c].first_layer + cells[c].num_layers) {
      return static_cast<int>(c);
    }
  }
  throw Error("layer " + std::to_string(layer) + " is in no cell");
}

Schedule::Collectives run_collectives(const layers::Sequential& model, const std::vector<CellSpec>& cells,
                                      bool replicas, bool gradient_norm, bool shard_optimizer) {
  Schedule::Collectives out;
  out.replicas = replicas;
  for (const layers::Tie& t : model.ties()) {
    out.ties.emplace_back(cell_of_layer(cells, t.owner_layer), cell_of_layer(cells, t.copy_layer));
  }
  out.gradient_norm = gradient_norm;
  out.shard_optimizer = replicas && shard_optimizer;  // one replica keeps all of it: nothing to shard
  return out;
}

namespace {
// What `phase` asks of the group: kinds, and bytes at this micro-batch (in `bytes`), each
// marked as layer `layer`'s.
template <typename Phase>
std::vector<TensorOp> asked_in(layers::ShapeCollectives& group, int layer, Phase&& phase) {
  group.clear_asked();
  phase();
  std::vector<TensorOp> out;
  for (const layers::ShapeCollectives::Asked& a : group.asked()) {
    TensorOp op;
    switch (a.kind) {
      case layers::ShapeCollectives::Kind::kSum: op.op = Op::kTensorSum; break;
      case layers::ShapeCollectives::Kind::kMax: op.op = Op::kTensorMax; break;
      case layers::ShapeCollectives::Kind::kGather: op.op = Op::kTensorGather; break;
      case layers::ShapeCollectives::Kind::kScatter: op.op = Op::kTensorScatter; break;
    }
    op.bytes = a.bytes;
    op.layer = layer;
    out.push_back(op);
  }
  group.clear_asked();
  return out;
}

void append(std::vector<TensorOp>& to, const std::vector<TensorOp>& more) { to.insert(to.end(), more.begin(), more.end()); }

// The program at micro-batches of `n` samples, every op's bytes in `bytes`.
TensorProgram asked_at(layers::Sequential& model, const std::vector<CellSpec>& cells, layers::ShapeCollectives& group,
                       int64_t n) {
  TensorProgram out;
  out.cells.resize(cells.size());
  Shape shape{n};
  for (int64_t d : model.input_shape()) shape.push_back(d);
  Tensor h = meta_backend(model.layer(0).device()).zeros(shape, model.input_dtype());
  // A step no run takes: a layer that keeps something per training step (BatchNorm's
  // statistics) drops it at the run's first step.
  const uint64_t no_step = std::numeric_limits<uint64_t>::max();
  for (size_t c = 0; c < cells.size(); ++c) {
    CellTensorOps& cell = out.cells[c];
    for (int i = cells[c].first_layer; i < cells[c].first_layer + cells[c].num_layers; ++i) {
      Backend& lb = meta_backend(model.layer(i).device());
      if (h.device() != lb.device()) {  // the executor's hand-over between stages
        Tensor moved = lb.empty(h.shape(), h.dtype());
        lb.copy(h, moved);
        h = moved;
      }
      layers::Layer& layer = model.layer(i);
      const bool need_dx = i > 0;  // as the executor: every layer but the model's first
      layers::ForwardArgs train, again, eval;
      train.step = again.step = eval.step = no_step;
      again.recompute = true;
      eval.training = false;
      layers::Context ctx;
      Tensor y;
      append(cell.forward, asked_in(group, i, [&] { y = layer.forward(lb, h, &ctx, train); }));
      append(cell.evaluate, asked_in(group, i, [&] { layer.forward(lb, h, nullptr, eval); }));
      layers::Context whole;
      append(cell.recompute, asked_in(group, i, [&] { layer.forward(lb, h, &whole, again); }));
      const Tensor dy = lb.zeros(y.shape(), y.dtype());
      CellTensorOps::Layer l;
      l.splits = layer.splits_backward();
      l.backward = asked_in(group, i, [&] { layer.backward(lb, dy, whole, need_dx); });
      l.backward_input = asked_in(group, i, [&] { layer.backward_input(lb, dy, ctx, need_dx); });
      if (l.splits) l.weight = asked_in(group, i, [&] { layer.backward_weight(lb, ctx); });
      // Once a step, where its gradients become final: its sequence-partial gradients in
      // one sum (Executor::sum_over_tensor_group), a narrow one as float32.
      int64_t partial = 0;
      for (const layers::Parameter* p : layer.parameters()) {
        if (!p->sequence_partial) continue;
        partial += p->value.numel() * static_cast<int64_t>(is_narrow(p->value.dtype()) ? 4 : dtype_size(p->value.dtype()));
      }
      if (partial > 0) l.step.push_back({Op::kTensorSum, partial, 0, i});
      cell.layers.push_back(std::move(l));
      h = y;
    }
  }
  if (model.has_loss() && !cells.empty()) {
    // The loss's, as the model's last layer's (the cost model counts them there).
    const int last_layer = model.size() - 1;
    CellTensorOps& last = out.cells.back();
    Backend& lb = meta_backend(h.device());
    Shape target_shape(h.shape().begin(), h.shape().end() - 1);
    const Tensor targets = lb.zeros(target_shape, DType::kI32);
    layers::Context lctx;
    const std::vector<TensorOp> loss =
        asked_in(group, last_layer, [&] { model.loss().forward(lb, h, targets, 1.0, &lctx); });
    append(last.forward, loss);
    append(last.recompute, loss);
    last.loss_backward = asked_in(group, last_layer, [&] { model.loss().backward(lb, lctx); });
    append(last.evaluate, asked_in(group, last_layer, [&] {
             model.loss().forward(lb, h, targets, 1.0, nullptr);
             model.loss().correct(lb, h, targets);
           }));
  }
  return out;
}

// `one`'s ops (at 1 sample) with `two`'s (at 2) into bytes + bytes_per_sample x n; the
// same kinds in the same order, or an Error (a layer's collectives must not depend on
// the batch).
void fit_bytes(std::vector<TensorOp>& one, const std::vector<TensorOp>& two) {
  if (one.size() != two.size()) {
    throw Error("a layer asks its tensor group for " + std::to_string(one.size()) + " collectives at a micro-batch of 1 "
                "sample and " + std::to_string(two.size()) + " at 2: its collectives must not depend on the batch");
  }
  for (size_t i = 0; i < one.size(); ++i) {
    GPIPE_CHECK(one[i].op == two[i].op && one[i].layer == two[i].layer,
                std::string("layer ") + std::to_string(one[i].layer) + " asks its tensor group for " +
                    op_short_name(one[i].op) + " at a micro-batch of 1 sample and " + op_short_name(two[i].op) +
                    " at 2");
    one[i].bytes_per_sample = two[i].bytes - one[i].bytes;
    one[i].bytes -= one[i].bytes_per_sample;
  }
}
}  // namespace

TensorProgram run_tensor_program(layers::Sequential& model, const std::vector<CellSpec>& cells, int rank, int members) {
  TensorProgram out;
  out.members = members;
  if (members <= 1) return out;
  const ShapesOnly shapes;
  layers::ShapeCollectives group(rank, members);
  const layers::Sequential::CollectivesFor shapes_group(model, &group);
  // Twice: what grows with the micro-batch (activations) and what does not (gradients).
  TensorProgram one = asked_at(model, cells, group, 1);
  const TensorProgram two = asked_at(model, cells, group, 2);
  for (size_t c = 0; c < one.cells.size(); ++c) {
    CellTensorOps& a = one.cells[c];
    const CellTensorOps& b = two.cells[c];
    fit_bytes(a.forward, b.forward);
    fit_bytes(a.recompute, b.recompute);
    fit_bytes(a.evaluate, b.evaluate);
    fit_bytes(a.loss_backward, b.loss_backward);
    for (size_t i = 0; i < a.layers.size(); ++i) {
      fit_bytes(a.layers[i].backward, b.layers[i].backward);
      fit_bytes(a.layers[i].backward_input, b.layers[i].backward_input);
      fit_bytes(a.layers[i].weight, b.layers[i].weight);
      fit_bytes(a.layers[i].step, b.layers[i].step);
    }
  }
  out.cells = std::move(one.cells);
  return out;
}

}  // namespace pipeline
}  // namespace gpipe

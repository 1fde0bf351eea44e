#include "pipeline/executor/cell.h"

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
std::vector<TensorOp> asked_ops(layers::ShapeCollectives& group, bool per_sample) {
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
    op.per_sample = per_sample;
    out.push_back(op);
  }
  group.clear_asked();
  return out;
}

// What `phase` asks of the group.
template <typename Phase>
std::vector<TensorOp> asked_in(layers::ShapeCollectives& group, bool per_sample, Phase&& phase) {
  group.clear_asked();
  phase();
  return asked_ops(group, per_sample);
}

void append(std::vector<TensorOp>& to, const std::vector<TensorOp>& more) { to.insert(to.end(), more.begin(), more.end()); }
}  // namespace

TensorProgram run_tensor_program(layers::Sequential& model, const std::vector<CellSpec>& cells, int rank, int members) {
  TensorProgram out;
  out.members = members;
  if (members <= 1) return out;
  const ShapesOnly shapes;
  layers::ShapeCollectives group(rank, members);
  layers::TensorCollectives* const before = model.collectives();
  struct Restore {
    layers::Sequential& model;
    layers::TensorCollectives* group;
    ~Restore() { model.set_collectives(group); }
  } restore{model, before};
  model.set_collectives(&group);
  out.cells.resize(cells.size());
  Shape shape{1};
  for (int64_t d : model.input_shape()) shape.push_back(d);
  Backend* be = &meta_backend(model.layer(0).device());
  Tensor h = be->zeros(shape, model.input_dtype());
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
      again.recompute = true;
      eval.training = false;
      layers::Context ctx;
      Tensor y;
      append(cell.forward, asked_in(group, true, [&] { y = layer.forward(lb, h, &ctx, train); }));
      append(cell.evaluate, asked_in(group, true, [&] { layer.forward(lb, h, nullptr, eval); }));
      layers::Context whole;
      append(cell.recompute, asked_in(group, true, [&] { layer.forward(lb, h, &whole, again); }));
      const Tensor dy = lb.zeros(y.shape(), y.dtype());
      CellTensorOps::Layer l;
      l.splits = layer.splits_backward();
      l.backward = asked_in(group, true, [&] { layer.backward(lb, dy, whole, need_dx); });
      l.backward_input = asked_in(group, true, [&] { layer.backward_input(lb, dy, ctx, need_dx); });
      if (l.splits) l.weight = asked_in(group, false, [&] { layer.backward_weight(lb, ctx); });
      // Once a step, where its gradients become final: its sequence-partial gradients in
      // one sum (Executor::sum_over_tensor_group), a narrow one as float32.
      int64_t partial = 0;
      for (const layers::Parameter* p : layer.parameters()) {
        if (!p->sequence_partial) continue;
        partial += p->value.numel() * static_cast<int64_t>(is_narrow(p->value.dtype()) ? 4 : dtype_size(p->value.dtype()));
      }
      if (partial > 0) l.step.push_back({Op::kTensorSum, partial, false});
      cell.layers.push_back(std::move(l));
      h = y;
    }
  }
  if (model.has_loss() && !cells.empty()) {
    CellTensorOps& last = out.cells.back();
    Backend& lb = meta_backend(h.device());
    Shape target_shape(h.shape().begin(), h.shape().end() - 1);
    const Tensor targets = lb.zeros(target_shape, DType::kI32);
    layers::Context lctx;
    const std::vector<TensorOp> loss = asked_in(group, true, [&] { model.loss().forward(lb, h, targets, 1.0, &lctx); });
    append(last.forward, loss);
    append(last.recompute, loss);
    last.loss_backward = asked_in(group, true, [&] { model.loss().backward(lb, lctx); });
    append(last.evaluate, asked_in(group, true, [&] {
             model.loss().forward(lb, h, targets, 1.0, nullptr);
             model.loss().correct(lb, h, targets);
           }));
  }
  return out;
}

}  // namespace pipeline
}  // namespace gpipe

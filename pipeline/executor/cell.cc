#include "pipeline/executor/cell.h"

#include <string>

#include "runtime/error.h"

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

}  // namespace pipeline
}  // namespace gpipe

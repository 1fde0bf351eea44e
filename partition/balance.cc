#include "partition/balance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "runtime/error.h"

namespace gpipe {
namespace partition {

double CostModel::group_time(int64_t sums, double bytes, int64_t gathers, double gather_bytes) const {
  if (tensor_members <= 1 || (sums == 0 && gathers == 0)) return 0;
  const double T = tensor_members, pass = T - 1;  // one pass of the ring: T - 1 steps
  const double passes = 2 * static_cast<double>(sums) + static_cast<double>(gathers);
  const double moved = (2 * bytes + gather_bytes) * pass / T;
  return passes * pass * group_latency_seconds + (group_bytes_per_second > 0 ? moved / group_bytes_per_second : 0.0);
}

CostModel::GroupSeconds CostModel::group_seconds(int layer, int64_t batch) const {
  const LayerLaunches n = launches_of(layer);
  const double b = static_cast<double>(batch);
  return {group_time(n.group_sums_forward, b * n.group_bytes_forward, n.group_gathers_forward,
                     b * n.group_gather_bytes_forward),
          group_time(n.group_sums_backward, b * n.group_bytes_backward, n.group_gathers_backward,
                     b * n.group_gather_bytes_backward),
          group_time(n.group_sums_weight, static_cast<double>(n.group_bytes_weight)),
          group_time(n.group_sums_step, static_cast<double>(n.group_bytes_step))};
}

double CostModel::seconds(const layers::LayerCost& c, bool recompute, int layer, int64_t batch) const {
  const LayerLaunches n = launches_of(layer);
  const GroupSeconds g = group_seconds(layer, batch);
  const double fwd = std::max(c.forward_flops / flops_per_second, c.forward_bytes / bytes_per_second) + g.forward;
  const double bwd = std::max(c.backward_flops / flops_per_second, c.backward_bytes / bytes_per_second) +
                     launch_time(n.backward()) + g.backward + g.weight;
  return (recompute ? 2 : 1) * fwd + launch_time(n.forward) + (recompute ? launch_time(n.recompute) : 0.0) + bwd;
}

LayerLaunches CostModel::launches_of(int layer) const {
  if (launches == nullptr || layer < 0 || layer >= static_cast<int>(launches->size())) return {};
  return (*launches)[static_cast<size_t>(layer)];
}

std::vector<int> balance_by_cost(const std::vector<double>& costs, int k) {
  const int n = static_cast<int>(costs.size());
  if (k < 1) throw UserError("pipeline.partitions must be at least 1, got " + std::to_string(k));
  if (k > n) {
    throw UserError("pipeline.partitions = " + std::to_string(k) + " but the model has only " + std::to_string(n) +
                    " layers; each partition needs at least one layer: lower pipeline.partitions to at most " +
                    std::to_string(n));
  }
  for (int i = 0; i < n; ++i) {
    if (!(costs[i] >= 0) || !std::isfinite(costs[i])) {
      throw UserError("layer " + std::to_string(i) + " has cost " + std::to_string(costs[i]) +
                      "; costs must be finite and non-negative");
    }
  }
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // rest[m][i]: the smallest possible max cell cost splitting layers [i, n) into m cells.
  std::vector<std::vector<double>> rest(k + 1, std::vector<double>(n + 1, inf));
  rest[0][n] = 0.0;
  for (int m = 1; m <= k; ++m) {
    for (int i = n - m; i >= 0; --i) {
      for (int e = i + 1; e <= n - (m - 1); ++e) {
        rest[m][i] = std::min(rest[m][i], std::max(prefix[e] - prefix[i], rest[m - 1][e]));
      }
    }
  }
  // Among the optimal splits, the earliest cells largest: from the front, each cell
  // takes as many layers as it can while the layers after it can still be split within
  // the optimum. (Keeping only each prefix's own optimum is not enough: with costs
  // [1, 1, 1, 1, 4] into 3 cells it gives [2, 2, 1], not [3, 1, 1].) Every value
  // compared is a max of the same prefix differences, so the comparison is exact.
  const double worst = rest[k][0];
  std::vector<int> sizes(k);
  for (int j = 0, i = 0; j < k; ++j) {
    const int after = k - j - 1;  // cells after this one
    int end = i + 1;
    for (int e = i + 1; e <= n - after; ++e) {
      if (std::max(prefix[e] - prefix[i], rest[after][e]) <= worst) end = e;
    }
    sizes[j] = end - i;
    i = end;
  }
  return sizes;
}

void validate_balance(const std::vector<int>& balance, int num_layers, int k) {
  if (static_cast<int>(balance.size()) != k) {
    throw UserError("pipeline.balance has " + std::to_string(balance.size()) + " entries but the pipeline has " +
                    std::to_string(k) + " cells (pipeline.partitions, times pipeline.virtual_stages when interleaved)"
                    "; give one layer count per cell");
  }
  int sum = 0;
  for (size_t i = 0; i < balance.size(); ++i) {
    if (balance[i] < 1) {
      throw UserError("pipeline.balance[" + std::to_string(i) + "] = " + std::to_string(balance[i]) +
                      "; every partition needs at least one layer");
    }
    sum += balance[i];
  }
  if (sum != num_layers) {
    throw UserError("pipeline.balance sums to " + std::to_string(sum) + " but the model has " +
                    std::to_string(num_layers) + " layers (after repeats are expanded); make the counts add up to " +
                    std::to_string(num_layers));
  }
}

double max_cell_cost(const std::vector<double>& costs, const std::vector<int>& balance) {
  double worst = 0;
  size_t i = 0;
  for (int size : balance) {
    double s = 0;
    for (int j = 0; j < size; ++j) s += costs.at(i++);
    worst = std::max(worst, s);
  }
  return worst;
}

std::vector<double> layer_costs(const layers::Sequential& model, int64_t micro_batch_size, bool recompute,
                                const std::vector<std::optional<double>>& overrides, const CostModel& cm) {
  auto counts = model.costs(micro_batch_size);
  if (!counts.empty()) {
    // Nothing upstream of the model's first layer needs its input gradient, so the
    // executor never computes it.
    counts.front() = layers::without_input_grad(counts.front());
  }
  std::vector<double> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i] = (i < overrides.size() && overrides[i]) ? *overrides[i] : cm.seconds(counts[i], recompute, static_cast<int>(i), micro_batch_size);
  }
  return out;
}

}  // namespace partition
}  // namespace gpipe

// The balancer against brute force over every split (its optimum, and which of several
// optimal splits it picks), and its error messages.
#include <doctest/doctest.h>

#include <functional>
#include <limits>
#include <string>

#include "layers/registry.h"
#include "partition/balance.h"
#include "runtime/error.h"
#include "runtime/random.h"

using namespace gpipe;
using namespace gpipe::partition;

namespace {
// The best max-cell cost over all compositions of n into k positive parts.
double brute_force(const std::vector<double>& costs, int k) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> parts;
  std::function<void(int, int)> rec = [&](int remaining, int cells) {
    if (cells == 1) {
      parts.push_back(remaining);
      best = std::min(best, max_cell_cost(costs, parts));
      parts.pop_back();
      return;
    }
    for (int s = 1; s <= remaining - (cells - 1); ++s) {
      parts.push_back(s);
      rec(remaining - s, cells - 1);
      parts.pop_back();
    }
  };
  rec(static_cast<int>(costs.size()), k);
  return best;
}
}  // namespace

TEST_CASE("the balancer is optimal on random costs") {
  Rng rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng.next() % 10);
    const int k = 1 + static_cast<int>(rng.next() % n);
    std::vector<double> costs(n);
    for (double& c : costs) c = (rng.next() % 4 == 0) ? 0.0 : rng.uniform(0.0, 10.0);
    const auto sizes = balance_by_cost(costs, k);
    CAPTURE(n);
    CAPTURE(k);
    REQUIRE(sizes.size() == static_cast<size_t>(k));
    int sum = 0;
    for (int s : sizes) {
      CHECK(s >= 1);
      sum += s;
    }
    CHECK(sum == n);
    CHECK(max_cell_cost(costs, sizes) == doctest::Approx(brute_force(costs, k)).epsilon(1e-12));
  }
}

TEST_CASE("equal layers split evenly") {
  CHECK(balance_by_cost(std::vector<double>(8, 1.0), 4) == std::vector<int>{2, 2, 2, 2});
  CHECK(balance_by_cost({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 2) == std::vector<int>{8, 8});
  CHECK(balance_by_cost({5, 1, 1, 1, 1, 1}, 2) == std::vector<int>{1, 5});
}

namespace {
// Of all compositions of n into k positive parts with the best max-cell cost, the
// lexicographically largest (the earliest cells largest). For costs whose sums are
// exact in double (small integers), so ties are exact.
std::vector<int> brute_force_tie_break(const std::vector<double>& costs, int k) {
  const int n = static_cast<int>(costs.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> chosen, parts;
  std::function<void(int, int)> rec = [&](int remaining, int cells) {
    if (cells == 0) {
      if (remaining != 0) return;
      const double v = max_cell_cost(costs, parts);
      if (v < best || (v == best && parts > chosen)) {
        best = v;
        chosen = parts;
      }
      return;
    }
    for (int s = 1; s <= remaining - (cells - 1); ++s) {
      parts.push_back(s);
      rec(remaining - s, cells - 1);
      parts.pop_back();
    }
  };
  rec(n, k);
  return chosen;
}
}  // namespace

TEST_CASE("of several optimal splits, the earliest cells get the most layers") {
  // Worked out by hand.
  // Six equal layers into 4 cells: the best max is 2 layers; [2, 2, 1, 1] beats
  // [1, 2, 2, 1], [1, 1, 2, 2] and the rest.
  CHECK(balance_by_cost(std::vector<double>(6, 1.0), 4) == std::vector<int>{2, 2, 1, 1});
  // Seven into 3: the best max is 3; [3, 3, 1] before [3, 2, 2] and [2, 2, 3].
  CHECK(balance_by_cost(std::vector<double>(7, 1.0), 3) == std::vector<int>{3, 3, 1});
  // The 4 must be alone (4 + 1 > 4), so the max is 4 and the four 1s share two cells
  // freely: [3, 1, 1] (cells 3, 1, 4), not [2, 2, 1] nor [1, 3, 1].
  CHECK(balance_by_cost({1, 1, 1, 1, 4}, 3) == std::vector<int>{3, 1, 1});
  // Likewise with the heavy layer first: [4] then four 1s into two cells, each at most
  // 4: [1, 3, 1].
  CHECK(balance_by_cost({4, 1, 1, 1, 1}, 3) == std::vector<int>{1, 3, 1});
  // Free layers go to the earlier cell: the max is 5 whatever the split of the zeros.
  CHECK(balance_by_cost({0, 0, 5, 0, 0}, 2) == std::vector<int>{4, 1});
  // The 4 alone, and the four 2s in three cells, one pair: the max is 4, and the pair
  // goes first.
  CHECK(balance_by_cost({2, 2, 2, 2, 4}, 4) == std::vector<int>{2, 1, 1, 1});

  // And against brute force on random small-integer costs, where ties abound.
  Rng rng(19);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + static_cast<int>(rng.next() % 9);
    const int k = 1 + static_cast<int>(rng.next() % n);
    std::vector<double> costs(n);
    for (double& c : costs) c = static_cast<double>(rng.next() % 4);
    CAPTURE(n);
    CAPTURE(k);
    std::string shown;
    for (double c : costs) shown += std::to_string(static_cast<int>(c)) + " ";
    CAPTURE(shown);
    CHECK(balance_by_cost(costs, k) == brute_force_tie_break(costs, k));
  }
}

TEST_CASE("impossible requests say so") {
  CHECK_THROWS_WITH_AS(balance_by_cost({1, 2}, 3), doctest::Contains("only 2 layers"), UserError);
  CHECK_THROWS_AS(balance_by_cost({1, 2}, 0), UserError);
  CHECK_THROWS_WITH_AS(validate_balance({3, 3, 2}, 9, 3), doctest::Contains("sums to 8 but the model has 9"),
                       UserError);
  CHECK_THROWS_WITH_AS(validate_balance({3, 3}, 6, 3), doctest::Contains("2 entries"), UserError);
  CHECK_THROWS_WITH_AS(validate_balance({6, 0}, 6, 2), doctest::Contains("at least one layer"), UserError);
  CHECK_NOTHROW(validate_balance({3, 3, 2}, 8, 3));
}

TEST_CASE("layer costs come from the layers' estimates unless overridden") {
  layers::ModelSpec spec;
  spec.input = {64};
  spec.layers = {{"linear", {{"out", "256"}}, {}, ""}, {"relu", {}, {}, ""}, {"linear", {{"out", "10"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = layers::build_model(spec);
  const auto est = layer_costs(*model, 32, false);
  CHECK(est[0] > est[1]);  // a matrix product outweighs a ReLU
  CHECK(est[0] > est[2]);
  const auto with_recompute = layer_costs(*model, 32, true);
  CHECK(with_recompute[0] > est[0]);
  const auto over = layer_costs(*model, 32, false, {std::nullopt, 100.0});
  CHECK(over[1] == 100.0);
  CHECK(over[0] == est[0]);
}

TEST_CASE("the first layer is not charged for an input gradient nobody needs") {
  layers::ModelSpec spec;
  spec.input = {128};
  spec.layers = {{"linear", {{"out", "128"}}, {}, ""}, {"linear", {{"out", "128"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = layers::build_model(spec);
  const auto est = layer_costs(*model, 64, false);
  CHECK(est[0] < est[1]);
  const auto counts = model->costs(64);
  CHECK(counts[0].input_grad_flops == 2.0 * 64 * 128 * 128);
}

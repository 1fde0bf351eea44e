// The one accounting of a step's time (report and planner) on spans written by hand:
// which instruction counts as compute, communication, waiting or optimizer, the span
// without the optimizer steps, idle as what the span leaves, and adding steps.
#include <doctest/doctest.h>

#include <vector>

#include "pipeline/schedule/time_accounting.h"

using namespace gpipe::pipeline;

TEST_CASE("every instruction kind has its category") {
  CHECK(time_category(Op::kForward) == TimeCategory::kCompute);
  CHECK(time_category(Op::kRecompute) == TimeCategory::kCompute);
  CHECK(time_category(Op::kBackward) == TimeCategory::kCompute);
  CHECK(time_category(Op::kBackwardWeight) == TimeCategory::kCompute);
  CHECK(time_category(Op::kSendActivation) == TimeCategory::kCommunication);
  CHECK(time_category(Op::kSendGradient) == TimeCategory::kCommunication);
  CHECK(time_category(Op::kRecvActivation) == TimeCategory::kWaiting);
  CHECK(time_category(Op::kRecvGradient) == TimeCategory::kWaiting);
  CHECK(time_category(Op::kOptimizerStep) == TimeCategory::kOptimizer);
}

TEST_CASE("a step's accounting: span, busy, communication, idle, utilization") {
  // stage 0: F0 [0,2] sA0 [2,3] rG0 [3,7] B0 [7,10] W0 [10,11] OPT [11,30]
  // stage 1: rA0 [0,3] F0 [3,5] R0 [5,6] B0 [6,7] sG0 [7,7.5] OPT [7.5,8]
  // span: the last end but the optimizer steps, 11 (stage 0's W0)
  const std::vector<std::vector<OpSpan>> spans = {
      {{Op::kForward, 0, 2}, {Op::kSendActivation, 2, 3}, {Op::kRecvGradient, 3, 7}, {Op::kBackward, 7, 10},
       {Op::kBackwardWeight, 10, 11}, {Op::kOptimizerStep, 11, 30}},
      {{Op::kRecvActivation, 0, 3}, {Op::kForward, 3, 5}, {Op::kRecompute, 5, 6}, {Op::kBackward, 6, 7},
       {Op::kSendGradient, 7, 7.5}, {Op::kOptimizerStep, 7.5, 8}}};
  const StepTime t = account_step(spans);
  CHECK(t.span_ms == 11);
  REQUIRE(t.stages.size() == 2);
  const StageTime& a = t.stages[0];
  CHECK(a.forward_ms == 2);
  CHECK(a.recompute_ms == 0);
  CHECK(a.backward_ms == 4);  // B 3 + W 1
  CHECK(a.weight_ms == 1);
  CHECK(a.busy_ms == 6);
  CHECK(a.comm_ms == 1);
  CHECK(a.idle_ms == 4);  // 11 - 6 - 1: the wait at rG0
  CHECK(a.optimizer_ms == 19);
  CHECK(a.utilization == doctest::Approx(6.0 / 11));
  const StageTime& b = t.stages[1];
  CHECK(b.forward_ms == 2);
  CHECK(b.recompute_ms == 1);
  CHECK(b.backward_ms == 1);
  CHECK(b.weight_ms == 0);
  CHECK(b.busy_ms == 4);
  CHECK(b.comm_ms == 0.5);
  CHECK(b.idle_ms == 6.5);  // 11 - 4 - 0.5: the wait at rA0 and the tail after sG0
  CHECK(b.optimizer_ms == 0.5);
  CHECK(b.utilization == doctest::Approx(4.0 / 11));
}

TEST_CASE("idle is never negative, and steps add up") {
  // Stage 1's send overlaps its forward (a measured send may): busy + comm = 2 > span 1.
  const StepTime t = account_step({{{Op::kForward, 0, 1}}, {{Op::kForward, 0, 1}, {Op::kSendActivation, 0, 1}}});
  CHECK(t.span_ms == 1);
  CHECK(t.stages[0].idle_ms == 0);
  CHECK(t.stages[1].idle_ms == 0);
  StageTime sum;
  sum.add(t.stages[1]);
  sum.add(t.stages[1]);
  CHECK(sum.forward_ms == 2);
  CHECK(sum.comm_ms == 2);
  CHECK(sum.busy_ms == 2);
  CHECK(sum.utilization == 0);  // a ratio: the caller divides the sums
  CHECK(account_step({}).span_ms == 0);
}

TEST_CASE("a split layer's sums over its tensor group are communication, not compute") {
  // F0 [0,4] of which 1.5 ms in the group's sums, R0 [4,6] of which 0.5, B0 [6,10] of
  // which 1, W0 [10,11] none; a sum longer than its op is clipped to the op.
  const StepTime t = account_step({{{Op::kForward, 0, 4, 0, 1.5},
                                    {Op::kRecompute, 4, 6, 0, 0.5},
                                    {Op::kBackward, 6, 10, 0, 1.0},
                                    {Op::kBackwardWeight, 10, 11, 0, 0.0},
                                    {Op::kSendGradient, 11, 11.5}},
                                   {{Op::kForward, 0, 1, 0, 5.0}}});
  const StageTime& a = t.stages[0];
  CHECK(a.forward_ms == 2.5);
  CHECK(a.recompute_ms == 1.5);
  CHECK(a.backward_ms == 4);  // B 3 + W 1
  CHECK(a.busy_ms == 8);
  CHECK(a.group_ms == 3);
  CHECK(a.comm_ms == 3.5);  // the sums and the send
  CHECK(a.idle_ms == 0);    // 11.5 - 8 - 3.5
  CHECK(a.utilization == doctest::Approx(8 / 11.5));
  const StageTime& b = t.stages[1];
  CHECK(b.group_ms == 1);
  CHECK(b.forward_ms == 0);
  CHECK(b.busy_ms == 0);
  StageTime sum;
  sum.add(a);
  sum.add(b);
  CHECK(sum.group_ms == 4);
}

// Deadlines of the in-process transport: a receive nobody sends to and a collective a
// stage never joins end with an Error saying what was awaited, instead of hanging; a
// message that does arrive in time is delivered; abort still wins over the deadline.
#include <doctest/doctest.h>

#include <cmath>
#include <thread>

#include "runtime/deadline.h"
#include "runtime/error.h"
#include "runtime/inprocess_replica_group.h"
#include "runtime/inprocess_transport.h"

using namespace gpipe;

TEST_CASE("in-process transport: a receive nobody sends to times out with what it awaited") {
  InProcessTransport tr(2, /*timeout_s=*/0.2);
  tr.set_step(7);
  CHECK_THROWS_WITH_AS(tr.recv(1, 0, {MessageKind::kActivation, 3}, Device::cpu()),
                       doctest::Contains("stage 1 waited 0.2 s for the activation of micro-batch 3 from stage 0 at "
                                         "step 7; pipeline.timeout_s is 0.2"),
                       Error);
}

TEST_CASE("in-process transport: collectives a stage never joins time out, naming how many arrived") {
  InProcessTransport tr(3, 0.2);
  CHECK_THROWS_WITH_AS(tr.all_reduce_sum(0, 1.0),
                       doctest::Contains("stage 0 waited 0.2 s for the all-reduce over the 3 stages (1 of them had "
                                         "arrived)"),
                       Error);
  InProcessTransport tr2(2, 0.2);
  CHECK_THROWS_WITH_AS(tr2.gather_to_first(1, {1.0}),
                       doctest::Contains("the gather to stage 0 over the 2 stages (1 of them had arrived)"), Error);
}

TEST_CASE("in-process transport: within the deadline, or with none, messages arrive") {
  for (double timeout : {0.0, 30.0}) {
    InProcessTransport tr(2, timeout);
    std::thread sender([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      tr.send(0, 1, {MessageKind::kGradient, 0}, Tensor::from_vector<float>({2.5f}, {1}));
      tr.all_reduce_sum(0, 1.0);
    });
    CHECK(tr.recv(1, 0, {MessageKind::kGradient, 0}, Device::cpu()).to_vector<float>()[0] == 2.5f);
    CHECK(tr.all_reduce_sum(1, 2.0) == 3.0);
    sender.join();
  }
}

TEST_CASE("in-process transport: abort wakes a waiting receiver with Aborted, not a timeout") {
  InProcessTransport tr(2, 30.0);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    tr.abort("stage 0 failed");
  });
  CHECK_THROWS_WITH_AS(tr.recv(1, 0, {MessageKind::kActivation, 0}, Device::cpu()), "stage 0 failed", Aborted);
  aborter.join();
}

TEST_CASE("in-process replica group: abort wakes a member waiting for the others with Aborted, and fails later calls") {
  InProcessReplicaHub hub(2, 30.0);
  InProcessReplicaGroup member(hub, 0);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    hub.abort("member 1 failed");
  });
  Tensor t = Tensor::from_vector<double>({1.0, 2.0}, {2});
  CHECK_THROWS_WITH_AS(member.all_reduce_sum(t), "member 1 failed", Aborted);  // not the 30 s timeout
  aborter.join();
  CHECK_THROWS_WITH_AS(member.all_reduce_sum(t), "member 1 failed", Aborted);
}

TEST_CASE("deadline: validation and polling") {
  CHECK_THROWS_AS(InProcessTransport(2, -1.0), UserError);
  CHECK_THROWS_AS(Deadline(std::nan("")), UserError);
  CHECK(Deadline(0).none());
  CHECK_FALSE(Deadline(0).expired());
  int calls = 0;
  CHECK(poll_until([&] { return ++calls == 3; }, Deadline(0)));
  CHECK(calls == 3);
  CHECK_FALSE(poll_until([] { return false; }, Deadline(0.05)));
}

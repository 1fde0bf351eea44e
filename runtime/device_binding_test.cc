// The device rule (runtime/device_binding.h) on a host model of CUDA 12's semantics:
// each thread starts on device 0 without touching it, selecting a device creates its
// primary context, and so does any work on the current device. Real threads play the
// stage workers and `main` of each rank. What is checked: a rank's process ends up
// with contexts on exactly the devices its stages use (never a stray one on GPU 0),
// a bound worker's guards never call cudaSetDevice, and a guard still restores a
// device that the thread really uses.
#include "runtime/device_binding.h"

#include <doctest/doctest.h>

#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace gpipe {
namespace {

class HostCuda : public DeviceSelector {
 public:
  int current() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = current_.find(std::this_thread::get_id());
    return it == current_.end() ? 0 : it->second;
  }
  void select(int index) override {
    std::lock_guard<std::mutex> lock(mu_);
    current_[std::this_thread::get_id()] = index;
    contexts_.insert(index);
    ++selects_;
  }
  bool has_context(int index) override {
    std::lock_guard<std::mutex> lock(mu_);
    return contexts_.count(index) != 0;
  }
  // A kernel launch, an allocation: work on the calling thread's current device.
  void work() {
    const int d = current();
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.insert(d);
  }
  std::set<int> contexts() {
    std::lock_guard<std::mutex> lock(mu_);
    return contexts_;
  }
  int selects() {
    std::lock_guard<std::mutex> lock(mu_);
    return selects_;
  }

 private:
  std::mutex mu_;
  std::map<std::thread::id, int> current_;
  std::set<int> contexts_;
  int selects_ = 0;
};

// One op of a backend on `device`: a guard, then work.
void op(HostCuda& cuda, Device device) {
  ScopedDevice guard(cuda, device.index);
  cuda.work();
}

}  // namespace

TEST_CASE("each rank of an 8-GPU node holds a context on its own GPU only") {
  for (int rank = 0; rank < 8; ++rank) {
    CAPTURE(rank);
    HostCuda cuda;  // one process
    const Device mine = Device::cuda(rank);
    std::thread main_thread([&] {
      bind_thread_to_device(main_thread_device({mine}), cuda);
      op(cuda, mine);  // the backend and the NCCL communicator are created here
      std::thread worker([&] {
        bind_thread_to_device(mine, cuda);
        for (int i = 0; i < 10; ++i) op(cuda, mine);
      });
      worker.join();
      op(cuda, mine);  // evaluation, the loss read back
    });
    main_thread.join();
    CHECK(cuda.contexts() == std::set<int>{rank});
    // One cudaSetDevice per thread that binds (a worker on GPU 0 is there already), and
    // none from a guard.
    CHECK(cuda.selects() == (rank == 0 ? 1 : 2));
  }
}

TEST_CASE("a guard on a thread that never chose a device does not come back to GPU 0") {
  HostCuda cuda;
  std::thread t([&] {
    op(cuda, Device::cuda(3));  // e.g. a destructor on a helper thread
    CHECK(cuda.current() == 3);  // left on the device it used, not "restored" to 0
  });
  t.join();
  CHECK(cuda.contexts() == std::set<int>{3});
}

TEST_CASE("a guard restores the previous device when the thread uses it") {
  HostCuda cuda;
  std::thread t([&] {
    bind_thread_to_device(Device::cuda(0), cuda);  // one process running stages on GPUs 0 and 1
    op(cuda, Device::cuda(1));
    CHECK(cuda.current() == 0);
    op(cuda, Device::cuda(0));
  });
  t.join();
  CHECK(cuda.contexts() == std::set<int>{0, 1});
}

TEST_CASE("single-process stages on GPUs 1 and 2: the threads never touch GPU 0") {
  HostCuda cuda;
  const std::vector<Device> stages = {Device::cuda(1), Device::cuda(2)};
  std::thread main_thread([&] {
    bind_thread_to_device(main_thread_device(stages), cuda);
    for (const Device& d : stages) op(cuda, d);  // moving each cell's weights
    std::vector<std::thread> workers;
    for (const Device& d : stages) {
      workers.emplace_back([&cuda, d] {
        bind_thread_to_device(d, cuda);
        for (int i = 0; i < 5; ++i) op(cuda, d);
      });
    }
    for (auto& w : workers) w.join();
    for (const Device& d : stages) op(cuda, d);  // evaluation, cell by cell
  });
  main_thread.join();
  CHECK(cuda.contexts() == std::set<int>{1, 2});
}

TEST_CASE("host stages never call into CUDA") {
  HostCuda cuda;
  std::thread t([&] { bind_thread_to_device(Device::cpu(1), cuda); });
  t.join();
  CHECK(cuda.selects() == 0);
  CHECK(cuda.contexts().empty());
}

TEST_CASE("the main thread's device is the first CUDA stage's, or the host's") {
  CHECK(main_thread_device({Device::cpu(0), Device::cuda(2), Device::cuda(1)}) == Device::cuda(2));
  CHECK(main_thread_device({Device::cpu(0), Device::cpu(1)}) == Device::cpu());
  CHECK(main_thread_device({}) == Device::cpu());
}

}  // namespace gpipe

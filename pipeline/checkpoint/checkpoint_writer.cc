#include "pipeline/checkpoint/checkpoint_writer.h"

#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

TensorMap host_copy(const TensorMap& tensors) {
  TensorMap out;
  for (const auto& [name, t] : tensors) {
    GPIPE_CHECK(t.defined(), "host_copy of the undefined tensor '" + name + "'");
    Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
    copy_tensor(t, h);
    out.emplace(name, std::move(h));
  }
  return out;
}

AsyncCheckpointWriter::AsyncCheckpointWriter(CheckpointStore store) : store_(std::move(store)) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("checkpoint: the last save failed: {}", e.what());
  }
}

void AsyncCheckpointWriter::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

bool AsyncCheckpointWriter::idle() {
  if (!done_.load(std::memory_order_acquire)) return false;
  wait();
  return true;
}

void AsyncCheckpointWriter::start(std::function<void()> job) {
  wait();
  done_.store(false, std::memory_order_release);
  const int rank = thread_rank();
  thread_ = std::thread([this, rank, job = std::move(job)] {
    set_thread_context(rank, -1);
    try {
      job();
    } catch (...) {
      error_ = std::current_exception();
    }
    done_.store(true, std::memory_order_release);
  });
}

void AsyncCheckpointWriter::save_shard(int64_t step, int shard, int num_shards, ShardTensors tensors) {
  start([this, step, shard, num_shards, t = std::move(tensors)] {
    store_.write_shard(step, shard, num_shards, t.model, t.optimizer);
  });
}

void AsyncCheckpointWriter::finalize(int64_t step, int num_shards, std::vector<ShardNames> names,
                                     nlohmann::json trainer_state) {
  start([this, step, num_shards, n = std::move(names), s = std::move(trainer_state)] {
    store_.finalize(step, num_shards, n, s);
  });
}

void AsyncCheckpointWriter::save(int64_t step, std::vector<ShardTensors> shards, nlohmann::json trainer_state) {
  start([this, step, sh = std::move(shards), s = std::move(trainer_state)] { store_.save(step, sh, s); });
}

}  // namespace pipeline
}  // namespace gpipe

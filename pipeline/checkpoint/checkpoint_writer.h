// Saving a checkpoint without stopping training: the caller copies the state to host
// memory (host_copy) at the end of a step, and a background thread writes the files
// while the next steps run. One save at a time: starting a save first waits for the
// previous one, and wait() blocks until the last one is durable.
//
// Multi-process runs: each writing rank calls save_shard; once every rank's shard is
// durable (each rank sees idle() or returns from wait(), and the caller's barrier or
// all-reduce of those flags says so everywhere), rank 0 calls finalize.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "pipeline/checkpoint/checkpoint.h"

namespace gpipe {
namespace pipeline {

// New contiguous host copies of tensors on any device, so that a save in flight does not
// see the optimizer change the originals.
TensorMap host_copy(const TensorMap& tensors);

class AsyncCheckpointWriter {
 public:
  explicit AsyncCheckpointWriter(CheckpointStore store);
  // Waits for a save in flight; logs its error (a destructor does not throw).
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Each of these waits for the previous save (rethrowing its error), starts this one
  // on the background thread and returns. The tensors must be host copies that nothing
  // else writes to (host_copy).
  void save_shard(int64_t step, int shard, int num_shards, ShardTensors tensors);
  void finalize(int64_t step, int num_shards, std::vector<ShardNames> names, nlohmann::json trainer_state);
  void save(int64_t step, std::vector<ShardTensors> shards, nlohmann::json trainer_state);  // all shards + finalize

  // Blocks until the save in flight (if any) is durable; rethrows its error, once.
  void wait();
  // True when no save is in flight, without blocking; rethrows a finished save's error.
  bool idle();
  const CheckpointStore& store() const { return store_; }

 private:
  void start(std::function<void()> job);
  CheckpointStore store_;
  std::thread thread_;
  std::atomic<bool> done_{true};
  std::exception_ptr error_;  // written by the job before done_ is set
};

}  // namespace pipeline
}  // namespace gpipe

// A tensor: element type, shape, strides and device over reference-counted storage
// from the device's allocator. Copying a Tensor shares its storage (a view); copying
// data is always explicit (Backend::copy or copy_tensor).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"

namespace gpipe {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "(256, 1024)"

// Owns one block from an allocator. Move-only.
class Storage {
 public:
  // stream: the stream the block is for (nullptr: the device's compute stream).
  Storage(Allocator& alloc, size_t bytes, Stream* stream = nullptr);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return alloc_->device(); }
  Allocator& allocator() const { return *alloc_; }

 private:
  Allocator* alloc_;
  void* ptr_;
  size_t bytes_;
};

// While one is alive on its thread, Tensor::empty (and so every Backend::empty and
// zeros) returns a tensor of shape, dtype and device without data: its storage has an
// address of its own, never mapped and never reused, so that buffers can be told apart
// and views matched (held_bytes.h), but no memory. Planning on shapes (a model built and
// run under it by kernels/meta_backend.h) allocates nothing in proportion to the model.
// from_vector and zeros_cpu, whose callers write the data at once, stay real.
class ShapesOnly {
 public:
  ShapesOnly();
  ~ShapesOnly();
  ShapesOnly(const ShapesOnly&) = delete;
  ShapesOnly& operator=(const ShapesOnly&) = delete;
  static bool active();

 private:
  bool outer_;  // an enclosing one's state, restored on destruction
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory on `device`, for work queued on `stream` (nullptr: the
  // device's compute stream; see Allocator::allocate_for).
  static Tensor empty(const Shape& shape, DType dtype, Device device, Stream* stream = nullptr);
  // Host-only conveniences (device must be a CPU device).
  static Tensor zeros_cpu(const Shape& shape, DType dtype, Device device = Device::cpu());
  template <typename T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape, Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  // Made under ShapesOnly: no data. raw_data() is its address (for identity only) and
  // data<T>() throws.
  bool is_meta() const;
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  void* raw_data() const;
  template <typename T>
  T* data() const {
    check_dtype(DTypeOf<T>::value);
    check_has_data();
    return static_cast<T*>(raw_data());
  }

  // Rows [start, start + length) along dimension 0; shares storage.
  Tensor narrow_rows(int64_t start, int64_t length) const;
  // Same storage, new shape with the same element count; requires contiguity.
  Tensor reshape(const Shape& shape) const;
  // Host copy of a CPU tensor's elements (contiguous order).
  template <typename T>
  std::vector<T> to_vector() const;

  std::string str() const;  // "float32(256, 1024) on cpu:0"
  // Identity of the underlying block, for tests that check hand-over without copies.
  const void* storage_id() const { return storage_.get(); }
  // Bytes of the whole underlying block (a view reports its base's size).
  size_t storage_bytes() const { return storage_ ? storage_->bytes() : 0; }
  Storage* storage() const { return storage_.get(); }

 private:
  void check_dtype(DType want) const;
  void check_has_data() const;  // throws for a meta tensor
  static Tensor empty_with_data(const Shape& shape, DType dtype, Device device, Stream* stream = nullptr);
  static Tensor unallocated(const Shape& shape, DType dtype, Device device);  // shape checked, no storage yet
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  std::vector<int64_t> strides_;
  DType dtype_ = DType::kF32;
  Device device_;
};

// Copies src into dst (same dtype and element count, both contiguous), across
// devices where needed, ordered with the devices' compute streams and never waiting
// for a whole device:
//   host -> GPU: staged through pinned memory and queued on dst's compute stream;
//                returns at once (src may change afterwards);
//   GPU -> host: after the work queued on src's compute stream; waits for that stream;
//   GPU -> GPU:  queued on dst's compute stream after the work queued so far on src's
//                (an event; cudaMemcpyPeerAsync between devices, with peer access
//                where they allow it); returns at once, src's block kept until done.
void copy_tensor(const Tensor& src, Tensor& dst);

// Work queued on `stream` uses t's block (not its own stream): once t's storage is
// freed, the block is reused only after that work has finished. A no-op on the host.
void record_stream(const Tensor& t, Stream& stream);

// `src`, produced on its device's compute stream up to `ready` (recorded when it was
// handed over; nullptr: up to now), made available on `device`: the same tensor where
// no copy is needed (host to host, or the same device); between GPUs a copy on the
// destination's transfer stream, so that it overlaps the destination's compute, which
// waits for it (no host wait); otherwise copy_tensor.
Tensor transfer_tensor(const Tensor& src, Device device, Event* ready);

}  // namespace gpipe

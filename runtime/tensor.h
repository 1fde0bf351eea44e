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

namespace gpipe {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "(256, 1024)"

// Owns one block from an allocator. Move-only.
class Storage {
 public:
  Storage(Allocator& alloc, size_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return alloc_->device(); }

 private:
  Allocator* alloc_;
  void* ptr_;
  size_t bytes_;
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory on `device`.
  static Tensor empty(const Shape& shape, DType dtype, Device device);
  // Host-only conveniences (device must be a CPU device).
  static Tensor zeros_cpu(const Shape& shape, DType dtype, Device device = Device::cpu());
  template <typename T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape, Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
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

 private:
  void check_dtype(DType want) const;
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  std::vector<int64_t> strides_;
  DType dtype_ = DType::kF32;
  Device device_;
};

// Copies src into dst (same dtype and element count, both contiguous), across
// devices where needed. CPU<->CUDA and CUDA<->CUDA copies are synchronous here.
void copy_tensor(const Tensor& src, Tensor& dst);

}  // namespace gpipe

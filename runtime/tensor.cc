#include "runtime/tensor.h"

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "runtime/error.h"

#ifdef GPIPE_WITH_CUDA
#include "runtime/cuda_runtime.h"
#endif

namespace gpipe {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ")";
  return os.str();
}

Storage::Storage(Allocator& alloc, size_t bytes, Stream* stream)
    : alloc_(&alloc), ptr_(stream != nullptr ? alloc.allocate_for(bytes, *stream) : alloc.allocate(bytes)),
      bytes_(bytes) {}

Storage::~Storage() { alloc_->deallocate(ptr_, bytes_); }

namespace {

thread_local bool shapes_only = false;

// The allocator of tensors without data (ShapesOnly): each block gets addresses of its
// own from a range no process maps (non-canonical on x86-64 and AArch64, so a stray
// read faults at once), never handed out twice. Nothing is counted as in use.
class MetaAllocator final : public Allocator {
 public:
  explicit MetaAllocator(Device device) : device_(device) {}
  void* allocate(size_t bytes) override {
    static std::atomic<uint64_t> next{uint64_t{1} << 62};
    const uint64_t size = (static_cast<uint64_t>(bytes) + 255) / 256 * 256 + 256;  // a gap between blocks
    return reinterpret_cast<void*>(next.fetch_add(size));
  }
  void deallocate(void*, size_t) override {}
  Device device() const override { return device_; }
  bool has_data() const override { return false; }
  void release_cache() override {}

 private:
  Device device_;
};

Allocator& meta_allocator(Device device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<MetaAllocator>> table;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = table[{static_cast<int>(device.kind), device.index}];
  if (!slot) slot = std::make_unique<MetaAllocator>(device);
  return *slot;
}

}  // namespace

ShapesOnly::ShapesOnly() : outer_(shapes_only) { shapes_only = true; }

ShapesOnly::~ShapesOnly() { shapes_only = outer_; }

bool ShapesOnly::active() { return shapes_only; }

bool Tensor::is_meta() const { return storage_ && !storage_->allocator().has_data(); }

void Tensor::check_has_data() const {
  if (is_meta()) {
    throw Error("the data of " + str() + " was read, but it was made for planning on shapes (ShapesOnly) and has "
                "none; a layer's forward or backward must not read tensor data on the host");
  }
}

namespace {
std::vector<int64_t> contiguous_strides(const Shape& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, Stream* stream) {
  if (!shapes_only) return empty_with_data(shape, dtype, device, stream);
  Tensor t = unallocated(shape, dtype, device);
  t.storage_ = std::make_shared<Storage>(meta_allocator(device), t.nbytes());
  return t;
}

Tensor Tensor::empty_with_data(const Shape& shape, DType dtype, Device device, Stream* stream) {
  GPIPE_CHECK(stream == nullptr || stream->device() == device,
              "a tensor on " + device.str() + " allocated for a stream of " + stream->device().str());
  Tensor t = unallocated(shape, dtype, device);
  t.storage_ = std::make_shared<Storage>(allocator_for(device), t.nbytes(), stream);
  return t;
}

Tensor Tensor::unallocated(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) {
    if (d < 0) throw UserError("negative dimension in shape " + shape_str(shape));
  }
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::zeros_cpu(const Shape& shape, DType dtype, Device device) {
  GPIPE_CHECK(device.is_cpu(), "zeros_cpu on " + device.str());
  Tensor t = empty_with_data(shape, dtype, device);
  std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& v, const Shape& shape, Device device) {
  GPIPE_CHECK(device.is_cpu(), "from_vector on " + device.str());
  GPIPE_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape),
              std::to_string(v.size()) + " values for shape " + shape_str(shape));
  Tensor t = empty_with_data(shape, DTypeOf<T>::value, device);
  std::memcpy(t.raw_data(), v.data(), v.size() * sizeof(T));
  return t;
}
template Tensor Tensor::from_vector<float>(const std::vector<float>&, const Shape&, Device);
template Tensor Tensor::from_vector<double>(const std::vector<double>&, const Shape&, Device);
template Tensor Tensor::from_vector<int32_t>(const std::vector<int32_t>&, const Shape&, Device);

int64_t Tensor::size(int d) const {
  if (d < 0) d += dim();
  GPIPE_CHECK(d >= 0 && d < dim(), "dimension " + std::to_string(d) + " of " + str());
  return shape_[d];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

void* Tensor::raw_data() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

void Tensor::check_dtype(DType want) const {
  if (want != dtype_) {
    throw Error(std::string("tensor ") + str() + " accessed as " + dtype_name(want));
  }
}

Tensor Tensor::narrow_rows(int64_t start, int64_t length) const {
  GPIPE_CHECK(dim() >= 1, "narrow_rows on a scalar");
  GPIPE_CHECK(start >= 0 && length >= 0 && start + length <= shape_[0],
              "rows [" + std::to_string(start) + ", " + std::to_string(start + length) + ") of " + str());
  Tensor t = *this;
  t.offset_ += start * strides_[0];
  t.shape_[0] = length;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  GPIPE_CHECK(is_contiguous(), "reshape of a non-contiguous tensor " + str());
  if (shape_numel(shape) != numel()) {
    throw UserError("cannot reshape " + str() + " to " + shape_str(shape) + ": element counts differ");
  }
  Tensor t = *this;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  check_dtype(DTypeOf<T>::value);
  GPIPE_CHECK(device_.is_cpu(), "to_vector on " + str() + "; copy it to the host first");
  GPIPE_CHECK(is_contiguous(), "to_vector of a non-contiguous tensor");
  const T* p = data<T>();
  return std::vector<T>(p, p + numel());
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;

std::string Tensor::str() const {
  if (!defined()) return "undefined tensor";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device_.str();
}

void copy_tensor(const Tensor& src, Tensor& dst) {
  GPIPE_CHECK(src.dtype() == dst.dtype(), "copy " + src.str() + " -> " + dst.str());
  GPIPE_CHECK(src.numel() == dst.numel(), "copy " + src.str() + " -> " + dst.str());
  GPIPE_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy of non-contiguous tensors");
  if (src.nbytes() == 0) return;
  if (src.is_meta() || dst.is_meta()) {  // planning on shapes: nothing to copy
    GPIPE_CHECK(src.is_meta() && dst.is_meta(), "copy between a tensor with data and one without: " + src.str() +
                                                    " -> " + dst.str());
    return;
  }
  if (src.device().is_cpu() && dst.device().is_cpu()) {
    std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
    return;
  }
#ifdef GPIPE_WITH_CUDA
  cuda_copy(src.raw_data(), src.device(), dst.raw_data(), dst.device(), src.nbytes());
  // Read on dst's compute stream: src's block must outlive that read.
  if (src.device().is_cuda() && dst.device().is_cuda() && src.device() != dst.device()) {
    record_stream(src, compute_stream_for(dst.device()));
  }
#else
  throw Error("copy between " + src.device().str() + " and " + dst.device().str() + " needs a CUDA build");
#endif
}

void record_stream(const Tensor& t, Stream& stream) {
  if (!t.defined() || t.device().is_cpu() || t.is_meta()) return;
  GPIPE_CHECK(stream.device().is_cuda(), "record_stream of " + t.str() + " on a stream of " + stream.device().str());
  t.storage()->allocator().record_stream(t.storage()->data(), stream);
}

Tensor transfer_tensor(const Tensor& src, Device device, Event* ready) {
  if (src.device() == device || (src.device().is_cpu() && device.is_cpu())) return src;
  if (src.is_meta()) {
    const ShapesOnly shapes;
    return Tensor::empty(src.shape(), src.dtype(), device);
  }
#ifdef GPIPE_WITH_CUDA
  if (src.device().is_cuda() && device.is_cuda()) return cuda_transfer(src, device, ready);
#endif
  (void)ready;  // host <-> GPU: copy_tensor orders itself with the compute streams
  Tensor out = Tensor::empty(src.shape(), src.dtype(), device);
  copy_tensor(src, out);
  return out;
}

}  // namespace gpipe

// The backend of planning on shapes: every op of backend.h accepted and none computed.
// With the tensors of ShapesOnly (runtime/tensor.h), which have shapes and addresses but
// no data, a layer's forward and backward run as they do on a device: they allocate the
// same buffers, keep the same ones in their contexts and return the same shapes, in
// microseconds and without memory. The planner reads what a layer keeps for its
// backward this way (plan.h: probe_activations); a derived layer's tape is recorded on
// shapes alike. Its device is the one it stands for (a GPU's, where no GPU is present),
// so that the layers' device checks hold; nothing on that device is touched.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace gpipe {

// The meta backend standing for `device`, alive for the process (thread-safe: it has
// no state). Use it with a ShapesOnly alive on the thread.
Backend& meta_backend(Device device);

// While one is alive on its thread, every meta backend answers what depends on the kind
// of device (has_fused_attention, which decides what an attention layer keeps) as
// `device`'s backend would, whichever device it stands for: planning for a device
// description (`gpipe plan --device-spec`), whose GPUs this machine may not have while
// the model it plans lives on the CPU. For a CUDA device the answer is a GPU build's
// with cuDNN's frontend (gpu_fused_attention_expected), whatever this machine's build.
// Nests; the outer one is restored at the end.
class MetaAnswersAs {
 public:
  explicit MetaAnswersAs(Device device);
  ~MetaAnswersAs();
  MetaAnswersAs(const MetaAnswersAs&) = delete;
  MetaAnswersAs& operator=(const MetaAnswersAs&) = delete;

 private:
  std::optional<Device> outer_;
};

// The ops that meta backends were called for on this thread since this was made: the
// matrix products and every op of kernels/backend_ops.inc, a fused op once (as a GPU
// backend launches it), nothing for allocation. The planner counts a layer's ops this
// way (its per-launch term: plan.h, LayerLaunches); on a GPU most ops are one kernel
// launch, a few (cuBLAS, cuDNN's attention) more than one.
class MetaOpCount {
 public:
  MetaOpCount();
  int64_t count() const;

 private:
  int64_t start_;
};

// A matrix product a meta backend was called for: c (m, n) = op(a) (m, k) op(b) (k, n),
// row-major as Backend::matmul takes it, a and b of `dtype`, c of `c_dtype`; `op` the
// backend op that makes it (matmul, matmul_weight, linear_bias, linear_weight_grad).
//
// Or an op made of several products, with m, n and k 0: attention and attention_backward
// (the exact path), fused_attention and fused_attention_backward, conv2d and
// conv2d_backward. Then `tensors` are the shapes of its tensor arguments in the op's order
// (an undefined one, a gradient the call skips, empty), `ints` its integer arguments
// (heads; stride and pad), `dtype` its first tensor's type and `c_dtype` its output's, and
// `op_flops` the FLOPs of its products a call: attention 4 B T^2 C forward (q k^T and the
// probabilities by v, every T x T score, C = H D of the query heads) and 8 B T^2 C
// backward (its four products; a flash backward's recomputed scores not counted); a
// convolution 2 N K P Q C R S for y, and as much again
// for each of dx and dw that its backward computes.
struct MetaProduct {
  std::string op;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  DType dtype = DType::kF32, c_dtype = DType::kF32;
  std::vector<Shape> tensors;
  std::vector<DType> types;  // of each of `tensors`
  std::vector<int64_t> ints;
  double op_flops = 0;
  bool is_gemm() const { return tensors.empty(); }
  double flops() const {
    return is_gemm() ? 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) : op_flops;
  }
  // A non-GEMM op's arguments as its signature names them: "qkv 4x128x384, heads 4 -> probs
  // 4x4x128x128, out 4x128x128" ("" for a product).
  std::string describe() const;
};

// While one is alive on its thread, the matrix products meta backends are called for on
// that thread are listed (in call order) for take(). Nests: an inner one lists what is
// called while it lives, then the outer one lists on.
class MetaProducts {
 public:
  MetaProducts();
  ~MetaProducts();
  MetaProducts(const MetaProducts&) = delete;
  MetaProducts& operator=(const MetaProducts&) = delete;
  // The products listed since the last take().
  std::vector<MetaProduct> take();
  void add(MetaProduct p) { list_.push_back(std::move(p)); }

 private:
  MetaProducts* outer_;
  std::vector<MetaProduct> list_;
};

}  // namespace gpipe
